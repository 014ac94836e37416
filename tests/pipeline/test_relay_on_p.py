"""A prefill node that relays what it prefills (`[[nodes]] relay = true`), in one process.

One engine prefills and relays; MD in cluster B over the shaped WAN.  Every
path streams exactly what one local engine generates, with its logprobs,
nothing but MD's missing KV crosses the WAN, and the relay node holds
nothing after (the `deploy` fixture's leak check).  Its handoffs are
tests/pipeline/test_embedded.py's, with the relay on P.
"""

from __future__ import annotations

import dataclasses

import pytest

from pddgw.config import RELAY_MIXED_STEP_TOKENS, Config, ConfigError, load_config
from pddgw.engines.types import SamplingParams

from .test_logprobs_paths import check_runs, local_off_loop, run_on
from .test_embedded import BYTES_PER_TOKEN, deploy, make_cfg, prompt_of, relay_on_p  # noqa: F401 (a fixture)


def relay_cfg(**policy) -> Config:
    return relay_on_p(make_cfg(**policy))


@pytest.mark.parametrize("pipeline,mode", [("P-RLD-MD", "catch-up"), ("P-RLD", None)])
async def test_relay_on_p_streams_the_local_engines_logprobs(deploy, pipeline, mode):
    ws, side, _ = await deploy(relay_cfg(pipeline=pipeline, handoff_mode=mode or "auto", catchup_threshold=2,
                                         catchup_threshold_md_loaded=2, catchup_max_rounds=2))
    p = prompt_of(61)             # the relay computes the prompt's last partial block itself
    n = 300 if pipeline == "P-RLD-MD" else 40
    sp = SamplingParams(max_tokens=n, temperature=0.8, seed=77, logprobs=3, prompt_logprobs=2)
    toks, lps = await local_off_loop(p, sp)
    out, runs = await run_on(side, "lp-" + pipeline, p, sp, pipeline, mode)
    assert list(out.output_ids) == toks
    check_runs(runs, toks, lps)
    assert len(out.prompt_logprobs) == len(p) - 1             # P's, fetched from P
    tl = out.record.to_dict()
    assert tl["pipeline"] == pipeline and tl["wan_kv_bytes"] == (61 * BYTES_PER_TOKEN if mode else 0)
    if mode:
        at = tl["handoff_position"]
        assert 0 < at < n and tl["tokens_by_role"] == {"rld": at, "md": n - at}
    else:
        assert tl["tokens_by_role"] == {"rld": n}


def test_relay_is_for_a_prefill_node(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('[[nodes]]\nname = "r"\nrole = "router"\n[[nodes]]\nname = "p0"\nrole = "prefill"\nrelay = true\n'
                 '[[nodes]]\nname = "md0"\nrole = "md"\nrelay = true\n')
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(ei.value) == f"{p}: nodes[2]: node 'md0': relay = true is for a prefill node (this one is md)"


def test_a_relaying_p_caps_its_mixed_steps_by_default():
    cfg = relay_cfg()
    p0, md0 = cfg.node("p0"), cfg.node("md0")
    assert cfg.engine_for(p0).mixed_step_tokens == RELAY_MIXED_STEP_TOKENS == 256
    assert cfg.engine_for(md0).mixed_step_tokens == 0
    own = dataclasses.replace(p0, engine=dataclasses.replace(cfg.engine, mixed_step_tokens=64))
    assert cfg.engine_for(own).mixed_step_tokens == 64
