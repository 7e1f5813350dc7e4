"""The cost of one call, for sizing a job by hand (`hfplan cost`): the very cost functions the search runs, on one
layout, with the numbers a person reads: seconds, FLOP/s per GPU, tokens/s, memory per GPU, and the parts.

kinds: `train` (one optimizer step over a batch of sequences), `forward` (forward passes over a batch: log-probs,
values, scores), `generate` (a batch of prompts through the generation engine, on GPUs of its own) and
`collective` (one all-reduce, all-gather, reduce-scatter or point-to-point of a message).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import get_args

from hfplan.errors import HfplanError
from hfplan.layout import shape_problem
from hfplan.plan import Batching, GenConfig, InferConfig, KvCache, Recompute, TrainConfig, engine_problem
from hfplan.profiles.hardware import HardwareProfile, load_hardware
from hfplan.profiles.models import ModelArch, resolve_model
from hfplan.simulator import collectives as coll
from hfplan.simulator import costs, memory
from hfplan.spec import ResponseLengths

KINDS = ("train", "forward", "generate", "collective")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True)
class CallRequest:
    """One call to cost. `batch`: sequences (train, forward) or prompts (generate) of the whole call, split
    over dp; `seq_len`: tokens of a trained or scored sequence; `nbytes`, `op`, `gpus`: the collective's."""

    kind: str
    hardware: str
    model: str = "llama2-7b"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    batch: int = 8
    seq_len: int = 2048
    prompt_len: int = 1024
    response_len: int = 1024
    response_len_mean: float | None = None
    recompute: str = "none"
    virtual_stages: int = 1
    shard: bool = True
    head: str = "lm"
    batching: str = "static"
    kv_cache: str = "reserved"
    gpus_per_node: int | None = None
    op: str = "all_reduce"
    nbytes: float = 2**30
    gpus: int | None = None  # collective group size (default tp * pp * dp)


# What each part of a call's seconds is (costs.Parts), for a person comparing them with a measurement.
PART_MEANINGS = {
    "gemm": "matmul kernels (projections, MLP, output head)",
    "attention": "attention kernels",
    "elementwise": "memory-bound kernels: norms, rotary, activations, residuals, softmax, sampling",
    "tp_comm": "tensor-parallel all-reduces",
    "pp_comm": "pipeline-stage sends",
    "dp_comm": "data-parallel and sharding collectives not hidden behind compute",
    "bubble": "pipeline fill and drain",
    "recompute": "activation recomputation",
    "optimizer": "optimizer step's memory traffic",
    "runtime": "host overhead: engine steps, passes, each layer's, per-tensor work",
    "controller": "the controller's dispatch of the call",
}


def part_meaning(name: str) -> str:
    """What a part of a call's seconds is; a collective's own part (its op) is the collective."""
    return PART_MEANINGS.get(name, "the collective" if name in COLLECTIVES else "")


@dataclass(frozen=True)
class CallCost:
    kind: str
    seconds: float
    gpus: int
    parts: dict[str, float]  # seconds by part, adding up to `seconds`
    flops_per_gpu_per_s: float | None = None
    tokens_per_s: float | None = None
    memory_gib_per_gpu: float | None = None
    detail: dict[str, float | int | str] = field(default_factory=dict)
    # generate: the parts of its prefills and of its decode steps apart ("prefill", "decode"); with the
    # controller's part they add up to `parts`
    phases: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "seconds": self.seconds, "gpus": self.gpus, "flops_per_gpu_per_s":
               self.flops_per_gpu_per_s, "tokens_per_s": self.tokens_per_s,
               "memory_gib_per_gpu": self.memory_gib_per_gpu, "parts": dict(self.parts), "detail": dict(self.detail)}
        if self.phases:
            out["phases"] = {name: dict(parts) for name, parts in self.phases.items()}
        return out


def _forward_flops(arch: ModelArch, head: str, tokens: float, keys_per_token: float) -> float:
    """Model FLOPs of one forward over `tokens`: 2 per matmul parameter and token, and causal attention's
    QK^T and PV, 4 per (query, key, query dimension) per layer."""
    matmul_params = arch.layers * arch.params_per_layer + arch.hidden * arch.head_out_dim(head)
    return 2.0 * matmul_params * tokens + 4.0 * arch.layers * tokens * keys_per_token * arch.q_dim


def _check(req: CallRequest) -> None:
    if req.kind not in KINDS:
        raise HfplanError(f"unknown call {req.kind!r}; known: {', '.join(KINDS)}")
    for name in ("tp", "pp", "dp", "micro_batch", "batch", "seq_len", "prompt_len", "response_len",
                 "virtual_stages"):
        if getattr(req, name) < 1:
            raise HfplanError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(req, name)}")
    if req.head not in ("lm", "scalar"):
        raise HfplanError(f"--head {req.head}: use lm or scalar")
    if req.batching not in get_args(Batching):
        raise HfplanError(f"--batching {req.batching}: use {' or '.join(get_args(Batching))}")
    if req.kv_cache not in get_args(KvCache):
        raise HfplanError(f"--kv-cache {req.kv_cache}: use {' or '.join(get_args(KvCache))}")
    problem = engine_problem(req.batching, req.kv_cache)
    if problem:
        raise HfplanError(problem.replace("kv_cache=", "--kv-cache ").replace("batching=", "--batching "))
    if req.kind == "collective" and req.op not in COLLECTIVES:
        raise HfplanError(f"--op {req.op}: use one of {', '.join(COLLECTIVES)}")
    if req.response_len_mean is not None and not 0 < req.response_len_mean <= req.response_len:
        raise HfplanError(f"--response-len-mean {req.response_len_mean:g} must be in (0, --response-len]")


def call_cost(req: CallRequest) -> CallCost:
    """Seconds and rates of one call, as the search costs it."""
    _check(req)
    hw = load_hardware(req.hardware)
    per_node = req.gpus_per_node or hw.gpus_per_node
    if req.kind == "collective":
        return _collective(hw, req, per_node)
    arch = resolve_model(req.model)
    _check_model(arch, req)
    gpus = req.tp * req.pp * req.dp
    where = costs.SetShape(gpus, per_node)
    if req.kind == "train":
        result = _train(hw, arch, req, where)
    elif req.kind == "forward":
        result = _forward(hw, arch, req, where)
    else:
        result = _generate(hw, arch, req, where)
    usable = _gib(hw.memory.usable_bytes)
    fits = result.memory_gib_per_gpu is None or result.memory_gib_per_gpu <= usable
    return replace(result, detail=result.detail | {"fits": fits, "usable_gib_per_gpu": usable})


def _check_model(arch: ModelArch, req: CallRequest) -> None:
    """The layout and context checks search and simulate make: tp and pp that split the model, and sequences
    within its context."""
    kind = {"train": "train", "forward": "infer", "generate": "gen"}[req.kind]
    problem = shape_problem(arch, kind, req.tp, req.pp, req.virtual_stages if kind == "train" else 1)
    if problem:
        with_pp = f" with --pp {req.pp}" if req.pp > 1 else ""
        raise HfplanError(f"--tp {req.tp} on {arch.name}{with_pp}: {problem}")
    tokens, what = ((req.prompt_len + req.response_len, "--prompt-len + --response-len") if kind == "gen"
                    else (req.seq_len, "--seq-len"))
    if arch.context_len is not None and tokens > arch.context_len:
        raise HfplanError(f"{what} = {tokens:,} tokens exceeds the context length of {arch.name} "
                          f"({arch.context_len:,} tokens)")


def _gib(nbytes: float) -> float:
    return nbytes / 2**30


def _train(hw: HardwareProfile, arch: ModelArch, req: CallRequest, where: costs.SetShape) -> CallCost:
    try:
        cfg = TrainConfig(tp=req.tp, pp=req.pp, dp=req.dp, micro_batch=req.micro_batch, shard=req.shard,
                          recompute=Recompute(req.recompute), virtual_stages=req.virtual_stages)
    except ValueError:
        raise HfplanError(f"--recompute {req.recompute}: use none, selective or full") from None
    parts = costs.train_step_parts(hw, arch, cfg, where, req.batch, req.seq_len, req.head)
    tokens = req.batch * req.seq_len
    flops = 3.0 * _forward_flops(arch, req.head, tokens, (req.seq_len + 1) / 2)  # forward 1, backward 2
    v = hw.compute.value_bytes
    mem = (memory.train_resident_bytes(arch, cfg, req.head, v)
           + memory.train_transient_bytes(arch, cfg, req.batch, req.seq_len, req.head, v, hw.compute.attention))
    seconds = parts.total
    return CallCost("train", seconds, where.gpus, parts, flops / (where.gpus * seconds), tokens / seconds, _gib(mem))


def _forward(hw: HardwareProfile, arch: ModelArch, req: CallRequest, where: costs.SetShape) -> CallCost:
    cfg = InferConfig(tp=req.tp, pp=req.pp, dp=req.dp, micro_batch=req.micro_batch)
    parts = costs.inference_parts(hw, arch, cfg, where, req.batch, req.seq_len, req.head)
    tokens = req.batch * req.seq_len
    flops = _forward_flops(arch, req.head, tokens, (req.seq_len + 1) / 2)
    v = hw.compute.value_bytes
    mem = (memory.infer_resident_bytes(arch, cfg, req.head, v)
           + memory.infer_transient_bytes(arch, cfg, req.seq_len, req.head, value_bytes=v,
                                            attention=hw.compute.attention))
    seconds = parts.total
    return CallCost("forward", seconds, where.gpus, parts, flops / (where.gpus * seconds), tokens / seconds,
                    _gib(mem))


def _generate(hw: HardwareProfile, arch: ModelArch, req: CallRequest, where: costs.SetShape) -> CallCost:
    """A standalone generation engine (weights of its own, the rest of the usable memory for the KV cache)."""
    gen = GenConfig(tp=req.tp, pp=req.pp, dp=req.dp, batching=req.batching, kv_cache=req.kv_cache)
    v = hw.compute.value_bytes
    held = (memory.infer_resident_bytes(arch, gen, "lm", v)
            + memory.generation_working_bytes(arch, gen, req.prompt_len, v, hw.compute.attention))
    kv_budget = max(0.0, hw.memory.usable_bytes - held)
    lengths = (ResponseLengths(req.response_len, float(req.response_len_mean)) if req.response_len_mean is not None
               else ResponseLengths.fixed(req.response_len))
    result = costs.generation_time(hw, arch, gen, where, req.batch, req.prompt_len, req.response_len, kv_budget,
                                   lengths=lengths)
    if result.parts is None:
        raise HfplanError(f"{arch.name} with tp={req.tp} on {hw.name}: no room for the KV cache of one sequence "
                          f"({_gib(held):.1f} GiB of weights and working memory per GPU, "
                          f"{_gib(hw.memory.usable_bytes):.1f} GiB usable)")
    kv = memory.kv_sequence(arch, gen, req.prompt_len, lengths, v)
    per_replica = -(-req.batch // req.dp)
    kv_used = min(kv_budget, kv.held(result.max_batch, per_replica))
    response_tokens = req.batch * lengths.mean
    tokens = req.batch * req.prompt_len + response_tokens
    flops = _forward_flops(arch, "lm", tokens, req.prompt_len / 2 + lengths.mean / 2)
    seconds = result.seconds
    phases = costs.waves_phases(hw, arch, req.tp, req.pp, where, per_replica, result.waves, req.prompt_len,
                                req.response_len, lengths, req.batching)
    return CallCost("generate", seconds, where.gpus, result.parts, flops / (where.gpus * seconds),
                    response_tokens / seconds, _gib(held + kv_used),
                    {"waves": result.waves, "batch_per_replica": result.max_batch, "batching": req.batching,
                     "kv_cache": req.kv_cache, "decode_steps": phases.decode_steps,
                     "decode_step_ms": 1e3 * phases.decode.total / phases.decode_steps if phases.decode_steps else 0.0},
                    phases={"prefill": dict(phases.prefill), "decode": dict(phases.decode)})


def _collective(hw: HardwareProfile, req: CallRequest, per_node: int) -> CallCost:
    size = req.gpus or req.tp * req.pp * req.dp
    if req.nbytes <= 0:
        raise HfplanError(f"--bytes must be positive, got {req.nbytes:g}")
    if req.op == "p2p":
        same = size <= per_node
        seconds = coll.point_to_point(hw, req.nbytes, same_node=same)
        return CallCost("collective", seconds, max(size, 2), {"p2p": seconds},
                        detail={"op": req.op, "algbw_gbytes_per_s": req.nbytes / seconds / 1e9,
                                "link": "intra-node" if same else "inter-node"})
    if size < 2:
        raise HfplanError(f"--op {req.op} needs a group of at least 2 GPUs (--gpus, or tp * pp * dp)")
    group = coll.group_of(size, 1, min(size, per_node))
    seconds = {"all_reduce": coll.all_reduce, "all_gather": coll.all_gather,
               "reduce_scatter": coll.reduce_scatter}[req.op](hw, group, req.nbytes)
    algbw = req.nbytes / seconds
    # nccl-tests' bus bandwidth: what each rank's link carries, comparable across group sizes.
    factor = coll.collective_terms(req.op, size)[1]
    return CallCost("collective", seconds, size, {req.op: seconds},
                    detail={"op": req.op, "algbw_gbytes_per_s": algbw / 1e9, "busbw_gbytes_per_s": algbw * factor / 1e9,
                            "nodes": group.nodes, "per_node": group.per_node,
                            "nvls": str(req.op == "all_reduce" and coll.uses_nvls(hw, group, req.nbytes)).lower(),
                            "runs_as": coll.how_it_runs(hw, group, req.nbytes, req.op)})
