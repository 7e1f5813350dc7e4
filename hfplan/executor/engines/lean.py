"""hfplan's own model-level forward over an HF decoder model's module tree (the same modules, parameters and names).

HF's `<Arch>Model.forward` and its head's forward wrap the decoder layers in per-call bookkeeping: output capture
decorators, keyword plumbing, the mask builder's checks (`masking_utils`), output dataclasses. For the demo models
that is a sizeable share of a forward. This forward runs the same modules itself: the embedding, the rotary module,
each decoder layer called as a module (so tensor parallelism's and FSDP2's per-layer hooks and HF gradient
checkpointing run as before), the final norm and the head, over only the positions the caller reads. The attention
mask is SDPA's boolean one, built once per forward: a query sees the real keys at or before it, and a padded query
also itself (so no row is empty and none is NaN); with no padding at all it is None and SDPA runs `is_causal`, as
HF's `sdpa_mask` skips it too. At real positions the result is HF's own (tests/test_lean_forward.py).

It runs where that mask is what the layers expect (`runs`): an SDPA attention (or its selective-recompute wrapper),
no sliding window narrower than the sequence, and a root that is not an FSDP2 module (FSDP2 gathers and reduces the
root's own parameters in hooks on the root's call, which only HF's forward makes). Elsewhere HF's forward runs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from hfplan.executor import sequences
from hfplan.executor.engines.modules import HEADS
from hfplan.executor.engines.recompute import SELECTIVE_PREFIX

_BOOLEAN_MASK_ATTENTION = ("sdpa", SELECTIVE_PREFIX + "sdpa")


def runs(model: nn.Module, joined: sequences.Joined) -> bool:
    """Whether this forward runs `model` over `joined` (else HF's forward does)."""
    if isinstance(model, FSDPModule):
        return False
    config = getattr(model, "config", None)
    backbone = getattr(model, "model", None)
    if config is None or backbone is None or not any(hasattr(model, head) for head in HEADS):
        return False
    if getattr(config, "_attn_implementation", None) not in _BOOLEAN_MASK_ATTENTION:
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or joined.input_ids.shape[1] <= window


def attention_mask(joined: sequences.Joined) -> torch.Tensor | None:
    """SDPA's boolean mask [B, 1, T, T] of the joined sequences (True: attend), or None without padding."""
    real = joined.attention_mask.bool()
    if bool(real.all()):
        return None
    length = real.shape[1]
    columns = torch.arange(length, device=real.device)
    allowed = (columns[None, :] <= columns[:, None])[None] & real[:, None, :]
    allowed |= torch.eye(length, dtype=torch.bool, device=real.device)
    return allowed[:, None]


def head_output(model: nn.Module, joined: sequences.Joined, keep: int = 0) -> torch.Tensor:
    """The head's output ([B, T, V] logits, or a token classifier's [B, T, labels]) at the last `keep`
    positions (0: every position), as `model(...).logits` with logits_to_keep=keep gives it."""
    backbone, config = model.model, model.config
    position_ids = joined.position_ids
    hidden = backbone.embed_tokens(joined.input_ids)
    position_embeddings = backbone.rotary_emb(hidden, position_ids=position_ids)
    mask = attention_mask(joined)
    for layer in backbone.layers[: config.num_hidden_layers]:
        hidden = layer(hidden, attention_mask=mask, position_ids=position_ids,
                       position_embeddings=position_embeddings)
    if keep:
        hidden = hidden[:, -keep:]
    hidden = backbone.norm(hidden)
    if hasattr(model, "lm_head"):
        return model.lm_head(hidden)
    return model.score(model.dropout(hidden))
