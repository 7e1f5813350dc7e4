"""The plan's rollout engine (gen.engine: torch | vllm), `hfplan execute --rollout`, and the one line a plan that
generates with vLLM gets where vLLM is missing. None of these needs vLLM installed."""

from __future__ import annotations

import importlib.util

import pytest

from hfplan.errors import HfplanError
from hfplan.plan import GenConfig
from tests.support.cli import assert_user_error, invoke
from tests.test_plan import valid_plan


def test_a_vllm_engine_keeps_a_paged_kv_cache_and_batches_continuously():
    assert GenConfig(engine="vllm").kv_cache == "paged" and GenConfig(engine="vllm").batching == "continuous"
    assert GenConfig().engine == "torch" and GenConfig().kv_cache == "reserved"
    # plans written before the field: a paged cache was vLLM's
    assert GenConfig(batching="continuous", kv_cache="paged").engine == "vllm"
    with pytest.raises(ValueError, match="engine=torch keeps a reserved KV cache"):
        GenConfig(batching="continuous", kv_cache="paged", engine="torch")
    with pytest.raises(ValueError, match="kv_cache=paged needs batching=continuous"):
        GenConfig(engine="vllm", batching="static")


def test_the_rollout_option_puts_every_generation_layout_on_that_engine():
    from hfplan.plan import plan_from_dict

    plan = plan_from_dict(valid_plan(), "test")
    vllm = plan.with_rollout_engine("vllm")
    gen = vllm.parallelism["actor"].gen
    assert (gen.engine, gen.kv_cache, gen.batching, gen.tp, gen.dp) == ("vllm", "paged", "continuous", 1, 4)
    back = vllm.with_rollout_engine("torch").parallelism["actor"].gen
    assert (back.engine, back.kv_cache, back.batching) == ("torch", "reserved", "continuous")
    assert vllm.parallelism["critic"] == plan.parallelism["critic"]
    with pytest.raises(HfplanError, match="--rollout sglang: use torch or vllm"):
        plan.with_rollout_engine("sglang")


def test_a_plan_generating_with_vllm_where_it_is_missing_gets_one_line_naming_the_extra(tmp_path, monkeypatch,
                                                                                          demo_plan_file):
    """vLLM hidden from this process (its import spec): execute refuses before starting anything, exit 2."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    result = invoke("execute", demo_plan_file, "--rollout", "vllm", "--out", tmp_path / "run")
    assert_user_error(result, "parallelism.actor.gen.engine is vllm but vLLM is not installed", "'.[vllm]'",
                      "--rollout torch")
    assert not (tmp_path / "run").exists()
