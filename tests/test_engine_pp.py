"""Pipeline-parallel roles on real gloo worlds (pp 2, pp 2 x dp 2, pp 2 x tp 2) against a single-stage
RoleModel in the test process."""

from pathlib import Path

import pytest
import torch
from test_engine_training import HP, LR, actor_batch, critic_batch, full_params
from torch.distributed.tensor import DTensor
from transformers import LlamaForCausalLM

from hfplan.executor import checkpoint
from hfplan.executor.engines import forward
from hfplan.executor.engines.hybrid import HybridEngine
from hfplan.executor.engines.pipeline_split import own_children, stage_layers, stage_of
from hfplan.executor.engines.training import RoleModel
from hfplan.executor.rollout.base import SamplingParams
from hfplan.executor.rollout.torch_engine import TorchRolloutEngine
from hfplan.layout import micro_batch_sizes, rank_coords
from hfplan.plan import GenConfig, InferConfig, Layout, TrainConfig
from tests.support.engine_models import (
    PAD,
    dp_mesh,
    llama_actor,
    llama_config,
    llama_critic,
    mesh_of,
    one_rank_world,
    random_sequences,
)
from tests.support.worlds import run_world


def test_stage_rule_puts_the_ends_on_the_first_and_last_stage():
    assert list(stage_layers(4, 2, 1)) == [2, 3]
    assert stage_of("model.embed_tokens.weight", 4, 2) == 0
    assert stage_of("model.layers.1.mlp.up_proj.weight", 4, 2) == 0
    assert stage_of("model.layers.2.mlp.up_proj.weight", 4, 2) == 1
    assert stage_of("model.norm.weight", 4, 2) == stage_of("lm_head.weight", 4, 2) == 1
    assert stage_of("score.weight", 4, 2) == 1
    with pytest.raises(ValueError, match="equally"):
        stage_layers(3, 2, 0)


def test_micro_batches_are_equal_and_never_exceed_the_plan_micro_batch():
    assert micro_batch_sizes(8, 2) == (2, 2, 2, 2)
    assert micro_batch_sizes(6, 4) == (3, 3)  # not 4 + 2
    assert micro_batch_sizes(5, 2) == (1,) * 5
    assert micro_batch_sizes(4, 8) == (4,)
    assert micro_batch_sizes(0, 2) == ()
    with pytest.raises(ValueError, match="at least 1"):
        micro_batch_sizes(4, 0)


def tied_actor(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(tie_word_embeddings=True)).float()


BUILDERS = {"actor": llama_actor, "critic": llama_critic, "tied": tied_actor}
GREEDY = SamplingParams(max_new_tokens=6, greedy=True)
# One training call: (model, shard, micro_batch, mini_batches, epochs, recompute). With 8 sequences,
# micro_batch 1 gives 1F1B (micro-batches >= stages), micro_batch 4 on pp 2 and 2 on pp 2 x dp 2 one
# micro-batch a mini-batch (GPipe).
Case = tuple[str, bool, int, int, int, str]
PP2: list[Case] = [("actor", True, 1, 2, 1, "none"), ("actor", True, 4, 2, 1, "full"),
                   ("critic", True, 1, 1, 2, "selective"), ("tied", True, 1, 2, 1, "none")]
PP2_DP2: list[Case] = [("actor", True, 1, 2, 1, "selective"), ("actor", False, 2, 2, 1, "none"),
                       ("critic", True, 1, 1, 2, "full")]
# pp 2 x tp 2 (dp 1): 1F1B, and GPipe with the tied embedding and head split over the tensor-parallel ranks.
PP2_TP2: list[Case] = [("actor", True, 1, 2, 1, "none"), ("critic", True, 2, 1, 2, "full"),
                       ("tied", True, 4, 2, 1, "selective")]


def _data(kind: str) -> dict:
    return critic_batch() if kind == "critic" else actor_batch()


def _replica(rank: int, layout: Layout) -> int:
    return rank_coords(layout, rank)[1]


def _forward(model, data: dict, kind: str, micro_batch: int) -> torch.Tensor:
    sequence = (data["prompts"], data["responses"], data["response_mask"])
    if kind == "critic":
        return model.values(*sequence, micro_batch=micro_batch)
    return model.log_probs(*sequence, micro_batch=micro_batch)


def _update(model, data: dict, kind: str, micro_batch: int, mini_batches: int, epochs: int) -> dict:
    common = dict(mini_batches=mini_batches, epochs=epochs, micro_batch=micro_batch)
    if kind == "critic":
        return model.update_critic(data, "values", "returns", **common)
    return model.update_actor(data, use_kl_loss=True, **common)


def _pipelined(rank: int, world: int, cases: list[Case], tp: int = 1) -> list[dict]:
    out = []
    for kind, shard, micro_batch, mini_batches, epochs, recompute in cases:
        layout = TrainConfig(pp=2, tp=tp, dp=world // (2 * tp), shard=shard)
        model = RoleModel(BUILDERS[kind](), mesh_of(layout), HP, "cpu", torch.float32,
                          pad_id=PAD, lr=LR, recompute=recompute)
        local = {k: v.chunk(layout.dp)[_replica(rank, layout)] for k, v in _data(kind).items()}
        before = _forward(model, local, kind, micro_batch)
        metrics = _update(model, local, kind, micro_batch, mini_batches, epochs)
        weight = model.module.layers[0].mlp.up_proj.weight  # the proof that tensor parallelism is applied
        local_weight = weight.to_local() if isinstance(weight, DTensor) else weight  # plain: one rank, no FSDP
        out.append({"before": before, "metrics": metrics, "params": model.full_weights(),
                    "up_local_rows": local_weight.shape[0]})
    return out


def _in_global_order(data: dict, dp: int, mini_batches: int) -> dict:
    """The batch as one rank must see it for its mini-batch k to be the k-th part of every replica's share."""
    shares = [{k: v.chunk(dp)[d] for k, v in data.items()} for d in range(dp)]
    return {k: torch.cat([s[k].chunk(mini_batches)[i] for i in range(mini_batches) for s in shares]) for k in data}


def _smallest_gradients(model: RoleModel) -> dict[str, torch.Tensor]:
    """Per element, the smallest non-zero |clipped gradient| over the optimizer steps the model takes from now."""
    smallest = {n: torch.full(p.shape, float("inf")) for n, p in model.module.named_parameters()}

    def record(optimizer, args, kwargs) -> None:
        for name, param in model.module.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            smallest[name] = torch.minimum(smallest[name], grad.abs().masked_fill(grad == 0, float("inf")))

    model.optimizer.register_step_pre_hook(record)
    return smallest


def _references(rank: int, world: int, runs: list[tuple[int, Case]]) -> list[dict]:
    """A single-stage RoleModel in the test process: the forward over the whole batch, the update over it in
    the order whose mini-batches are those of the pipelined run with `dp` replicas. `sensitive`: the elements
    whose gradient came within 10 x Adam's eps (1e-8) of zero at some step (test_engine_tp's note: there a
    reduction-order difference of 1e-10, as tensor parallelism's partial sums make, moves the update by ~1e-5)."""
    out = []
    for dp, (kind, _, micro_batch, mini_batches, epochs, _) in runs:
        mesh = dp_mesh(1, True)
        model = RoleModel(BUILDERS[kind](), mesh, HP, "cpu", torch.float32, pad_id=PAD, lr=LR)
        data = _data(kind)
        before = _forward(model, data, kind, micro_batch)
        smallest = _smallest_gradients(model)
        metrics = _update(model, _in_global_order(data, dp, mini_batches), kind, micro_batch, mini_batches, epochs)
        out.append({"before": before, "metrics": metrics, "params": full_params(model.module),
                    "sensitive": {n: s < 10 * 1e-8 for n, s in smallest.items()},
                    "steps": mini_batches * epochs})
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    runs = [(1, case) for case in PP2 + PP2_TP2] + [(2, case) for case in PP2_DP2]
    with one_rank_world():
        results = _references(0, 1, runs)
    return dict(zip(runs, results, strict=True))


def _check(results: list[dict], ref: dict, dp: int, case: Case, tp: int = 1) -> None:
    kind, shard = case[:2]
    metric = "value_loss" if kind == "critic" else "policy_loss"
    ref_before = ref["before"].chunk(dp)
    layout = Layout(pp=2, dp=dp, tp=tp)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["before"], ref_before[_replica(rank, layout)], atol=1e-6, rtol=0)
        assert set(got["metrics"]) == set(ref["metrics"])
        assert got["metrics"][metric] == pytest.approx(ref["metrics"][metric], abs=1e-5)
        assert got["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
        assert got["metrics"] == results[0]["metrics"]  # every stage returns the last stage's metrics
        assert got["up_local_rows"] == 128 // (tp * (dp if shard else 1))  # the MLP's columns: tp, then FSDP
        for name, value in ref["params"].items():
            error = (got["params"][name] - value).abs()
            if tp > 1:  # the sensitive elements held to the bound of Adam's steps (lr each), the rest to 1e-5
                assert error.max().item() <= LR * ref["steps"], name
                error = error[~ref["sensitive"][name]]
            assert error.max().item() <= 1e-5, name
    sensitive = sum(int(s.sum()) for s in ref["sensitive"].values())
    assert sensitive < 0.01 * sum(s.numel() for s in ref["sensitive"].values())  # few are exempt
    initial = full_params(BUILDERS[kind]())
    moved = max((ref["params"][n] - initial[n]).abs().max().item() for n in initial)
    assert moved > 100 * 1e-5  # the step is large against the tolerance
    assert ref["metrics"]["grad_norm"] > HP.max_grad_norm  # clipping is active


@pytest.mark.slow
def test_pp2_steps_and_forwards_match_single_process(references):
    results = run_world(_pipelined, 2, PP2, timeout=180)
    for index, case in enumerate(PP2):
        _check([rank[index] for rank in results], references[(1, case)], 1, case)


@pytest.mark.slow
def test_pp2_dp2_steps_and_forwards_match_single_process(references):
    results = run_world(_pipelined, 4, PP2_DP2, timeout=180)
    for index, case in enumerate(PP2_DP2):
        _check([rank[index] for rank in results], references[(2, case)], 2, case)


@pytest.mark.slow
def test_pp2_tp2_steps_and_forwards_match_single_process(references):
    """Ranks (stage, tp rank): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1); stage 0's tp rank t sends to
    stage 1's tp rank t."""
    results = run_world(_pipelined, 4, PP2_TP2, 2, timeout=180)
    for index, case in enumerate(PP2_TP2):
        _check([rank[index] for rank in results], references[(1, case)], 1, case, tp=2)


def _sequences():
    return random_sequences(6, 5, 6, seed=7)


def _inference_and_generation(rank: int, world: int, tp: int) -> dict:
    """Inference-only stages (unsharded copies, split over tp), then a trained tied actor's generation module
    (its generation shards by the resharding plan) and greedy generation from it in a one-stage layout with the
    same tp."""
    mesh = mesh_of(InferConfig(pp=2, tp=tp))
    sequence = _sequences()
    actor = RoleModel(llama_actor(), mesh, HP, "cpu", torch.float32, pad_id=PAD)
    critic = RoleModel(llama_critic(), mesh, HP, "cpu", torch.float32, pad_id=PAD)
    out = {"log_probs": actor.log_probs(*sequence, micro_batch=4),  # 6 sequences: 2 micro-batches of 3
           "values": critic.values(*sequence, micro_batch=2), "scores": critic.scores(*sequence, micro_batch=6),
           "trains": critic.optimizer is not None}
    from hfplan.executor.runtime import _place_tp_group

    train, gen = TrainConfig(pp=2, tp=tp), GenConfig(tp=tp, dp=world // tp)
    trained = RoleModel(tied_actor(), mesh_of(train), HP, "cpu", torch.float32, pad_id=PAD, lr=LR)
    hybrid = HybridEngine(trained, (train, gen))  # a pipelined actor generates from the plan's shards
    generation = hybrid.enter_generation()
    if tp == 1:  # the generation shards are the whole tensors
        out["generation"] = {n: p.detach().clone() for n, p in generation.named_parameters(remove_duplicate=False)}
        out["generation_log_probs"] = forward.token_log_probs(generation, *sequence, PAD, HP.temperature,
                                                              micro_batch=6)
    group, tp_ranks = _place_tp_group(train, gen)
    rollout = TorchRolloutEngine(None, PAD, eos_id=-1, tp_group=group, tp_ranks=tp_ranks)
    rollout.load_weights(generation, presharded=True)
    out["generated"] = rollout.generate(_sequences()[0], GREEDY).responses
    rollout.release_weights()
    hybrid.exit_generation()
    out["released"] = all(p.is_meta for p in generation.parameters())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_inference_stages_and_the_generation_module_match_the_whole_model(tp):
    results = run_world(_inference_and_generation, 2 * tp, tp, timeout=120)
    sequence = _sequences()
    with torch.no_grad():
        log_probs = forward.token_log_probs(llama_actor().eval(), *sequence, PAD, HP.temperature, micro_batch=6)
        values = forward.token_values(llama_critic().eval(), *sequence, PAD, micro_batch=6)
        scores = forward.sequence_scores(llama_critic().eval(), *sequence, PAD, micro_batch=6)
        tied = tied_actor().eval()
        tied_log_probs = forward.token_log_probs(tied, *sequence, PAD, HP.temperature, micro_batch=6)
        generated = TorchRolloutEngine(tied, PAD, eos_id=-1).generate(sequence[0], GREEDY).responses
    for got in results:  # every stage returns the last stage's outputs
        torch.testing.assert_close(got["log_probs"], log_probs, atol=1e-6, rtol=0)
        torch.testing.assert_close(got["values"], values, atol=1e-6, rtol=0)
        torch.testing.assert_close(got["scores"], scores, atol=1e-6, rtol=0)
        assert not got["trains"] and got["released"]
        if tp == 1:
            for name, param in tied.named_parameters(remove_duplicate=False):
                torch.testing.assert_close(got["generation"][name], param, atol=0, rtol=0, msg=name)
            torch.testing.assert_close(got["generation_log_probs"], tied_log_probs, atol=1e-6, rtol=0)
        assert torch.equal(got["generated"], generated)


def _last_stage_fails(rank: int, world: int) -> None:
    model = RoleModel(llama_actor(), mesh_of(TrainConfig(pp=2)), HP, "cpu", torch.float32,
                      pad_id=PAD, lr=LR)
    data = actor_batch()
    if rank == 1:  # only the last stage reads the advantages: a wrong shape fails there, not on stage 0
        data["advantages"] = data["advantages"][:, :2]
    model.update_actor(data, mini_batches=1, epochs=1, micro_batch=4, use_kl_loss=False)


@pytest.mark.slow
def test_a_failing_stage_is_named():
    """Stage 1 fails naming itself; stage 0, left waiting for it, is killed by the harness (in a run, the
    process group's or the controller's call timeout ends the wait)."""
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*pipeline stage 1 of 2 failed in an update"):
        run_world(_last_stage_fails, 2, timeout=60, pg_timeout=5)


def _checkpointed(rank: int, world: int, folder: str) -> dict:
    """A trained stage saved by every rank, then loaded into a fresh pipeline of the other model's seed."""
    layout = TrainConfig(pp=2, tp=world // 2)
    trained = RoleModel(tied_actor(), mesh_of(layout), HP, "cpu", torch.float32, pad_id=PAD, lr=LR)
    trained.update_actor(actor_batch(), mini_batches=1, epochs=1, micro_batch=4, use_kl_loss=False)
    checkpoint.save_trained(trained, Path(folder))
    fresh = RoleModel(tied_actor(seed=1), mesh_of(layout), HP, "cpu", torch.float32, pad_id=PAD,
                      lr=LR)
    checkpoint.load_trained(fresh, Path(folder))
    moments = [m.full_tensor() if isinstance(m, DTensor) else m
               for m in (state["exp_avg"] for state in fresh.optimizer.state.values())]
    return {"saved": trained.full_weights(), "loaded": fresh.full_weights(),
            "moments": len(moments) and all(bool(m.abs().sum() > 0) for m in moments)}


@pytest.mark.slow
def test_a_pipeline_checkpoint_holds_the_whole_models_names(tmp_path):
    """Stages save their parameters by the HF names (stage 1's first layer is model.layers.1, not a second
    layers.0): the checkpoint loads back into the stages and into one plain model, as export does."""
    folder = tmp_path / "actor"
    results = run_world(_checkpointed, 4, str(folder), timeout=120)
    plain = tied_actor(seed=1)
    checkpoint.load_model_weights(folder, plain)
    for got in results:
        assert got["moments"]
        for name, param in plain.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(got["saved"][name], param, atol=0, rtol=0, msg=name)
            torch.testing.assert_close(got["loaded"][name], param, atol=0, rtol=0, msg=name)


def test_a_stage_backbone_owns_its_registries_and_shares_the_modules():
    """pipeline_split.own_children (public copy.deepcopy with a memo, no private registries): replacing the
    copy's children leaves the original's, and the parameters stay the same tensors."""
    model = llama_actor()
    original = model.model
    clone = own_children(original)
    clone.layers = torch.nn.ModuleList([original.layers[1]])
    clone.norm = torch.nn.Identity()
    assert len(original.layers) == 2 and not isinstance(original.norm, torch.nn.Identity)
    assert clone.embed_tokens is original.embed_tokens and clone.config is original.config
    assert clone.layers[0].mlp.up_proj.weight is original.layers[1].mlp.up_proj.weight
    assert dict(clone.named_buffers()).keys() == dict(original.named_buffers()).keys()
