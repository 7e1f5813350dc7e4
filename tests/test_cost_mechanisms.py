"""Runtime costs, recomputation modes, interleaved 1F1B, eager attention, the flash kernel's measured rate and
response-length distributions, by hand on the toy profile of conftest.py (matmul 5e13 FLOP/s, memory 5e11 B/s,
5 us per kernel, intra-node 5e10 B/s with alpha 1 us)."""

from dataclasses import replace

import pytest

from hfplan.plan import GenConfig, InferConfig, Layout, TrainConfig
from hfplan.profiles.hardware import Runtime, load_hardware
from hfplan.profiles.models import CATALOG
from hfplan.simulator import costs, kernels
from hfplan.simulator.costs import SetShape
from hfplan.simulator.kernels import attention_time, kernel_time, memory_time
from hfplan.spec import ResponseLengths

LLAMA7 = CATALOG["llama2-7b"]
ONE = SetShape(1, 8)
RUNTIME = Runtime(forward_pass_us=100, engine_step_us=50, controller_call_us=1000)


def with_runtime(hw):
    return hw.model_copy(update={"runtime": RUNTIME})


# -- runtime costs ----------------------------------------------------------------------------------------


def test_inference_pays_a_forward_pass_per_micro_batch_and_one_controller_call(toy_hw):
    cfg = InferConfig(micro_batch=2)
    plain = costs.inference_time(toy_hw, LLAMA7, cfg, ONE, 8, 256, "lm")
    paid = costs.inference_time(with_runtime(toy_hw), LLAMA7, cfg, ONE, 8, 256, "lm")
    assert paid - plain == pytest.approx(4 * 100e-6 + 1000e-6)  # 4 micro-batches, one call


def test_a_pass_pays_a_fixed_cost_per_token_shared_by_the_pipeline_stages(toy_hw):
    per_token = toy_hw.model_copy(update={"runtime": Runtime(forward_token_us=2, train_token_us=5)})
    cfg = InferConfig(micro_batch=2)
    plain = costs.inference_time(toy_hw, LLAMA7, cfg, ONE, 8, 256, "lm")
    paid = costs.inference_time(per_token, LLAMA7, cfg, ONE, 8, 256, "lm")
    assert paid - plain == pytest.approx(8 * 256 * 2e-6)  # every token once
    train = TrainConfig(micro_batch=2)
    step = costs.train_step_parts(per_token, LLAMA7, train, ONE, 8, 256, "lm")
    assert step["runtime"] == pytest.approx(8 * 256 * 5e-6)
    # Two stages: each micro-batch's tokens cost the busiest stage half as much, plus the pipeline's fill.
    staged = costs.train_step_parts(per_token, LLAMA7, TrainConfig(pp=2, micro_batch=2), SetShape(2, 8), 8, 256, "lm")
    assert staged["runtime"] == pytest.approx(4 * 2 * 256 * 5e-6 / 2)


def test_generation_pays_an_engine_step_per_prefill_and_decode_step(toy_hw):
    gen = GenConfig()
    kv = 1e12  # room for everything: one wave of 4
    plain = costs.generation_time(toy_hw, LLAMA7, gen, ONE, 4, 64, 16, kv)
    paid = costs.generation_time(with_runtime(toy_hw), LLAMA7, gen, ONE, 4, 64, 16, kv)
    assert plain.waves == paid.waves == 1
    # 16-token responses: a prefill (it samples each first token) and 15 decode steps
    assert paid.seconds - plain.seconds == pytest.approx((1 + 15) * 50e-6 + 1000e-6)
    assert paid.parts["runtime"] == pytest.approx(16 * 50e-6)
    assert paid.parts["controller"] == pytest.approx(1000e-6)
    assert paid.parts.total == pytest.approx(paid.seconds)


def test_an_engine_step_pays_a_fixed_cost_for_each_sequence_in_it(toy_hw):
    per_sequence = toy_hw.model_copy(update={"runtime": Runtime(engine_step_us=50, engine_sequence_step_us=10)})
    paid = costs.generation_time(per_sequence, LLAMA7, GenConfig(), ONE, 4, 64, 16, 1e12)
    assert paid.waves == 1  # one batch of 4: a prefill and 15 decode steps of 4 sequences each
    assert paid.parts["runtime"] == pytest.approx((1 + 15) * (50e-6 + 4 * 10e-6))


def test_a_generation_pays_the_engines_fixed_cost_per_call_once_a_wave(toy_hw):
    """Runtime.generate_call_us once per static wave (4 sequences in waves of 2: twice), and once for a continuous
    engine's whole run, whatever its prefills and steps."""
    called = toy_hw.model_copy(update={"runtime": Runtime(generate_call_us=300)})
    lengths = ResponseLengths(max_len=30, mean=20.0, points=((10, 0.5), (30, 0.5)))
    for batching, calls in (("static", 2), ("continuous", 1)):
        plain = costs.waves_phases(toy_hw, LLAMA7, 1, 1, ONE, 4, 2, 64, 30, lengths, batching)
        paid = costs.waves_phases(called, LLAMA7, 1, 1, ONE, 4, 2, 64, 30, lengths, batching)
        assert paid.prefill.total - plain.prefill.total == pytest.approx(calls * 300e-6)
        assert paid.decode == pytest.approx(dict(plain.decode))


def test_a_switch_pays_the_engines_fixed_cost_per_tensor_even_where_it_moves_nothing(toy_hw):
    from hfplan.layout import stage_parameter_tensors

    per_tensor = toy_hw.model_copy(update={"runtime": Runtime(switch_tensor_us=20)})
    same = (TrainConfig(tp=2), GenConfig(tp=2))  # generation in the training layout: no weight moves
    assert costs.transition_time(toy_hw, LLAMA7, *same, SetShape(2, 8)) == 0.0
    fixed = stage_parameter_tensors(LLAMA7, 1, "lm") * 20e-6
    assert costs.transition_time(per_tensor, LLAMA7, *same, SetShape(2, 8)) == pytest.approx(fixed)
    moved = (TrainConfig(tp=4), GenConfig(tp=2, dp=2))
    assert costs.transition_time(per_tensor, LLAMA7, *moved, SetShape(4, 8)) == pytest.approx(
        costs.transition_time(toy_hw, LLAMA7, *moved, SetShape(4, 8)) + fixed)


def test_a_switch_in_the_training_layout_pays_its_training_engines_cost_per_tensor(toy_hw):
    """Generating in the training layout, the actor's weights are unsharded by its training engine: through
    FSDP2 (dp > 1) its per-tensor cost replaces the rollout engine's, split by tp it adds on top. A switch
    resharded by plan (another tp) pays the rollout engine's alone."""
    from hfplan.layout import stage_parameter_tensors

    tensors = stage_parameter_tensors(LLAMA7, 1, "lm")
    rt = Runtime(switch_tensor_us=20, fsdp_switch_tensor_us=70, tp_switch_tensor_us=5)
    hw = toy_hw.model_copy(update={"runtime": rt})

    def fixed(train, gen, gpus):
        return (costs.transition_time(hw, LLAMA7, train, gen, SetShape(gpus, 8))
                - costs.transition_time(toy_hw, LLAMA7, train, gen, SetShape(gpus, 8)))

    assert fixed(TrainConfig(dp=2), GenConfig(dp=2), 2) == pytest.approx(tensors * 70e-6)
    assert fixed(TrainConfig(tp=2, dp=2), GenConfig(tp=2, dp=2), 4) == pytest.approx(tensors * 75e-6)
    # One data-parallel rank trains through FSDP2 only below fp32 (layout.trains_through_fsdp).
    fp32 = hw.model_copy(update={"compute": hw.compute.model_copy(update={"value_bytes": 4})})
    for profile, through_fsdp in ((hw, hw.compute.value_bytes != 4), (fp32, False)):
        split = (costs.transition_time(profile, LLAMA7, TrainConfig(tp=2), GenConfig(tp=2), SetShape(2, 8))
                 - costs.transition_time(toy_hw.model_copy(update={"compute": profile.compute}), LLAMA7,
                                         TrainConfig(tp=2), GenConfig(tp=2), SetShape(2, 8)))
        assert split == pytest.approx(tensors * ((70 if through_fsdp else 20) + 5) * 1e-6)
    assert fixed(TrainConfig(tp=4), GenConfig(tp=2, dp=2), 4) == pytest.approx(tensors * 20e-6)  # by plan
    # A profile without the FSDP2 figure: the rollout engine's.
    older = toy_hw.model_copy(update={"runtime": Runtime(switch_tensor_us=20)})
    assert (costs.transition_time(older, LLAMA7, TrainConfig(dp=2), GenConfig(dp=2), SetShape(2, 8))
            - costs.transition_time(toy_hw, LLAMA7, TrainConfig(dp=2), GenConfig(dp=2), SetShape(2, 8))
            ) == pytest.approx(tensors * 20e-6)


def test_an_actor_generating_with_the_tensors_it_trains_pays_its_measured_switch_once(toy_hw):
    """One fp32 data-parallel rank trained as it is, generating in its training layout, keeps its tensors
    (layout.keeps_trained_tensors): its switch is the profile's kept_switch_us, whole; a rollout set's weight sync,
    a resharded switch and an FSDP2 rank still pay per tensor. Without the figure, per tensor as before."""
    from hfplan.layout import keeps_trained_tensors, stage_parameter_tensors

    tensors = stage_parameter_tensors(LLAMA7, 1, "lm")
    fp32 = toy_hw.compute.model_copy(update={"value_bytes": 4})
    bare = toy_hw.model_copy(update={"compute": fp32})
    kept = bare.model_copy(update={"runtime": Runtime(switch_tensor_us=20, kept_switch_us=150)})
    one = (TrainConfig(), GenConfig())
    assert keeps_trained_tensors(*one, 4) and not keeps_trained_tensors(*one, 2)
    assert costs.transition_time(kept, LLAMA7, *one, SetShape(1, 8)) == pytest.approx(150e-6)
    unset = bare.model_copy(update={"runtime": Runtime(switch_tensor_us=20)})
    assert costs.transition_time(unset, LLAMA7, *one, SetShape(1, 8)) == pytest.approx(tensors * 20e-6)
    for train, gen, gpus in ((TrainConfig(dp=2), GenConfig(dp=2), 2), (TrainConfig(pp=2), GenConfig(), 2)):
        assert not keeps_trained_tensors(train, gen, 4)
        assert (costs.transition_time(kept, LLAMA7, train, gen, SetShape(gpus, 8))
                - costs.transition_time(bare, LLAMA7, train, gen, SetShape(gpus, 8))) == pytest.approx(
                    tensors * 20e-6)
    assert costs.weight_sync_time(kept, LLAMA7, GenConfig(), SetShape(1, 8), True) == pytest.approx(
        costs.weight_sync_time(bare, LLAMA7, GenConfig(), SetShape(1, 8), True) + tensors * 20e-6)


def test_a_continuous_engine_pays_its_own_step_cost(toy_hw):
    lengths = ResponseLengths(max_len=30, mean=20.0, points=((10, 0.5), (30, 0.5)))
    both = toy_hw.model_copy(update={"runtime": Runtime(engine_step_us=50, engine_step_continuous_us=80)})
    old = toy_hw.model_copy(update={"runtime": Runtime.model_validate({"engine_step_us": 50})})  # no such field
    # 8 sequences through 2 slots: 4 prefills and 80 + 5 decode steps (test_static_and_continuous_batching_by_hand).
    refilled = costs.wave_parts(both, LLAMA7, 1, 1, ONE, 2, 64, 30, lengths, "continuous", 8)
    assert refilled["runtime"] == pytest.approx((4 + 85) * 80e-6)
    older = costs.wave_parts(old, LLAMA7, 1, 1, ONE, 2, 64, 30, lengths, "continuous", 8)
    assert older["runtime"] == pytest.approx((4 + 85) * 50e-6)  # a profile without the field: the static step
    # A slot for every sequence: one static batch, 1 prefill and 24 expected steps, at the static step's cost.
    one_batch = costs.wave_parts(both, LLAMA7, 1, 1, ONE, 2, 64, 30, lengths, "continuous", 2)
    assert one_batch["runtime"] == pytest.approx((1 + 24) * 50e-6)


def test_training_step_pays_a_forward_pass_per_micro_batch_chunk(toy_hw):
    cfg = TrainConfig(pp=2, micro_batch=1, virtual_stages=2)
    where = SetShape(2, 8)
    plain = costs.train_step_parts(toy_hw, LLAMA7, cfg, where, 4, 128, "lm")
    paid = costs.train_step_parts(with_runtime(toy_hw), LLAMA7, cfg, where, 4, 128, "lm")
    # 4 micro-batches x 2 chunks, and the bubble's (pp-1)/v = 1/2 slot pays its share.
    assert paid["runtime"] == pytest.approx(4 * 2 * 100e-6)
    assert paid.total - plain.total == pytest.approx((4 + 0.5) * 2 * 100e-6)


def test_a_training_engine_pays_its_own_pass_and_a_cost_per_parameter_tensor_each_step(toy_hw):
    from hfplan.layout import stage_parameter_tensors

    cfg = TrainConfig(pp=2, micro_batch=1)
    where = SetShape(2, 8)
    trained = toy_hw.model_copy(update={"runtime": Runtime(forward_pass_us=100, train_pass_us=300,
                                                           optimizer_tensor_us=2)})
    plain = costs.train_step_parts(toy_hw, LLAMA7, cfg, where, 4, 128, "lm")
    paid = costs.train_step_parts(trained, LLAMA7, cfg, where, 4, 128, "lm")
    # llama2-7b: 9 tensors a layer, 16 layers a stage; the last stage adds the final norm and the LM head.
    assert stage_parameter_tensors(LLAMA7, 2, "lm") == 9 * 16 + 2
    assert paid["runtime"] == pytest.approx(4 * 300e-6 + 146 * 2e-6)
    assert paid.total - plain.total == pytest.approx((4 + 1) * 300e-6 + 146 * 2e-6)  # the bubble's slot too


def test_the_fsdp_wrapped_engine_pays_its_own_fixed_costs_where_the_executor_wraps_it(toy_hw):
    """One data-parallel rank in fp32 trains the module as it is; more ranks, or a lower compute precision,
    wrap it in FSDP2, whose passes (training and a trained role's inference) and optimizer step cost more."""
    from hfplan.layout import stage_parameter_tensors, trains_through_fsdp

    assert not trains_through_fsdp(1, 4) and trains_through_fsdp(2, 4) and trains_through_fsdp(1, 2)
    runtime = Runtime(forward_pass_us=100, train_pass_us=300, optimizer_tensor_us=2, fsdp_forward_pass_us=700,
                      fsdp_train_pass_us=900, fsdp_optimizer_tensor_us=5)
    fp32 = toy_hw.model_copy(update={"runtime": runtime, "compute": toy_hw.compute.model_copy(
        update={"value_bytes": 4})})
    tensors = stage_parameter_tensors(LLAMA7, 1, "lm")
    for dp, pass_us, tensor_us in ((1, 300, 2), (2, 900, 5)):
        cfg = TrainConfig(dp=dp, micro_batch=1)
        step = costs.train_step_parts(fp32, LLAMA7, cfg, SetShape(dp, 8), 2 * dp, 128, "lm")
        assert step["runtime"] == pytest.approx(2 * pass_us * 1e-6 + tensors * tensor_us * 1e-6), dp
        for fsdp, forward_us in ((False, 100), (True, 700)):
            forward = costs.inference_parts(fp32, LLAMA7, InferConfig(dp=dp, micro_batch=1), SetShape(dp, 8),
                                            2 * dp, 128, "lm", fsdp=fsdp)
            assert forward["runtime"] == pytest.approx(2 * forward_us * 1e-6), (dp, fsdp)
    split = fp32.model_copy(update={"runtime": runtime.model_copy(update={
        "tp_forward_pass_us": 40, "tp_train_pass_us": 60, "tp_optimizer_tensor_us": 1})})
    tp2 = costs.train_step_parts(split, LLAMA7, TrainConfig(tp=2, micro_batch=1), SetShape(2, 8), 2, 128, "lm")
    assert tp2["runtime"] == pytest.approx(2 * 360e-6 + tensors * 3e-6)  # on top of the unsplit engine's
    forward = costs.inference_parts(split, LLAMA7, InferConfig(tp=2, micro_batch=1), SetShape(2, 8), 2, 128, "lm")
    assert forward["runtime"] == pytest.approx(2 * 140e-6)
    bf16 = fp32.model_copy(update={"compute": fp32.compute.model_copy(update={"value_bytes": 2})})
    one_rank = costs.train_step_parts(bf16, LLAMA7, TrainConfig(micro_batch=1), SetShape(1, 8), 2, 128, "lm")
    assert one_rank["runtime"] == pytest.approx(2 * 900e-6 + tensors * 5e-6)


def test_a_pipeline_stage_pays_its_own_fixed_cost_per_micro_batch_and_a_switch_by_plan_per_tensor(toy_hw):
    """Runtime.pp_*_pass_us: each micro-batch slot of a pipelined call (its micro-batches and the pipeline's fill
    and drain) pays it on top of the unsplit engine's pass, a call without stages never; reshard_tensor_us: every
    tensor of a switch resharded by plan, and no other switch."""
    from hfplan.layout import stage_parameter_tensors

    fp32 = toy_hw.model_copy(update={"compute": toy_hw.compute.model_copy(update={"value_bytes": 4})})
    fixed = fp32.model_copy(update={"runtime": Runtime(pp_forward_pass_us=400, pp_train_pass_us=2000,
                                                       reshard_tensor_us=30)})
    where = SetShape(2, 8)

    def added(cost) -> float:
        return cost(fixed) - cost(fp32)

    for pp, slots in ((1, 0), (2, 4 + 1)):  # 4 micro-batches of one sequence and, with 2 stages, one of fill and drain
        train = TrainConfig(pp=pp, micro_batch=1)
        assert added(lambda hw, train=train: costs.train_step_time(hw, LLAMA7, train, where, 4, 128, "lm")) == \
            pytest.approx(slots * 2000e-6), pp
        infer = InferConfig(pp=pp, micro_batch=1)
        assert added(lambda hw, infer=infer: costs.inference_time(hw, LLAMA7, infer, where, 4, 128, "lm")) == \
            pytest.approx(slots * 400e-6), pp
    pipelined, split = TrainConfig(pp=2), TrainConfig(tp=2)
    assert added(lambda hw: costs.transition_time(hw, LLAMA7, pipelined, GenConfig(dp=2), where)) == \
        pytest.approx(stage_parameter_tensors(LLAMA7, 1, "lm") * 30e-6)
    assert added(lambda hw: costs.transition_time(hw, LLAMA7, split, GenConfig(tp=1, dp=2), where)) > 0  # by plan
    assert added(lambda hw: costs.transition_time(hw, LLAMA7, split, GenConfig(tp=2), where)) == 0  # in place


def test_parameter_tensors_of_a_stage_follow_the_model():
    from hfplan.layout import stage_parameter_tensors

    tiny = CATALOG["tiny"]
    assert stage_parameter_tensors(tiny, 1, "lm") == 9 * 2 + 3  # two layers, embedding, final norm, LM head
    assert stage_parameter_tensors(tiny, 1, "scalar") == 9 * 2 + 4  # a value head has a bias
    assert stage_parameter_tensors(tiny, 2, "lm") == 9 + 2  # one layer, the final norm and the head
    qwen = CATALOG["qwen2.5-0.5b"]  # tied embeddings, q/k/v biases: 12 tensors a layer, no LM head of its own
    assert stage_parameter_tensors(qwen, 1, "lm") == 12 * qwen.layers + 2


def test_parameter_tensors_are_those_of_the_executor_models():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hfplan.executor.models import build_model
    from hfplan.layout import stage_parameter_tensors

    for head in ("lm", "scalar"):
        model = build_model("tiny", head, seed=0)
        assert stage_parameter_tensors(CATALOG["tiny"], 1, head) == len(list(model.parameters()))


def test_the_optimizer_step_streams_fused_adamw_once_and_the_gradient_clip(toy_hw, small_arch):
    """small_arch holds 107,328 parameters (conftest.py). The executor's fused AdamW reads each fp32 parameter, its
    gradient and both moments (16 bytes) and writes the parameter and the moments (12) in one pass; the clip reads
    the gradients (4) and scales them (8): 40 bytes at 5e11 B/s, one kernel's 5 us."""
    params = 2 * 36992 + 16640 + 64 + 16640
    one = costs.train_step_parts(toy_hw, small_arch, TrainConfig(), ONE, 4, 64, "lm")
    assert one["optimizer"] == pytest.approx(5e-6 + 40 * params / 5e11)
    # Fully sharded over 4 ranks, each rank steps a quarter of them.
    four = costs.train_step_parts(toy_hw, small_arch, TrainConfig(dp=4, shard="full"), SetShape(4, 8), 16, 64, "lm")
    assert four["optimizer"] == pytest.approx(5e-6 + 40 * params / 4 / 5e11)
    # A stack that runs one kernel per line of the update (Compute.optimizer unfused: torch's foreach path): weight
    # decay 8, the first moment's lerp 12, the second's scaling 8 and addcmul 12, its sqrt, division and epsilon 8
    # each, the addcdiv update 16, and the clip's 12: 92 bytes.
    unfused = toy_hw.model_copy(update={"compute": toy_hw.compute.model_copy(update={"optimizer": "unfused"})})
    assert costs.train_step_parts(unfused, small_arch, TrainConfig(), ONE, 4, 64, "lm")["optimizer"] == \
        pytest.approx(5e-6 + 92 * params / 5e11)


def test_each_decoder_layer_pays_its_fixed_cost_in_every_pass_and_step(toy_hw, small_arch):
    """Runtime.layer_*_us: a forward micro-batch pays layer_forward_us for each layer of its stage, a training
    micro-batch layer_train_us, a generation engine's step (prefill or decode) layer_step_us for each layer of the
    model. small_arch's 2 layers, one stage: 2 micro-batches of 2 sequences."""
    fixed = toy_hw.model_copy(update={"runtime": Runtime(layer_forward_us=100, layer_train_us=300,
                                                         layer_step_us=50)})

    def added(cost) -> float:
        return cost(fixed) - cost(toy_hw)

    assert added(lambda hw: costs.inference_time(hw, small_arch, InferConfig(micro_batch=2), ONE, 4, 64, "lm")) == \
        pytest.approx(2 * 2 * 100e-6)
    assert added(lambda hw: costs.train_step_time(hw, small_arch, TrainConfig(micro_batch=2), ONE, 4, 64, "lm")) == \
        pytest.approx(2 * 2 * 300e-6)
    assert added(lambda hw: costs.decode_step_time(hw, small_arch, Layout(), ONE, 8, 100)) == pytest.approx(2 * 50e-6)
    assert added(lambda hw: costs.prefill_parts(hw, small_arch, Layout(), ONE, 8, 64).total) == \
        pytest.approx(2 * 50e-6)
    # Full recomputation runs each layer's forward again in the backward: its fixed cost too.
    full = TrainConfig(micro_batch=2, recompute="full")
    assert added(lambda hw: costs.train_step_time(hw, small_arch, full, ONE, 4, 64, "lm")) == \
        pytest.approx(2 * 2 * (300e-6 + 100e-6))
    # Three layers on two pipeline stages: a pass pays the busiest stage's two, in each of its slots (one
    # micro-batch and one of fill); a generation step every layer, the stages in turn.
    three, two_stages = replace(small_arch, layers=3), SetShape(2, 8)
    assert added(lambda hw: costs.inference_time(hw, three, InferConfig(pp=2, micro_batch=4), two_stages, 4, 64,
                                                 "lm")) == pytest.approx(2 * 2 * 100e-6)
    assert added(lambda hw: costs.decode_step_time(hw, three, Layout(pp=2), two_stages, 8, 100)) == \
        pytest.approx(3 * 50e-6)


def test_a_wrapped_or_split_decoder_layer_pays_its_engine_s_fixed_cost_on_top(toy_hw, small_arch):
    """Runtime.fsdp_layer_*_us and tp_layer_*_us: a pass through the engine wrapped in FSDP2 pays the former for
    each layer, one split by tensor parallelism the latter, the plain engine (one rank in fp32) neither.
    small_arch's 2 layers; 4 sequences, micro-batches of 2."""
    fp32 = toy_hw.model_copy(update={"compute": toy_hw.compute.model_copy(update={"value_bytes": 4})})
    fixed = fp32.model_copy(update={"runtime": Runtime(fsdp_layer_forward_us=70, fsdp_layer_train_us=200,
                                                       tp_layer_forward_us=40, tp_layer_train_us=500)})

    def added(cost) -> float:
        return cost(fixed) - cost(fp32)

    two = SetShape(2, 8)
    # Two data-parallel ranks: one micro-batch each, through FSDP2.
    assert added(lambda hw: costs.train_step_time(hw, small_arch, TrainConfig(dp=2, micro_batch=2), two, 4, 64,
                                                  "lm")) == pytest.approx(2 * 200e-6)
    assert added(lambda hw: costs.inference_time(hw, small_arch, InferConfig(dp=2, micro_batch=2), two, 4, 64,
                                                 "lm", 2, True)) == pytest.approx(2 * 70e-6)
    # Split over two ranks: every rank runs both micro-batches.
    assert added(lambda hw: costs.train_step_time(hw, small_arch, TrainConfig(tp=2, micro_batch=2), two, 4, 64,
                                                  "lm")) == pytest.approx(2 * 2 * 500e-6)
    assert added(lambda hw: costs.inference_time(hw, small_arch, InferConfig(tp=2, micro_batch=2), two, 4, 64,
                                                 "lm")) == pytest.approx(2 * 2 * 40e-6)
    assert added(lambda hw: costs.train_step_time(hw, small_arch, TrainConfig(micro_batch=2), ONE, 4, 64,
                                                  "lm")) == 0.0
    assert added(lambda hw: costs.inference_time(hw, small_arch, InferConfig(micro_batch=2), ONE, 4, 64,
                                                 "lm")) == 0.0


# -- pipeline schedules and recomputation ------------------------------------------------------------------


def test_interleaved_1f1b_shrinks_the_bubble_and_multiplies_point_to_point(toy_hw):
    where, seq, micro = SetShape(4, 8), 256, 8
    one = costs.train_step_parts(toy_hw, LLAMA7, TrainConfig(pp=4), where, micro, seq, "lm")
    two = costs.train_step_parts(toy_hw, LLAMA7, TrainConfig(pp=4, virtual_stages=2), where, micro, seq, "lm")
    # One activation crossing: bf16 256 x 4096 = 2 MiB over NVLink: 1 us + 2,097,152 / 5e10 s.
    crossing = 1e-6 + 2 * 256 * 4096 / 5e10
    assert one["pp_comm"] == pytest.approx(micro * 2 * crossing)  # forward and backward
    assert two["pp_comm"] == pytest.approx(micro * 2 * 2 * crossing)  # and twice as many boundaries
    slot_one = (one.total - one["bubble"] - one["optimizer"] - one.get("dp_comm", 0.0)) / micro
    slot_two = (two.total - two["bubble"] - two["optimizer"] - two.get("dp_comm", 0.0)) / micro
    assert one["bubble"] == pytest.approx(3 * slot_one)
    assert two["bubble"] == pytest.approx(3 / 2 * slot_two)
    assert two.total < one.total


def test_recompute_modes_add_the_layers_or_their_attention(toy_hw):
    sp = costs.stage_pass(toy_hw, LLAMA7, 1, 1, ONE, 1, 512, "lm")
    none = costs.train_step_parts(toy_hw, LLAMA7, TrainConfig(), ONE, 2, 512, "lm")
    full = costs.train_step_parts(toy_hw, LLAMA7, TrainConfig(recompute="full"), ONE, 2, 512, "lm")
    selective = costs.train_step_parts(toy_hw, LLAMA7, TrainConfig(recompute="selective"), ONE, 2, 512, "lm")
    assert none.get("recompute", 0.0) == 0.0
    assert full["recompute"] == pytest.approx(2 * sp.layers)  # every layer's forward, for both micro-batches
    assert selective["recompute"] == pytest.approx(2 * sp.attention)
    assert sp.attention < sp.layers
    # Full recomputation repeats the layers only: the head and embedding are not recomputed.
    assert sp.layers < sp.forward


# -- bias gradients -----------------------------------------------------------------------------------------


def test_biased_projections_pay_their_bias_gradient_reductions_in_the_backward(toy_hw, small_arch):
    """small_arch (conftest: h 64, q 64, kv 32, ffn 128; SwiGLU) on toy_hw (5e11 B/s, 5 us a kernel), 1000 tokens,
    tp 1. Every projection biased: the backward reads each one's bf16 output gradient whole to sum it over the
    tokens: q, k, v (64 + 2 * 32 = 128 wide), the attention's output (64), gate and up (256) and down (64). The
    forward adds the biases in the GEMMs' epilogues: nothing there changes."""
    from dataclasses import replace

    biased = replace(small_arch, linear_bias=True)
    plain = kernels.layer_forward(toy_hw, small_arch, 1000, 500, 1)
    layer = kernels.layer_forward(toy_hw, biased, 1000, 500, 1)
    expected = sum(5e-6 + 2 * 1000 * width / 5e11 for width in (128, 64, 256, 64))
    assert layer.backward_only == pytest.approx(expected)
    assert plain.backward_only == 0.0
    assert (layer.total, layer.backward() - plain.backward()) == pytest.approx((plain.total, expected))
    # Qwen2's biases on q, k and v alone: one reduction, 128 wide.
    qkv = kernels.layer_forward(toy_hw, replace(small_arch, attention_bias=True), 1000, 500, 1)
    assert qkv.backward_only == pytest.approx(5e-6 + 2 * 1000 * 128 / 5e11)
    # A training step pays them once a layer (2 layers) and micro-batch (one sequence of 1000 tokens, 2 of them).
    step = costs.train_step_parts(toy_hw, biased, TrainConfig(), ONE, 2, 1000, "lm")
    base = costs.train_step_parts(toy_hw, small_arch, TrainConfig(), ONE, 2, 1000, "lm")
    assert step["elementwise"] - base["elementwise"] == pytest.approx(2 * 2 * expected)
    assert step["gemm"] == base["gemm"]


def test_biases_count_in_the_parameters(small_arch):
    """Per layer 36992 without biases (conftest); every projection biased adds 64 + 2 * 32 + 64 + 2 * 128 + 64."""
    from dataclasses import replace

    assert replace(small_arch, linear_bias=True).params_per_layer == 36992 + 128 + 64 + 256 + 64


# -- attention kernels --------------------------------------------------------------------------------------


def test_eager_attention_writes_and_reads_the_scores(toy_hw, small_arch):
    """small_arch: 4 heads of 16 (q_dim 64), 2 KV heads (kv_dim 32). One sequence of 128 tokens, tp 1."""
    eager = toy_hw.model_copy(update={"compute": toy_hw.compute.model_copy(update={"attention": "eager"})})
    tokens, seq = 128, 128
    io = 2 * tokens * (2 * 64 + 2 * 32)  # q and output, k and v, bf16
    scores = 2 * tokens * seq * 4  # one bf16 score per (query, key, head): the full square, mask applied
    half = 2.0 * tokens * seq * 64
    expected = 2 * kernel_time(toy_hw, half, io / 2 + scores) + memory_time(toy_hw, 2 * scores)
    assert attention_time(eager, small_arch, tokens, (seq + 1) / 2, 1, False, seq) == pytest.approx(expected)
    flash = kernel_time(toy_hw, 4.0 * tokens * (seq + 1) / 2 * 64, io)
    assert attention_time(toy_hw, small_arch, tokens, (seq + 1) / 2, 1, False, seq) == pytest.approx(flash)


def _with_attention_rate(hw, points):
    return hw.model_copy(update={"compute": hw.compute.model_copy(update={"attention_rate": points})})


def test_flash_attention_runs_at_its_measured_rate_by_sequence_length(toy_hw, small_arch):
    """Measured: 10% of peak at 1024 keys, 30% at 4096; 2048 is halfway in log(length): 20%. Peak 1e14 FLOP/s, so
    2e13 FLOP/s; one sequence of 2048 tokens through small_arch (q_dim 64) is far from memory-bound."""
    hw = _with_attention_rate(toy_hw, ((1024, 0.1), (4096, 0.3)))
    assert kernels.attention_fraction(hw, 2048) == pytest.approx(0.2)
    assert kernels.attention_fraction(hw, 512) == pytest.approx(0.1)  # beyond the ends: the end's
    assert kernels.attention_fraction(hw, 16384) == pytest.approx(0.3)
    assert kernels.attention_fraction(toy_hw, 2048) == pytest.approx(0.5)  # no table: the matmul rate
    tokens, seq = 2048, 2048
    flops = 4.0 * tokens * (seq + 1) / 2 * 64
    expected = 5e-6 + flops / 2e13
    assert attention_time(hw, small_arch, tokens, (seq + 1) / 2, 1, False, seq) == pytest.approx(expected)
    # The rate follows each sequence's length, not the tokens of the pass: 8 sequences of 256 run at 10%.
    short = attention_time(hw, small_arch, tokens, (256 + 1) / 2, 1, False, 256)
    assert short == pytest.approx(5e-6 + 4.0 * tokens * (256 + 1) / 2 * 64 / 1e13)


def _per_query_head(hw, l2=None, vector=None):
    compute = hw.compute.model_copy(update={"decode_attention": "per_query_head", "vector_tflops": vector})
    memory = hw.memory.model_copy(update={"l2_gbytes_per_s": l2})
    return hw.model_copy(update={"compute": compute, "memory": memory})


def test_per_query_head_decode_attention_reads_each_kv_head_once_per_query_head(toy_hw, small_arch):
    """small_arch at tp 1: 4 query heads of 16 (q 64) on 2 KV heads (kv 32), 2 query heads per KV head. A decode
    step of 8 sequences at 100 keys: the cache is 2 B x 8 x 100 x (k, v) x 32 = 102,400 B, with q and the output
    (2 B x 2 x 8 x 64 = 2,048 B) 104,448 B through HBM: 2.08896e-7 s at 5e11 B/s. The second query head of each
    KV head reads the cache again from L2: 206,848 B, 2.06848e-6 s at 100 GB/s. Its math, 4 x 8 x 100 x 64 =
    204,800 FLOP, in fp32 on the CUDA cores: 2.048e-6 s at 0.1 TFLOP/s. Plus the 5 us launch."""
    tokens, keys = 8, 100
    grouped = attention_time(toy_hw, small_arch, tokens, keys, 1, True)
    hbm_only = attention_time(_per_query_head(toy_hw), small_arch, tokens, keys, 1, True)
    assert hbm_only == pytest.approx(5e-6 + 104_448 / 5e11)
    assert grouped == pytest.approx(kernel_time(toy_hw, 4.0 * tokens * keys * 64, 104_448))  # flash, one read
    l2_bound = attention_time(_per_query_head(toy_hw, l2=100, vector=0.1), small_arch, tokens, keys, 1, True)
    assert l2_bound == pytest.approx(5e-6 + 206_848 / 1e11)
    vector_bound = attention_time(_per_query_head(toy_hw, l2=100, vector=0.01), small_arch, tokens, keys, 1, True)
    assert vector_bound == pytest.approx(5e-6 + 204_800 / 1e10)
    # Split by tensor parallelism over 2: one KV head and 2 query heads per GPU, the same group of 2.
    tp2 = attention_time(_per_query_head(toy_hw, l2=100), small_arch, tokens, keys, 2, True)
    assert tp2 == pytest.approx(5e-6 + (104_448 + 102_400) / 2 / 1e11)
    # Prefill is not decode: the flash kernel either way.
    assert attention_time(_per_query_head(toy_hw, l2=100), small_arch, 128, 64.5, 1, False, 128) == \
        pytest.approx(attention_time(toy_hw, small_arch, 128, 64.5, 1, False, 128))


def test_per_query_head_decode_of_multi_head_attention_is_its_hbm_read(toy_hw):
    """One query head per KV head: nothing is read twice, so L2 (as fast as HBM here) adds no time."""
    from hfplan.profiles.models import ModelArch

    mha = ModelArch("mha", layers=2, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=260)
    tokens, keys = 8, 100
    hbm = 2 * (tokens * keys * 2 * 64 + 2 * tokens * 64)
    slow_l2 = _per_query_head(toy_hw, l2=toy_hw.memory.bandwidth_gbytes_per_s * toy_hw.memory.efficiency)
    assert attention_time(slow_l2, mha, tokens, keys, 1, True) == pytest.approx(5e-6 + hbm / 5e11)


def test_a100_per_query_head_decode_of_llama_70b_is_bound_by_its_measured_l2_rate():
    """Llama 2 70B at tp 4 on the shipped A100 profile: 2 KV heads (256 values) and 16 query heads (2048) a GPU, 8
    query heads to a KV head. A decode layer of 240 sequences at 1,152 keys: the cache is 2 B x 240 x 1152 x (k, v)
    x 256 = 283,115,520 B, with q and the output (2 B x 2 x 240 x 2048 = 1,966,080 B) 285,081,600 B from HBM,
    159 us at 2,039 GB/s x 0.88; the 7 other query heads re-read the cache from L2: 2,266,890,240 B, 419 us at the
    measured 5,411 GB/s; the math, 4 x 240 x 1152 x 2048 FLOP, 116 us at 19.5 TFLOP/s. L2 binds, plus 4 us."""
    a100 = load_hardware("a100-80g")
    hw = a100.model_copy(update={"compute": a100.compute.model_copy(update={"decode_attention": "per_query_head"})})
    l2_bytes = 285_081_600 + 7 * 283_115_520
    assert attention_time(hw, CATALOG["llama2-70b"], 240, 1152, 4, True) == pytest.approx(4e-6 + l2_bytes / 5411e9)
    # Llama 2 7B has one query head per KV head: its 32 heads' cache (2 B x 60 x 1152 x 2 x 4096) and q and the
    # output (2 B x 2 x 60 x 4096) are one HBM read, whatever the L2's rate.
    hbm = 2 * 60 * 1152 * 2 * 4096 + 2 * 2 * 60 * 4096
    assert attention_time(hw, LLAMA7, 60, 1152, 1, True) == pytest.approx(4e-6 + hbm / (2039e9 * 0.88))


def test_attention_rate_points_must_rise_in_length_and_be_fractions(toy_hw):
    for bad in ((), ((2048, 0.2), (1024, 0.1)), ((1024, 0.1), (1024, 0.2)), ((1024, 0.0),), ((1024, 1.5),)):
        with pytest.raises(ValueError):
            toy_hw.compute.model_validate({**toy_hw.compute.model_dump(), "attention_rate": bad})


# -- response lengths and batching ---------------------------------------------------------------------------


def test_expected_longest_response_by_hand():
    lengths = ResponseLengths(max_len=30, mean=20.0, points=((10, 0.5), (30, 0.5)))
    # Two draws: both 10 with probability 1/4.
    assert lengths.expected_max(2) == pytest.approx(10 * 0.25 + 30 * 0.75)
    assert lengths.expected_max(1) == pytest.approx(20.0)
    assert lengths.mean_square == pytest.approx((100 + 900) / 2)
    mean_only = ResponseLengths(max_len=30, mean=20.0)
    assert mean_only.expected_max(4) == 30.0 and mean_only.mean_square == 20.0 * 30
    assert ResponseLengths.fixed(16).expected_max(64) == 16.0


def test_static_and_continuous_batching_by_hand(toy_hw):
    lengths = ResponseLengths(max_len=30, mean=20.0, points=((10, 0.5), (30, 0.5)))
    prompt, layout = 64, Layout()
    prefill = costs.prefill_parts(toy_hw, LLAMA7, layout, ONE, 2, prompt).total
    # Static, a batch of 2: the batch runs until its longest ends, 25 tokens expected, the first of them sampled by
    # the prefill: 24 decode steps, at contexts 64 + 1 to 64 + 24, 64 + 12.5 on average.
    static = costs.wave_parts(toy_hw, LLAMA7, 1, 1, ONE, 2, prompt, 30, lengths, "static").total
    assert static == pytest.approx(prefill + 24 * costs.decode_step_time(toy_hw, LLAMA7, layout, ONE, 2, 64 + 12.5))
    # Continuous, 8 sequences through 2 slots: each holds its slot for its 19 or 29 decode steps and, the lengths
    # varying, one more (the torch engine runs a slot that has just finished through the next step before refilling
    # it): 8 x (20 - 1 + 1) / 2 = 80 full steps plus the last batch's drain (25 - 20), at the token-weighted context
    # 64 + (500 / 20 - 1) / 2 = 76; 4 prefills of 2 prompts.
    continuous = costs.wave_parts(toy_hw, LLAMA7, 1, 1, ONE, 2, prompt, 30, lengths, "continuous", 8).total
    assert continuous == pytest.approx(4 * prefill + 85 * costs.decode_step_time(toy_hw, LLAMA7, layout, ONE, 2, 76))
    # Fixed lengths end every slot at once (no step runs a finished slot), as does a single slot: 8 x (10 - 1) / 2
    # and 8 x (20 - 1) / 1 decode steps.
    fixed = costs.wave_phases(toy_hw, LLAMA7, 1, 1, ONE, 2, prompt, 10, ResponseLengths.fixed(10), "continuous", 8)
    assert fixed.decode_steps == pytest.approx(36)
    alone = costs.wave_phases(toy_hw, LLAMA7, 1, 1, ONE, 1, prompt, 30, lengths, "continuous", 8)
    assert alone.decode_steps == pytest.approx(8 * 19)  # one slot: no drain beyond its own sequence
    # One-token responses are their prefills' alone: no decode step, however they are batched.
    one_token = ResponseLengths(max_len=1, mean=1.0)
    assert costs.wave_phases(toy_hw, LLAMA7, 1, 1, ONE, 2, prompt, 1, one_token, "continuous", 8).decode_steps == 0
    assert costs.wave_phases(toy_hw, LLAMA7, 1, 1, ONE, 2, prompt, 1, one_token, "static").decode_steps == 0


def test_continuous_batching_beats_static_waves_when_lengths_vary(toy_hw):
    lengths = ResponseLengths(max_len=512, mean=128.0, points=((64, 0.75), (320, 0.25)))
    kv = 2 * 2 * 32 * 128 * 32 * (64 + 512) * 16  # room for 16 sequences of llama2-7b at their longest
    static = costs.generation_time(toy_hw, LLAMA7, GenConfig(), ONE, 64, 64, 512, kv, lengths=lengths)
    continuous = costs.generation_time(toy_hw, LLAMA7, GenConfig(batching="continuous"), ONE, 64, 64, 512, kv,
                                       lengths=lengths)
    assert static.max_batch == continuous.max_batch == 16
    assert continuous.seconds < static.seconds
    fixed = costs.generation_time(toy_hw, LLAMA7, GenConfig(), ONE, 64, 64, 512, kv)
    assert static.seconds < fixed.seconds  # shorter responses end waves sooner


def test_a_paged_cache_holds_more_sequences_than_a_reserved_one_and_is_never_slower(toy_hw):
    """The same room: reserved, 16 sequences at their longest (576 tokens); paged, slots of 64 + held_by_slot +
    7.5 tokens each (memory.KvSequence.slots), as generation_time then runs them."""
    lengths = ResponseLengths(max_len=512, mean=128.0, points=((64, 0.75), (320, 0.25)))
    per_token = 2 * 2 * 32 * 128 * 32  # llama2-7b
    room = per_token * (64 + 512) * 16
    reserved = costs.generation_time(toy_hw, LLAMA7, GenConfig(batching="continuous"), ONE, 64, 64, 512, room,
                                     lengths=lengths)
    paged_gen = GenConfig(batching="continuous", kv_cache="paged")
    paged = costs.generation_time(toy_hw, LLAMA7, paged_gen, ONE, 64, 64, 512, room, lengths=lengths)
    slot_tokens = 64 + lengths.held_by_slot + 7.5  # 64 + (28672 / 128 - 1) / 2 + 7.5 = 183
    assert slot_tokens == pytest.approx(183)
    assert reserved.max_batch == 16
    assert int(room // (per_token * slot_tokens)) == 50  # 9216 // 183 refilled slots, but all 64 fit at once:
    burst_tokens = max(1.0 * (64 + 64), 0.25 * (64 + 320)) + 7.5  # the 3 in 4 that end at 64 tokens free theirs
    assert 64 * burst_tokens <= 9216
    assert paged.max_batch == 64 and paged.seconds < reserved.seconds
    half = costs.generation_time(toy_hw, LLAMA7, paged_gen, ONE, 64, 64, 512, room / 2, lengths=lengths)
    assert int(room / 2 // (per_token * slot_tokens)) == 25 and half.max_batch <= 25  # room for 25 slots
    # the paged engine runs the fastest batch it has room for: none of 1..25 slots is faster
    assert half.seconds == pytest.approx(min(
        costs.generation_time(toy_hw, LLAMA7, paged_gen.model_copy(update={"max_batch": b}), ONE, 64, 64, 512,
                              room / 2, lengths=lengths).seconds for b in range(1, 26)))


@pytest.mark.parametrize("lengths", [ResponseLengths(max_len=512, mean=128.0, points=((64, 0.75), (320, 0.25))),
                                     ResponseLengths.fixed(512), ResponseLengths(max_len=512, mean=400.0)],
                         ids=["bimodal", "fixed", "mean"])
@pytest.mark.parametrize("most", [1, 5, 24])
def test_batching_never_slower_is_generation_time_compared_at_every_room(toy_hw, lengths, most):
    """The search keeps one engine per layout where it is never slower: checked here against generation_time at
    the KV room of every batch size from 1 to `most`."""
    per_seq = 2 * 2 * 32 * 128 * 32 * (64 + 512)  # llama2-7b's KV cache of one sequence at its longest
    rooms = [per_seq * k for k in range(1, most + 1)]

    def seconds(batching: str, room: float) -> float:
        return costs.generation_time(toy_hw, LLAMA7, GenConfig(batching=batching), ONE, 24, 64, 512, room,
                                     lengths=lengths).seconds

    for first, second in (("continuous", "static"), ("static", "continuous")):
        expected = all(seconds(first, r) <= seconds(second, r) for r in rooms)
        assert costs.batching_never_slower(toy_hw, LLAMA7, 1, 1, ONE, 24, most, 64, 512, lengths, first,
                                           second) == expected


def test_a_plans_engine_cap_limits_the_batch_and_the_waves(toy_hw):
    """GenConfig.max_batch caps what the KV room allows: 10 sequences with room for 16 run at once; capped at 4
    they run in ceil(10 / 4) = 3 static waves (4, 3, 3 sequences), the largest of 4."""
    kv = 2 * 2 * 32 * 128 * 32 * (64 + 64) * 16  # room for 16 sequences of llama2-7b at their longest
    free = costs.generation_time(toy_hw, LLAMA7, GenConfig(), ONE, 10, 64, 64, kv)
    capped = costs.generation_time(toy_hw, LLAMA7, GenConfig(max_batch=4), ONE, 10, 64, 64, kv)
    assert free.max_batch == 10 and free.waves == 1
    assert capped.max_batch == 4 and capped.waves == 3
    assert capped.seconds > free.seconds


def test_a_role_call_pays_its_cost_on_the_worker_and_a_result_for_the_controller_the_rest_of_a_round_trip(toy_hw):
    """call_dispatch_us is what a queued call costs its worker; the rest of controller_call_us (a round trip) is
    paid where the controller waits for a result; a profile without the field pays the round trip per call."""
    queued = Runtime(controller_call_us=1000, call_dispatch_us=300, controller_step_us=200)
    cfg = InferConfig(micro_batch=2)
    plain = costs.inference_time(toy_hw, LLAMA7, cfg, ONE, 8, 256, "lm")
    paid = costs.inference_time(toy_hw.model_copy(update={"runtime": queued}), LLAMA7, cfg, ONE, 8, 256, "lm")
    assert paid - plain == pytest.approx(300e-6)
    assert queued.result_wait_s() == pytest.approx(700e-6) and queued.controller_step_s() == pytest.approx(200e-6)
    assert queued.send_wait_s() == 0.0  # no sending side measured: a fed call pays its dispatch alone
    older = Runtime(controller_call_us=1000)
    assert older.call_dispatch_s() == pytest.approx(1000e-6) and older.result_wait_s() == 0.0


def test_the_round_trip_splits_into_a_result_s_way_in_and_a_call_s_way_out_of_the_controller():
    """With its sending side measured, the round trip is a result's wait on its way in (round trip less the
    sending side) and, on the way out, the sending side less the dispatch the call pays itself."""
    split = Runtime(controller_call_us=2300, call_dispatch_us=800, controller_send_us=1500)
    assert split.result_wait_s() == pytest.approx(800e-6)
    assert split.send_wait_s() == pytest.approx(700e-6)
    assert split.result_wait_s() + split.send_wait_s() + split.call_dispatch_s() == pytest.approx(2300e-6)


def test_the_controller_s_steps_and_the_results_it_waits_for_are_priced_in_search_and_simulation(tmp_path):
    """The demo on one CPU "GPU", on the cpu profile with the controller's costs set: the search's fast schedule
    agrees with the simpy engine (search raises if not), advantages take the controller's step, and a field
    reaching the controller takes the host link's transfer plus the round trip less its sending side, a field leaving
    it the sending side less the dispatch the call pays itself."""
    from hfplan.layout import ON_CONTROLLER
    from hfplan.planner.search import search
    from hfplan.profiles.hardware import load_hardware
    from hfplan.simulator import collectives
    from hfplan.simulator.engine import simulate_plan
    from hfplan.spec import load_workload, make_cluster

    base = load_hardware("cpu")
    runtime = base.runtime.model_copy(update={"controller_call_us": 2000.0, "call_dispatch_us": 500.0,
                                              "task_dispatch_us": 500.0, "controller_step_us": 400.0,
                                              "controller_send_us": 1200.0})
    path = tmp_path / "slow-controller.yaml"
    path.write_text(base.model_copy(update={"name": "slow-controller", "runtime": runtime}).to_yaml())
    plan = search(load_workload("demo"), make_cluster(1, str(path)), top_k=1).top[0]
    timeline = simulate_plan(plan).timeline
    (gae,) = [s for s in timeline.spans if s.op == "gae" and s.kind == "compute"]
    assert gae.end - gae.start == pytest.approx(400e-6)
    into = [s for s in timeline.spans
            if s.kind == "transfer" and s.set == ON_CONTROLLER and s.op.endswith("->controller.gae")]
    assert into and all(s.end - s.start > 800e-6 for s in into)
    assert all(s.end - s.start < 800e-6 + collectives.host_transfer(base, 1e6) for s in into)
    # A field the controller sends travels with the call: drawn as the call's dispatch, not a transfer.
    out = [s for s in timeline.spans if s.set >= 0 and "controller.gae->" in s.op]
    assert {s.kind for s in out} == {"dispatch"}
    assert out and all(700e-6 < s.end - s.start < 700e-6 + collectives.host_transfer(base, 1e6) for s in out)


def test_a_field_between_two_sets_waits_for_its_owner_the_controller_to_learn_it_exists(toy_hw):
    """Between two sets the consumer's worker fetches the producer's outputs straight from it, but only once the
    controller, which owns the references, knows they exist: the result's way in (the round trip less its sending
    side) plus the point-to-point transfer of its bytes; within a set nothing moves."""
    from hfplan.simulator import collectives
    from hfplan.simulator.mapping import transfer_seconds

    hw = toy_hw.model_copy(update={"runtime": Runtime(controller_call_us=2300, call_dispatch_us=800,
                                                      controller_send_us=1500)})
    nbytes = 4e6
    for same_node in (True, False):
        moved = transfer_seconds(hw, 0, 1, nbytes, same_node)
        assert moved == pytest.approx(800e-6 + collectives.point_to_point(hw, nbytes, same_node))
    assert transfer_seconds(hw, 1, 1, nbytes, True) == 0.0
    bare = toy_hw.model_copy(update={"runtime": Runtime()})  # a profile without Ray's costs (a GPU's)
    assert transfer_seconds(bare, 0, 1, nbytes, True) == pytest.approx(collectives.point_to_point(bare, nbytes, True))


def test_a_step_past_the_wide_batch_pays_the_wide_slope_per_sequence(toy_hw):
    """engine_sequence_step_us up to engine_wide_sequences, engine_wide_sequence_step_us for each one beyond."""
    both = Runtime(engine_step_us=50, engine_sequence_step_us=10, engine_wide_sequences=8,
                   engine_wide_sequence_step_us=4)
    assert both.engine_step_s("static", 8) == pytest.approx((50 + 8 * 10) * 1e-6)
    assert both.engine_step_s("static", 32) == pytest.approx((50 + 8 * 10 + 24 * 4) * 1e-6)
    assert Runtime(engine_step_us=50, engine_sequence_step_us=10).engine_step_s("static", 32) == pytest.approx(
        (50 + 32 * 10) * 1e-6)


def test_a_gemm_with_its_operands_in_the_cache_runs_at_the_cached_fraction_with_no_memory_term(toy_hw):
    """Cached: 2mkn / (peak x its fraction) + overhead, however many bytes (toy: peak 1e14, the matmul rate half of
    it); streamed: the table's fraction of the matmul rate and the roofline."""
    cpu = toy_hw.model_copy(update={"compute": toy_hw.compute.model_copy(update={
        "row_efficiency": ((1, 65536, 0.01), (512, 65536, 1.0)),
        "cached_row_efficiency": ((1, 65536, 0.2), (512, 65536, 1.0)), "cache_bytes": 2**20})})
    rate = cpu.matmul_flops
    assert kernels.gemm_time(cpu, 1, 128, 128, cached=True) == pytest.approx(5e-6 + 2 * 128 * 128 / (0.2 * 1e14))
    streamed = max(2 * 128 * 128 / (0.01 * rate), 2 * (128 + 128 * 128 + 128) / 5e11)
    assert kernels.gemm_time(cpu, 1, 128, 128) == pytest.approx(5e-6 + streamed)
    # Without a cached table every GEMM streams.
    assert kernels.gemm_time(toy_hw, 1, 128, 128, cached=True) == kernels.gemm_time(toy_hw, 1, 128, 128)


def test_a_generation_step_reads_its_operands_from_the_cache_only_where_they_fit(toy_hw, small_arch):
    """small_arch's 107,328 parameters (tests/conftest.py: 2 x 36,992 + 16,640 + 64 + 16,640) are 214,656 bytes of
    bf16 weights; with its KV cache
    (2 layers x 2 x 32 values x 2 bytes = 256 bytes a token) a step fits a 256 KiB cache at 8 sequences of 16
    tokens (32 KiB), not at 64 of 64 (1 MiB); llama2-7b never does."""
    from hfplan.simulator import memory

    cpu = toy_hw.model_copy(update={"compute": toy_hw.compute.model_copy(update={
        "cached_row_efficiency": ((1, 65536, 0.5), (512, 65536, 1.0)), "cache_bytes": 256 * 2**10})})
    layout = Layout()
    assert memory.generation_step_bytes(small_arch, layout, 8, 16) == pytest.approx(214_656 + 8 * 16 * 256)
    assert costs.step_operands_cached(cpu, small_arch, layout, 8, 16)
    assert not costs.step_operands_cached(cpu, small_arch, layout, 64, 64)
    assert not costs.step_operands_cached(cpu, LLAMA7, layout, 1, 16)
    assert not costs.step_operands_cached(toy_hw, small_arch, layout, 8, 16)  # no cache measured
    # The step's GEMMs are the cached ones there, the streamed ones past the cache.
    fits = costs.decode_step_parts(cpu, small_arch, layout, costs.SetShape(1, 1), 8, 16)
    assert fits["gemm"] == pytest.approx(
        small_arch.layers * kernels.layer_forward(cpu, small_arch, 8, 16, 1, True, None, True).gemm
        + kernels.head_forward(cpu, small_arch, 8, 1, "lm", True).gemm)
    spills = costs.decode_step_parts(cpu, small_arch, layout, costs.SetShape(1, 1), 64, 64)
    assert spills["gemm"] == pytest.approx(
        small_arch.layers * kernels.layer_forward(cpu, small_arch, 64, 64, 1, True).gemm
        + kernels.head_forward(cpu, small_arch, 64, 1, "lm").gemm)
