"""Activation recomputation of an HF decoder model in the backward pass (the plan's `TrainConfig.recompute`).

- none: every activation is kept for the backward pass.
- full: each decoder layer is recomputed from its input (HF gradient checkpointing, non-reentrant).
- selective (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022): only the
  core attention (the scores Q K^T, softmax, dropout, the weighted sum with V) is recomputed; the projections,
  norms and MLP keep their activations. The model's attention implementation (sdpa, eager, ...) is swapped for
  one registered with transformers' attention interface that runs it under a non-reentrant checkpoint.

The selective mode lives on the model's config and in its attention modules, which pipeline stages keep
(`pipeline_split`); it sees plain query, key and value tensors, so tensor parallelism (whose column-parallel
projections return local shards) and FSDP2 (the checkpointed part holds no parameters) compose with it.
Apply it to the whole HF model, before tensor parallelism, FSDP or the pipeline split.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from hfplan.plan import Recompute

SELECTIVE_PREFIX = "hfplan-selective-"


def apply_recompute(model: nn.Module, mode: Recompute | str) -> None:
    """Make `model` (an HF PreTrainedModel) recompute per `mode` in its backward passes; `none` changes nothing."""
    mode = Recompute(mode)
    if mode is Recompute.FULL:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif mode is Recompute.SELECTIVE:
        current = model.config._attn_implementation
        if current.startswith(SELECTIVE_PREFIX):
            return
        name = _register_selective(current)
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise ValueError(f"{type(model).__name__}: selective recomputation needs a model whose attention "
                             "goes through transformers' attention interface")


def _register_selective(inner: str) -> str:
    """Register the selective wrapper of attention implementation `inner` (and its mask) under a name of its own."""
    if inner != "eager" and inner not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"selective recomputation: unknown attention implementation {inner!r}")
    if inner not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"selective recomputation: attention implementation {inner!r} has no mask of its own")
    name = SELECTIVE_PREFIX + inner
    AttentionInterface.register(name, _selective_attention(inner))
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])  # the same masks as inner
    return name


def _model_eager(module: nn.Module) -> Callable:
    """The eager attention of the module's own architecture (each HF modeling file defines one)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{type(module).__name__}: no eager_attention_forward in {type(module).__module__}")
    return eager


def _selective_attention(inner: str) -> Callable:
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs):
        core = ALL_ATTENTION_FUNCTIONS.get_interface(inner, _model_eager(module))
        if not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)):
            return core(module, query, key, value, attention_mask, **kwargs)  # inference: nothing to recompute

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
            return core(module, q, k, v, mask, **kwargs)

        return checkpoint(run, query, key, value, attention_mask, use_reentrant=False)

    attention.__name__ = f"selective_{inner}_attention"
    return attention
