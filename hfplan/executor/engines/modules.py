"""What the engines read off a wrapped HF model: its own class, its decoder layers, its FSDP groups."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

HEADS = ("lm_head", "score")  # the attribute of an HF causal LM's head, and of a token classifier's


def plain_class(module: nn.Module) -> type[nn.Module]:
    """A module's own class, under the FSDP subclass that `fully_shard` swaps in."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, by the class names HF lists as never to be split across devices."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if plain_class(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (by _no_split_modules {sorted(names)})")
    return layers


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]
