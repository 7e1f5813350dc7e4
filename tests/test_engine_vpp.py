"""Interleaved pipeline stages (pp 2 x 2 virtual stages: 4 model stages, rank r holding stages r and r + 2) on
real gloo worlds against a single-stage RoleModel in the test process, and the layout rule that admits them."""

from pathlib import Path

import pytest
import torch
from test_engine_training import HP, LR, actor_batch, full_params
from transformers import LlamaForCausalLM, LlamaForTokenClassification

from hfplan.executor import checkpoint
from hfplan.executor.engines import forward
from hfplan.executor.engines.hybrid import HybridEngine
from hfplan.executor.engines.pipeline import interleaved_takes, schedule_class
from hfplan.executor.engines.pipeline_split import rank_stages, stage_of
from hfplan.executor.engines.training import RoleModel
from hfplan.layout import unsupported_layout
from hfplan.plan import GenConfig, TrainConfig
from hfplan.profiles.models import resolve_model
from tests.support.engine_models import PAD, dp_mesh, llama_config, mesh_of, one_rank_world, random_sequences
from tests.support.worlds import run_world

LAYERS = 4
V = 2


def actor(seed: int = 0, tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(num_hidden_layers=LAYERS, tie_word_embeddings=tied)).float()


def critic(seed: int = 0) -> LlamaForTokenClassification:
    torch.manual_seed(seed)
    return LlamaForTokenClassification(llama_config(num_hidden_layers=LAYERS, num_labels=1)).float()


def test_rank_r_holds_every_pp_th_stage_with_the_ends_first_and_last():
    assert rank_stages(0, 2, 2) == [0, 2] and rank_stages(1, 2, 2) == [1, 3]
    assert rank_stages(1, 4, 3) == [1, 5, 9]
    assert stage_of("model.layers.2.mlp.up_proj.weight", LAYERS, 4) == 2  # on rank 0, after stage 1 of rank 1
    assert stage_of("model.embed_tokens.weight", LAYERS, 4) == 0
    assert stage_of("lm_head.weight", LAYERS, 4) == 3


def test_interleaved_schedule_where_torch_runs_it_and_breadth_first_elsewhere():
    # torch's rounds: max(1, m // pp) of them must split m equally.
    assert [m for m in range(1, 13) if interleaved_takes(m, 2)] == [1, 2, 3, 4, 6, 8, 10, 12]
    assert [m for m in range(1, 13) if interleaved_takes(m, 4)] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12]
    assert schedule_class(True, 4, 2, 2).__name__ == "ScheduleInterleaved1F1B"
    assert schedule_class(True, 5, 2, 2).__name__ == "ScheduleLoopedBFS"
    assert schedule_class(False, 4, 2, 2).__name__ == "ScheduleLoopedBFS"
    assert schedule_class(True, 4, 2, 1).__name__ == "Schedule1F1B"
    assert schedule_class(True, 1, 2, 1).__name__ == "ScheduleGPipe"


def test_the_layout_rule_cuts_layers_into_pp_times_virtual_stages():
    arch = resolve_model("llama2-7b")  # 32 layers
    assert unsupported_layout(arch, "train", TrainConfig(pp=4, virtual_stages=8)) is None
    problem = unsupported_layout(arch, "train", TrainConfig(pp=4, virtual_stages=3))
    assert problem == "pp=4 x virtual_stages=3 = 12 stages do not divide the 32 layers of llama2-7b equally"
    assert "pp=1" in unsupported_layout(arch, "train", TrainConfig(pp=1, virtual_stages=2))
    assert "does not divide the 32 layers" in unsupported_layout(arch, "train", TrainConfig(pp=3, virtual_stages=2))


# (kind, sequences, micro_batch, mini_batches): 8 sequences in 2 mini-batches of 4 micro-batches of 1
# (interleaved, two rounds), of 1 micro-batch of 4 (interleaved, fewer micro-batches than ranks; the tied
# embedding and head on ranks 0 and 1); 10 in one mini-batch of 5 micro-batches of 2 (breadth-first: torch's
# interleaved schedule refuses 5 on 2 ranks).
Case = tuple[str, int, int, int]
CASES: list[Case] = [("actor", 8, 1, 2), ("tied", 8, 4, 2), ("critic", 10, 2, 1)]
BUILDERS = {"actor": actor, "critic": critic, "tied": lambda seed=0: actor(seed, tied=True)}


def _data(kind: str, size: int) -> dict:
    data = actor_batch(size)
    if kind == "critic":
        gen = torch.Generator().manual_seed(6)
        mask = data["response_mask"]
        data["values"] = torch.where(mask.bool(), 0.3 * torch.randn(mask.shape, generator=gen), 0.0)
        data["returns"] = torch.where(mask.bool(), torch.randn(mask.shape, generator=gen), 0.0)
    return data


def _call(model, kind: str, data: dict, micro_batch: int, mini_batches: int) -> dict:
    sequence = (data["prompts"], data["responses"], data["response_mask"])
    common = dict(mini_batches=mini_batches, epochs=1, micro_batch=micro_batch)
    if kind == "critic":
        before = model.values(*sequence, micro_batch=micro_batch)
        metrics = model.update_critic(data, "values", "returns", **common)
    else:
        before = model.log_probs(*sequence, micro_batch=micro_batch)
        metrics = model.update_actor(data, use_kl_loss=True, **common)
    return {"before": before, "metrics": metrics}


def _interleaved(rank: int, world: int, cases: list[Case]) -> list[dict]:
    out = []
    for kind, size, micro_batch, mini_batches in cases:
        model = RoleModel(BUILDERS[kind](), mesh_of(TrainConfig(pp=2)), HP, "cpu", torch.float32,
                          pad_id=PAD, lr=LR, virtual_stages=V)
        result = _call(model, kind, _data(kind, size), micro_batch, mini_batches)
        out.append(result | {"params": model.full_weights(), "stages": len(model.module.stages)})
    return out


def _references(rank: int, world: int, cases: list[Case]) -> list[dict]:
    out = []
    for kind, size, micro_batch, mini_batches in cases:
        mesh = dp_mesh(1, True)
        model = RoleModel(BUILDERS[kind](), mesh, HP, "cpu", torch.float32, pad_id=PAD, lr=LR)
        out.append(_call(model, kind, _data(kind, size), micro_batch, mini_batches)
                   | {"params": full_params(model.module)})
    return out


@pytest.mark.slow
def test_pp2_v2_steps_and_forwards_match_single_process():
    with one_rank_world():
        references = _references(0, 1, CASES)
    results = run_world(_interleaved, 2, CASES, timeout=180)
    for index, (kind, *_) in enumerate(CASES):
        ref = references[index]
        metric = "value_loss" if kind == "critic" else "policy_loss"
        for got in (rank[index] for rank in results):
            assert got["stages"] == V
            torch.testing.assert_close(got["before"], ref["before"], atol=1e-6, rtol=0)
            assert got["metrics"][metric] == pytest.approx(ref["metrics"][metric], abs=1e-5)
            assert got["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
            assert got["metrics"] == results[0][index]["metrics"]  # every rank returns the last stage's
            assert set(got["params"]) == set(ref["params"]) | ({"lm_head.weight"} if kind == "tied" else set())
            for name, value in ref["params"].items():
                torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=0, msg=name)
        initial = full_params(BUILDERS[kind]())
        assert max((ref["params"][n] - initial[n]).abs().max().item() for n in initial) > 100 * 1e-5
        assert ref["metrics"]["grad_norm"] > HP.max_grad_norm  # clipping is active


def _sequences():
    return random_sequences(6, 5, 6, seed=7)


def _inference_generation_checkpoint(rank: int, world: int, folder: str) -> dict:
    """A trained tied actor with virtual stages: its log-probs, its generation module (the resharding plan's
    shards at generation tp 1: the whole model, from both ranks' interleaved stages), and its checkpoint loaded
    into fresh pipelines of another seed, with virtual stages and without."""
    layout = TrainConfig(pp=2)
    build = dict(pad_id=PAD, lr=LR, virtual_stages=V)
    trained = RoleModel(actor(tied=True), mesh_of(layout), HP, "cpu", torch.float32, **build)
    out = {"log_probs": trained.log_probs(*_sequences(), micro_batch=2)}  # 3 micro-batches, breadth-first
    trained.update_actor(actor_batch(), mini_batches=1, epochs=1, micro_batch=2, use_kl_loss=False)
    hybrid = HybridEngine(trained, (TrainConfig(pp=2, virtual_stages=V), GenConfig(tp=1, dp=2)))
    generation = hybrid.enter_generation()
    out["generation"] = {n: p.detach().clone() for n, p in generation.named_parameters(remove_duplicate=False)}
    hybrid.exit_generation()
    out["trained_log_probs"] = trained.log_probs(*_sequences(), micro_batch=3)
    checkpoint.save_trained(trained, Path(folder))
    fresh = RoleModel(actor(seed=1, tied=True), mesh_of(layout), HP, "cpu", torch.float32, **build)
    checkpoint.load_trained(fresh, Path(folder))
    out["loaded"] = fresh.full_weights()
    plain_stages = RoleModel(actor(seed=1, tied=True), mesh_of(layout), HP, "cpu", torch.float32,
                             pad_id=PAD, lr=LR)  # one stage per rank: DCP reshards by the whole model's names
    checkpoint.load_trained(plain_stages, Path(folder))
    out["loaded_one_stage_each"] = plain_stages.full_weights()
    out["moments"] = all(bool(s["exp_avg"].abs().sum() > 0) for s in fresh.optimizer.state.values())
    return out


@pytest.mark.slow
def test_pp2_v2_inference_generation_weights_and_checkpoint_match_the_whole_model(tmp_path):
    folder = tmp_path / "actor"
    results = run_world(_inference_generation_checkpoint, 2, str(folder), timeout=120)
    plain = actor(seed=1, tied=True)
    checkpoint.load_model_weights(folder, plain)  # the pipeline's checkpoint in one plain model
    sequence = _sequences()
    with torch.no_grad():
        log_probs = forward.token_log_probs(actor(tied=True).eval(), *sequence, PAD, HP.temperature, micro_batch=6)
        trained_log_probs = forward.token_log_probs(plain.eval(), *sequence, PAD, HP.temperature, micro_batch=6)
    initial = actor(tied=True)
    assert any(not torch.equal(p, initial.get_parameter(n)) for n, p in plain.named_parameters())  # it trained
    for got in results:
        torch.testing.assert_close(got["log_probs"], log_probs, atol=1e-6, rtol=0)
        torch.testing.assert_close(got["trained_log_probs"], trained_log_probs, atol=1e-6, rtol=0)
        assert got["moments"]
        for name, param in plain.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(got["generation"][name], param, atol=0, rtol=0, msg=name)
            torch.testing.assert_close(got["loaded"][name], param, atol=0, rtol=0, msg=name)
            torch.testing.assert_close(got["loaded_one_stage_each"][name], param, atol=0, rtol=0, msg=name)

