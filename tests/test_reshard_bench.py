"""bench/reshard.py: the simulator prices the switch to generation on the bytes the executor moves, for the
benchmark's own model and layouts, and the benchmark's quick grid runs with no mismatch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from hfplan.executor.engines.reshard import model_specs
from hfplan.layout import most_received_numel, received_numel
from hfplan.plan import GenConfig
from hfplan.profiles.models import arch_from_hf_config
from hfplan.simulator import costs
from tests.support.scripts import BENCH_DIR, ROOT, load_bench

SCRIPT = BENCH_DIR / "reshard.py"


BENCH = load_bench("reshard")
CASES = [(sizes, world, train, GenConfig(tp=tp_g, dp=world // tp_g))
         for grid, sizes in ((BENCH.GRID, BENCH.MODEL), (BENCH.QUICK, BENCH.QUICK_MODEL))
         for world, layouts in grid.items() for train, tps in layouts for tp_g in tps]


@pytest.mark.parametrize(("sizes", "world", "train", "gen"), CASES,
                         ids=[f"{s['hidden_size']}-{t.pp}{t.tp}{t.dp}{t.shard}-t{g.tp}" for s, _, t, g in CASES])
def test_simulator_prices_the_bytes_the_executor_moves(sizes, world, train, gen, toy_hw, monkeypatch):
    config = LlamaConfig(**sizes)
    specs = model_specs(LlamaForCausalLM, config)
    # The ModelArch hfplan reads from the same model's config.json.
    arch = arch_from_hf_config({**config.to_dict(), "architectures": ["LlamaForCausalLM"]}, "bench")
    assert sum(s.numel for s in specs) == arch.params()
    executor = max(received_numel(train, gen, specs, config.num_hidden_layers))
    assert executor == most_received_numel(arch, train, gen)
    priced = []

    def spy(*args):
        priced.append(most_received_numel(*args))
        return priced[-1]

    monkeypatch.setattr(costs, "most_received_numel", spy)
    seconds = costs.transition_time(toy_hw, arch, train, gen, costs.SetShape(world, 8))
    assert priced == [executor] and (seconds > 0) == (executor > 0)


@pytest.mark.slow
def test_the_quick_benchmark_runs_without_mismatch():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # one timed switch per method: the mismatches come from the counted switch before it, the times are not checked
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--reps", "1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mismatch" not in done.stdout
    assert sum(line.startswith(("p1t2d2", "p1t1d4", "p2t2d1")) for line in done.stdout.splitlines()) == 3
