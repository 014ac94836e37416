"""The hardware profiles: datasheet numbers as profiles.py's comments state them, and the
`calibrated` flag against pddgw/sim/calibration.toml's rows."""

import dataclasses
import tomllib
from pathlib import Path

import pytest

from pddgw.sim import profiles

CALIBRATION = Path(profiles.__file__).with_name("calibration.toml")
H100 = profiles.hardware("H100-SXM")


# name: (BF16, FP8, FP4 dense TFLOPS, HBM TB/s, HBM GB, scale-up GB/s per direction, scale-out GB/s)
DATASHEET = {
    "H100-SXM": (989.5, 1979.0, 0.0, 3.35, 80.0, 450.0, 50.0),
    "H200-SXM": (989.5, 1979.0, 0.0, 4.8, 141.0, 450.0, 50.0),
    "H800-SXM": (989.5, 1979.0, 0.0, 3.35, 80.0, 200.0, 50.0),
    "A100-80G": (312.0, 0.0, 0.0, 2.039, 80.0, 300.0, 25.0),
    "H20": (148.0, 296.0, 0.0, 4.0, 96.0, 450.0, 50.0),
    "B200": (2250.0, 4500.0, 9000.0, 8.0, 180.0, 900.0, 50.0),
    "MI300X": (1307.4, 2614.9, 0.0, 5.3, 192.0, 448.0, 50.0),
    "L40S": (362.05, 733.0, 0.0, 0.864, 48.0, 32.0, 25.0),
    "Ascend-910C": (752.0, 0.0, 0.0, 3.2, 128.0, 392.0, 50.0),
    "Ascend-950PR": (500.0, 1000.0, 2000.0, 1.6, 128.0, 1000.0, 50.0),
    "Ascend-950DT": (500.0, 1000.0, 2000.0, 4.0, 144.0, 1000.0, 50.0),
}


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_each_part_has_its_datasheet_numbers(name):
    hw = profiles.hardware(name)
    assert (hw.peak_tflops_bf16, hw.peak_tflops_fp8, hw.peak_tflops_fp4, hw.hbm_tb_s, hw.hbm_gb,
            hw.interconnect_gb_s, hw.scaleout_gb_s) == DATASHEET[name]
    assert hw.native_fp4 == (name in ("B200", "Ascend-950PR", "Ascend-950DT"))


def test_calibrated_means_a_published_row_in_calibration_toml():
    with CALIBRATION.open("rb") as f:
        rows = {m["hardware"] for m in tomllib.load(f)["measurement"]}
    assert set(profiles.HARDWARE) == set(DATASHEET)
    for hw in profiles.HARDWARE.values():
        assert hw.calibrated == (hw.name in rows), hw.name
    assert {n for n, hw in profiles.HARDWARE.items() if not hw.calibrated} == {
        "H20", "B200", "MI300X", "L40S", "Ascend-910C", "Ascend-950PR", "Ascend-950DT"}


def test_uncalibrated_parts_inherit_h100s_fitted_numbers_and_say_so():
    for hw in profiles.HARDWARE.values():
        if hw.calibrated:
            assert hw.efficiencies_from == ""
            continue
        assert hw.efficiencies_from == "H100-SXM"
        assert (hw.compute_efficiency, hw.bandwidth_efficiency, hw.step_overhead_ms, hw.allreduce_latency_us) == (
            H100.compute_efficiency, H100.bandwidth_efficiency, H100.step_overhead_ms, H100.allreduce_latency_us)
    assert profiles.uncalibrated(["H100-SXM", "B200", "MI300X", "B200"]) == {"B200": "H100-SXM",
                                                                             "MI300X": "H100-SXM"}
    assert profiles.uncalibrated(["H100-SXM", "H200-SXM"]) == {}
    line = profiles.uncalibrated_line({"B200": "H100-SXM"})
    assert line.startswith("uncalibrated hardware") and "B200 <- H100-SXM" in line
    assert profiles.uncalibrated_line({}) == ""


def test_a_profile_names_where_its_efficiencies_come_from_exactly_when_uncalibrated():
    with pytest.raises(ValueError, match="efficiencies_from"):
        dataclasses.replace(H100, calibrated=False)
    with pytest.raises(ValueError, match="efficiencies_from"):
        dataclasses.replace(H100, efficiencies_from="A100-80G")
    with pytest.raises(ValueError, match="peak_tflops_fp4"):
        dataclasses.replace(H100, peak_tflops_fp4=-1.0)


def test_gemm_peaks_follow_the_weights_and_the_part():
    b200, a100, ascend = (profiles.hardware(n) for n in ("B200", "A100-80G", "Ascend-910C"))
    fp4, fp8, bf16 = 0.53125, 1.0 + 1 / 16384, 2.0
    assert (b200.gemm_peak_flops(fp4), b200.gemm_peak_flops(fp8), b200.gemm_peak_flops(bf16)) == (
        9000e12, 4500e12, 2250e12)
    # Hopper: FP4 as W4A16 (the BF16 peak), FP8 on its FP8 tensor cores.
    assert (H100.gemm_peak_flops(fp4), H100.gemm_peak_flops(fp8), H100.gemm_peak_flops(bf16)) == (
        989.5e12, 1979e12, 989.5e12)
    # No FP8 tensor cores: every precision at the BF16 peak.
    assert {a100.gemm_peak_flops(b) for b in (fp4, fp8, bf16)} == {312e12}
    assert {ascend.gemm_peak_flops(b) for b in (fp4, fp8, bf16)} == {752e12}
