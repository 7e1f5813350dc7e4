"""The arithmetic of an HF Llama-family decoder layer that hfplan's own forwards share (the training side's lean
forward, engines.lean, and the rollout engine's decode loop), written as HF's modules compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalised in fp32, rounded to the input's dtype, then scaled (one fused op in fp32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """A rotary sin table [..., D] with the sign of HF's rotate_half on its first half (see `rotate`)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin, with `sin` from `signed_sin`: rotate_half(x) * sin equals
    x.roll(D/2) * signed_sin, one op fewer than rotate_half's slices, negation and concatenation."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def causal_mask(real: torch.Tensor) -> torch.Tensor:
    """SDPA's boolean mask [B, 1, T, T] (True: attend) of sequences whose real tokens `real` [B, T] marks: a query
    sees the real keys at or before it, and a padded query also itself, so no row is empty (nor NaN)."""
    length = real.shape[1]
    columns = torch.arange(length, device=real.device)
    allowed = (columns[None, :] <= columns[:, None])[None] & real.bool()[:, None, :]
    allowed |= torch.eye(length, dtype=torch.bool, device=real.device)
    return allowed[:, None]
