"""config.toml -> frozen dataclasses: defaults, the shipped example, errors that name file and key."""

from pathlib import Path

import pytest

from pddgw.config import Config, ConfigError, CostModelConfig, load_config

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


def test_vllm_example_loads():
    """config.vllm.toml: every node a vLLM engine over 8 GPUs; MD with bigger blocks and pool."""
    cfg = load_config(ROOT / "config.vllm.toml")
    engines = {n.name: cfg.engine_for(n) for n in cfg.nodes}
    assert {e.implementation for e in engines.values()} == {"vllm"}
    assert {e.vllm.tensor_parallel for e in engines.values()} == {8}
    assert [(n, e.block_size, e.num_blocks) for n, e in engines.items()] == [
        ("router", 16, 16384), ("p0", 16, 16384), ("rld0", 16, 4096), ("md0", 32, 32768)]
    assert cfg.engine.vllm.args == {"long_prefill_token_threshold": 4096}
    assert cfg.model.path and cfg.model.dtype == "bfloat16"


@pytest.mark.parametrize("text,msg", [
    ("[engine.vllm]\ntensor_paralel = 2\n", "engine.vllm.tensor_paralel: unknown key"),
    ("[engine.vllm]\ngpu_memory_utilization = 1.5\n", "engine.vllm: gpu_memory_utilization must be in (0, 1]"),
    ("[engine]\nblock_sise = 16\n", "engine.block_sise: unknown key"),
    ("[engine]\nblock_size = 12\n", "engine: block_size must be a positive power of two"),
    ("[engine]\nnum_blocks = \"many\"\n", "engine.num_blocks: expected an integer, got 'many'"),
    ("[model]\ndtype = \"int4\"\n", "model.dtype: 'int4' is not one of"),
    ("[[nodes]]\nname = \"a\"\nrole = \"router\"\n", "nodes: no prefill node"),
    ("[[nodes]]\nname = \"a\"\nrole = \"prefil\"\n", "nodes[0].role: 'prefil' is not one of"),
    ("[frobnicate]\nx = 1\n", "frobnicate: unknown key"),
    ("[engine.costmodel]\nexpert_paralel = 8\n", "engine.costmodel.expert_paralel: unknown key"),
    ("[engine.costmodel]\ntensor_parallel = 8\ndata_parallel = 2\nexpert_parallel = 3\n",
     "engine.costmodel: expert_parallel = 3 must divide the instance's 16 GPUs (tensor_parallel 8 x data_parallel 2)"),
    ("[engine.costmodel]\ndata_parallel = 0\n", "engine.costmodel: data_parallel must be in [1, 512]"),
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


def test_local_example_loads():
    """config.local.toml: four processes on 127.0.0.1, CPU, TLS + secret file on the links, an emulated WAN."""
    cfg = load_config(ROOT / "config.local.toml")
    assert [(n.name, n.role, n.cluster, n.host, n.port) for n in cfg.nodes] == [
        ("router", "router", "A", "127.0.0.1", 0), ("p0", "prefill", "A", "127.0.0.1", 9101),
        ("rld0", "rld", "A", "127.0.0.1", 9102), ("md0", "md", "B", "127.0.0.1", 9201)]
    assert {cfg.engine_for(n).device for n in cfg.nodes} == {"cpu"}
    assert cfg.engine_for(cfg.node("md0")).block_size == 32
    assert (cfg.server.host, cfg.server.port, cfg.server.api_keys) == ("127.0.0.1", 8000, ("local-dev-key",))
    assert cfg.net.secret_file == "local-keys/link-secret" and not cfg.net.secret
    tls = cfg.net.tls
    assert tls.enabled and tls.mutual and not tls.front_door
    assert (tls.for_node("md0").cert_file == "local-keys/md0.crt"
            and tls.for_node("md0").key_file == "local-keys/md0.key")
    assert tls.for_node("md0").ca_file == "local-keys/ca.crt"
    wan = cfg.net.shaping("wan")
    assert wan is not None and (wan.gbps, wan.latency_ms) == (0.5, 1.0)


@pytest.mark.parametrize("tls,msg", [
    ('front_door = true', "net.tls: front_door needs front_cert_file and front_key_file (or cert_file and key_file)"),
    ('front_cert_file = "a.crt"', "net.tls: front_cert_file and front_key_file go together"),
    ('enabled = true\ncert_file = "a.crt"', "net.tls: cert_file and key_file go together"),
    ('mutual = true', "net.tls: mutual TLS needs enabled, cert_file, key_file and ca_file"),
])
def test_tls_errors(tmp_path, tls, msg):
    p = tmp_path / "bad.toml"
    p.write_text(f"[net.tls]\n{tls}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(ei.value) == f"{p}: {msg}"


def test_front_door_files():
    from pddgw.config import TlsConfig

    own = TlsConfig(front_door=True, front_cert_file="d/{node}-door.crt", front_key_file="d/door.key",
                    cert_file="n.crt", key_file="n.key")
    assert own.for_node("router").front_files() == (
        "net.tls.front_cert_file", "d/router-door.crt", "net.tls.front_key_file", "d/door.key")
    node = TlsConfig(front_door=True, cert_file="k/{node}.crt", key_file="k/{node}.key")
    assert node.for_node("router").front_files() == (
        "net.tls.cert_file", "k/router.crt", "net.tls.key_file", "k/router.key")


def test_unreadable_secret_file_names_key_and_file(tmp_path):
    from pddgw.config import NetConfig

    missing = tmp_path / "link-secret"
    with pytest.raises(ConfigError) as ei:
        NetConfig(secret_file=str(missing)).load_secret()
    assert str(ei.value) == f"net.secret_file: cannot read {missing}: No such file or directory"
    missing.write_text("short\n")
    with pytest.raises(ConfigError, match="^net.secret_file: secret must have >= 16 characters$"):
        NetConfig(secret_file=str(missing)).load_secret()


def test_costmodel_instance_shape_keys(tmp_path):
    p = tmp_path / "moe.toml"
    p.write_text('[model]\nprofile = "deepseek-v4-pro"\n[engine]\nimplementation = "costmodel"\n'
                 '[engine.costmodel]\nhardware = "H100-SXM"\ntensor_parallel = 1\ndata_parallel = 16\n'
                 'expert_parallel = 16\ngpus_per_node = 8\n')
    cm = load_config(p).engine.costmodel
    assert (cm.tensor_parallel, cm.data_parallel, cm.expert_parallel, cm.gpus_per_node, cm.gpus) == (1, 16, 16, 8, 16)
    # A dense deployment keeps its meaning: tensor_parallel GPUs, experts over all of them.
    assert (CostModelConfig(tensor_parallel=4).gpus, CostModelConfig().expert_parallel) == (4, 0)


def test_stream_interval_key(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[engine]\nstream_interval = 8\n")
    assert load_config(p).engine.stream_interval == 8
    p.write_text("[engine]\nstream_interval = 0\n")
    with pytest.raises(ConfigError, match="stream_interval must be in 1..1024"):
        load_config(p)
