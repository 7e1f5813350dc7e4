"""Every check `hfplan execute` makes before a worker starts: hardware, layouts, batch shapes, data,
hyperparameters. Each failure is one HfplanError line; nothing has been started yet when it is raised."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hfplan.errors import HfplanError
from hfplan.hyperparams import Hyperparameters, with_overrides
from hfplan.layout import generating_role, unsupported_role
from hfplan.plan import Plan

if TYPE_CHECKING:
    from hfplan.executor.controller import ExecuteOptions


@dataclass(frozen=True)
class Checked:
    """What the checks established: how to run, with what, on which prompts."""

    device: str  # cpu | cuda
    backend: str  # gloo | nccl
    hyper: Hyperparameters
    prompts: list[str]
    encode: Callable[[list[str]], np.ndarray]
    decode_responses: Callable[[np.ndarray, np.ndarray], list[str]]
    decode_prompts: Callable[[np.ndarray], list[str]]


def check(plan: Plan, options: ExecuteOptions) -> Checked:
    if options.iterations < 1:
        raise HfplanError(f"--iterations must be at least 1, got {options.iterations}")
    hyper = with_overrides(plan.workload.hyperparameters, list(options.overrides))
    device, backend = check_hardware(plan)
    check_layouts(plan)
    check_vocabularies(plan)
    return Checked(device, backend, hyper, *_prompts_and_codecs(plan, options.data))


def check_hardware(plan: Plan) -> tuple[str, str]:
    profile = plan.cluster.profile
    if profile.backend == "gloo":
        return "cpu", "gloo"
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        raise HfplanError(f"the plan is for {profile.name} GPUs ({profile.backend}) but this machine has no CUDA "
                          "device; plan a CPU run with `hfplan search --hardware cpu`")
    return "cuda", profile.backend


def check_layouts(plan: Plan) -> None:
    """The contract's limits (hfplan.layout.unsupported_role: layouts and batch splits no executor runs, and
    the search never offers; generation with pp > 1 among them). This executor runs every other layout,
    pipeline stages with tensor and data parallelism included."""
    for role, par in plan.parallelism.items():
        problem = unsupported_role(plan.workload, role, par)
        if problem:
            raise HfplanError(f"parallelism.{role}: {problem}")


def check_vocabularies(plan: Plan) -> None:
    """Every model reads the actor's token ids, so every model role must share the actor's vocabulary."""
    workload = plan.workload
    actor_vocab = workload.arch(generating_role(workload)).vocab
    for role in workload.model_roles:
        vocab = workload.arch(role).vocab
        if vocab != actor_vocab:
            raise HfplanError(f"model of role {role} ({workload.models[role]}) has a vocabulary of {vocab}, the "
                              f"actor's has {actor_vocab}: every model must read the actor's tokens")


def _prompts_and_codecs(plan: Plan, data: str | None):
    from hfplan.executor.data import read_prompts
    from hfplan.executor.tokenizers import build_tokenizer, builtin_prompts, decode_responses, encode_prompts

    actor_ref = plan.workload.models[generating_role(plan.workload)]
    if data is not None:
        prompts = read_prompts(data)
    else:
        prompts = builtin_prompts(actor_ref)
        if prompts is None:
            raise HfplanError(f"model {actor_ref} has no built-in prompt set; give one with --data PATH "
                              "(.parquet or .jsonl with a 'prompt' column)")
    tokenizer = build_tokenizer(actor_ref)
    prompt_len = plan.workload.prompt_len

    def encode(texts: list[str]) -> np.ndarray:
        return encode_prompts(tokenizer, texts, prompt_len).numpy()

    def decode(responses: np.ndarray, mask: np.ndarray) -> list[str]:
        import torch

        return decode_responses(tokenizer, torch.from_numpy(responses), torch.from_numpy(mask))

    def decode_prompts(ids: np.ndarray) -> list[str]:
        return tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True)

    return prompts, encode, decode, decode_prompts



