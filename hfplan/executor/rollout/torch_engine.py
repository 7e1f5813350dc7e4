"""A native torch rollout engine: its own decode loop over an HF Llama / Qwen2 / Mistral model's weights.

One prefill over the left-padded prompts fills a KV cache preallocated for P + max_new_tokens
columns; each decode step then runs one token per row through the layers, reading the weights the
model holds (shared, never copied). The arithmetic follows the HF modules it replaces (RMSNorm in
fp32, rotary tables from the model's own inverse frequencies, grouped-query attention, SwiGLU), so the
log-probs it returns match a training-side forward over `sequences.join(...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from hfplan.errors import HfplanError
from hfplan.executor.rollout.base import Rollout, SamplingParams
from hfplan.executor.sequences import positions

# Rotary types whose frequencies change with the sequence length at run time; a fixed table cannot follow them.
_DYNAMIC_ROPE = ("dynamic", "longrope")


def _full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor of a parameter: a DTensor (FSDP2, tensor parallel) is gathered, a plain one shared."""
    if tensor is None:
        return None
    if hasattr(tensor, "full_tensor"):
        return tensor.full_tensor().detach()
    return tensor.detach()


@dataclass(frozen=True)
class _Linear:
    weight: torch.Tensor
    bias: torch.Tensor | None

    @staticmethod
    def of(module: torch.nn.Module) -> _Linear:
        return _Linear(_full(module.weight), _full(module.bias))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class _Norm:
    weight: torch.Tensor
    eps: float

    @staticmethod
    def of(module: torch.nn.Module) -> _Norm:
        return _Norm(_full(module.weight), float(module.variance_epsilon))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


@dataclass(frozen=True)
class _Layer:
    attn_norm: _Norm
    q: _Linear
    k: _Linear
    v: _Linear
    o: _Linear
    mlp_norm: _Norm
    gate: _Linear
    up: _Linear
    down: _Linear


@dataclass(frozen=True)
class _Weights:
    embed: torch.Tensor
    layers: list[_Layer]
    norm: _Norm
    lm_head: torch.Tensor
    inv_freq: torch.Tensor
    rope_scale: float  # the rotary tables' post-scaling (attention_scaling of the HF rotary module)
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    act: torch.nn.Module
    sliding_window: int | None

    @staticmethod
    def of(model: torch.nn.Module) -> _Weights:
        config = model.config
        base = model.model
        rotary = base.rotary_emb
        if getattr(rotary, "rope_type", "default") in _DYNAMIC_ROPE:
            raise HfplanError(f"the torch rollout engine does not run rotary type {rotary.rope_type!r}")
        layers = [
            _Layer(
                attn_norm=_Norm.of(layer.input_layernorm),
                q=_Linear.of(layer.self_attn.q_proj), k=_Linear.of(layer.self_attn.k_proj),
                v=_Linear.of(layer.self_attn.v_proj), o=_Linear.of(layer.self_attn.o_proj),
                mlp_norm=_Norm.of(layer.post_attention_layernorm),
                gate=_Linear.of(layer.mlp.gate_proj), up=_Linear.of(layer.mlp.up_proj),
                down=_Linear.of(layer.mlp.down_proj),
            )
            for layer in base.layers[: config.num_hidden_layers]
        ]
        attn = base.layers[0].self_attn
        return _Weights(
            embed=_full(base.embed_tokens.weight), layers=layers, norm=_Norm.of(base.norm),
            lm_head=_full(model.lm_head.weight), inv_freq=rotary.inv_freq, rope_scale=float(rotary.attention_scaling),
            heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=attn.head_dim,
            scaling=float(attn.scaling), act=ACT2FN[config.hidden_act],
            sliding_window=getattr(config, "sliding_window", None),
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool mask of the nucleus: the most probable tokens whose mass first reaches `top_p` (at least one)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probs [B] under log_softmax(logits / temperature) (1 when greedy)."""
    log_probs = F.log_softmax(logits / params.logit_temperature, dim=-1)
    if params.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        probs = log_probs.exp()
        if params.top_p < 1.0:
            probs = probs * top_p_keep(probs, params.top_p)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return tokens, log_probs.gather(1, tokens[:, None]).squeeze(1)


class TorchRolloutEngine:
    """Batched generation with a preallocated KV cache; see the module docstring."""

    def __init__(self, model: torch.nn.Module, pad_id: int, eos_id: int) -> None:
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.load_weights(model)

    def load_weights(self, model: torch.nn.Module) -> None:
        self._w = _Weights.of(model)

    @torch.inference_mode()
    def generate(
        self, prompts: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
    ) -> Rollout:
        w = self._w
        if prompts.dim() != 2 or prompts.dtype != torch.long:
            raise ValueError(f"prompts must be a [B, P] long tensor, got {tuple(prompts.shape)} {prompts.dtype}")
        device = w.embed.device
        prompts = prompts.to(device).repeat_interleave(params.n, dim=0)
        rows, prompt_len = prompts.shape
        steps = params.max_new_tokens
        total = prompt_len + steps
        if w.sliding_window is not None and total > w.sliding_window:
            raise HfplanError(f"prompt + response length {total} exceeds the model's sliding window {w.sliding_window}")

        prompt_mask = prompts != self.pad_id
        # Keys a query may see: real prompt tokens and every generated column (the causal limit is the slice).
        key_mask = torch.cat([prompt_mask, prompt_mask.new_ones(rows, steps)], dim=1)
        angles = torch.arange(total, device=device, dtype=torch.float32)[:, None] * w.inv_freq.float()[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        cos_table = (angles.cos() * w.rope_scale).to(w.embed.dtype)
        sin_table = (angles.sin() * w.rope_scale).to(w.embed.dtype)
        cache = w.embed.new_empty((len(w.layers), 2, rows, w.kv_heads, total, w.head_dim))

        columns = torch.arange(prompt_len, device=device)
        causal = columns[None, :] <= columns[:, None]
        allowed = (causal[None] & prompt_mask[:, None, :]) | torch.eye(prompt_len, dtype=torch.bool, device=device)
        rope = (cos_table, sin_table)
        logits = self._forward(prompts, positions(prompt_mask.long()), rope, cache, 0, allowed)

        responses = prompts.new_full((rows, steps), self.pad_id)
        response_mask = torch.zeros(rows, steps, device=device)
        log_probs = torch.zeros(rows, steps, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        next_position = prompt_mask.sum(dim=1)
        for step in range(steps):
            tokens, token_log_probs = sample_tokens(logits, params, generator)
            alive = ~finished
            responses[:, step] = tokens.masked_fill(finished, self.pad_id)
            response_mask[:, step] = alive.float()
            log_probs[:, step] = token_log_probs.masked_fill(finished, 0.0)
            finished = finished | (tokens == self.eos_id)
            if step + 1 == steps or bool(finished.all()):
                break
            column = prompt_len + step
            logits = self._forward(
                responses[:, step: step + 1], (next_position + step)[:, None], rope, cache, column,
                key_mask[:, None, : column + 1],
            )
        return Rollout(prompts, responses, response_mask, log_probs)

    def _forward(
        self, tokens: torch.Tensor, pos: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor, start: int, allowed: torch.Tensor,
    ) -> torch.Tensor:
        """Run `tokens` [B, T] (cache columns start..start+T-1, rotary positions `pos` [B, T]) through the
        model; fp32 logits [B, V] of the last one. `allowed` [B, T, start+T]: the cached keys each query sees."""
        w = self._w
        rows, length = tokens.shape
        groups = w.heads // w.kv_heads
        end = start + length
        cos, sin = rope[0][pos][:, None], rope[1][pos][:, None]  # [B, 1, T, D]
        # Query heads grouped by the KV head they share: [B, KV, G*T, S] scores, no repeated keys.
        mask = allowed[:, None, None].expand(rows, w.kv_heads, groups, length, end).reshape(
            rows, w.kv_heads, groups * length, end)
        h = F.embedding(tokens, w.embed)
        for index, layer in enumerate(w.layers):
            x = layer.attn_norm(h)
            q = layer.q(x).view(rows, length, w.heads, w.head_dim).transpose(1, 2)
            k = layer.k(x).view(rows, length, w.kv_heads, w.head_dim).transpose(1, 2)
            v = layer.v(x).view(rows, length, w.kv_heads, w.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            cache[index, 0, :, :, start:end] = k
            cache[index, 1, :, :, start:end] = v
            keys, values = cache[index, 0, :, :, :end], cache[index, 1, :, :, :end]
            q = q.reshape(rows, w.kv_heads, groups * length, w.head_dim)
            scores = torch.matmul(q, keys.transpose(-1, -2)) * w.scaling
            scores = scores.masked_fill(~mask, float("-inf"))
            attn = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)
            attn = attn.view(rows, w.heads, length, w.head_dim).transpose(1, 2).reshape(rows, length, -1)
            h = h + layer.o(attn)
            x = layer.mlp_norm(h)
            h = h + layer.down(w.act(layer.gate(x)) * layer.up(x))
        return F.linear(w.norm(h[:, -1]), w.lm_head).float()
