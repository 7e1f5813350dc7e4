"""The profiler behind `hfplan profile`: its fits on synthetic measurements with known parameters, the
profile it writes (schema round trip), its input checks, and one real quick run on CPU processes."""

from __future__ import annotations

import builtins
import dataclasses
import datetime
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import Result
from typer.testing import CliRunner

from hfplan import cli
from hfplan.errors import HfplanError
from hfplan.profiler import command, runtime
from hfplan.profiler.build import Fits, build_profile
from hfplan.profiler.call_gaps import CALL_FIELDS
from hfplan.profiler.device import KNOWN_GPUS, Device, Nominal, nominal_rates
from hfplan.profiler.fit import (
    COLLECTIVES,
    LinkFit,
    RooflineFit,
    fit_alpha_beta,
    fit_roofline,
)
from hfplan.profiler.idle_wake import IDLE_MS
from hfplan.profiler.pace import PACE_DRIFT
from hfplan.profiler.report import FLAG_PCT, PASS_LABEL
from hfplan.profiles.hardware import HardwareProfile, Link, load_hardware
from hfplan.profiles.models import CATALOG, ModelArch
from hfplan.simulator import collectives as coll
from hfplan.simulator.collectives import collective_terms
from hfplan.simulator.costs import step_tp_collectives
from tests.support.cli import assert_user_error, invoke

SIZES = [2.0**k for k in range(3, 29)]  # 8 B .. 256 MiB


def synthetic_collectives(alpha: float, bandwidth: float, world: int, noise: float = 0.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    steps, moved, seconds = [], [], []
    for op in COLLECTIVES:
        s, factor = collective_terms(op, world)
        for n in SIZES:
            steps.append(s)
            moved.append(factor * n)
            seconds.append((s * alpha + factor * n / bandwidth) * (1 + noise * rng.standard_normal()))
    return steps, moved, seconds


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("alpha,bandwidth", [(25e-6, 3e9), (2e-6, 230e9), (300e-6, 0.5e9)])
def test_alpha_beta_fit_recovers_known_latency_and_bandwidth(world, alpha, bandwidth):
    fit = fit_alpha_beta(*synthetic_collectives(alpha, bandwidth, world))
    assert fit.latency_s == pytest.approx(alpha, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    assert fit.rms_rel_error < 1e-6
    assert fit.points == len(COLLECTIVES) * len(SIZES)


def test_alpha_beta_fit_with_measurement_noise():
    fit = fit_alpha_beta(*synthetic_collectives(40e-6, 2e9, world=2, noise=0.05, seed=1))
    assert fit.latency_s == pytest.approx(40e-6, rel=0.05)
    assert fit.bytes_per_s == pytest.approx(2e9, rel=0.05)
    assert 0.02 < fit.rms_rel_error < 0.1


def test_alpha_beta_fit_never_negative():
    # Latency-free measurements that look slightly super-linear must not give a negative alpha.
    moved = np.array(SIZES)
    fit = fit_alpha_beta(np.ones_like(moved), moved, moved / 1e9 * (1 + 1e-3 * np.log2(moved)))
    assert fit.latency_s >= 0.0 and fit.bytes_per_s > 0


def test_alpha_beta_fit_rejects_bad_input():
    with pytest.raises(ValueError):
        fit_alpha_beta([1.0], [8.0], [1e-5])
    with pytest.raises(ValueError):
        fit_alpha_beta([1.0, 1.0], [8.0, 16.0], [1e-5, 0.0])


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_collective_terms_match_the_simulator(world):
    """The fit's model of each collective is the simulator's: a fitted link predicts what it measured."""
    link = Link(bandwidth_gbytes_per_s=3.0, efficiency=1.0, latency_us=25.0)
    hw = load_hardware("cpu").model_copy(update={"links": load_hardware("cpu").links.model_copy(
        update={"intra_node": link})})
    group = coll.Group(world, world, world)
    fitted = LinkFit(latency_s=25e-6, bytes_per_s=3e9, rms_rel_error=0.0, points=0)
    for n in (8.0, 1e6, 3e8):
        for op, simulated in (("all_reduce", coll.all_reduce(hw, group, n)),
                              ("all_gather", coll.all_gather(hw, group, n)),
                              ("reduce_scatter", coll.reduce_scatter(hw, group, n)),
                              ("p2p", coll.point_to_point(hw, n, same_node=True))):
            steps, factor = collective_terms(op, world)
            assert fitted.predict(steps, factor * n) == pytest.approx(simulated, rel=1e-12)


def synthetic_kernels(overhead: float, flops_per_s: float, bytes_per_s: float, noise: float = 0.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    flops, nbytes = [], []
    for m in (1, 16, 128, 1024, 4096):
        for k, n in ((256, 256), (1024, 1024), (4096, 4096), (4096, 14336)):
            flops.append(2.0 * m * k * n)
            nbytes.append(2.0 * (m * k + k * n + m * n))
    for size in (2.0**k for k in range(6, 31, 2)):
        flops.append(0.0)
        nbytes.append(2 * size)
    f, b = np.array(flops), np.array(nbytes)
    t = overhead + np.maximum(f / flops_per_s, b / bytes_per_s)
    return f, b, t * (1 + noise * rng.standard_normal(len(t)))


@pytest.mark.parametrize("overhead,flops_per_s,bytes_per_s", [(5e-6, 7e11, 1.8e12), (1e-6, 1.3e11, 1.2e10),
                                                             (12e-6, 2.5e14, 3e12)])
def test_roofline_fit_recovers_known_rates(overhead, flops_per_s, bytes_per_s):
    fit = fit_roofline(*synthetic_kernels(overhead, flops_per_s, bytes_per_s))
    assert fit.overhead_s == pytest.approx(overhead, rel=1e-3)
    assert fit.flops_per_s == pytest.approx(flops_per_s, rel=1e-3)
    assert fit.bytes_per_s == pytest.approx(bytes_per_s, rel=1e-3)
    assert fit.rms_rel_error < 1e-3


def test_roofline_fit_with_noise_and_fixed_bandwidth():
    f, b, t = synthetic_kernels(4e-6, 2.5e14, 3e12, noise=0.03, seed=2)
    fit = fit_roofline(f, b, t)
    assert fit.flops_per_s == pytest.approx(2.5e14, rel=0.05)
    assert fit.bytes_per_s == pytest.approx(3e12, rel=0.05)
    assert fit.overhead_s == pytest.approx(4e-6, rel=0.1)
    held = fit_roofline(f, b, t, bytes_per_s=3e12)
    assert held.bytes_per_s == 3e12
    assert held.flops_per_s == pytest.approx(2.5e14, rel=0.05)


def test_roofline_fit_is_robust_to_a_few_kernels_off_the_roofline():
    f, b, t = synthetic_kernels(4e-6, 2.5e14, 3e12)
    t = t.copy()
    t[[1, 5]] *= 3.0  # two kernels three times slower than any roof (say, disturbed)
    fit = fit_roofline(f, b, t)
    assert fit.flops_per_s == pytest.approx(2.5e14, rel=0.05)
    assert fit.bytes_per_s == pytest.approx(3e12, rel=0.05)


def test_roofline_fit_needs_a_matmul():
    with pytest.raises(ValueError):
        fit_roofline([0.0, 0.0, 0.0], [1e3, 1e6, 1e9], [1e-6, 1e-4, 1e-1])


def fake_fits(intra: bool = True) -> Fits:
    return Fits(roofline=RooflineFit(overhead_s=2e-6, flops_per_s=1.2e11, bytes_per_s=1.1e10, rms_rel_error=0.1,
                                     points=26),
                best_matmul_flops=1.5e11, best_copy_bytes=1.2e10,
                intra=LinkFit(latency_s=80e-6, bytes_per_s=2.4e9, rms_rel_error=0.2, points=36) if intra else None,
                host=None, per_collective={})


def fake_device(kind: str = "cpu", name: str = "Test CPU", world: int = 2) -> Device:
    return Device(kind=kind, name=name, world_size=world, count=world, threads=1, cache_bytes=32 * 2**20,
                  capacity_bytes=12 * 2**30, used_bytes=0.5 * 2**30, nominal=nominal_rates(name, kind))


def test_profile_schema_round_trip(tmp_path):
    base = load_hardware("cpu")
    profile = build_profile(fake_device(), fake_fits(), base, "measured", "torch x", "15 matmul shapes")
    path = tmp_path / "measured.yaml"
    path.write_text(profile.to_yaml())
    loaded = load_hardware(str(path))
    assert loaded == profile
    assert loaded.measured is True
    assert loaded.date == datetime.date.today().isoformat()
    assert loaded.backend == "gloo" and loaded.gpus_per_node == 2
    # CPU: the best measured rates stand in for the datasheet, efficiency is the fitted share of them.
    assert loaded.compute.peak_tflops == pytest.approx(0.15)
    assert loaded.compute.matmul_efficiency == pytest.approx(1.2 / 1.5, rel=1e-3)
    assert loaded.compute.kernel_overhead_us == pytest.approx(2.0)
    assert loaded.memory.bandwidth_gbytes_per_s * loaded.memory.efficiency == pytest.approx(11.0, rel=1e-3)
    assert loaded.links.intra_node.latency_us == pytest.approx(80.0)
    assert loaded.links.intra_node.effective_bytes_per_s == pytest.approx(2.4e9, rel=1e-3)
    assert loaded.links.inter_node == base.links.inter_node
    assert loaded.links.host == base.links.host
    assert loaded.compute.attention_rate is None  # CPU: attention at the fitted matmul rate
    assert loaded.compute.overlaps_collectives is False  # CPU: FSDP2's collectives run in line
    assert "carried over from base profile 'cpu'" in loaded.description
    assert "each collective also fitted on its own, every call timed after a millisecond" in loaded.description


def test_a_cpu_profile_prices_each_collective_by_its_own_fit_and_a_gpu_profile_by_the_link():
    fits = dataclasses.replace(fake_fits(), per_collective={
        "all_reduce": LinkFit(latency_s=600e-6, bytes_per_s=0.8e9, rms_rel_error=0.5, points=26),
        "p2p": LinkFit(latency_s=40e-6, bytes_per_s=5e9, rms_rel_error=0.1, points=26)})
    link = build_profile(fake_device(), fits, load_hardware("cpu"), "c", "t", "n").links.intra_node
    (measured,) = link.collectives  # point-to-point is the link's own
    assert (measured.op, measured.latency_us, measured.bandwidth_gbytes_per_s) == ("all_reduce", 600.0, 0.8)
    gpu = Device(kind="cuda", name="NVIDIA H100 80GB HBM3", world_size=8, count=8, threads=1,
                 cache_bytes=50 * 2**20, capacity_bytes=80 * 2**30, used_bytes=0.6 * 2**30,
                 nominal=nominal_rates("NVIDIA H100 80GB HBM3", "cuda"))
    assert build_profile(gpu, fits, load_hardware("h100-80g"), "h", "t", "n").links.intra_node.collectives == ()


def test_profile_without_collectives_carries_the_intra_node_link():
    base = load_hardware("cpu")
    profile = build_profile(fake_device(world=1), fake_fits(intra=False), base, "one", "torch x", "note")
    assert profile.links.intra_node == base.links.intra_node
    assert "intra-node link" in profile.description


def test_gpu_profile_uses_datasheet_peaks():
    device = Device(kind="cuda", name="NVIDIA H100 80GB HBM3", world_size=8, count=8, threads=1,
                    cache_bytes=50 * 2**20, capacity_bytes=80 * 2**30, used_bytes=0.6 * 2**30,
                    nominal=nominal_rates("NVIDIA H100 80GB HBM3", "cuda"))
    fits = Fits(roofline=RooflineFit(4e-6, 7.0e14, 3.0e12, 0.1, 40), best_matmul_flops=7.5e14, best_copy_bytes=3e12,
                intra=LinkFit(3e-6, 3.6e11, 0.1, 100), host=LinkFit(10e-6, 5.3e10, 0.1, 20), per_collective={})
    profile = build_profile(device, fits, load_hardware("h100-80g"), "h100", "torch x", "note")
    assert profile.backend == "nccl" and profile.gpus_per_node == 8
    assert profile.compute.peak_tflops == pytest.approx(989.4)
    assert profile.compute.matmul_efficiency == pytest.approx(700 / 989.4, rel=1e-3)
    # The flash attention rate is not measured: the base profile's is carried, and said to be.
    assert profile.compute.attention_rate == load_hardware("h100-80g").compute.attention_rate
    assert "flash attention rate" in profile.description
    # So are the CUDA cores' fp32 peak (67 TFLOP/s on H100) and the stack's decode attention kernel.
    assert profile.compute.vector_tflops == 67 and "fp32 CUDA-core peak" in profile.description
    assert profile.compute.decode_attention == "grouped" and profile.memory.l2_gbytes_per_s is None
    assert profile.compute.overlaps_collectives is True  # CUDA streams: collectives beside compute
    a100 = build_profile(device, fits, load_hardware("a100-80g"), "a100", "torch x", "note")
    assert a100.memory.l2_gbytes_per_s == load_hardware("a100-80g").memory.l2_gbytes_per_s == 5411
    assert "L2 bandwidth" in a100.description
    assert profile.memory.bandwidth_gbytes_per_s == pytest.approx(3350)
    assert profile.links.intra_node.bandwidth_gbytes_per_s == pytest.approx(450)
    assert profile.links.intra_node.effective_bytes_per_s == pytest.approx(3.6e11, rel=1e-3)
    assert profile.links.host.effective_bytes_per_s == pytest.approx(5.3e10, rel=1e-3)
    HardwareProfile.model_validate(profile.model_dump())


def test_known_gpu_names():
    assert nominal_rates("NVIDIA A100-SXM4-80GB", "cuda") == Nominal(312.0, 2039.0, 300.0, "a100-80g")
    assert nominal_rates("NVIDIA H200", "cuda").base == "h200-141g"
    assert nominal_rates("Some Future GPU", "cuda").peak_tflops is None
    for _, _, _, _, base in KNOWN_GPUS:
        load_hardware(base)  # every base profile named is shipped


def test_layer_scaling_keeps_head_size_and_divisibility():
    from hfplan.profiler.layers import cases_for, scaled, valid_tp
    from hfplan.profiler.sweeps import sweeps_for

    llama = CATALOG["llama3.1-8b"]
    small = scaled(llama, 8)
    assert (small.hidden, small.heads, small.kv_heads, small.ffn, small.dim_per_head) == (512, 4, 1, 1792, 128)
    assert scaled(llama, 3) is None
    assert valid_tp(llama, 8) and not valid_tp(CATALOG["qwen2.5-0.5b"], 4)
    cases = cases_for(small, sweeps_for("cpu", quick=True).layers)
    assert {c.op for c in cases} == {"forward", "forward+backward", "decode"}
    assert {c.tp for c in cases} == {1, 2}


def test_real_layer_measurement_and_prediction():
    """The real transformers layer runs in all three passes (the decode step through the KV cache)
    and is compared with the cost model for the shapes that ran."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hfplan.profiler.layers import LayerPlan, cases_for, measure_layers, predict
    from hfplan.profiler.sweeps import LayerCases

    for arch in (CATALOG["tiny"], ModelArch("qwen-like", layers=1, hidden=64, heads=4, kv_heads=2, ffn=96,
                                            vocab=10, attention_bias=True)):
        cases = cases_for(arch, LayerCases(batches=(2,), seqs=(8,), decode_batches=(2,), contexts=(16,), tps=(1, 2),
                                           budget_s=1))
        plan = LayerPlan(arch=arch, source=arch, scale=1, cases=cases, copies=2)
        steps: list[int] = []
        rows = measure_layers(torch, fake_device(), plan, min_time=0.002, step=lambda steps=steps: steps.append(1))
        assert len(rows) == len(cases) == len(steps) == 6
        for row, case in zip(rows, cases, strict=True):
            assert row["op"] == case.op and row["tp"] == case.tp
            assert 0 < row["seconds"] < 1
            assert predict(load_hardware("cpu"), arch, case) > 0


def test_missing_torch_gives_the_install_hint(monkeypatch):
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(HfplanError, match=r"pip install '\.\[execute\]'"):
        command.import_torch()
    assert_user_error(invoke("profile", "--device", "cpu"), command.INSTALL_HINT)


@pytest.mark.parametrize("args,message", [
    (["--device", "tpu"], "use cuda or cpu"),
    (["--device", "cpu", "--world-size", "0"], "at least 1"),
    (["--device", "cpu", "--world-size", "5"], "at most 4"),
    (["--device", "cpu", "--model", "llama9-1t"], "unknown model"),
    (["--device", "cpu", "--out", "/no/such/folder/p.yaml"], "does not exist"),
    (["--device", "cpu", "--out", "p.json"], ".yaml"),
    (["--device", "cpu", "--base", "nope"], "unknown hardware"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    assert_user_error(invoke("profile", *args), message)


def test_cuda_requested_without_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert_user_error(invoke("profile", "--device", "cuda"), "no CUDA GPU")


@dataclass(frozen=True)
class QuickProfile:
    result: Result  # the CLI's
    out: Path  # the profile; its raw measurements beside it (.csv)
    engine_times: list  # what each call of runtime.time_engines returned in the run


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory) -> QuickProfile:
    """The module's one real `hfplan profile --device cpu --world-size 2 --quick` (measuring takes a minute or
    more on 2 cores). Its runtime measurement times the executor's engines on one rank (runtime.time_engines,
    watched here, not replaced: it runs as it would and its result is kept), which the runtime test fits again."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")

    out = tmp_path_factory.mktemp("quick-profile") / "measured.yaml"
    measure, engine_times = runtime.time_engines, []

    def watched(*args, **kwargs):
        engine_times.append(measure(*args, **kwargs))
        return engine_times[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runtime, "time_engines", watched)
        result = CliRunner().invoke(cli.app, ["profile", "--device", "cpu", "--world-size", "2", "--quick", "--out",
                                              str(out)], terminal_width=160)
    return QuickProfile(result, out, engine_times)


@pytest.mark.slow
def test_the_quick_profile_is_the_refit_of_its_own_measurements(quick_profile, tmp_path):
    """What `hfplan profile` fits as it measures is what `--refit` fits from the rows it wrote beside the profile:
    no measurement behind a fitted field is missing from them, none is read back as another (this profile has no
    Ray: its call gaps and worker memory are carried over, both times alike)."""
    assert quick_profile.result.exit_code == 0, quick_profile.result.output
    out = tmp_path / "again.yaml"
    result = invoke("profile", "--refit", quick_profile.out, "--out", out)
    assert result.exit_code == 0, result.output
    measured, again = load_hardware(str(quick_profile.out)), load_hardware(str(out))
    assert again.model_dump(exclude={"name", "description"}) == measured.model_dump(exclude={"name", "description"})
    assert again.description.startswith(measured.description)


@pytest.mark.slow
def test_quick_cpu_profile_end_to_end(quick_profile):
    """`hfplan profile --device cpu --world-size 2 --quick`: a profile the simulator reads, raw
    measurements beside it, and the layer table against predictions from that very profile."""
    from hfplan.plan import GenConfig, InferConfig, Layout, TrainConfig
    from hfplan.profiler.layers import Case, predict
    from hfplan.simulator import costs

    result, out = quick_profile.result, quick_profile.out
    assert result.exit_code == 0, result.output
    assert "measured vs cost model" in result.output and "error %" in result.output
    profile = load_hardware(str(out))
    assert profile.measured is True and profile.name == "measured" and profile.backend == "gloo"
    assert profile.date == datetime.date.today().isoformat()
    assert profile.gpus_per_node == 2

    frame = pd.read_csv(out.with_suffix(".csv"))
    counts = frame["kind"].value_counts()
    for kind in ("matmul", "memory", "collective", "layer"):
        assert counts.get(kind, 0) > 0, kind
    assert set(frame.loc[frame["kind"] == "collective", "op"]) == set(COLLECTIVES)
    assert (frame["seconds"] > 0).all()
    # The same products with their operands in the cache: a table of every weight size measured (narrow ones too),
    # read where a generation step's weights and KV cache fit the cache share sysfs names.
    from hfplan.profiler import device as devices
    from hfplan.profiler.fit import fit_row_efficiency
    from hfplan.profiler.sweeps import sweeps_for

    cached = frame[frame["kind"] == "matmul_cached"]
    assert len(cached) == len(sweeps_for("cpu", True).cached_matmuls)
    table, share = profile.compute.cached_row_efficiency, devices.probe(None, "cpu", 2).cache_share_bytes
    assert profile.compute.cache_bytes == share and (table is None) == (share is None)  # sysfs may not say
    if table is not None:
        value = profile.compute.value_bytes
        refit = fit_row_efficiency(cached.to_dict("records"), profile.peak_flops,
                                   profile.compute.kernel_overhead_us * 1e-6, value, ends_at_rate=False, min_width=1)
        assert [(m, weight) for m, weight, _ in table] == [(m, weight) for m, weight, _ in refit]
        assert [fraction for _, _, fraction in table] == pytest.approx([f for _, _, f in refit], abs=0.01)
        assert {weight for _, weight, _ in table} == {
            value * k * n for k, n in set(zip(cached["k"], cached["n"], strict=True))}
    # The attention kernel timed alone at every case of the sweep, both kinds of call fitted from those rows.
    from hfplan.profiler.fit import fit_attention

    attention = frame[frame["kind"] == "attention"]
    assert len(attention) == len(sweeps_for("cpu", True).attention)
    refit = fit_attention(attention.to_dict("records"), profile.compute.value_bytes, profile.compute.cache_bytes)
    for op, kernel in profile.compute.measured_attention.items():
        assert (kernel.call_us, kernel.pair_us, kernel.score_ns, kernel.tflops) == pytest.approx(refit[op], rel=0.01,
                                                                                                 abs=1e-3)
    # The FSDP2-wrapped and the tensor-parallel engine are timed across the profiled world (its ranks computing
    # at once), the unwrapped one on a rank of its own; the raw rows behind them are not written twice.
    engine = frame[frame["kind"] == "runtime"].set_index("op")["world"]
    assert engine["fsdp_train_step_3_micro_batches"] == engine["fsdp_engine_log_prob"] == 2
    assert engine["tp_train_step_3_micro_batches"] == engine["tp_engine_log_prob"] == 2
    assert engine["train_step_3_micro_batches"] == engine["engine_step"] == engine["hybrid_switch"] == 1
    assert "engine" not in set(frame["kind"])
    # Both are timed with the demo model at DEEP_LAYERS as well: each one's per-layer figure of a forward is where
    # the written profile's difference between the two depths meets the measured one (zero where the model's
    # difference already reaches it).
    for mode in ("fsdp", "tp"):
        deep = f"{mode}_engine_log_prob_{runtime.DEEP_LAYERS}_layers"
        assert engine[deep] == engine[f"{mode}_train_step_3_micro_batches_{runtime.DEEP_LAYERS}_layers"] == 2
        seconds = frame[frame["kind"] == "runtime"].set_index("op")["seconds"]
        measured = seconds[deep] - seconds[f"{mode}_engine_log_prob"]
        modelled = (runtime.log_prob_price(profile, mode, 2, runtime.DEEP_LAYERS)
                    - runtime.log_prob_price(profile, mode, 2))
        if getattr(profile.runtime, f"{mode}_layer_forward_us") > 0:
            assert modelled == pytest.approx(measured, abs=1e-6)  # the figure is written to 0.01 us
        else:
            assert modelled >= measured - 1e-6
    # The rollout engine split by tensor parallelism generates across the world, as the executor does in that
    # layout; the fixed cost of each collective of its step is what the two cases leave beyond their modelled steps.
    split = frame[frame["op"].isin(runtime.SPLIT_STEP_OPS)].set_index("op")
    assert set(split.index) == set(runtime.SPLIT_STEP_OPS) and (split["world"] == 2).all()
    # Each collective of a step is what the two cases need of it on average: on the written profile the model's
    # two steps miss the timings by as much either way (or meet both where the link's model alone exceeds them).
    modelled = [costs.decode_step_time(profile, CATALOG["tiny"], Layout(tp=2), costs.SetShape(2, 2), batch,
                                       runtime.PROBE_CONTEXT) for batch in (1, runtime.BATCH)]
    missed = [m - split.loc[op, "seconds"] for m, op in zip(modelled, runtime.SPLIT_STEP_OPS, strict=True)]
    assert profile.runtime.step_collective_us is not None and profile.runtime.tp_step_collective_us == 0.0
    rounding = step_tp_collectives(CATALOG["tiny"]) * 0.01e-6  # the figure is written to 0.01 us
    if profile.runtime.step_collective_us > 0:  # the mean of the two cases' figures: one over, one under, or both met
        assert min(missed) <= rounding and max(missed) >= -rounding
    else:
        assert min(missed) >= -rounding
    assert profile.runtime.fsdp_train_pass_us is not None
    # The engine in pipeline stages, timed across the world too: its fixed costs are where the written profile's
    # model meets those timings (the slope of a step over its micro-batches, a log-prob call, a switch resharded by
    # plan), or zero where the model already reaches them.
    assert engine["pp_train_step_3_micro_batches"] == engine["pp_engine_log_prob"] == engine["pp_hybrid_switch"] == 2
    pipelined = frame[frame["op"].str.startswith("pp_")].set_index("op")["seconds"]
    tiny, two = CATALOG["tiny"], costs.SetShape(2, 2)
    tokens = runtime.PROMPT + runtime.LONG
    measured_slope = (pipelined["pp_train_step_3_micro_batches"] - pipelined["pp_train_step_1_micro_batches"]) / 2
    step = {n: costs.train_step_time(profile, tiny, TrainConfig(pp=2, micro_batch=1), two, n, tokens, "lm")
            for n in (1, 3)}
    modelled = {"pp_train_pass_us": ((step[3] - step[1]) / 2, measured_slope),
                "pp_forward_pass_us": (costs.inference_time(profile, tiny, InferConfig(pp=2, micro_batch=1), two, 1,
                                                            tokens, "lm", fsdp=False) - costs.call_dispatch(profile),
                                       pipelined["pp_engine_log_prob"]),  # the engine's own call; fp32: unwrapped
                "reshard_tensor_us": (costs.transition_time(profile, tiny, TrainConfig(pp=2), GenConfig(dp=2), two),
                                      pipelined["pp_hybrid_switch"])}
    for field, (model_s, measured_s) in modelled.items():
        if getattr(profile.runtime, field) > 0:
            assert model_s == pytest.approx(measured_s, rel=1e-3), field
        else:  # the model reaches the timing without it (a figure below the written 0.01 us rounds to 0)
            assert model_s >= measured_s * (1 - 1e-3), field
    # How the two processes share the host's cores: the probe alone and together, and the profile's figure from them.
    host = frame[frame["kind"] == "sharing"].set_index("op")
    assert set(host.index) == {"probe_alone", "probe_together"} and (host["world"] == 2).all()
    assert profile.compute.host_parallelism == pytest.approx(
        2 * host.loc["probe_alone", "seconds"] / host.loc["probe_together", "seconds"], abs=1e-3)
    # A call after its process idled: the probe back to back and after each wait, and the profile's points from them.
    wake = frame[frame["kind"] == "wake"]
    back = wake[wake["op"] == "back_to_back"]["seconds"].iloc[0]
    after = wake[wake["op"] == "after_idle"].sort_values("idle_ms")
    assert list(after["idle_ms"]) == list(IDLE_MS)
    assert profile.compute.idle_wake == tuple(
        (idle, round(max(0.0, seconds - back) * 1e6, 1))
        for idle, seconds in zip(after["idle_ms"], after["seconds"], strict=True))
    # A product of few rows runs below the matmul rate on a CPU BLAS: per weight size, the one-row point is the
    # median rate of that size's one-row matmuls over the fitted rate.
    table = profile.compute.row_efficiency
    assert table is not None
    matmuls = frame[(frame["kind"] == "matmul") & (frame[["k", "n"]].min(axis=1) >= 256)]
    weights = matmuls["k"] * matmuls["n"] * 4
    assert {weight for _, weight, _ in table} <= set(weights)
    assert {2**18, 2**24} <= {weight for _, weight, _ in table}  # 256 x 256 and 1024 x 4096 fp32, at 1, 16, 128 rows
    for weight in {weight for _, weight, _ in table}:
        points = [(m, fraction) for m, w, fraction in table if w == weight]
        assert points[0][0] == 1 and points[-1][1] == 1.0
        assert [fraction for _, fraction in points] == sorted(fraction for _, fraction in points)
        one_row = matmuls[(matmuls["m"] == 1) & (weights == weight)]
        reached = (one_row["flops"] / (one_row["seconds"] - profile.compute.kernel_overhead_us * 1e-6)
                   / profile.matmul_flops)
        assert points[0][1] == pytest.approx(min(1.0, reached.median()), rel=0.01)
    # The products are timed as nn.Linear runs them, and their backward pairs (input and weight gradients) at
    # training's rows: per weight size, the fewest rows' point is the median rate of those pairs (two kernels)
    # over the matmul rate.
    assert set(matmuls["op"]) == {"linear"}
    backwards = frame[frame["kind"] == "matmul_backward"]
    assert set(backwards["op"]) == {"linear_backward"} and set(backwards["m"]) == {16, 128, 512}
    assert (backwards["flops"] == 4.0 * backwards["m"] * backwards["k"] * backwards["n"]).all()
    backward_table = profile.compute.backward_row_efficiency
    assert backward_table is not None
    backward_weights = backwards["k"] * backwards["n"] * 4
    for weight in {weight for _, weight, _ in backward_table}:
        points = [(m, fraction) for m, w, fraction in backward_table if w == weight]
        assert [m for m, _ in points] == [16, 128, 512]
        assert [fraction for _, fraction in points] == sorted(fraction for _, fraction in points)
        fewest = backwards[(backwards["m"] == 16) & (backward_weights == weight)]
        reached = (fewest["flops"] / (fewest["seconds"] - 2 * profile.compute.kernel_overhead_us * 1e-6)
                   / profile.matmul_flops)
        assert points[0][1] == pytest.approx(min(1.0, reached.median()), rel=0.01)
    # --quick starts no Ray: the executor's call gaps, its controller step and the worker's memory are the
    # base profile's.
    base = load_hardware("cpu")
    for name in CALL_FIELDS:
        assert getattr(profile.runtime, name) == getattr(base.runtime, name), name
    assert profile.memory.worker_resident_gib == base.memory.worker_resident_gib
    assert profile.runtime.vllm_batched_tokens == base.runtime.vllm_batched_tokens == 4096  # vLLM's CPU default
    assert "controller_step" not in set(engine.index)
    layers = frame[frame["kind"] == "layer"]
    assert set(layers["op"]) == {"forward", "forward+backward", "decode"}
    # Predictions come from the profile as written, for the shapes that ran.
    for row in layers.itertuples():
        arch = ModelArch("measured", layers=1, hidden=int(row.hidden), heads=int(row.heads),
                         kv_heads=int(row.kv_heads), ffn=int(row.ffn), vocab=1,
                         attention_bias=CATALOG[row.model].attention_bias,
                         head_dim=CATALOG[row.model].dim_per_head)
        length = row.context if row.op == "decode" else row.seq
        case = Case(row.op, int(row.batch), int(length), int(row.tp))
        assert row.predicted_s == pytest.approx(predict(profile, arch, case), rel=1e-9)
        assert math.isclose(row.error_pct, 100 * (row.predicted_s - row.seconds) / row.seconds, rel_tol=1e-9)
    # Passes predicted more than 25% off are named under the tables (the note wraps to the terminal's width).
    note = " ".join(result.output.split())
    # The pace probe at the start and the end, in the raw rows and under the tables.
    paces = frame[frame["kind"] == "pace"].set_index("op")["seconds"]
    assert set(paces.index) == {"pace_start", "pace_end"} and (paces > 0).all()
    assert f"took {paces['pace_start'] * 1e6:,.0f} us at the start and {paces['pace_end'] * 1e6:,.0f} us" in note
    moved = max(paces) / min(paces) - 1
    assert ("moved by" in note) == (moved > PACE_DRIFT)
    for op, group in layers.groupby("op"):
        label = PASS_LABEL[op]
        assert (f"{label} predictions (" in note) == bool((group["error_pct"].abs() > FLAG_PCT).any()), op


def test_gpu_profile_carries_the_base_tiling_on_its_own_sm_count():
    device = Device(kind="cuda", name="NVIDIA H100 80GB HBM3", world_size=1, count=8, threads=1,
                    cache_bytes=50 * 2**20, capacity_bytes=80 * 2**30, used_bytes=0.6 * 2**30,
                    nominal=nominal_rates("NVIDIA H100 80GB HBM3", "cuda"), sm_count=114)
    base = load_hardware("h100-80g")
    profile = build_profile(device, fake_fits(intra=False), base, "h100", "torch x", "note")
    assert profile.compute.gemm == base.compute.gemm.model_copy(update={"sm_count": 114})
    assert build_profile(fake_device(), fake_fits(), load_hardware("cpu"), "c", "t", "n").compute.gemm is None


def test_a_cpu_sweep_fits_its_rate_without_the_products_its_rows_slow():
    """A CPU sweep timed as the cost model charges it (the few-row products at their row fraction of the rate)
    fits back the rate; fitted over every matmul, the slow few-row products pull it down."""
    from hfplan.profiler.run import roofline_kernels
    from hfplan.profiler.sweeps import sweeps_for

    rate, overhead, bandwidth = 1.2e11, 1e-6, 1.2e10
    fraction = {1: 0.05, 2: 0.08, 4: 0.12, 8: 0.2, 16: 0.3, 32: 0.45, 64: 0.6, 128: 0.8}
    shapes = sweeps_for("cpu", quick=False).matmuls
    most_rows: dict[int, int] = {}  # per weight size: its largest row count, which the table takes as the rate's
    for m, k, n in shapes:
        most_rows[k * n] = max(m, most_rows.get(k * n, 0))
    rows = [dict(kind="matmul", m=m, k=k, n=n, flops=2.0 * m * k * n, bytes=4.0 * (m * k + k * n + m * n))
            for m, k, n in shapes]
    rows += [dict(kind="memory", flops=0.0, bytes=float(b)) for b in (2**16, 2**20, 2**24, 2**28)]
    for r in rows:
        few = r["kind"] == "matmul" and min(r["k"], r["n"]) >= 256 and r["m"] < most_rows[r["k"] * r["n"]]
        slowed = fraction.get(r["m"], 1.0) if few else 1.0
        r["seconds"] = overhead + max(r["flops"] / (rate * slowed), r["bytes"] / bandwidth)
    kept = roofline_kernels(rows, None, 4)
    fit = fit_roofline([r["flops"] for r in kept], [r["bytes"] for r in kept], [r["seconds"] for r in kept])
    assert fit.flops_per_s == pytest.approx(rate, rel=0.02)
    assert not any(r["kind"] == "matmul" and min(r["k"], r["n"]) >= 256 and r["m"] < most_rows[r["k"] * r["n"]]
                   for r in kept)
    every = fit_roofline([r["flops"] for r in rows], [r["bytes"] for r in rows], [r["seconds"] for r in rows])
    assert every.flops_per_s < 0.97 * rate
    assert roofline_kernels(rows, load_hardware("a100-80g").compute.gemm, 4) == [
        r for r in rows if r["kind"] in ("matmul", "memory")]  # a GPU's tiling prices its shapes instead


def test_matmul_sweep_is_fitted_with_the_shape_model():
    """A sweep timed exactly as the cost model charges it (rate / shape efficiency; the small-M shapes split K and
    bound by their bytes, partial sums included) fits back the rate and the bandwidth."""
    from hfplan.profiler.run import effective_bytes, effective_flops
    from hfplan.profiler.sweeps import SMALL_M
    from hfplan.simulator.kernels import gemm_shape_efficiency, split_k_bytes

    tiling = load_hardware("a100-80g").compute.gemm
    rate, overhead, bandwidth = 2.5e14, 4e-6, 1.8e12
    shapes = [(s, s, s) for s in (512, 1024, 2048, 3072, 4096, 6144, 8192)]
    shapes += [(m, k, n) for m in SMALL_M for k, n in ((4096, 4096), (4096, 14336), (14336, 4096))]
    rows = [dict(kind="matmul", m=m, k=k, n=n, flops=2.0 * m * k * n, bytes=2.0 * (m * k + k * n + m * n))
            for m, k, n in shapes]
    rows += [dict(kind="memory", flops=0.0, bytes=float(b)) for b in (2**20, 2**24, 2**28)]

    def charged(r):
        if r["kind"] != "matmul":
            return overhead + r["bytes"] / bandwidth
        flops = r["flops"] / (rate * gemm_shape_efficiency(tiling, r["m"], r["k"], r["n"]))
        return overhead + max(flops, (r["bytes"] + split_k_bytes(tiling, r["m"], r["k"], r["n"])) / bandwidth)

    seconds = [charged(r) for r in rows]
    assert effective_flops(rows[0], None) == rows[0]["flops"]
    assert effective_bytes(rows[-1], tiling) == rows[-1]["bytes"]
    gemv = next(r for r in rows if r["m"] == 1)
    assert effective_bytes(gemv, tiling) > gemv["bytes"]  # a decode GEMM splits K: its partial sums count
    fit = fit_roofline([effective_flops(r, tiling) for r in rows], [effective_bytes(r, tiling) for r in rows], seconds)
    assert fit.flops_per_s == pytest.approx(rate, rel=1e-3)
    assert fit.bytes_per_s == pytest.approx(bandwidth, rel=1e-3)
    plain = fit_roofline([r["flops"] for r in rows], [r["bytes"] for r in rows], seconds)
    assert plain.flops_per_s < 0.97 * rate  # the plain roofline mistakes the quantization loss for a slower rate


def test_gpu_matmul_sweep_measures_decode_shaped_gemms():
    """The CUDA sweep times GEMMs of one to a few rows against hidden and MLP widths (decode's weight-read bound,
    where the library splits K), full and quick."""
    from hfplan.profiler.sweeps import sweeps_for

    for quick in (False, True):
        shapes = sweeps_for("cuda", quick).matmuls
        small = {m for m, k, n in shapes if k >= 4096 and n >= 4096 and m <= 16}
        assert 1 in small and len(small) >= 2
        assert any(m >= 1024 and k == n for m, k, n in shapes)


def test_fixed_cost_is_what_the_kernels_leave_over():
    from hfplan.profiler.runtime import fixed_us

    assert fixed_us(0.63e-3, 0.15e-3) == pytest.approx(480.0)
    assert fixed_us(1e-4, 2e-4) == 0.0  # faster than modelled: no negative fixed cost


@pytest.mark.slow
def test_runtime_costs_measured_on_the_executor_engine(quick_profile, monkeypatch):
    """The torch rollout engine's decode step, static and continuous, the training engine's micro-batch,
    optimizer step, log-prob call and costs per token, and the hybrid engine's switch on CPU, less their modelled
    kernels; no Ray and no probe run here (through_ray=False), no world profiled (the FSDP2 engine timed here
    on one rank). The engines on one rank are as the module's quick profile timed them (the same
    runtime.time_engines, run once a module: timing them takes most of a minute on 2 cores)."""
    torch = pytest.importorskip("torch")
    from hfplan.layout import stage_parameter_tensors
    from hfplan.plan import Layout, TrainConfig
    from hfplan.profiler import device as devices
    from hfplan.profiler.runtime import (
        BATCH,
        DEEP_LAYERS,
        FEW,
        LONG,
        MANY,
        PROMPT,
        SHORT,
        WIDE,
        fit_runtime,
        measure_runtime_inputs,
    )
    from hfplan.profiles.hardware import Runtime
    from hfplan.simulator import costs

    assert len(quick_profile.engine_times) == 1, quick_profile.result.output
    [timed] = quick_profile.engine_times
    monkeypatch.setattr(runtime, "time_engines", lambda *args, **kwargs: timed)
    hw = load_hardware("cpu")
    fit = fit_runtime(hw, measure_runtime_inputs(torch, devices.probe(torch, "cpu", 1), hw, 0.02, through_ray=False))
    assert not fit.ray and fit.runtime.controller_call_us == fit.runtime.controller_step_us == 0.0
    assert fit.runtime.call_dispatch_us is None
    rows = {r["op"]: r for r in fit.rows}
    engines = {engine: {n: f"{engine}train_step_{n}_micro_batches" for n in (FEW, MANY)} for engine in ("", "fsdp_")}
    assert set(rows) == {"engine_step", f"engine_step_{BATCH}_sequences", f"engine_step_{WIDE}_sequences",
                         "engine_step_continuous", "generate_call",
                         "engine_log_prob", "fsdp_engine_log_prob", "hybrid_switch", "fsdp_hybrid_switch",
                         "kept_hybrid_switch",
                         f"train_step_1_micro_batch_of_{BATCH}", f"engine_log_prob_{BATCH}_sequences",
                         *(op for steps in engines.values() for op in steps.values()),
                         *(f"depth_{call}_{n}_layers" for call in ("log_prob", "train_pass", "step")
                           for n in (2, DEEP_LAYERS))}
    # A switch in the training layout on one rank moves nothing: all of it is the engines' cost per tensor.
    assert rows["hybrid_switch"]["predicted_s"] == 0.0
    assert fit.runtime.switch_tensor_us == pytest.approx(
        rows["hybrid_switch"]["seconds"] * 1e6 / stage_parameter_tensors(CATALOG["tiny"], 1, "lm"), abs=1e-3)
    # The executor's own switch there keeps the trained tensors: timed whole, with weights handed over apart.
    assert fit.runtime.kept_switch_us == pytest.approx(rows["kept_hybrid_switch"]["seconds"] * 1e6, abs=0.01)
    assert all(r["seconds"] > 0 for r in fit.rows if not r["op"].startswith("depth_train_pass"))  # those: slopes
    # Each decoder layer's fixed cost: the same call on the demo model at two depths, beyond the modelled kernels
    # alone (the profile's own fixed costs are what the measurement replaces), over the layers between them.
    kernels_only = hw.model_copy(update={"runtime": Runtime()})
    rt = fit.runtime
    deeper = dataclasses.replace(CATALOG["tiny"], layers=DEEP_LAYERS)
    assert rows[f"depth_step_{DEEP_LAYERS}_layers"]["predicted_s"] == pytest.approx(costs.decode_step_time(
        kernels_only, deeper, Layout(), costs.SetShape(1, 1), 1, PROMPT + (SHORT + LONG) / 2))
    for call, field in (("log_prob", "layer_forward_us"), ("train_pass", "layer_train_us"), ("step", "layer_step_us")):
        shallow, deep = rows[f"depth_{call}_2_layers"], rows[f"depth_{call}_{DEEP_LAYERS}_layers"]
        per_layer = (max(0.0, deep["seconds"] - shallow["seconds"] - deep["predicted_s"] + shallow["predicted_s"])
                     / (DEEP_LAYERS - 2))
        assert getattr(rt, field) == pytest.approx(per_layer * 1e6, abs=0.01)
    # The shallower depth's training calls are the very timings the engine's other fixed costs are fitted from.
    assert rows["depth_log_prob_2_layers"]["seconds"] == rows["engine_log_prob"]["seconds"]
    assert rows["depth_train_pass_2_layers"]["seconds"] == pytest.approx(
        (rows[f"train_step_{MANY}_micro_batches"]["seconds"] - rows[f"train_step_{FEW}_micro_batches"]["seconds"])
        / (MANY - FEW))
    # Every other fixed cost is what its call took beyond its kernels and its layers' fixed costs.
    kernels_only = hw.model_copy(update={"runtime": Runtime(layer_forward_us=rt.layer_forward_us,
                                                            layer_train_us=rt.layer_train_us,
                                                            layer_step_us=rt.layer_step_us)})
    step_model = costs.decode_step_time(kernels_only, CATALOG["tiny"], Layout(), costs.SetShape(1, 1), 1,
                                        PROMPT + (SHORT + LONG) / 2)
    assert rows["engine_step"]["predicted_s"] == rows["engine_step_continuous"]["predicted_s"] == pytest.approx(
        step_model)  # both run a batch of one
    # The fixed cost per sequence in a step is the slope from one sequence to BATCH; a step of one costs the
    # measured step's fixed cost, whichever the engine.
    batch_model = costs.decode_step_time(kernels_only, CATALOG["tiny"], Layout(), costs.SetShape(1, 1), BATCH,
                                         PROMPT + (SHORT + LONG) / 2)
    assert rows[f"engine_step_{BATCH}_sequences"]["predicted_s"] == pytest.approx(batch_model)
    one, many = (max(0.0, rows[op]["seconds"] - model) for op, model in (("engine_step", step_model),
                                                                        (f"engine_step_{BATCH}_sequences",
                                                                         batch_model)))
    assert rt.engine_sequence_step_us == pytest.approx(max(0.0, many - one) / (BATCH - 1) * 1e6, abs=0.01)
    assert rt.engine_step_s("static", 1) == pytest.approx(max(one, rt.engine_sequence_step_us * 1e-6), abs=2e-8)
    assert rt.engine_step_s("continuous", 1) == pytest.approx(max(
        max(0.0, rows["engine_step_continuous"]["seconds"] - step_model), rt.engine_sequence_step_us * 1e-6),
        abs=2e-8)
    # Beyond BATCH sequences, each more costs the slope from BATCH to WIDE.
    wide_model = costs.decode_step_time(kernels_only, CATALOG["tiny"], Layout(), costs.SetShape(1, 1), WIDE,
                                        PROMPT + (SHORT + LONG) / 2)
    assert rows[f"engine_step_{WIDE}_sequences"]["predicted_s"] == pytest.approx(wide_model)
    wide = max(0.0, rows[f"engine_step_{WIDE}_sequences"]["seconds"] - wide_model)
    assert rt.engine_wide_sequences == BATCH
    assert rt.engine_wide_sequence_step_us == pytest.approx(max(0.0, wide - many) / (WIDE - BATCH) * 1e6, abs=0.01)
    assert rt.engine_step_s("static", WIDE) - rt.engine_step_s("static", BATCH) == pytest.approx(
        (WIDE - BATCH) * rt.engine_wide_sequence_step_us * 1e-6)
    # A generation's own fixed cost: one of SHORT tokens less its decode steps, beyond its prefill as the fitted
    # runtime prices it (one sequence of PROMPT tokens).
    fitted = hw.model_copy(update={"runtime": rt})
    prefill = costs.prefill_parts(fitted, CATALOG["tiny"], Layout(), costs.SetShape(1, 1), 1, PROMPT).total
    assert rows["generate_call"]["predicted_s"] == pytest.approx(prefill)
    assert rt.generate_call_us == pytest.approx(max(0.0, rows["generate_call"]["seconds"] - prefill) * 1e6, abs=0.01)
    assert rows["generate_call"]["seconds"] == pytest.approx(timed.beyond_steps)
    # Per token: a micro-batch of BATCH sequences against one, beyond their modelled kernels.
    tokens = PROMPT + LONG

    def beyond_row(op: str) -> float:
        return max(0.0, rows[op]["seconds"] - rows[op]["predicted_s"])

    assert rt.train_token_us == pytest.approx((max(0.0, beyond_row(f"train_step_1_micro_batch_of_{BATCH}")
                                                   - beyond_row(f"train_step_{FEW}_micro_batches")))
                                              / ((BATCH - 1) * tokens) * 1e6, abs=1e-3)
    assert rt.forward_token_us == pytest.approx(max(0.0, beyond_row(f"engine_log_prob_{BATCH}_sequences")
                                                    - beyond_row("engine_log_prob")) / ((BATCH - 1) * tokens) * 1e6,
                                                abs=1e-3)
    # A step of n micro-batches beyond its modelled kernels is n passes and one optimizer step, for the engine
    # as one rank trains and as FSDP2 wraps it; a pass's fixed cost is what its tokens' leave.
    tensors = stage_parameter_tensors(CATALOG["tiny"], 1, "lm")
    forward_model = costs.stage_pass(kernels_only, CATALOG["tiny"], 1, 1, costs.SetShape(1, 1), 1, PROMPT + LONG,
                                     "lm").forward + CATALOG["tiny"].layers * rt.layer_forward_us * 1e-6
    for engine, steps in engines.items():
        fsdp = engine == "fsdp_"
        beyond = {}
        for n, op in steps.items():
            modelled = costs.train_step_time(kernels_only, CATALOG["tiny"], TrainConfig(micro_batch=1),
                                             costs.SetShape(1, 1), n, PROMPT + LONG, "lm")
            assert rows[op]["predicted_s"] == pytest.approx(modelled)
            beyond[n] = rows[op]["seconds"] - modelled
        pass_s = max(0.0, (beyond[MANY] - beyond[FEW]) / (MANY - FEW))
        assert rt.train_pass_s(fsdp) == pytest.approx(max(0.0, pass_s - tokens * rt.train_token_us * 1e-6),
                                                      abs=1e-7)  # the per-token figure is rounded
        assert rt.optimizer_tensor_s(fsdp) == pytest.approx(max(0.0, beyond[FEW] - FEW * pass_s) / tensors,
                                                            abs=1e-9)
    for fsdp, op in ((False, "engine_log_prob"), (True, "fsdp_engine_log_prob")):
        # the wrapped engine's layers pay their own fixed cost on top, measured at two depths before its pass's
        model = forward_model + (CATALOG["tiny"].layers * rt.fsdp_layer_forward_us * 1e-6 if fsdp else 0.0)
        assert rows[op]["predicted_s"] == pytest.approx(model)
        assert rt.forward_pass_s(fsdp) == pytest.approx(max(0.0, rows[op]["seconds"] - model
                                                            - tokens * rt.forward_token_us * 1e-6), abs=1e-7)
    # No world profiled (a world of one): nothing measured of a tensor-parallel engine, nothing charged for it.
    assert rt.tp_forward_pass_us == rt.tp_train_pass_us == rt.tp_optimizer_tensor_us == 0.0


def test_the_tensor_parallel_engine_is_timed_only_over_worlds_the_demo_model_splits_over():
    from hfplan.layout import shape_problem
    from hfplan.profiler.runtime import MODEL, splits_by_tp

    tiny = CATALOG[MODEL]
    assert splits_by_tp(2) and not splits_by_tp(1)
    for world in (3, 4, 8):  # its 2 KV heads split over 2 ranks only
        assert shape_problem(tiny, "train", world, 1) is not None
        assert not splits_by_tp(world)


def test_the_pipelined_engine_s_fixed_costs_are_those_the_model_needs_to_meet_its_timings():
    """Timings made by the model itself with 2.5 ms per stage micro-batch of training, 0.4 ms of a forward and
    30 us per tensor of a switch resharded by plan come back as those figures; timings the model already exceeds
    leave none (never negative)."""
    from hfplan.plan import GenConfig, InferConfig, TrainConfig
    from hfplan.profiler.runtime import FEW, LONG, MANY, PP, PROMPT, EngineSeconds, _pipeline_fixed
    from hfplan.simulator import costs

    shipped = load_hardware("cpu")  # as fit_runtime fits them: every other fixed cost fitted, these not yet
    fitted = shipped.model_copy(update={"runtime": shipped.runtime.model_copy(update=dict(
        pp_train_pass_us=0.0, pp_forward_pass_us=0.0, reshard_tensor_us=0.0))})
    planted = fitted.model_copy(update={"runtime": fitted.runtime.model_copy(update=dict(
        pp_train_pass_us=2500.0, pp_forward_pass_us=400.0, reshard_tensor_us=30.0))})
    tiny, two, tokens = CATALOG["tiny"], costs.SetShape(2, 2), PROMPT + LONG
    steps = {n: costs.train_step_time(planted, tiny, TrainConfig(pp=2, micro_batch=1), two, n, tokens, "lm")
             for n in (FEW, MANY)}
    log_prob = (costs.inference_time(planted, tiny, InferConfig(pp=2, micro_batch=1), two, 1, tokens, "lm")
                - costs.call_dispatch(planted))  # the engine's own call, timed without a controller's
    switch = costs.transition_time(planted, tiny, TrainConfig(pp=2), GenConfig(dp=2), two)
    fields, rows = _pipeline_fixed(fitted, EngineSeconds(2, PP, steps, log_prob, switch))
    assert fields == pytest.approx({"pp_train_pass_us": 2500.0, "pp_forward_pass_us": 400.0,
                                    "reshard_tensor_us": 30.0}, abs=0.01)
    assert {r["op"] for r in rows} == {"pp_train_step_1_micro_batches", "pp_train_step_3_micro_batches",
                                       "pp_engine_log_prob", "pp_hybrid_switch"}
    assert all(r["world"] == 2 and r["predicted_s"] < r["seconds"] for r in rows)
    faster = EngineSeconds(2, PP, {FEW: steps[FEW], MANY: steps[FEW]}, 0.0, 0.0)
    none, _ = _pipeline_fixed(fitted, faster)
    assert set(none.values()) == {0.0}


def test_a_layer_s_fixed_cost_is_the_deeper_model_s_time_beyond_its_kernels_per_layer_added():
    """Calls timed as the kernels of their depth plus 2 ms a call, and 150, 400 and 90 us per decoder layer (a
    forward, a training micro-batch, a decode step): those per-layer figures come back; a deeper model that ran
    faster than its kernels say leaves none (never negative)."""
    from hfplan.plan import InferConfig, Layout, TrainConfig
    from hfplan.profiler.runtime import FEW, LONG, MANY, PROMPT, SHORT, DepthSeconds, _layer_fixed
    from hfplan.profiles.hardware import Runtime
    from hfplan.simulator import costs

    bare = load_hardware("cpu").model_copy(update={"runtime": Runtime()})
    one, tokens = costs.SetShape(1, 1), PROMPT + LONG

    def timed(layers: int) -> tuple[float, float, float]:
        arch = dataclasses.replace(CATALOG["tiny"], layers=layers)
        log_prob = costs.inference_time(bare, arch, InferConfig(micro_batch=1), one, 1, tokens, "lm")
        steps = [costs.train_step_time(bare, arch, TrainConfig(micro_batch=1), one, n, tokens, "lm")
                 for n in (FEW, MANY)]
        step = costs.decode_step_time(bare, arch, Layout(), one, 1, PROMPT + (SHORT + LONG) / 2)
        return (log_prob + 2e-3 + layers * 150e-6, (steps[1] - steps[0]) / (MANY - FEW) + 2e-3 + layers * 400e-6,
                step + 2e-3 + layers * 90e-6)

    shallow, deep = timed(2), timed(4)
    depths = DepthSeconds((2, 4), *zip(shallow, deep, strict=True))
    layers, rows = _layer_fixed(bare, depths)
    assert (layers.layer_forward_us, layers.layer_train_us, layers.layer_step_us) == pytest.approx((150, 400, 90))
    assert len(rows) == 6 and {r["op"] for r in rows} >= {"depth_log_prob_2_layers", "depth_step_4_layers"}
    faster = DepthSeconds((2, 4), (shallow[0], shallow[0]), (shallow[1], shallow[1]), (shallow[2], shallow[2]))
    none, _ = _layer_fixed(bare, faster)
    assert none.layer_forward_us == none.layer_train_us == none.layer_step_us == 0.0


@pytest.mark.parametrize("mode", ["fsdp", "tp"])
def test_a_split_or_wrapped_layer_s_fixed_cost_is_what_the_deeper_model_took_beyond_its_model_per_layer(mode):
    """The engine across two ranks (wrapped in FSDP2, or split by tensor parallelism) timed as the model prices it
    with 300 us per decoder layer of a forward and 2 ms of a training micro-batch planted on top of the plain
    engine's layer costs: those come back from the two depths; a deeper model that took no longer than the shallow
    one leaves none (never negative)."""
    from hfplan.profiler.runtime import (
        DEEP_LAYERS,
        FEW,
        MANY,
        EngineSeconds,
        _layers_across,
        log_prob_price,
        mode_step_price,
    )

    fitted = load_hardware("cpu")
    fields = {f"{mode}_layer_forward_us": 0.0, f"{mode}_layer_train_us": 0.0}
    fitted = fitted.model_copy(update={"runtime": fitted.runtime.model_copy(update=fields)})
    planted = fitted.model_copy(update={"runtime": fitted.runtime.model_copy(update={
        f"{mode}_layer_forward_us": 300.0, f"{mode}_layer_train_us": 2000.0})})
    shallow, deep = CATALOG["tiny"].layers, DEEP_LAYERS
    assert deep > shallow

    def timed(layers: int) -> tuple[float, dict[int, float]]:
        return (log_prob_price(planted, mode, 2, layers),
                {n: mode_step_price(planted, mode, 2, n, layers) for n in (FEW, MANY)})

    (log_prob, steps), (deep_log_prob, deep_steps) = timed(shallow), timed(deep)
    measured = EngineSeconds(2, mode, steps, log_prob, 0.0, deep=(deep_log_prob, deep_steps[FEW], deep_steps[MANY]))
    got, rows = _layers_across(fitted, measured)
    assert got == pytest.approx({f"{mode}_layer_forward_us": 300.0, f"{mode}_layer_train_us": 2000.0}, abs=0.01)
    assert {r["op"] for r in rows} == {f"{mode}_engine_log_prob_{deep}_layers",
                                       f"{mode}_train_step_1_micro_batches_{deep}_layers",
                                       f"{mode}_train_step_3_micro_batches_{deep}_layers"}
    # priced with the figures fitted: as timed
    assert all(r["world"] == 2 and r["predicted_s"] == pytest.approx(r["seconds"]) for r in rows)
    flat = EngineSeconds(2, mode, steps, log_prob, 0.0, deep=(log_prob, steps[FEW], steps[MANY]))
    none, _ = _layers_across(fitted, flat)
    assert set(none.values()) == {0.0}


def test_the_engine_s_timings_across_a_world_keep_their_deeper_calls_through_raw_rows():
    """measure_collectives' worlds hand the engine's timings to the parent as raw rows: the deeper model's calls
    come back with them (and none where they were not timed)."""
    from hfplan.profiler.runtime import FEW, MANY, EngineSeconds

    timed = EngineSeconds(2, "tp", {FEW: 0.04, MANY: 0.12}, 0.013, 0.002, deep=(0.02, 0.07, 0.2),
                          split_steps=(0.001, 0.002))
    untimed = EngineSeconds(2, "fsdp", {FEW: 0.02, MANY: 0.05}, 0.007, 0.003)
    back = EngineSeconds.from_rows(timed.rows() + untimed.rows())
    assert back == {"tp": timed, "fsdp": untimed}


def test_pace_drift_is_symmetric_and_zero_at_the_same_pace():
    from hfplan.profiler.pace import drift

    assert drift(200e-6, 200e-6) == 0.0
    assert drift(200e-6, 300e-6) == pytest.approx(0.5) == drift(300e-6, 200e-6)


class _SlowStretchClock:
    """Runs each timed call once and reports its modelled seconds, twice as long for the calls numbered in `slow`
    (a slower stretch of a virtual machine, or a burst of other work)."""

    def __init__(self, slow: range) -> None:
        self.slow, self.calls = slow, 0

    def per_call(self, fn, min_time: float) -> float:
        seconds = fn()
        self.calls += 1
        return seconds * (2.0 if self.calls - 1 in self.slow else 1.0)


class _Engine:
    """A decode step of `step_s` per step, one step per token, and a 1 ms prefill."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.stats = type("Stats", (), {"decode_steps": 0})()

    def generate(self, prompts, params) -> float:
        self.stats.decode_steps = params.max_new_tokens
        return 1e-3 + self.step_s * params.max_new_tokens


def test_engine_steps_are_timed_in_interleaved_rounds_so_a_slow_stretch_falls_on_every_case_alike():
    engines = [_Engine(1e-4), _Engine(2e-4), _Engine(3e-4)]
    cases = [(engine, None) for engine in engines]
    # The first six timings slow: case after case, that would be the whole of the first case's; in rounds, it
    # is the first round of every case, which the medians over the rounds leave out.
    clock = _SlowStretchClock(range(6))
    steps = runtime.steps_seconds(clock, cases, min_time=0.0)
    assert steps == pytest.approx([1e-4, 2e-4, 3e-4])
    assert clock.calls == 2 * len(cases) * runtime.ROUNDS


def test_collectives_on_cpu_are_timed_beyond_a_burst_before_each():
    """comm.beyond_bursts: each call follows a burst, and the bursts alone are timed again and taken off; a burst of
    0 s is no work at all (GPUs time their collectives back to back)."""
    import time

    from hfplan.profiler.comm import beyond_bursts, compute_burst

    counts = {"burst": 0, "call": 0}

    def burst():
        counts["burst"] += 1

    def call():
        counts["call"] += 1
        time.sleep(0.002)

    assert beyond_bursts(call, burst, 4) >= 0.002  # a call's own sleep is never taken off
    assert counts == {"burst": 8, "call": 4}  # a burst before each call, then as many alone
    compute_burst(None, 0.0)()  # no work: it never touches torch (None here), before or during the call


def test_a_cache_is_shared_by_the_cpus_its_sysfs_list_names():
    from hfplan.profiler.device import _cpu_count

    assert _cpu_count("0-1") == 2 and _cpu_count("0") == 1 and _cpu_count("0-3,8,10-11") == 7
    assert _cpu_count("") == 0 and _cpu_count("x") == 0
