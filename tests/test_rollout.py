"""The torch rollout engine against HF transformers: log-probs, greedy tokens, EOS, groups, top-p."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hfplan.errors import HfplanError  # noqa: E402
from hfplan.executor import sequences  # noqa: E402
from hfplan.executor.models import build_model  # noqa: E402
from hfplan.executor.rollout.base import RolloutEngine, SamplingParams  # noqa: E402
from hfplan.executor.rollout.torch_engine import TorchRolloutEngine, sample_tokens, top_p_keep  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=128, rope_theta=500.0,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "qwen2-bias": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},  # q, k, v biases
    "llama-tied": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": True},
}
PAD = 0


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("configs") / f"{request.param}.json"
    path.write_text(json.dumps(CONFIGS[request.param] | SMALL))
    built = build_model(str(path), "lm", seed=0).eval()
    # HF initialises biases to 0 and norms to 1; draw them so that a dropped bias or norm shows.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in built.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5 + (1.0 if "norm" in name else 0.0))
    assert built.config.tie_word_embeddings == (request.param == "llama-tied")
    if request.param == "llama-tied":
        assert built.lm_head.weight.data_ptr() == built.model.embed_tokens.weight.data_ptr()
    return built


def uneven_prompts(rows: int = 4, width: int = 7, seed: int = 0, vocab: int = 300) -> torch.Tensor:
    """Left-padded prompts of lengths 1 (just a BOS), then longer ones, up to the full width."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.full((rows, width), PAD)
    for i in range(rows):
        length = 1 + i * (width - 1) // max(rows - 1, 1)
        prompts[i, width - length:] = torch.randint(3, vocab, (length,), generator=gen)
        prompts[i, width - length] = 1
    return prompts


def training_log_probs(model, rollout, temperature: float) -> torch.Tensor:
    joined = sequences.join(rollout.prompts, rollout.responses, rollout.response_mask, PAD)
    with torch.no_grad():
        logits = model(input_ids=joined.input_ids, attention_mask=joined.attention_mask,
                       position_ids=joined.position_ids).logits
    per_token = sequences.response_predictions(logits / temperature, joined.prompt_len, rollout.responses.shape[1])
    taken = per_token.log_softmax(-1).gather(-1, rollout.responses[..., None]).squeeze(-1)
    return taken * rollout.response_mask


def most_common_token(responses: torch.Tensor) -> int:
    values, counts = responses.flatten().unique(return_counts=True)
    return int(values[counts.argmax()])


def check_padding_after_eos(rollout, eos: int, steps: int) -> torch.Tensor:
    lengths = rollout.response_mask.sum(1).long()
    assert rollout.responses.shape[1] == steps and rollout.log_probs.shape[1] == steps
    assert rollout.response_mask.dtype == torch.float32 and rollout.log_probs.dtype == torch.float32
    for row, length in enumerate(lengths.tolist()):
        assert rollout.response_mask[row, :length].eq(1).all() and rollout.response_mask[row, length:].eq(0).all()
        assert rollout.responses[row, length:].eq(PAD).all()
        assert rollout.log_probs[row, length:].eq(0).all()
        real = rollout.responses[row, :length]
        assert (real == eos).sum() <= 1
        if length < steps:
            assert real[-1] == eos  # stopped on EOS, which stays a real (masked-in) token
    return lengths


@pytest.mark.parametrize(("temperature", "top_p", "greedy"), [(0.7, 0.9, False), (1.3, 1.0, False), (1.0, 1.0, True)])
def test_generated_log_probs_equal_a_training_forward(model, temperature, top_p, greedy):
    prompts, steps = uneven_prompts(), 12
    params = SamplingParams(max_new_tokens=steps, temperature=temperature, top_p=top_p, greedy=greedy, n=2)
    # A first run without EOS picks a token the model does emit as EOS, so that rows stop at different steps.
    probe = TorchRolloutEngine(model, PAD, eos_id=-1).generate(prompts, params, torch.Generator().manual_seed(5))
    eos = most_common_token(probe.responses)
    rollout = TorchRolloutEngine(model, PAD, eos).generate(prompts, params, torch.Generator().manual_seed(5))
    lengths = check_padding_after_eos(rollout, eos, steps)
    assert lengths.min() < steps and len(set(lengths.tolist())) >= 2
    assert torch.equal(rollout.prompts, prompts.repeat_interleave(2, dim=0))  # the n samples are consecutive
    expected = training_log_probs(model, rollout, params.logit_temperature)
    torch.testing.assert_close(rollout.log_probs, expected, atol=1e-5, rtol=0)


def test_greedy_tokens_equal_hf_generate(model):
    prompts, steps = uneven_prompts(rows=5, seed=3), 10
    params = SamplingParams(max_new_tokens=steps, greedy=True)
    probe = TorchRolloutEngine(model, PAD, eos_id=-1).generate(prompts, params)
    eos = most_common_token(probe.responses)
    ours = TorchRolloutEngine(model, PAD, eos).generate(prompts, params)
    check_padding_after_eos(ours, eos, steps)
    hf = model.generate(input_ids=prompts, attention_mask=(prompts != PAD).long(), max_new_tokens=steps,
                        do_sample=False, pad_token_id=PAD, eos_token_id=eos, use_cache=True)[:, prompts.shape[1]:]
    assert torch.equal(ours.responses[:, : hf.shape[1]], hf)
    assert ours.responses[:, hf.shape[1]:].eq(PAD).all()
    assert ours.response_mask.sum() < prompts.shape[0] * steps  # EOS did stop some rows


def test_greedy_groups_repeat_each_prompt_n_times(model):
    prompts = uneven_prompts(rows=3, seed=4)
    engine = TorchRolloutEngine(model, PAD, eos_id=-1)
    single = engine.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True))
    grouped = engine.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True, n=3))
    assert grouped.responses.shape == (9, 6)
    assert torch.equal(grouped.responses, single.responses.repeat_interleave(3, dim=0))
    # Equal up to rounding: a batch of 9 rows may sum in another order than a batch of 3.
    torch.testing.assert_close(grouped.log_probs, single.log_probs.repeat_interleave(3, dim=0), atol=1e-5, rtol=0)


def test_generation_stops_early_when_every_row_has_ended(model):
    prompts = uneven_prompts(rows=1, seed=6).repeat(3, 1)  # identical rows: identical greedy answers
    steps = 9
    params = SamplingParams(max_new_tokens=steps, greedy=True)
    probe = TorchRolloutEngine(model, PAD, eos_id=-1).generate(prompts, params).responses[0]
    eos = int(probe[2])
    first = int((probe == eos).nonzero()[0])
    engine = TorchRolloutEngine(model, PAD, eos)
    calls = []
    forward = engine._forward
    engine._forward = lambda *args: calls.append(1) or forward(*args)
    rollout = engine.generate(prompts, params)
    assert len(calls) == 1 + first  # the prefill, then one step per token before the EOS
    assert rollout.responses.shape == (3, steps)
    assert rollout.responses[:, first].eq(eos).all()
    assert rollout.response_mask.sum(1).eq(first + 1).all()
    check_padding_after_eos(rollout, eos, steps)


def test_load_weights_shares_the_model_tensors(model, tmp_path):
    prompts = uneven_prompts(rows=2, seed=7)
    params = SamplingParams(max_new_tokens=5, greedy=True)
    engine = TorchRolloutEngine(model, PAD, eos_id=-1)
    assert engine._w.embed.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    backup = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():  # an optimiser step updates the parameters in place
            for param in model.parameters():
                param.mul_(1.5)
        after = engine.generate(prompts, params)
        hf = model.generate(input_ids=prompts, attention_mask=(prompts != PAD).long(), max_new_tokens=5,
                            min_new_tokens=5, do_sample=False, pad_token_id=PAD, use_cache=True)
        assert torch.equal(after.responses, hf[:, prompts.shape[1]:])
    finally:
        model.load_state_dict(backup)
    model.config.to_json_file(tmp_path / "config.json")
    other = build_model(str(tmp_path / "config.json"), "lm", seed=11).eval()
    engine.load_weights(other)
    swapped = engine.generate(prompts, params)
    hf = other.generate(input_ids=prompts, attention_mask=(prompts != PAD).long(), max_new_tokens=5,
                        min_new_tokens=5, do_sample=False, pad_token_id=PAD, use_cache=True)
    assert torch.equal(swapped.responses, hf[:, prompts.shape[1]:])
    engine.release_weights()
    with pytest.raises(RuntimeError, match="load_weights"):
        engine.generate(prompts, params)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    # By hand: sorted 0.5, 0.3, 0.15, 0.05; mass before each: 0, 0.5, 0.8, 0.95.
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    assert top_p_keep(probs, 0.4).tolist() == [[False, True, False, False]]
    assert top_p_keep(probs, 0.6).tolist() == [[False, True, False, True]]
    assert top_p_keep(probs, 0.85).tolist() == [[True, True, False, True]]
    assert top_p_keep(probs, 1.0).tolist() == [[True, True, True, True]]


def test_top_p_sampling_draws_only_from_the_nucleus_and_reports_untruncated_log_probs():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = probs.log().repeat(4000, 1)
    tokens, log_probs = sample_tokens(logits, SamplingParams(max_new_tokens=1, top_p=0.6),
                                      torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {1, 3}
    # Renormalised nucleus: 0.5 / 0.8 = 0.625 for token 1 (4000 draws: standard error ~0.008).
    assert abs(tokens.eq(1).float().mean().item() - 0.625) < 0.04
    torch.testing.assert_close(log_probs, probs.log()[tokens])


def test_temperature_scales_the_sampled_distribution_and_greedy_uses_temperature_one():
    # By hand: logits 0 and 2 ln 3 at temperature 2 give probabilities 1/4 and 3/4; at 1, 1/10 and 9/10.
    logits = torch.tensor([0.0, 2 * math.log(3)]).repeat(4000, 1)
    tokens, log_probs = sample_tokens(logits, SamplingParams(max_new_tokens=1, temperature=2.0),
                                      torch.Generator().manual_seed(1))
    assert abs(tokens.eq(1).float().mean().item() - 0.75) < 0.04
    torch.testing.assert_close(log_probs, torch.tensor([math.log(1 / 4), math.log(3 / 4)])[tokens])
    greedy, greedy_log_probs = sample_tokens(logits[:2], SamplingParams(max_new_tokens=1, temperature=2.0, greedy=True),
                                             None)
    assert greedy.tolist() == [1, 1]
    torch.testing.assert_close(greedy_log_probs, torch.full((2,), math.log(9 / 10)))


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(max_new_tokens=4, n=0),
                                 dict(max_new_tokens=4, temperature=0.0), dict(max_new_tokens=4, top_p=0.0),
                                 dict(max_new_tokens=4, top_p=1.5)])
def test_sampling_params_refuse_impossible_values(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_sequences_past_a_sliding_window_are_refused(tmp_path):
    path = tmp_path / "mistral.json"
    path.write_text(json.dumps({"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                                **SMALL, "sliding_window": 8}))
    engine = TorchRolloutEngine(build_model(str(path), "lm", seed=0), PAD, 2)
    engine.generate(uneven_prompts(rows=2, width=4), SamplingParams(max_new_tokens=4, greedy=True))
    with pytest.raises(HfplanError, match="sliding window"):
        engine.generate(uneven_prompts(rows=2, width=4), SamplingParams(max_new_tokens=5, greedy=True))


def test_bf16_log_probs_stay_close_to_a_bf16_training_forward():
    model = build_model("tiny", "lm", seed=0, dtype=torch.bfloat16).eval()
    prompts = uneven_prompts(rows=4, seed=8, vocab=260)
    params = SamplingParams(max_new_tokens=8, temperature=0.8)
    rollout = TorchRolloutEngine(model, PAD, eos_id=-1).generate(prompts, params, torch.Generator().manual_seed(0))
    assert rollout.log_probs.dtype == torch.float32 and rollout.response_mask.dtype == torch.float32
    expected = training_log_probs(model, rollout, params.temperature)
    # bf16 keeps 8 bits of mantissa: logits of a few units round at the 1e-2 level, not 1e-5.
    torch.testing.assert_close(rollout.log_probs, expected.float(), atol=5e-2, rtol=0)


def test_fsdp2_sharded_parameters_are_gathered(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    model = build_model("tiny", "lm", seed=0)
    prompts = uneven_prompts(rows=3, seed=9, vocab=260)
    params = SamplingParams(max_new_tokens=6, greedy=True)
    plain = TorchRolloutEngine(model, PAD, eos_id=-1).generate(prompts, params)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert hasattr(model.model.layers[0].self_attn.q_proj.weight, "full_tensor")  # parameters are DTensors
        sharded = TorchRolloutEngine(model, PAD, eos_id=-1).generate(prompts, params)
    finally:
        dist.destroy_process_group()
    assert torch.equal(sharded.responses, plain.responses)
    torch.testing.assert_close(sharded.log_probs, plain.log_probs, atol=1e-6, rtol=0)


# -- static waves and continuous batching ---------------------------------------------------------------------------
def varied_eos(responses: torch.Tensor) -> int:
    """The token that, taken as EOS, ends the rows at the most distinct lengths (the first such id)."""
    steps = responses.shape[1]

    def lengths(token: int) -> set[int]:
        hits = responses == token
        return set(torch.where(hits.any(1), hits.int().argmax(1) + 1, steps).tolist())

    return max(responses.unique().tolist(), key=lambda token: len(lengths(token)))


def _early_eos_case(model, rows: int = 9, steps: int = 12, n: int = 1):
    """Prompts, greedy params and an EOS that ends the model's responses at varied lengths."""
    prompts, params = uneven_prompts(rows=rows, seed=3), SamplingParams(max_new_tokens=steps, greedy=True, n=n)
    probe = TorchRolloutEngine(model, PAD, eos_id=-1).generate(prompts, params)
    return prompts, params, varied_eos(probe.responses)


def _same_rollout(got, want) -> None:
    assert torch.equal(got.prompts, want.prompts)
    assert torch.equal(got.responses, want.responses)
    assert torch.equal(got.response_mask, want.response_mask)
    torch.testing.assert_close(got.log_probs, want.log_probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("max_batch", "n"), [(3, 1), (4, 2)])
def test_greedy_continuous_batching_equals_one_static_batch(model, max_batch, n):
    prompts, params, eos = _early_eos_case(model, n=n)
    whole = TorchRolloutEngine(model, PAD, eos).generate(prompts, params)
    lengths = check_padding_after_eos(whole, eos, params.max_new_tokens)
    assert lengths.min() < params.max_new_tokens and len(set(lengths.tolist())) >= 2  # mixed lengths
    engine = TorchRolloutEngine(model, PAD, eos, batching="continuous", max_batch=max_batch)
    continuous = engine.generate(prompts, params)
    _same_rollout(continuous, whole)
    assert engine.stats.prefills > 1  # slots were refilled
    torch.testing.assert_close(continuous.log_probs, training_log_probs(model, continuous, 1.0), atol=1e-5, rtol=0)


def test_static_waves_equal_one_batch_and_split_as_evenly_as_they_can(model):
    prompts, params, eos = _early_eos_case(model, rows=8)
    whole = TorchRolloutEngine(model, PAD, eos).generate(prompts, params)
    engine = TorchRolloutEngine(model, PAD, eos, max_batch=3)
    waved = engine.generate(prompts, params)
    _same_rollout(waved, whole)
    # 8 rows, at most 3 at once: waves of 3, 3 and 2, each decoding until its longest response ends.
    lengths = whole.response_mask.sum(1).long().tolist()
    assert engine.stats.prefills == 3
    assert engine.stats.decode_steps == sum(max(lengths[a:b]) - 1 for a, b in [(0, 3), (3, 6), (6, 8)])


def test_continuous_batching_refills_slots_instead_of_waiting_for_the_longest(model):
    prompts, params, eos = _early_eos_case(model, rows=10)
    static = TorchRolloutEngine(model, PAD, eos, batching="static", max_batch=3)
    continuous = TorchRolloutEngine(model, PAD, eos, batching="continuous", max_batch=3)
    lengths = static.generate(prompts, params).response_mask.sum(1).long().tolist()
    continuous.generate(prompts, params)
    assert continuous.stats.decode_steps < static.stats.decode_steps
    # Each step decodes at most 3 rows, and the longest response needs its own steps one after another.
    assert continuous.stats.decode_steps >= max(max(lengths) - 1, -(-sum(lengths) // 3) - continuous.stats.prefills)


def test_continuous_sampling_is_reproducible_and_its_log_probs_equal_a_training_forward(model):
    prompts, steps = uneven_prompts(rows=6, seed=10), 10
    params = SamplingParams(max_new_tokens=steps, temperature=0.8, top_p=0.9, n=2)
    probe = TorchRolloutEngine(model, PAD, eos_id=-1).generate(prompts, params, torch.Generator().manual_seed(2))
    eos = most_common_token(probe.responses)
    engine = TorchRolloutEngine(model, PAD, eos, batching="continuous", max_batch=4)
    first = engine.generate(prompts, params, torch.Generator().manual_seed(3))
    again = engine.generate(prompts, params, torch.Generator().manual_seed(3))
    assert engine.stats.prefills > 1
    assert torch.equal(first.responses, again.responses) and torch.equal(first.log_probs, again.log_probs)
    check_padding_after_eos(first, eos, steps)
    expected = training_log_probs(model, first, params.temperature)
    torch.testing.assert_close(first.log_probs, expected, atol=1e-5, rtol=0)


def test_the_torch_engine_is_a_rollout_engine():
    """Every method the runtime calls on a generation backend (RolloutEngine) is there; an engine without
    release_weights, as the protocol once was, is not one."""

    class LoadsOnly:
        def generate(self, prompts, params, generator=None): ...

        def load_weights(self, model): ...

    assert isinstance(TorchRolloutEngine(None, PAD, 2), RolloutEngine)
    assert not isinstance(LoadsOnly(), RolloutEngine)


def test_batching_options_are_checked():
    with pytest.raises(ValueError, match="batching"):
        TorchRolloutEngine(None, PAD, 2, batching="dynamic")
    with pytest.raises(ValueError, match="max_batch"):
        TorchRolloutEngine(None, PAD, 2, max_batch=0)


def _tp2_continuous(rank: int, world: int, config: dict, eos: int) -> dict:
    import torch.distributed as dist

    model = build_model(config["path"], "lm", seed=0).eval()
    engine = TorchRolloutEngine(model, PAD, eos, tp_group=dist.group.WORLD, batching="continuous", max_batch=3)
    rollout = engine.generate(uneven_prompts(rows=9, seed=3), SamplingParams(max_new_tokens=12, greedy=True))
    assert engine._w.kv_heads == 1  # this rank's share of the two KV heads
    return {"responses": rollout.responses, "mask": rollout.response_mask, "log_probs": rollout.log_probs}


@pytest.mark.slow
def test_tensor_parallel_continuous_batching_equals_one_process(tmp_path):
    from tests.support.worlds import run_world

    path = tmp_path / "llama.json"
    path.write_text(json.dumps(CONFIGS["llama"] | SMALL))
    model = build_model(str(path), "lm", seed=0).eval()
    prompts, params, eos = _early_eos_case(model)
    want = TorchRolloutEngine(model, PAD, eos).generate(prompts, params)
    assert len(set(want.response_mask.sum(1).tolist())) >= 3
    for got in run_world(_tp2_continuous, 2, {"path": str(path)}, eos, timeout=120):
        assert torch.equal(got["responses"], want.responses) and torch.equal(got["mask"], want.response_mask)
        torch.testing.assert_close(got["log_probs"], want.log_probs, atol=1e-5, rtol=0)


def test_a_rollout_set_generates_with_the_batching_its_plan_gives():
    import numpy as np

    from hfplan.dataflow.ops import BEHAVIOUR
    from hfplan.executor.mesh import WorkerMeshes
    from hfplan.executor.runtime import _build_role
    from hfplan.plan import ROLLOUT, GenConfig, RoleParallelism
    from hfplan.spec import make_cluster
    from tests.support.executor_runs import tiny_workload
    from tests.support.plans import build_plan

    workload = tiny_workload("ppo")
    prompts = uneven_prompts(rows=workload.batch_prompts, width=workload.prompt_len, seed=11, vocab=260).numpy()
    outputs = {}
    for gen in (GenConfig(), GenConfig(batching="continuous", max_batch=3)):
        plan = build_plan(workload, [(("actor", "critic", "reference"), 1), ((ROLLOUT,), 1)],
                          cluster=make_cluster(2, "cpu"), tp=1, gen_tp=1, overrides={ROLLOUT: RoleParallelism(gen=gen)})
        runtime = _build_role(ROLLOUT, plan, workload.hyperparameters, 0, torch.device("cpu"), 0, WorkerMeshes("cpu"))
        assert (runtime.engine.batching, runtime.engine.max_batch) == (gen.batching, gen.max_batch)
        outputs[gen.batching] = runtime.run("generate", {"prompts": prompts}, {"greedy": True, "n": 2}, [])
        # 8 rows: one prefill of them all, or, with 3 slots, prefills of at most 3 rows each.
        prefills = runtime.engine.stats.prefills
        assert prefills == 1 if gen.max_batch is None else prefills >= 3
    for name, value in outputs["static"].items():
        if name == BEHAVIOUR:  # the same tokens' log-probs, from batches of other shapes
            np.testing.assert_allclose(outputs["continuous"][name], value, atol=1e-5, rtol=0)
        else:
            assert np.array_equal(outputs["continuous"][name], value), name


@pytest.mark.slow
def test_a_continuous_batching_plan_runs_as_its_static_twin_when_sampling_is_argmax():
    """GRPO on one device (the hybrid engine): a top_p that keeps only the likeliest token makes sampling pick
    the argmax, so a plan with 3 continuous slots for its 8 rollouts runs as the static one does."""
    from hfplan.executor.controller import ExecuteOptions
    from hfplan.executor.local import run_local, single_process_world
    from hfplan.plan import GenConfig
    from tests.support.executor_runs import ARITH_GRPO, cpu_plan, tiny_workload

    static = cpu_plan(tiny_workload("grpo", ARITH_GRPO), [(("actor", "reference"), 1)])
    actor = static.parallelism["actor"]
    continuous = static.model_copy(update={"parallelism": static.parallelism | {"actor": actor.model_copy(
        update={"gen": GenConfig(batching="continuous", max_batch=3)})}})
    options = ExecuteOptions(iterations=2, overrides=("top_p=1e-6",))
    with single_process_world():
        runs = [run_local(plan, options).iterations for plan in (static, continuous)]
    assert any(0 < it["response_len"] < static.workload.response_len for it in runs[0])  # lengths vary
    for got, want in zip(runs[1], runs[0], strict=True):
        for key in ("response_len", "reward", "actor/policy_loss", "actor/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
