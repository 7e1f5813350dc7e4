"""`hfplan profile --refit`: a measured profile fitted again from its raw measurements, measuring nothing.

The shipped `cpu` profile ships its measurements (cpu.csv) and must be their refit by this version of hfplan: a
change to the cost model that moves a fitted fixed cost fails here until the shipped profile is refitted (README,
"hfplan profile"). The quick profile's own refit is in test_profiler.py (its module measures one)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from hfplan.errors import HfplanError
from hfplan.profiler.refit import read_rows, refit_profile
from hfplan.profiler.runtime import DEEP_LAYERS, GENERATE_CALL_OP, depth_op
from hfplan.profiles.hardware import SHIPPED_DIR, HardwareProfile, load_hardware
from tests.support.cli import assert_user_error, invoke

SHIPPED_CSV = SHIPPED_DIR / "cpu.csv"


def fitted_fields(profile: HardwareProfile) -> dict:
    """Everything a refit derives, without the name and the prose."""
    return profile.model_dump(exclude={"name", "description"})


def test_the_shipped_cpu_profile_is_the_refit_of_its_shipped_measurements():
    shipped = load_hardware("cpu")
    result = refit_profile(shipped, read_rows(SHIPPED_CSV), "cpu")
    assert fitted_fields(result.profile) == fitted_fields(shipped)
    assert result.profile.compute.measured_attention is not None  # the attention rows are among them
    # The refitted rows are the shipped ones: the same measurements, the same predictions.
    shipped_rows = pd.read_csv(SHIPPED_CSV)
    pd.testing.assert_frame_equal(result.measurements.reset_index(drop=True), shipped_rows, check_dtype=False)


def test_a_refit_without_the_attention_rows_prices_attention_at_the_matmul_rate_and_fits_other_fixed_costs():
    """The fixed costs are fitted beyond the kernels the model prices: a different kernel model moves them."""
    rows = read_rows(SHIPPED_CSV)
    without = refit_profile(load_hardware("cpu"), [r for r in rows if r["kind"] != "attention"], "cpu").profile
    shipped = load_hardware("cpu")
    assert without.compute.measured_attention is None
    assert without.compute.peak_tflops == shipped.compute.peak_tflops  # the rates come from the same rows
    assert without.runtime.layer_forward_us != shipped.runtime.layer_forward_us


def copied(tmp_path: Path) -> Path:
    source = tmp_path / "measured.yaml"
    shutil.copy(SHIPPED_DIR / "cpu.yaml", source)
    shutil.copy(SHIPPED_CSV, source.with_suffix(".csv"))
    return source


def test_the_cli_writes_the_refit_and_its_rows_beside_it(tmp_path):
    source = copied(tmp_path)
    out = tmp_path / "again.yaml"
    result = invoke("profile", "--refit", source, "--out", out)
    assert result.exit_code == 0, result.output
    assert "fitted rates" in result.output and "measured vs cost model" in result.output
    again = load_hardware(str(out))
    assert again.name == "again" and fitted_fields(again) == fitted_fields(load_hardware("cpu"))
    assert "Refitted from its raw measurements" in again.description
    assert out.read_text().startswith("# Hardware profile refitted by `hfplan profile --refit")
    assert len(pd.read_csv(out.with_suffix(".csv"))) == len(pd.read_csv(SHIPPED_CSV))


def test_bad_refits_are_one_line_and_write_nothing(tmp_path):
    source = copied(tmp_path)
    out = tmp_path / "out.yaml"
    assert_user_error(invoke("profile", "--refit", tmp_path / "missing.yaml", "--out", out), "missing.yaml")
    assert_user_error(invoke("profile", "--refit", source, "--device", "cpu", "--out", out), "--device")
    assert_user_error(invoke("profile", "--refit", source, "--out", source), "overwrite")
    # A profile hfplan profile did not measure (a shipped GPU profile), with rows beside it.
    gpu = tmp_path / "gpu.yaml"
    shutil.copy(SHIPPED_DIR / "h100-80g.yaml", gpu)
    shutil.copy(SHIPPED_CSV, gpu.with_suffix(".csv"))
    assert_user_error(invoke("profile", "--refit", gpu, "--out", out), "not written by hfplan profile")
    # Measurements missing, unreadable, or without a row the runtime is fitted from.
    alone = tmp_path / "alone.yaml"
    shutil.copy(source, alone)
    assert_user_error(invoke("profile", "--refit", alone, "--out", out), "no raw measurements")
    alone.with_suffix(".csv").write_text("not,a\nprofile")
    assert_user_error(invoke("profile", "--refit", alone, "--out", out), "no column")
    frame = pd.read_csv(SHIPPED_CSV)
    frame[frame["op"] != GENERATE_CALL_OP].to_csv(alone.with_suffix(".csv"), index=False)
    assert_user_error(invoke("profile", "--refit", alone, "--out", out), GENERATE_CALL_OP)
    # A CPU profile's rows of the demo model at two depths are always measured: not taken as never measured.
    depth = depth_op("step", DEEP_LAYERS)
    frame[frame["op"] != depth].to_csv(alone.with_suffix(".csv"), index=False)
    assert_user_error(invoke("profile", "--refit", alone, "--out", out), depth)
    frame.drop(columns=["world"]).to_csv(alone.with_suffix(".csv"), index=False)
    assert_user_error(invoke("profile", "--refit", alone, "--out", out), "malformed raw measurements", "world")
    assert not out.exists() and not out.with_suffix(".csv").exists()


@pytest.mark.parametrize("needle", ["matmul", "layer"])
def test_measurements_without_a_kind_the_fit_needs_are_refused(needle):
    rows = [r for r in read_rows(SHIPPED_CSV) if r["kind"] != needle]
    with pytest.raises(HfplanError, match=f"no {needle} rows"):
        refit_profile(load_hardware("cpu"), rows, "cpu")
