"""The demo models' built-in prompt sets (torch-free: a run's inputs are checked before torch is imported)."""

from __future__ import annotations

import random

from hfplan.dataflow.rewards import ARITH_MAX
from hfplan.profiles.models import DEMO_MODELS


def builtin_prompts(model_ref: str) -> list[str] | None:
    """The demo prompt set of a demo model (by its vocabulary: the phrases, or the arithmetic), in a fixed order;
    None for any other model."""
    vocabulary = DEMO_MODELS.get(model_ref)
    if vocabulary == "bytes":
        return _tiny_prompts()
    if vocabulary == "arith":
        return _arith_prompts()
    return None


def _tiny_prompts() -> list[str]:
    # Short English-ish phrases: 8 x 6 = 48 prompts of at most 15 bytes (16 tokens with <bos>).
    starts = ("the", "a", "my", "one", "our", "some", "his", "her")
    nouns = ("cat", "sun", "tree", "road", "song", "boat")
    verbs = ("is", "was", "sees", "has", "gets", "made")
    return [f"{s} {n} {verbs[(i + j) % len(verbs)]}" for i, s in enumerate(starts) for j, n in enumerate(nouns)]


def _arith_prompts() -> list[str]:
    """Every `add A B =` with A + B <= 40 and `sub A B =` with A >= B, in a fixed shuffled order
    (so that any slice mixes both operations and all sizes)."""
    adds = [f"add {a} {b} =" for a in range(ARITH_MAX + 1) for b in range(ARITH_MAX + 1 - a)]
    subs = [f"sub {a} {b} =" for a in range(ARITH_MAX + 1) for b in range(a + 1)]
    prompts = adds + subs
    random.Random(0).shuffle(prompts)
    return prompts
