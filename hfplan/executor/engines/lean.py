"""hfplan's own forward over an HF decoder model's module tree (the same modules, parameters and names).

HF's `<Arch>Model.forward` and its head's forward wrap the decoder layers in per-call bookkeeping: output capture
decorators, keyword plumbing, the mask builder's checks (`masking_utils`), output dataclasses; inside each layer,
the attention interface's dispatch, RMSNorm as five ops, rotate_half as four. For the demo models that is a
sizeable share of a forward. This forward runs the embedding, the rotary module, the decoder layers, the final
norm and the head itself, the head over only the positions the caller reads. The attention mask is SDPA's boolean
one (decoder_math.causal_mask), built once per forward; with no padding at all it is None and SDPA runs
`is_causal`, as HF's `sdpa_mask` skips it too.

A decoder layer whose parameters are plain tensors, with no hooks, and that does not recompute (no FSDP2, tensor
parallelism or HF gradient checkpointing on it) is computed here from its submodules, with decoder_math's RMSNorm
and rotation; any other layer is called as a module with that mask and the rotary tables, so those wrappers' hooks
run as before. At real positions the results are HF's own, to the bit (tests/test_lean_forward.py).

The forward runs where that mask is what the layers expect (`runs`): an SDPA attention (or its
selective-recompute wrapper), no sliding window narrower than the sequence, and a root without hooks and not an
FSDP2 module (FSDP2 gathers and reduces the root's own parameters in hooks on the root's call, which only HF's
forward makes). Elsewhere HF's forward runs. A pipeline stage runs its share of the layers the same way
(`layers_output`, where `runs_backbone`): the stage itself is the FSDP2 root there, called by the pipeline
schedule, so its hooks run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hfplan.executor import sequences
from hfplan.executor.engines import decoder_math
from hfplan.executor.engines.decoder_math import rms_norm, rotate, signed_sin
from hfplan.executor.engines.modules import HEADS, plain_class
from hfplan.executor.engines.recompute import SELECTIVE_PREFIX

_BOOLEAN_MASK_ATTENTION = ("sdpa", SELECTIVE_PREFIX + "sdpa")
_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer")  # the same pre-norm SwiGLU layer


def runs(model: nn.Module, joined: sequences.Joined) -> bool:
    """Whether this forward runs `model` over `joined` (else HF's forward does)."""
    if isinstance(model, FSDPModule) or model._forward_hooks or model._forward_pre_hooks:
        return False
    backbone = getattr(model, "model", None)
    if backbone is None or not any(hasattr(model, head) for head in HEADS):
        return False
    return runs_backbone(backbone, joined)


def runs_backbone(backbone: nn.Module, joined: sequences.Joined) -> bool:
    """Whether `layers_output` runs an HF backbone (`<Arch>Model`, or a pipeline stage's share of one) over
    `joined`: the mask it builds is what its attention expects, and nothing hooks the backbone's own call."""
    config = getattr(backbone, "config", None)
    if config is None or isinstance(backbone, FSDPModule) or backbone._forward_hooks or backbone._forward_pre_hooks:
        return False
    if getattr(config, "_attn_implementation", None) not in _BOOLEAN_MASK_ATTENTION:
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or joined.input_ids.shape[1] <= window


def attention_mask(joined: sequences.Joined) -> torch.Tensor | None:
    """SDPA's boolean mask [B, 1, T, T] of the joined sequences, or None without padding."""
    real = joined.attention_mask.bool()
    return None if bool(real.all()) else decoder_math.causal_mask(real)


def _computed_here(layer: nn.Module) -> bool:
    """A layer this module computes from its submodules (else it is called as a module): one of the layer classes
    `_layer` follows, no wrapper's hooks or parameters on it, and no attention dropout to apply."""
    if plain_class(layer).__name__ not in _LAYERS or getattr(layer, "gradient_checkpointing", False):
        return False
    attn = layer.self_attn
    if attn.config._attn_implementation != "sdpa" or (layer.training and attn.attention_dropout):
        return False
    wrapped = (layer, attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)
    if any(m._forward_hooks or m._forward_pre_hooks for m in wrapped):
        return False
    # Tensor parallelism and FSDP2 make every parameter of a layer a DTensor: one of them tells.
    return not isinstance(attn.q_proj.weight, DTensor)


def _layer(layer: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor,
           sin: torch.Tensor) -> torch.Tensor:
    """HF's Llama-family decoder layer (pre-norm attention and SwiGLU MLP, each with its residual), op for op as
    HF computes it, so to the bit. `cos`, `sin`: [B, 1, T, D], the sin signed (decoder_math.signed_sin)."""
    attn, mlp = layer.self_attn, layer.mlp
    norm = layer.input_layernorm
    x = rms_norm(hidden, norm.weight, norm.variance_epsilon)
    shape = (*hidden.shape[:-1], -1, attn.head_dim)
    q = rotate(attn.q_proj(x).view(shape).transpose(1, 2), cos, sin)
    k = rotate(attn.k_proj(x).view(shape).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=attn.scaling,
                                         enable_gqa=q.shape[1] != k.shape[1])
    hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(*hidden.shape[:-1], -1))
    norm = layer.post_attention_layernorm
    x = rms_norm(hidden, norm.weight, norm.variance_epsilon)
    return hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def layers_output(backbone: nn.Module, hidden: torch.Tensor, joined: sequences.Joined) -> torch.Tensor:
    """The hidden states after `backbone`'s decoder layers (before its final norm), from their input `hidden`
    (the embeddings, or an earlier pipeline stage's output) at `joined`'s positions."""
    position_ids = joined.position_ids
    cos, sin = backbone.rotary_emb(hidden, position_ids=position_ids)
    mask = attention_mask(joined)
    tables = None  # the [B, 1, T, D] tables of the layers computed here, made on first use
    for layer in backbone.layers[: backbone.config.num_hidden_layers]:
        if _computed_here(layer):
            tables = tables or (cos[:, None], signed_sin(sin)[:, None])
            hidden = _layer(layer, hidden, mask, *tables)
        else:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=(cos, sin))
    return hidden


def head_output(model: nn.Module, joined: sequences.Joined, keep: int = 0) -> torch.Tensor:
    """The head's output ([B, T, V] logits, or a token classifier's [B, T, labels]) at the last `keep`
    positions (0: every position), as `model(...).logits` with logits_to_keep=keep gives it: every layer over
    every position, as HF's forward computes them (a matrix product over fewer rows may round otherwise, and an
    actor trained through HF's forward must match a reference run through this one to the bit)."""
    backbone = model.model
    hidden = layers_output(backbone, backbone.embed_tokens(joined.input_ids), joined)
    hidden = backbone.norm(hidden)
    if hasattr(model, "lm_head"):
        # Contiguous, so aten's matmul takes one matrix product whether the head's weight requires grad (an
        # actor's loss: it folds a strided slice with a copy, as HF's forward of a trained actor does) or not
        # (a frozen reference: a strided slice would go batched and round otherwise).
        return model.lm_head(hidden[:, -keep:].contiguous() if keep else hidden)
    scores = model.score(model.dropout(hidden))
    return scores[:, -keep:] if keep else scores
