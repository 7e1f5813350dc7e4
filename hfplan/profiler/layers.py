"""The real transformer layer (transformers' Llama / Qwen2 decoder layer) at a model's architecture,
measured on one device and set against the cost model's prediction for the very shapes that ran.

A tensor-parallel degree t is emulated by the layer of one TP shard: heads/t query heads, kv_heads/t
KV heads (one when fewer than t, as the cost model assumes), ffn/t MLP columns, the full hidden size.
Where the full layer would take too long for the time budget (a large model on CPU), heads, KV heads,
hidden and ffn are divided by a power of two, the head size kept; predictions are made for that
scaled architecture. Layer copies rotate as in a many-layer model, so weights are not cache-resident
unless a real model's would be.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace

from hfplan.layout import kv_heads_per_rank
from hfplan.profiler.compute import compute_dtype
from hfplan.profiler.device import Device
from hfplan.profiler.sweeps import LayerCases
from hfplan.profiler.timing import Clock, copies_for, rotating
from hfplan.profiles.hardware import HardwareProfile
from hfplan.profiles.models import ModelArch
from hfplan.simulator.kernels import layer_forward

Step = Callable[[], None]
PASSES = ("forward", "forward+backward", "decode")


@dataclass(frozen=True)
class Case:
    op: str  # one of PASSES
    batch: int
    length: int  # sequence length (forward passes) or context already in the KV cache (decode)
    tp: int

    @classmethod
    def of_row(cls, row: dict) -> Case:
        """The case a layer row (measure_layers') measured."""
        return cls(row["op"], int(row["batch"]), int(row["context"] if row["op"] == "decode" else row["seq"]),
                   int(row["tp"]))

    @property
    def tokens(self) -> int:
        return self.batch * (1 if self.op == "decode" else self.length)

    @property
    def keys_per_token(self) -> float:
        """As the simulator costs it: (L+1)/2 for a causal pass over L tokens; a decode step attends the
        cached context and its own new key."""
        return float(self.length + 1) if self.op == "decode" else (self.length + 1) / 2


@dataclass(frozen=True)
class LayerPlan:
    arch: ModelArch  # the architecture that runs (scaled down by `scale` from the catalog one)
    source: ModelArch
    scale: int
    cases: tuple[Case, ...]
    copies: int  # layer copies rotated through

    @property
    def shape(self) -> str:
        a = self.arch
        return f"hidden {a.hidden}, heads {a.heads}/{a.kv_heads} kv, head dim {a.dim_per_head}, ffn {a.ffn}"


def predict(hw: HardwareProfile, arch: ModelArch, case: Case) -> float:
    decode = case.op == "decode"
    cost = layer_forward(hw, arch, case.tokens, case.keys_per_token, case.tp, decode=decode,
                         seq_len=None if decode else case.length)
    return cost.total + (cost.backward() if case.op == "forward+backward" else 0.0)


def scaled(arch: ModelArch, factor: int) -> ModelArch | None:
    """The architecture with heads, KV heads, hidden and ffn divided by factor (head size kept)."""
    if factor == 1:
        return replace(arch, head_dim=arch.dim_per_head)
    if arch.heads % factor or arch.hidden % factor:
        return None
    heads = arch.heads // factor
    kv = max(1, arch.kv_heads // factor)
    if heads % kv:
        return None
    return replace(arch, name=f"{arch.name}/{factor}", hidden=arch.hidden // factor, heads=heads, kv_heads=kv,
                   ffn=max(1, arch.ffn // factor), head_dim=arch.dim_per_head, layers=1)


def valid_tp(arch: ModelArch, tp: int) -> bool:
    return (arch.heads % tp == 0 and arch.ffn % tp == 0
            and (arch.kv_heads % tp == 0 or tp % arch.kv_heads == 0))


def cases_for(arch: ModelArch, cases: LayerCases) -> tuple[Case, ...]:
    out = []
    for tp in (t for t in cases.tps if valid_tp(arch, t)):
        out += [Case(op, b, s, tp) for op in PASSES[:2] for b in cases.batches for s in cases.seqs]
        out += [Case("decode", b, c, tp) for b in cases.decode_batches for c in cases.contexts]
    return tuple(out)


def layer_bytes(arch: ModelArch, esize: int) -> float:
    return float(arch.params_per_layer * esize)


def plan_layers(hw: HardwareProfile, source: ModelArch, cases: LayerCases, device: Device, esize: int,
                min_time: float) -> LayerPlan:
    """The least scaled-down architecture whose measurements fit the time budget (as the profile
    predicts them) and the memory budget."""
    memory_budget = min(16 * 2**30 if device.kind == "cuda" else 2 * 2**30, 0.25 * device.capacity_bytes)
    chosen = None
    for factor in (1, 2, 4, 8, 16, 32, 64):
        arch = scaled(source, factor)
        if arch is None:
            continue
        planned = cases_for(arch, cases)
        if not planned:
            continue
        # per_call runs a warm-up, a sizing call and five trials of about min_time/5 each.
        seconds = sum(max(min_time, 5 * p) + 2 * p for p in (predict(hw, arch, c) for c in planned))
        chosen = (arch, factor, planned)
        if seconds <= cases.budget_s and 2 * layer_bytes(arch, esize) <= memory_budget:
            break
    if chosen is None:
        raise ValueError(f"no tensor-parallel degree of {cases.tps} divides model {source.name}")
    arch, factor, planned = chosen
    set_bytes = 2 * layer_bytes(arch, esize)  # weights and their gradients
    copies = copies_for(set_bytes, device.cache_bytes, memory_budget, most=32)
    return LayerPlan(arch=arch, source=source, scale=factor, cases=planned, copies=copies)


class SlotCache:
    """A preallocated KV cache per layer holding `context` keys and values, plus one free slot that each
    decode step writes; attention then reads all context+1 keys (as a static / paged cache does)."""

    def __init__(self, keys, values, slot: int) -> None:
        self.keys, self.values, self.slot = keys, values, slot

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[:, :, self.slot:self.slot + 1].copy_(key_states)
        values[:, :, self.slot:self.slot + 1].copy_(value_states)
        return keys, values


def _classes(arch: ModelArch):
    """Qwen2's layer for models with q/k/v biases (the Qwen family), Llama's otherwise."""
    if arch.attention_bias:
        from transformers import Qwen2Config
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

        return Qwen2Config, Qwen2DecoderLayer, Qwen2RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    return LlamaConfig, LlamaDecoderLayer, LlamaRotaryEmbedding


def shard_config(arch: ModelArch, tp: int):
    config_cls, _, _ = _classes(arch)
    extra = {} if arch.attention_bias else {"attention_bias": False}
    config = config_cls(hidden_size=arch.hidden, num_attention_heads=arch.heads // tp,
                        num_key_value_heads=kv_heads_per_rank(arch.kv_heads, tp), intermediate_size=arch.ffn // tp,
                        head_dim=arch.dim_per_head, num_hidden_layers=1, vocab_size=256,
                        max_position_embeddings=1 << 16, **extra)
    config._attn_implementation = "sdpa"
    return config


def measure_layers(torch, device: Device, plan: LayerPlan, min_time: float, step: Step) -> list[dict]:
    dtype = compute_dtype(device)
    clock = Clock(torch, device.kind)
    rows = []
    for tp in sorted({c.tp for c in plan.cases}):
        config = shard_config(plan.arch, tp)
        _, layer_cls, rotary_cls = _classes(plan.arch)
        with torch.device(device.kind):
            first = layer_cls(config, layer_idx=0).to(dtype)
            rotary = rotary_cls(config)
        layers = [first] + [copy.deepcopy(first) for _ in range(plan.copies - 1)]
        for index, layer in enumerate(layers):
            layer.self_attn.layer_idx = index
        cache_arg = "cache" if "cache" in inspect.signature(layer_cls.forward).parameters else "past_key_values"
        for case in (c for c in plan.cases if c.tp == tp):
            seconds = _measure_case(torch, device, dtype, clock, config, layers, rotary, cache_arg, case, min_time)
            rows.append(dict(kind="layer", op=case.op, model=plan.source.name, scale=plan.scale,
                             hidden=plan.arch.hidden, heads=plan.arch.heads, kv_heads=plan.arch.kv_heads,
                             ffn=plan.arch.ffn, dtype=str(dtype).removeprefix("torch."), batch=case.batch,
                             seq=case.length if case.op != "decode" else None,
                             context=case.length if case.op == "decode" else None, tp=tp, tokens=case.tokens,
                             seconds=seconds))
            step()
        del layers, first
    return rows


def _output(result):
    return result[0] if isinstance(result, tuple) else result


def _measure_case(torch, device, dtype, clock, config, layers, rotary, cache_arg, case: Case, min_time) -> float:
    hidden, on = config.hidden_size, device.kind
    following = rotating(layers)
    length = 1 if case.op == "decode" else case.length
    first_position = case.length if case.op == "decode" else 0
    x = torch.randn(case.batch, length, hidden, dtype=dtype, device=on)
    positions = torch.arange(first_position, first_position + length, device=on).unsqueeze(0).expand(case.batch, -1)
    with torch.no_grad():
        embeddings = rotary(x, positions)
    if case.op == "forward":
        with torch.inference_mode():
            return clock.per_call(lambda: following()(x, position_embeddings=embeddings), min_time)
    if case.op == "forward+backward":
        x.requires_grad_(True)
        grad = torch.randn_like(x)

        def train_step() -> None:
            layer = following()
            for p in layer.parameters():
                p.grad = None
            x.grad = None
            _output(layer(x, position_embeddings=embeddings)).backward(grad)

        return clock.per_call(train_step, min_time)
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    shape = (case.batch, kv_heads, case.length + 1, head_dim)
    cache = SlotCache([torch.randn(shape, dtype=dtype, device=on) for _ in layers],
                      [torch.randn(shape, dtype=dtype, device=on) for _ in layers], slot=case.length)
    with torch.inference_mode():
        return clock.per_call(lambda: following()(x, position_embeddings=embeddings, **{cache_arg: cache}), min_time)
