"""Shared fixtures: a hardware profile with round numbers, so hand computations stay readable; the plans the
export targets' searches write; the session's one Ray cluster."""

import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import Result

from hfplan.profiles.hardware import Compute, HardwareProfile, Link, Links, Memory
from hfplan.profiles.models import ModelArch

if importlib.util.find_spec("torch") is None:
    # A core-only install (no execute extra): the modules that import torch at their top, or run
    # `hfplan execute` (which imports it), are not collected;
    # the planner and simulator tests, and the executor's checks that need no torch, still run.
    collect_ignore_glob = ["test_engine*.py", "test_checkpoint.py", "test_losses.py", "test_faults.py",
                           "test_worlds.py", "test_cli_execute.py", "test_reshard_bench.py", "test_local_runs.py"]


@pytest.fixture
def toy_hw() -> HardwareProfile:
    """Achievable rates: matmul 100e12 * 0.5 = 5e13 FLOP/s; memory 1000e9 * 0.5 = 5e11 B/s;
    intra-node link 100e9 * 0.5 = 5e10 B/s (alpha 1 us); inter-node 10e9 * 0.8 = 8e9 B/s per node
    (alpha 10 us); host 20e9 * 0.5 = 1e10 B/s (alpha 3 us); 5 us per kernel."""
    return HardwareProfile(
        name="toy",
        gpus_per_node=8,
        compute=Compute(peak_tflops=100, matmul_efficiency=0.5, kernel_overhead_us=5),
        memory=Memory(capacity_gib=16, reserved_gib=1, bandwidth_gbytes_per_s=1000, efficiency=0.5),
        links=Links(
            intra_node=Link(bandwidth_gbytes_per_s=100, efficiency=0.5, latency_us=1),
            inter_node=Link(bandwidth_gbytes_per_s=10, efficiency=0.8, latency_us=10),
            host=Link(bandwidth_gbytes_per_s=20, efficiency=0.5, latency_us=3),
        ),
    )


@pytest.fixture
def small_arch() -> ModelArch:
    """A small GQA model. By hand: head_dim 64/4 = 16, q_dim 64, kv_dim 2*16 = 32.
    Per layer: q 64*64 + k,v 2*64*32 + o 64*64 = 12288; MLP 3*64*128 = 24576; two norms 128 -> 36992.
    Embedding 260*64 = 16640; final norm 64; untied LM head 16640."""
    return ModelArch("small", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=260)


@pytest.fixture
def plan_file(tmp_path):
    """The sample plan (tests/support/plans.py) written to a file: what `simulate` reads."""
    from tests.support.plans import sample_plan

    path = tmp_path / "plan.json"
    path.write_text(sample_plan().to_json())
    return path


@pytest.fixture
def demo_plan_file(tmp_path):
    """The demo workload's plan on 2 CPU processes, as `hfplan search` writes it: what `execute` tests run."""
    return search_demo_plan(tmp_path / "demo.json")


def search_demo_plan(path: Path) -> Path:
    from tests.support.cli import invoke

    result = invoke("search", "--workload", "demo", "--hardware", "cpu", "--gpus", 2, "--out", path, "--no-compare")
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture(scope="session")
def target_plans(tmp_path_factory) -> dict[str, Path]:
    """`hfplan search --gpus 16 --target X --out X.json` for both export targets and hfplan's own plan, searched
    once a session (the export tests of several modules read them): each plan file by target."""
    from tests.support.cli import invoke

    folder = tmp_path_factory.mktemp("target-plans")
    plans = {}
    for target in ("verl", "openrlhf", "hfplan"):
        path = folder / f"{target}.json"
        result = invoke("search", "--gpus", 16, "--target", target, "--out", path, "--no-compare", "--jobs", 1)
        assert result.exit_code == 0, result.output
        if target != "hfplan":
            assert f"hfplan export {path} --to {target}" in " ".join(result.stdout.split())
        plans[target] = path
    return plans


@pytest.fixture(scope="session")
def ray_cluster() -> str:
    """The session's one local Ray cluster, started on first use: its address (for `--address`). Its folder
    is short: Ray's socket paths under it must stay under 108 bytes (pytest's own tmp paths can be longer)."""
    pytest.importorskip("ray")
    from tests.support.executor_runs import local_ray_head

    with tempfile.TemporaryDirectory(prefix="hfray-") as folder, local_ray_head(Path(folder)) as address:
        yield address


@pytest.fixture
def ray_driver(ray_cluster) -> str:
    """This process connected to the session's cluster, so that in-process runs use it."""
    import ray

    from tests.support.executor_runs import connect

    if not ray.is_initialized():
        connect(ray_cluster)
    return ray_cluster


@pytest.fixture(scope="session")
def shared_runs(ray_cluster, tmp_path_factory):
    """The executor runs that tests of several modules read, each run once on the session's cluster
    (tests/support/executor_runs.SharedRuns)."""
    from tests.support.executor_runs import SharedRuns

    return SharedRuns(ray_cluster, tmp_path_factory.mktemp("shared-runs"))


@dataclass(frozen=True)
class DemoCliRun:
    result: Result  # the CLI's
    out: Path  # the run folder
    timeline: Path  # the --timeline chart
    plan_file: Path  # the demo plan it ran


@pytest.fixture(scope="session")
def demo_cli_run(ray_cluster, tmp_path_factory) -> DemoCliRun:
    """`hfplan execute` of the demo plan (demo_plan_file's) from the command line on the session's cluster, made once
    a session: test_cli_execute's learning claim and test_cli_execute_loggers' loggers, samples and --config read it;
    a test that changes its folder (a resume) works on a copy. The file gives the length (4 iterations), the progress
    interval, 10x the demo's learning rate and 3 samples; the command line gives the loggers and 2 samples, which win,
    a checkpoint after each iteration, all kept, and the timeline chart."""
    import ray

    from tests.support.cli import invoke
    from tests.support.executor_runs import connect

    folder = tmp_path_factory.mktemp("demo-cli-run")
    plan_file = search_demo_plan(folder / "demo.json")
    config = folder / "run.yaml"
    config.write_text("iterations: 4\nlog_every: 1\nsamples: 3\nset: {actor_lr: 1e-2}\n")
    if not ray.is_initialized():
        connect(ray_cluster)
    out, timeline = folder / "run", folder / "run.png"
    result = invoke("execute", plan_file, "--config", config, "--out", out, "--logger", "jsonl,csv,tensorboard",
                    "--samples", 2, "--checkpoint-every", 1, "--keep", 4, "--timeline", timeline,
                    "--address", ray_cluster)
    return DemoCliRun(result, out, timeline, plan_file)


@pytest.fixture
def no_ray_driver() -> None:
    """This process connected to no cluster: for a run that starts Ray itself or joins a cluster of its own."""
    ray = pytest.importorskip("ray")
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """The search's largest exhaustive cross-checks (30-60 s each on 2 cores) run only with HFPLAN_EXHAUSTIVE=1."""
    if os.environ.get("HFPLAN_EXHAUSTIVE") == "1":
        return
    skip = pytest.mark.skip(reason="exhaustive search reference; run with HFPLAN_EXHAUSTIVE=1")
    for item in items:
        if "exhaustive" in item.keywords:
            item.add_marker(skip)
