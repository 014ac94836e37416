"""Prices are a menu input: pddgw/sim/prices.toml, a scenario's or plan's [prices], a group's
price_per_gpu_hour; a part without a price, or an unknown part, is refused in one line."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pddgw.config import ConfigError
from pddgw.sim import profiles
from pddgw.sim.plan_space import load_plan
from pddgw.sim.scenario import NodeGroup, deployment_price, load_scenario

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "sim" / "tiny.toml"
PLAN_TINY = ROOT / "tests" / "sim" / "plan_tiny.toml"


def test_the_shipped_prices_are_todays_each_with_a_source_and_a_date():
    assert profiles.shipped_prices() == {"A100-80G": 1.30, "H100-SXM": 3.00, "H200-SXM": 3.75, "H800-SXM": 2.00,
                                         "B200": 5.25, "MI300X": 1.99}
    with profiles.PRICES_TOML.open("rb") as f:
        for entry in tomllib.load(f)["prices"].values():
            assert entry["source"] and len(entry["date"]) == 7          # "YYYY-MM"
    assert not hasattr(profiles.HARDWARE["H100-SXM"], "price_per_gpu_hour")


def test_a_scenarios_prices_override_the_shipped_ones_and_a_groups_override_both(tmp_path):
    sc = load_scenario(TINY)
    same, pdd = sc.deployments
    assert deployment_price(sc, same) == (2 * 3.00, 2)
    assert deployment_price(sc, pdd) == (2 * 3.00 + 3.75, 3)
    cheap = tmp_path / "cheap.toml"
    text = TINY.read_text().replace('kv_frame_mb = 8.0', 'kv_frame_mb = 8.0\n\n[prices]\n"H100-SXM" = 2.5')
    cheap.write_text(text)
    sc = load_scenario(cheap)
    assert [deployment_price(sc, d)[0] for d in sc.deployments] == [2 * 2.5, 2 * 2.5 + 3.75]
    cheap.write_text(text.replace('{ role = "md", count = 1, cluster = "B", tensor_parallel = 1, hardware = '
                                  '"H200-SXM" }', '{ role = "md", count = 1, cluster = "B", tensor_parallel = 1, '
                                  'hardware = "H200-SXM", price_per_gpu_hour = 4.0 }'))
    assert deployment_price(load_scenario(cheap), load_scenario(cheap).deployments[1])[0] == 2 * 2.5 + 4.0


def test_a_part_without_a_price_is_refused_naming_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace('hardware = "H200-SXM"', 'hardware = "H20"'))
    with pytest.raises(ConfigError, match=r'bad.toml: prices.H20: no price for hardware .H20.: add \[prices\] '
                                          r'"H20" = USD per GPU-hour'):
        load_scenario(bad)
    with pytest.raises(KeyError, match="prices.L40S"):
        assert NodeGroup(role="md", hardware="L40S", tensor_parallel=8).price
    ok = tmp_path / "ok.toml"
    ok.write_text(bad.read_text().replace('kv_frame_mb = 8.0', 'kv_frame_mb = 8.0\n\n[prices]\nH20 = 6.0'))
    sc = load_scenario(ok)
    assert deployment_price(sc, sc.deployments[1])[0] == 2 * 3.00 + 6.0


def test_an_unknown_part_is_refused_listing_the_known_ones(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace('kv_frame_mb = 8.0', 'kv_frame_mb = 8.0\n\n[prices]\nGB300 = 6.0'))
    with pytest.raises(ConfigError, match=r"prices.GB300: unknown hardware \(known: A100-80G, Ascend-910C"):
        load_scenario(bad)
    bad.write_text(TINY.read_text().replace('hardware = "H200-SXM"', 'hardware = "GB300"'))
    with pytest.raises(ConfigError, match=r"hardware 'GB300' is not one of \['A100-80G', 'Ascend-910C'"):
        load_scenario(bad)


@pytest.mark.parametrize("edit,needle", [
    (('hardware = "H200-SXM"', 'hardware = "H20"'), "prices.H20: no price for hardware 'H20'"),
    (('hardware = "H200-SXM"', 'hardware = "GB300"'), "hardware 'GB300' is not one of"),
])
def test_pddgw_sim_refuses_in_one_line(tmp_path, edit, needle):
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace(*edit))
    proc = subprocess.run([sys.executable, "-m", "pddgw.cli", "sim", "--scenario", str(bad), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr


def test_a_plans_prices_override_the_scenarios_and_a_missing_one_is_refused(tmp_path):
    plan = load_plan(PLAN_TINY)
    assert [o.price for c in plan.spec.clusters for o in c.hardware] == [3.0, 3.75]
    text = PLAN_TINY.read_text().replace(", price_per_gpu_hour = 3.75", "").replace(", price_per_gpu_hour = 3.0", "")
    free = tmp_path / "free.toml"
    free.write_text(text)
    (tmp_path / "tiny.toml").write_text(TINY.read_text())
    plan = load_plan(free)
    assert [o.price for c in plan.spec.clusters for o in c.hardware] == [3.00, 3.75]      # prices.toml
    free.write_text(text + '\n[prices]\n"H200-SXM" = 4.5\n')
    assert [o.price for c in load_plan(free).spec.clusters for o in c.hardware] == [3.00, 4.5]
    free.write_text(text.replace('hardware = "H200-SXM"', 'hardware = "L40S"'))
    with pytest.raises(ConfigError, match=r"free.toml: prices.L40S: no price"):
        load_plan(free)


def test_reports_that_use_an_uncalibrated_part_say_so(tmp_path):
    b200 = tmp_path / "b200.toml"
    b200.write_text(TINY.read_text().replace('hardware = "H200-SXM"', 'hardware = "B200"')
                    .replace('kv_frame_mb = 8.0', 'kv_frame_mb = 8.0\n\n[prices]\nB200 = 6.0'))
    proc = subprocess.run([sys.executable, "-m", "pddgw.cli", "sim", "--scenario", str(b200), "--jobs", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("uncalibrated hardware (no published serving measurement in calibration.toml; efficiencies of the "
            "part named): B200 <- H100-SXM") in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "pddgw.cli", "sim", "--scenario", str(TINY), "--jobs", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert proc.returncode == 0 and "uncalibrated" not in proc.stdout


def test_a_plan_over_an_uncalibrated_part_says_so(tmp_path):
    from pddgw.sim.plan import _uncalibrated, format_dry_run
    (tmp_path / "tiny.toml").write_text(TINY.read_text())
    plan_path = tmp_path / "plan.toml"
    plan_path.write_text(PLAN_TINY.read_text().replace('hardware = "H200-SXM", price_per_gpu_hour = 3.75',
                                                       'hardware = "L40S"') + '\n[prices]\nL40S = 1.0\n')
    plan = load_plan(plan_path)
    assert _uncalibrated(plan) == {"L40S": "H100-SXM"}
    assert "uncalibrated hardware" in format_dry_run(plan).splitlines()[1]
    assert _uncalibrated(load_plan(PLAN_TINY)) == {}
