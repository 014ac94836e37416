"""config.toml -> frozen dataclasses: defaults, the shipped example, errors that name file and key."""

from pathlib import Path

import pytest

from pddgw.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_default_is_the_embedded_deployment():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.nodes == () and cfg.model.path == "" and cfg.server.port == 8000
    # The WAN's figures are derived from the measured decode step at start (tests/pipeline/test_regime.py).
    assert cfg.net.shaping("wan") is None and cfg.net.regime.enabled


def test_shipped_example_loads():
    cfg = load_config(ROOT / "config.toml")
    assert [(n.name, n.role, n.cluster) for n in cfg.nodes] == [
        ("router", "router", "A"), ("p0", "prefill", "A"), ("rld0", "rld", "A"), ("md0", "md", "B")]
    assert cfg.engine_for(cfg.node("md0")).block_size == 32
    assert cfg.engine_for(cfg.node("p0")) == cfg.engine
    assert cfg.net.tls.mutual and cfg.policy.catchup_threshold == 64


@pytest.mark.parametrize("text,msg", [
    ("[engine]\nblock_sise = 16\n", "engine.block_sise: unknown key"),
    ("[engine]\nblock_size = 12\n", "engine: block_size must be a positive power of two"),
    ("[engine]\nnum_blocks = \"many\"\n", "engine.num_blocks: expected an integer, got 'many'"),
    ("[model]\ndtype = \"int4\"\n", "model.dtype: 'int4' is not one of"),
    ("[[nodes]]\nname = \"a\"\nrole = \"router\"\n", "nodes: no prefill node"),
    ("[[nodes]]\nname = \"a\"\nrole = \"prefil\"\n", "nodes[0].role: 'prefil' is not one of"),
    ("[frobnicate]\nx = 1\n", "frobnicate: unknown key"),
    ("[engine\n", "invalid TOML"),
])
def test_errors_name_file_and_key(tmp_path, text, msg):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(ei.value).startswith(str(p)) and msg in str(ei.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.toml")
