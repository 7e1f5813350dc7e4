"""The switch to generation by the per-tensor resharding plan, on a real 4-process gloo world: every rank
builds exactly its generation shard of a trained tiny Llama (from whole, tensor-parallel, sharded and
pipelined training layouts), and the bytes it receives are the plan's."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from hfplan.executor.engines.reshard import (
    assemble,
    bucket_array,
    bucket_values,
    empty_shards,
    generation_shards,
    local_tensor,
    model_specs,
    switch_plan,
    sync_buckets,
    sync_plan,
)
from hfplan.executor.engines.training import RoleModel
from hfplan.hyperparams import Hyperparameters
from hfplan.layout import (
    GenerationPlace,
    generation_box,
    generation_numel,
    generation_places,
    new_numel,
    rank_coords,
    received_numel,
)
from hfplan.plan import GenConfig, TrainConfig
from tests.support.engine_models import PAD, llama_actor, llama_config, mesh_of
from tests.support.worlds import run_world

HP = Hyperparameters()
CONFIG = llama_config()
# (training layout, generation tp) on 4 ranks: coarser, finer (past the 2 KV heads) and equal generation tp,
# with and without FSDP, and FSDP alone; pipelined (one layer a stage) with FSDP or tensor parallelism.
CASES = [(TrainConfig(tp=2, dp=2, shard="full"), 1), (TrainConfig(tp=2, dp=2, shard="full"), 4),
         (TrainConfig(tp=2, dp=2, shard="full"), 2), (TrainConfig(tp=2, dp=2, shard="replicated"), 1),
         (TrainConfig(tp=1, dp=4, shard="full"), 2), (TrainConfig(pp=2, dp=2, shard="full"), 1),
         (TrainConfig(pp=2, dp=2, shard="full"), 4), (TrainConfig(pp=2, tp=2), 2), (TrainConfig(pp=2, tp=2), 1)]


def whole_weights(trained: RoleModel) -> dict[str, torch.Tensor]:
    """Every parameter whole on every rank, by HF name."""
    if trained.dims.pp > 1:
        return trained.full_weights()
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for n, p in trained.module.named_parameters()}


def _switches(rank: int, world: int) -> list[dict]:
    out = []
    for train, tp_g in CASES:
        gen = GenConfig(tp=tp_g, dp=world // tp_g)
        trained = RoleModel(llama_actor(), mesh_of(train), HP, "cpu", torch.float32, pad_id=PAD, lr=1e-3)
        full = whole_weights(trained)
        specs = model_specs(trained.hf_class, trained.config)
        plan = switch_plan(specs, train, gen, CONFIG.num_hidden_layers, rank, 4, bucket_bytes=4096)
        shards, stats = generation_shards(trained.local_parameters(), plan, torch.float32)
        place = generation_places(train, gen)[rank]
        diff = 0.0
        for spec in specs:
            box = generation_box(gen, spec, place)
            expected = full[spec.name][tuple(slice(s, e) for s, e in box)]
            diff = max(diff, (shards[spec.name] - expected).abs().max().item())
        shard_bytes = sum(t.numel() * 4 for t in shards.values())
        plan_bytes = 4 * received_numel(train, gen, specs, CONFIG.num_hidden_layers)[rank]
        trained_storage = {local_tensor(p).untyped_storage().data_ptr() for p in trained.local_parameters().values()}
        kept_bytes = sum(t.numel() * 4 for t in shards.values() if t.untyped_storage().data_ptr() in trained_storage)
        out.append({"diff": diff, "received": stats.received, "plan": plan_bytes, "peak": stats.peak,
                    "shard_bytes": shard_bytes, "sent": stats.sent, "made": stats.made, "kept": kept_bytes,
                    "plan_made": 4 * new_numel(train, gen, specs, CONFIG.num_hidden_layers, keeps_own=True)[rank],
                    "plan_shard": 4 * generation_numel(gen, specs, CONFIG.num_hidden_layers, place),
                    "model_bytes": 4 * sum(t.numel() for t in full.values()),
                    "tp_g": tp_g})
        if train.pp == 1 and train.tp == 1:
            sharded = trained  # the FSDP-only layout feeds the rollout set below
    # A separate rollout set at tp 2 x dp 2 fed by an FSDP-only and by a pipelined tensor-parallel layout: each
    # rank sends its buckets, the world's all_gather_object standing in for the object store, and assembles the
    # ones addressed to it.
    import torch.distributed as dist

    rollout = GenConfig(tp=2, dp=2)
    syncs = {}
    for train, source in ((TrainConfig(tp=1, dp=4, shard="full"), sharded), (CASES[-1][0], trained)):
        full, specs = whole_weights(source), model_specs(source.hf_class, source.config)
        plan = sync_plan(specs, train, rollout, CONFIG.num_hidden_layers, rank, 4, bucket_bytes=4096)
        sent = sync_buckets(source.local_parameters(), plan, torch.float32)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, sent)
        mine = [bucket for by_dst in everyone for bucket in by_dst.get(rank, [])]
        shards = empty_shards(specs, rollout, torch.float32, torch.device("cpu"))
        assemble(shards, specs, rollout, mine, torch.float32)
        place = GenerationPlace(*rank_coords(rollout, rank))
        syncs[f"pp{train.pp}"] = {
            "sync_diff": max((shards[s.name] - full[s.name][tuple(slice(a, b) for a, b in
                              generation_box(rollout, s, place))]).abs().max().item() for s in specs),
            "sync_bytes": sum(raw.nbytes for _, raw in mine),
            "sync_plan": 4 * generation_numel(rollout, specs, CONFIG.num_hidden_layers, place)}
    out.append(syncs)
    return out


def test_every_rank_builds_its_generation_shard_receiving_the_plans_bytes():
    results = run_world(_switches, 4, timeout=180)
    for syncs in (per_rank[-1] for per_rank in results):
        assert set(syncs) == {"pp1", "pp2"}
        for r in syncs.values():
            assert r["sync_diff"] == 0.0 and r["sync_bytes"] == r["sync_plan"]
    for case, per_rank in zip(CASES, zip(*[res[:-1] for res in results], strict=True), strict=True):
        for r in per_rank:
            assert r["diff"] == 0.0, case
            assert r["received"] == r["plan"], case
            # The switch keeps the training tensors that are already generation shards (fp32 both) and makes the
            # rest (the layout's count); it holds those plus one bucket in flight (sent and received together; the
            # largest slice here is the 16 KiB embedding), never the model.
            assert r["shard_bytes"] == r["plan_shard"], case
            assert r["made"] == r["plan_made"] == r["shard_bytes"] - r["kept"], case
            assert r["made"] <= r["peak"] <= r["made"] + max(4096, 4 * 260 * 64), case
            assert r["peak"] < r["model_bytes"] or r["tp_g"] == 1, case
        assert any(r["received"] > 0 for r in per_rank) or case[0].shard == "replicated", case
    # What is kept, by hand: unsharded tensors whose generation slice is the trained one (the pipelined tp 2 model's
    # own stage at tp 2; the norms, replicated over tp, of unsharded layouts going to tp 1), and FSDP chunks that are
    # the finer tp split (tp 2 x FSDP 2 to tp 4: the column-split tensors; pp 2 x FSDP 2 to tp 4: k and v, whose 2 KV
    # heads make a tp-4 rank's slice the half an FSDP chunk is). Nothing of FSDP-chunked norms.
    kept = [any(r["kept"] > 0 for r in per_rank) for per_rank in zip(*[res[:-1] for res in results], strict=True)]
    assert kept == [False, True, False, True, False, False, True, True, True]


def _generations(rank: int, world: int) -> list[dict]:
    from transformers import LlamaForCausalLM

    from hfplan.executor.engines.hybrid import HybridEngine
    from hfplan.executor.mesh import TP
    from hfplan.executor.rollout.base import SamplingParams
    from hfplan.executor.rollout.torch_engine import TorchRolloutEngine
    from hfplan.executor.runtime import _place_tp_group

    prompts = torch.randint(1, CONFIG.vocab_size, (3, 5), generator=torch.Generator().manual_seed(7))
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1.0, greedy=True)
    out = []
    # (training layout, generation tps): the reference generates in the training layout where generation can
    # (pp = 1), else over the whole model on each rank.
    for train, tps in ((TrainConfig(tp=2, dp=2, shard="full"), (1, 4)), (TrainConfig(pp=2, dp=2, shard="full"), (1, 2)),
                       (TrainConfig(pp=2, tp=2), (2, 4))):
        trained = RoleModel(llama_actor(), mesh_of(train), HP, "cpu", torch.float32, pad_id=PAD, lr=1e-3)
        if train.pp == 1:
            reference = TorchRolloutEngine(None, PAD, 1, trained.mesh[TP].get_group())
            hybrid = HybridEngine(trained)
            reference.load_weights(hybrid.enter_generation())
            want = reference.generate(prompts, params).responses
            reference.release_weights()
            hybrid.exit_generation()
        else:
            whole = LlamaForCausalLM(CONFIG).float().eval()
            whole.load_state_dict(whole_weights(trained))
            want = TorchRolloutEngine(whole, PAD, 1, None).generate(prompts, params).responses
        specs = model_specs(trained.hf_class, trained.config)
        for tp_g in tps:
            gen = GenConfig(tp=tp_g, dp=world // tp_g)
            group, tp_ranks = _place_tp_group(train, gen)
            engine = TorchRolloutEngine(None, PAD, 1, group, tp_ranks=tp_ranks)
            switch = HybridEngine(trained, (train, gen))
            engine.load_weights(switch.enter_generation(), presharded=True)
            got = engine.generate(prompts, params).responses
            engine.release_weights()
            switch.exit_generation()
            plan = 4 * received_numel(train, gen, specs, CONFIG.num_hidden_layers)[rank]
            out.append({"case": (train.pp, train.tp, tp_g), "same": torch.equal(got, want),
                        "received": switch.last_switch.received, "plan": plan,
                        "freed": all(p.is_meta for p in switch._generation.parameters())})
    return out


def test_generation_after_the_plan_driven_switch_equals_generation_in_the_training_layout():
    """Greedy fp32 generation with tp_g < tp, tp_g > tp and from pipelined training layouts."""
    results = run_world(_generations, 4, timeout=180)
    for per_rank in results:
        for r in per_rank:
            assert r["same"] and r["freed"] and r["received"] == r["plan"], r["case"]
    assert all(r["received"] > 0 for per_rank in results for r in per_rank)  # FSDP: every switch moves slices


def test_a_bucket_travels_as_its_bytes_and_reads_back_exactly_without_a_copy():
    """The sync's buckets cross Ray as arrays of their bytes (any dtype, bfloat16 too, which numpy lacks), read
    back over the same memory: here as Ray hands them to the receiver, read-only."""
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.randn(1000).to(dtype)
        raw = bucket_array(flat)
        assert raw.nbytes == flat.numel() * flat.element_size()
        raw.flags.writeable = False
        values = bucket_values(raw, dtype)
        assert values.dtype == dtype and torch.equal(values, flat)
        assert values.data_ptr() == raw.ctypes.data
