"""Shaping schedule arithmetic (virtual time) and the net config section."""

from __future__ import annotations

import pytest

from pddgw.config import ConfigError, NetConfig, ShapingConfig, TlsConfig, load_config
from pddgw.net.shaping import Shaper


def test_constant_rate_and_latency():
    s = Shaper(ShapingConfig(gbps=0.1, latency_ms=10.0), t0=100.0)
    done, arrival = s.schedule(10_000_000, now=100.0)
    assert done == pytest.approx(100.8)            # 80 Mbit at 100 Mbit/s
    assert arrival == pytest.approx(100.81)        # + one-way latency


def test_frames_queue_behind_each_other_and_pipeline():
    s = Shaper(ShapingConfig(gbps=1.0, latency_ms=5.0), t0=0.0)
    # Ten 1 MB frames sent at once leave back to back; each arrives 5 ms after it left.
    times = [s.schedule(1_000_000, now=0.0) for _ in range(10)]
    assert [round(d, 9) for d, _ in times] == [round(0.008 * (i + 1), 9) for i in range(10)]
    assert [round(a - d, 9) for d, a in times] == [0.005] * 10
    # An idle wire starts at `now`, not at the end of the last frame.
    d, a = s.schedule(1_000_000, now=1.0)
    assert (d, a) == (pytest.approx(1.008), pytest.approx(1.013))


def test_trace_steps_are_integrated_across_a_change():
    s = Shaper(ShapingConfig(trace=((0.0, 1.0), (1.0, 0.5))), t0=10.0)
    # 200 MB from t=0.5: 0.5 s at 1 Gbps = 62.5 MB, then 137.5 MB at 0.5 Gbps = 2.2 s.
    done, _ = s.schedule(200_000_000, now=10.5)
    assert done == pytest.approx(10.0 + 1.0 + 2.2)


def test_periodic_trace_and_outage():
    cfg = ShapingConfig(trace=((0.0, 1.0), (1.0, 0.0)), trace_period_s=2.0)
    s = Shaper(cfg, t0=0.0)
    # 250 MB = 2 Gbit: 1 s of 1 Gbps, a 1 s outage, then 1 more second.
    done, _ = s.schedule(250_000_000, now=0.0)
    assert done == pytest.approx(3.0)
    dead = Shaper(ShapingConfig(trace=((0.0, 1.0), (1.0, 0.0))), t0=0.0)
    assert dead.serialization_end(2.0, 1) > 1e8      # bandwidth 0 for ever: never


def test_unlimited_bandwidth_latency_only():
    s = Shaper(ShapingConfig(latency_ms=15.0), t0=0.0)
    assert s.schedule(10 ** 9, now=1.0) == (1.0, pytest.approx(1.015))


def test_jitter_is_bounded_ordered_and_reproducible():
    cfg = ShapingConfig(gbps=10.0, latency_ms=20.0, jitter_ms=5.0, seed=7)
    a, b = Shaper(cfg, 0.0), Shaper(cfg, 0.0)
    ra = [a.schedule(1000, now=i * 0.001) for i in range(200)]
    rb = [b.schedule(1000, now=i * 0.001) for i in range(200)]
    assert ra == rb
    arrivals = [x for _, x in ra]
    assert arrivals == sorted(arrivals)
    delays = [x - d for d, x in ra]
    assert min(delays) >= 0.015 - 1e-12 and max(delays) <= 0.025 + 1e-12
    assert max(delays) - min(delays) > 0.003          # jitter is really applied


@pytest.mark.parametrize("kwargs, match", [
    ({"gbps": -1.0}, "gbps must be >= 0"),
    ({"latency_ms": 1.0, "jitter_ms": 2.0}, "jitter_ms"),
    ({"gbps": 1.0, "trace": ((0.0, 1.0),)}, "either gbps or trace"),
    ({"trace": ((1.0, 1.0),)}, "start at 0"),
    ({"trace": ((0.0, 1.0), (0.0, 2.0))}, "increase"),
    ({"trace": ((0.0, 1.0, 2.0),)}, r"trace\[0\]"),
    ({"trace": ((0.0, 1.0), (2.0, 1.0)), "trace_period_s": 1.0}, "trace_period_s"),
])
def test_shaping_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShapingConfig(**kwargs)


def test_net_config_defaults_describe_the_embedded_wan():
    cfg = NetConfig()
    # A "wan" entry with no figures of its own: the embedded deployment derives
    # them from its decode step ([net.regime], tests/pipeline/test_regime.py).
    assert [s.name for s in cfg.links] == ["wan"] and cfg.shaping("wan") is None and cfg.regime.enabled
    assert cfg.shaping("local") is None


def test_net_config_from_toml(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123\n")
    path = tmp_path / "config.toml"
    path.write_text(f"""
[net]
secret_file = "{secret}"
stripes = 3
[net.tls]
enabled = true
cert_file = "c.pem"
key_file = "k.pem"
[[net.links]]
name = "wan"
gbps = 25
latency_ms = 20
[[net.links]]
name = "flaky"
trace = [[0, 10], [5, 1.5]]
trace_period_s = 10
""")
    cfg = load_config(path).net
    assert cfg.stripes == 3 and cfg.tls == TlsConfig(enabled=True, cert_file="c.pem", key_file="k.pem")
    assert cfg.load_secret() == "0123456789abcdef0123"
    assert cfg.shaping("wan") == ShapingConfig(name="wan", gbps=25.0, latency_ms=20.0)
    assert cfg.shaping("flaky").trace == ((0.0, 10.0), (5.0, 1.5))


@pytest.mark.parametrize("body, match", [
    ("[net]\nstripe = 2", "net.stripe: unknown key"),
    ("[net]\nstripes = 0", "net: stripes must be in"),
    ("[net]\nsecret = 'short'", "net: secret must have >= 16"),
    ("[[net.links]]\nname = 'wan'\ngbps = 'fast'", r"net.links\[0\].gbps: expected a number"),
    ("[[net.links]]\nname='a'\n[[net.links]]\nname='a'", "duplicate name"),
    ("[net.tls]\nmutual = true", "net.tls: mutual TLS needs"),
])
def test_net_config_errors_name_the_key(tmp_path, body, match):
    path = tmp_path / "config.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=match):
        load_config(path)
