"""The executor allocates and splits what the simulator costs, for a grid of layouts and models.

- KV heads per rank: the shapes the torch rollout engine really cuts (its k / v weights, the heads its KV cache
  is made for) and those of the DTensor tensor-parallel split (training, and inference with copied KV heads)
  equal the heads the simulator's KV-cache and activation bytes count.
- The row split: what the executor's dispatch sends to each data-parallel replica is Batch.chunk's piece.
- Resident memory: the per-rank numel of an FSDP2-trained model's weights, gradients and Adam moments (read off
  a 2-rank world) equals the simulator's resident training bytes at the CPU profile's precision.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hfplan.dataflow.batch import Batch  # noqa: E402
from hfplan.dataflow.ops import ROLE_OPS  # noqa: E402
from hfplan.dataflow.roles import RoleFacts  # noqa: E402
from hfplan.executor import wire  # noqa: E402
from hfplan.executor.roles import Dispatch, Recorder, WorkerGroupRole, WorkerSet  # noqa: E402
from hfplan.executor.rollout.torch_engine import _TensorParallel, _Weights  # noqa: E402
from hfplan.layout import replica_groups, unsupported_layout  # noqa: E402
from hfplan.plan import Layout, TrainConfig  # noqa: E402
from hfplan.profiles.models import ModelArch  # noqa: E402
from hfplan.simulator import memory  # noqa: E402
from tests.support.worlds import run_world  # noqa: E402

HEAD_DIM = 8
FP32 = 4  # the CPU profile's value bytes: the executor trains and generates in fp32 on CPU processes


def arch_of(heads: int, kv_heads: int, layers: int = 1) -> ModelArch:
    return ModelArch(f"h{heads}kv{kv_heads}", layers=layers, hidden=heads * HEAD_DIM, heads=heads, kv_heads=kv_heads,
                     ffn=64, vocab=256)


def model_of(arch: ModelArch, seed: int = 0) -> LlamaForCausalLM:
    """The HF model of `arch`, as hfplan.executor.models builds a catalog model."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=arch.vocab, hidden_size=arch.hidden, intermediate_size=arch.ffn,
                         num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
                         num_key_value_heads=arch.kv_heads, head_dim=arch.dim_per_head,
                         tie_word_embeddings=arch.tied_embeddings, max_position_embeddings=64)
    return LlamaForCausalLM(config).float()


def simulated_kv_heads(arch: ModelArch, tp: int) -> float:
    """KV heads per rank as the simulator's KV cache counts them."""
    return memory.kv_bytes_per_token_per_gpu(arch, Layout(tp=tp), value_bytes=1) / (2 * arch.dim_per_head
                                                                                     * arch.layers)


def simulated_working_kv_heads(arch: ModelArch, tp: int) -> float:
    """KV heads per rank as the simulator's inference working memory counts them (k and v of each token)."""
    others = 2 * arch.hidden + arch.q_dim / tp + 3 * arch.ffn / tp
    return (memory.layer_working_values_per_token(arch, tp) - others) / (2 * arch.dim_per_head)


GRID = [(heads, kv, tp) for heads, kv in [(4, 4), (4, 2), (4, 1), (8, 2), (8, 8)] for tp in (1, 2, 4, 8)
        if unsupported_layout(arch_of(heads, kv), "gen", Layout(tp=tp)) is None]


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), GRID, ids=[f"h{h}-kv{k}-tp{t}" for h, k, t in GRID])
def test_the_rollout_engine_holds_the_kv_heads_the_simulator_caches(heads, kv_heads, tp):
    arch = arch_of(heads, kv_heads)
    model = model_of(arch)
    for rank in range(tp):  # each rank's cut, in this process (the cut needs no collective)
        weights = _Weights.of(model, _TensorParallel(None, size=tp, rank=rank))
        held = {weights.layers[0].k.weight.shape[0] // HEAD_DIM, weights.layers[0].v.weight.shape[0] // HEAD_DIM}
        assert held == {weights.kv_heads}  # the KV cache is made for the heads the weights hold
        assert weights.kv_heads == simulated_kv_heads(arch, tp) == simulated_working_kv_heads(arch, tp)


def _dtensor_kv_heads_and_fsdp_numel(rank: int, world: int) -> dict:
    """In a 2-rank world: the local KV heads of the executor's tensor-parallel split (inference, with copies;
    training, without), and the per-rank numel of a model FSDP2 trains (weights, gradients, Adam moments)."""
    from hfplan.executor.engines.tensor_parallel import apply_tensor_parallel
    from hfplan.executor.engines.training import RoleModel
    from hfplan.executor.mesh import TP, ParallelDims
    from hfplan.hyperparams import Hyperparameters

    out: dict = {"tp": {}, "fsdp": {}}
    tp_mesh = ParallelDims.of(Layout(tp=world)).build("cpu")[TP]
    for kv_heads, copies in [(1, True), (2, True), (4, True), (2, False), (4, False)]:
        model = apply_tensor_parallel(model_of(arch_of(4, kv_heads)), tp_mesh, copy_kv_heads=copies)
        k = model.model.layers[0].self_attn.k_proj.weight
        out["tp"][f"{kv_heads}-{copies}"] = k.to_local().shape[0] // HEAD_DIM
    for shard in ("full", "replicated"):
        arch = arch_of(4, 2, layers=2)
        trained = RoleModel(model_of(arch), ParallelDims.of(TrainConfig(dp=world, shard=shard)).build("cpu"),
                            Hyperparameters(), "cpu", torch.float32, pad_id=0, lr=1e-3)
        tokens = torch.randint(1, arch.vocab, (2, 6), generator=torch.Generator().manual_seed(rank))
        trained.module(input_ids=tokens).logits.float().square().mean().backward()
        trained.optimizer.step()  # Adam's moments exist from the first step
        params = list(trained.module.parameters())
        moments = [t for p in params for name, t in trained.optimizer.state[p].items() if name != "step"]
        out["fsdp"][shard] = {"weights": sum(p.to_local().numel() for p in params),
                              "grads": sum(p.grad.to_local().numel() for p in params),
                              "optimizer": sum(t.to_local().numel() for t in moments),
                              "bytes": sum(t.to_local().numel() * t.element_size()
                                           for t in params + [p.grad for p in params] + moments)}
    return out


@pytest.fixture(scope="module")
def two_rank_world() -> list[dict]:
    return run_world(_dtensor_kv_heads_and_fsdp_numel, 2, timeout=240)


@pytest.mark.slow  # a spawned 2-rank world
@pytest.mark.parametrize(("kv_heads", "copies"), [(1, True), (2, True), (4, True), (2, False), (4, False)])
def test_the_tensor_parallel_split_holds_the_kv_heads_the_simulator_counts(two_rank_world, kv_heads, copies):
    arch = arch_of(4, kv_heads)
    for rank_out in two_rank_world:
        held = rank_out["tp"][f"{kv_heads}-{copies}"]
        assert held == simulated_kv_heads(arch, 2) == simulated_working_kv_heads(arch, 2)
        if not copies:  # a training layout: the simulator's saved activations count the same heads
            saved = memory.activation_values_per_token_layer(arch, 2)
            assert saved == 4 * arch.hidden + 2 * arch.q_dim / 2 + 2 * held * HEAD_DIM + 3 * arch.ffn / 2


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["full", "replicated"])
def test_fsdp_keeps_the_resident_training_state_the_simulator_counts(two_rank_world, shard):
    arch = arch_of(4, 2, layers=2)
    cfg = TrainConfig(dp=2, shard=shard)
    params = arch.params("lm")
    ranks = [rank_out["fsdp"][shard] for rank_out in two_rank_world]
    for state in ("weights", "grads"):
        assert sum(r[state] for r in ranks) == params * len(ranks) / cfg.shards(state)
    assert sum(r["optimizer"] for r in ranks) == 2 * params * len(ranks) / cfg.shards("optimizer")
    simulated = memory.train_resident_bytes(arch, cfg, "lm", value_bytes=FP32)
    for r in ranks:  # FSDP2 pads a dim-0 shard: a rank holds at most a row of each tensor more than its share
        assert r["bytes"] == pytest.approx(simulated, rel=0.02)
    assert sum(r["bytes"] for r in ranks) == pytest.approx(2 * simulated, rel=1e-12)


class _Worker:
    """Stands in for one remote worker: keeps the share of each call dispatched to it (Ray's transport is not
    what this checks; tests/test_execute.py runs the whole path)."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.shares: list[dict] = []
        self.calls = self

    def options(self, num_returns: int) -> _Worker:
        return self

    def remote(self, *packed) -> str | list[str]:
        calls = wire.unpack(*packed)  # (role, op, share, options, call_id, keep_from) per call
        self.shares += [share for _, _, share, _, _, _ in calls]
        refs = [f"{self.name} call {call_id}" for _, _, _, _, call_id, _ in calls]  # stand in for the references
        return refs if len(refs) > 1 else refs[0]


LAYOUTS = [Layout(tp=t, pp=p, dp=d) for t, p, d in itertools.product((1, 2), (1, 2), (1, 2, 3, 4))]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{lay.tp}-pp{lay.pp}-dp{lay.dp}" for lay in LAYOUTS])
@pytest.mark.parametrize("rows", [4, 7, 9])
def test_each_replica_receives_the_rows_of_its_batch_chunk(layout, rows):
    if rows < layout.dp:
        pytest.skip("fewer rows than replicas: the pre-flight refuses it (layout.unsupported_split)")
    workers = [_Worker() for _ in range(layout.tp * layout.pp * layout.dp)]
    role = WorkerGroupRole("reference", RoleFacts(output="ref_log_probs"), WorkerSet(0, ("reference",), workers,
                                                                                   lambda *a: ""),
                           {ROLE_OPS["log_prob"].layout: layout}, Recorder(clock_offsets={}), timeout_s=1.0,
                           dispatch=Dispatch())
    batch = Batch(prompts=np.arange(rows * 3).reshape(rows, 3), responses=np.arange(rows * 2).reshape(rows, 2))
    role.log_prob(batch)
    role.dispatch.send()
    for piece, ranks in zip(batch.chunk(layout.dp), replica_groups(layout), strict=True):
        for rank in ranks:
            (share,) = workers[rank].shares
            assert set(share) == set(piece)
            assert all(np.array_equal(share[name], piece[name]) for name in piece)


def test_a_rank_reads_rows_it_made_itself_where_they_are_and_fetches_the_others():
    """A call's fields made by an earlier call on the same rank come as KeptOutputs of that call (no Ray
    reference to wait for or fetch); rows of another rank or set come as that rank's output reference."""
    from hfplan.executor.roles import KeptOutputs, RowsFrom

    def role_on(set_index: int, name: str, workers: list[_Worker], recorder: Recorder) -> WorkerGroupRole:
        return WorkerGroupRole(name, RoleFacts(output=f"{name}_log_probs"), WorkerSet(set_index, (name,), workers,
                                                                                    lambda *a: ""),
                               {ROLE_OPS["log_prob"].layout: Layout(dp=2)}, recorder, timeout_s=1.0,
                               dispatch=dispatch)

    recorder, dispatch = Recorder(clock_offsets={}), Dispatch()
    recorder.start_iteration()
    here, there = [_Worker("set 0 rank 0"), _Worker("set 0 rank 1")], [_Worker("set 1 rank 0"), _Worker("set 1 rank 1")]
    first = role_on(0, "a", here, recorder).log_prob(Batch(prompts=np.zeros((4, 3)), responses=np.zeros((4, 2))))
    made = first["a_log_probs"]
    role_on(0, "b", here, recorder).log_prob(Batch(prompts=np.zeros((4, 3)), responses=made))
    role_on(1, "c", there, recorder).log_prob(Batch(prompts=np.zeros((4, 3)), responses=made))
    dispatch.send()
    for rank in (0, 1):
        kept = here[rank].shares[1]["responses"]
        assert kept == RowsFrom("a_log_probs", ((KeptOutputs(made.call.call_id), 0, 2),))
        fetched = there[rank].shares[0]["responses"]
        assert fetched == RowsFrom("a_log_probs", ((f"set 0 rank {rank} call {made.call.call_id}", 0, 2),))
    assert recorder.first_call_id == 0 and recorder.next_call_id == 3
