"""Every check `hfplan execute` makes before a worker starts, in two phases. `check_inputs` needs neither torch
nor Ray (options, hyperparameters, hardware of a CPU plan, layouts, vocabularies, the controller's reward
functions, imported here, the prompts file, the run folder), so a bad input is refused in well under two seconds
(unless a reward function's own module is slow to import); `with_codecs` then builds the tokenizer and checks
the prompts' lengths. Each failure is one HfplanError line; nothing has been started yet when it is raised."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hfplan.dataflow.rewards import Reward, is_rule, load_reward
from hfplan.errors import HfplanError
from hfplan.executor.loggers import check_available as check_loggers
from hfplan.executor.loggers import parse_names
from hfplan.executor.rollout.installed import vllm_missing
from hfplan.files import check_new_folder
from hfplan.hyperparams import Hyperparameters, with_overrides
from hfplan.layout import generating_role, unsupported_role
from hfplan.plan import Plan

if TYPE_CHECKING:
    from hfplan.executor.controller import ExecuteOptions
    from hfplan.executor.data import PromptSet


LONG_PROMPTS = ("truncate", "refuse")  # what a prompt longer than the workload's prompt_len gets



@dataclass(frozen=True)
class Inputs:
    """What the torch-free checks established."""

    device: str  # cpu | cuda
    backend: str  # gloo | nccl
    hyper: Hyperparameters
    prompts: list[str]
    columns: dict[str, list]  # the data's other columns, one value per prompt (what a reward function reads)
    rewards: dict[str, Reward]  # the roles computed on the controller, imported
    eval_set: PromptSet | None = None  # the held-out prompts of --eval-data


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
    columns: dict[str, list]
    rewards: dict[str, Reward]
    truncated: str | None = None  # how many prompts keep only their last prompt_len tokens (a warning to give)
    eval_set: PromptSet | None = None  # the held-out prompts of --eval-data (their columns go to the rewards)


def check(plan: Plan, options: ExecuteOptions) -> Checked:
    return with_codecs(plan, check_inputs(plan, options), options)


def check_inputs(plan: Plan, options: ExecuteOptions) -> Inputs:
    if options.iterations < 1:
        raise HfplanError(f"--iterations must be at least 1, got {options.iterations}")
    if options.checkpoint_every is not None and options.checkpoint_every < 1:
        raise HfplanError(f"--checkpoint-every must be at least 1, got {options.checkpoint_every}")
    if options.keep < 1:
        raise HfplanError(f"--keep must be at least 1, got {options.keep}")
    if options.long_prompts not in LONG_PROMPTS:
        raise HfplanError(f"--long-prompts {options.long_prompts}: expected one of {', '.join(LONG_PROMPTS)}")
    if options.log_every < 1:
        raise HfplanError(f"--log-every must be at least 1, got {options.log_every}")
    if options.samples < 0:
        raise HfplanError(f"--samples must be at least 0, got {options.samples}")
    check_eval_options(options.eval_data, options.eval_every)
    check_loggers(parse_names(options.loggers))
    hyper = with_overrides(plan.workload.hyperparameters, list(options.overrides))
    device, backend = check_hardware(plan)
    check_layouts(plan)
    check_rollout_engine(plan)
    check_vocabularies(plan)
    rewards = load_rewards(plan)
    check_new_folder(options.out, "--out")
    if options.address is not None:
        check_reachable(options.address, options.connect_timeout_s)
    data = _prompts(plan, options.data)
    return Inputs(device, backend, hyper, data.prompts, data.columns, rewards, _eval_prompts(options.eval_data))


def with_codecs(plan: Plan, inputs: Inputs, options: ExecuteOptions) -> Checked:
    """The tokenizer's encode and decode functions (hfplan.executor.codec: no torch, and transformers only for a
    checkpoint folder's own tokenizer), and the prompts checked against `prompt_len`: a longer one is refused
    (`--long-prompts refuse`) or keeps its last `prompt_len` tokens (`Checked.truncated` counts them, for a
    warning once every check has passed)."""
    from hfplan.executor.codec import build_codec

    codec = build_codec(plan.workload.models[generating_role(plan.workload)])
    prompt_len = plan.workload.prompt_len
    found = [_longer(codec, inputs.prompts, prompt_len, "prompts")]
    if inputs.eval_set is not None:
        found.append(_longer(codec, inputs.eval_set.prompts, prompt_len, "--eval-data prompts"))
    longer = [what for what in found if what is not None]
    truncated = None
    if longer:
        what = "; ".join(longer)
        if options.long_prompts == "refuse":
            raise HfplanError(f"{what}; shorten them, raise prompt_len, or run with --long-prompts truncate")
        truncated = f"{what}: each keeps its last {prompt_len} tokens"

    def encode(texts: list[str]) -> np.ndarray:
        return codec.encode(texts, prompt_len)

    return Checked(inputs.device, inputs.backend, inputs.hyper, inputs.prompts, encode, codec.decode_responses,
                   codec.decode, inputs.columns, inputs.rewards, truncated, inputs.eval_set)


def _longer(codec, prompts: list[str], prompt_len: int, what: str) -> str | None:
    """How many of `prompts` are longer than prompt_len tokens, as a sentence (None: none is)."""
    lengths = [len(ids) for ids in codec.encode_batch(list(prompts))]
    longer = [n for n in lengths if n > prompt_len]
    if not longer:
        return None
    return (f"{len(longer)} of {len(lengths)} {what} are longer than the workload's prompt_len of {prompt_len} "
            f"tokens (the longest has {max(longer)})")


def check_eval_options(eval_data: str | None, eval_every: int | None) -> None:
    """--eval-every is a positive interval, and only with the prompts it evaluates."""
    if eval_every is not None and eval_every < 1:
        raise HfplanError(f"--eval-every must be at least 1, got {eval_every}")
    if eval_every is not None and eval_data is None:
        raise HfplanError(f"--eval-every {eval_every} needs --eval-data PATH (the held-out prompts to evaluate)")


def _eval_prompts(eval_data: str | None) -> PromptSet | None:
    """The held-out prompts, read as --data's (.parquet or .jsonl with a `prompt` column, other columns kept)."""
    if eval_data is None:
        return None
    from hfplan.executor.data import read_prompts

    try:
        return read_prompts(eval_data)
    except HfplanError as bad:
        raise HfplanError(f"--eval-data: {bad}") from None


def check_hardware(plan: Plan) -> tuple[str, str]:
    profile = plan.cluster.profile
    if profile.on_host:
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


def check_rollout_engine(plan: Plan) -> None:
    """A plan that generates with vLLM needs it installed (one line naming the extra; --rollout torch runs the
    plan on hfplan's own engine instead)."""
    for role, par in plan.parallelism.items():
        problem = vllm_missing() if par.gen is not None and par.gen.engine == "vllm" else None
        if problem:
            raise HfplanError(f"parallelism.{role}.gen.engine is vllm but {problem}; or run it on hfplan's own "
                              "engine: hfplan execute --rollout torch")


def check_vocabularies(plan: Plan) -> None:
    """Every model reads the actor's token ids, so every model role must share the actor's vocabulary."""
    workload = plan.workload
    actor_vocab = workload.arch(generating_role(workload)).vocab
    for role in workload.model_roles:
        vocab = workload.arch(role).vocab
        if vocab != actor_vocab:
            raise HfplanError(f"model of role {role} ({workload.models[role]}) has a vocabulary of {vocab}, the "
                              f"actor's has {actor_vocab}: every model must read the actor's tokens")


def load_rewards(plan: Plan) -> dict[str, Reward]:
    """The controller's rewards, imported now (the planner only checked their names): a function that is not
    installed, not there or not callable stops the run before anything starts."""
    rewards = {}
    for role in plan.workload.roles:
        ref = plan.workload.models[role]
        if is_rule(ref):
            try:
                rewards[role] = load_reward(ref)
            except HfplanError as error:
                raise HfplanError(f"models.{role}: {error}") from None
    return rewards


def _prompts(plan: Plan, data: str | None) -> PromptSet:
    from hfplan.executor.data import PromptSet, read_prompts
    from hfplan.executor.prompts import builtin_prompts

    if data is not None:
        return read_prompts(data)
    actor_ref = plan.workload.models[generating_role(plan.workload)]
    prompts = builtin_prompts(actor_ref)
    if prompts is None:
        raise HfplanError(f"model {actor_ref} has no built-in prompt set; give one with --data PATH "
                          "(.parquet or .jsonl with a 'prompt' column)")
    return PromptSet(prompts)


def check_reachable(address: str, timeout_s: float) -> None:
    """A `host:port` cluster address must accept a connection within `timeout_s` (Ray itself retries for
    minutes); other forms (`auto`, `ray://...`) are left to Ray."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except TimeoutError:
        raise HfplanError(f"--address {address}: no Ray cluster answered within {timeout_s:g} s "
                          "(--connect-timeout S waits longer)") from None
    except OSError as bad:
        raise HfplanError(f"--address {address}: no Ray cluster there ({bad.strerror or bad})") from None
