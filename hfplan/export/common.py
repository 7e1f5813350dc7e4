"""What every exporter shares: the refusal of plans a target cannot run, model paths, placeholders, the
lists of keys and flags each framework release defines (hfplan/export/known/<framework>-<version>*.txt, written
by scripts/export_keys.py from the release's wheel named in each list's header), and the result."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from hfplan.errors import HfplanError
from hfplan.plan import GenConfig, Plan
from hfplan.planner.targets import Target, get_target
from hfplan.profiles.models import CATALOG, DEMO_MODELS
from hfplan.simulator.mapping import PlanCosts

# Hugging Face repositories of the catalog's models (the published checkpoints their architectures are).
HF_REPOS = {
    "llama2-7b": "meta-llama/Llama-2-7b-hf", "llama2-13b": "meta-llama/Llama-2-13b-hf",
    "llama2-34b": "codellama/CodeLlama-34b-hf", "llama2-70b": "meta-llama/Llama-2-70b-hf",
    "llama3.1-8b": "meta-llama/Llama-3.1-8B", "llama3.1-70b": "meta-llama/Llama-3.1-70B",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B", "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B", "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen2.5-14b": "Qwen/Qwen2.5-14B", "qwen2.5-32b": "Qwen/Qwen2.5-32B", "qwen2.5-72b": "Qwen/Qwen2.5-72B",
}


@dataclass(frozen=True)
class Env:
    """A value the user supplies through an environment variable (data files, a reward function)."""

    name: str
    meaning: str


@dataclass(frozen=True)
class Export:
    framework: str
    command: str  # a shell command to paste, its comment lines first
    file_text: str  # what --out writes: verl's YAML config, OpenRLHF's shell script
    keys: tuple[str, ...]  # every key or flag written


def checked_target(plan: Plan, to: str) -> Target:
    """The target `to`, refusing (HfplanError, one line) a plan it cannot run, with the reason."""
    target = get_target(to, plan.workload)
    problem = target.plan_problem(plan)
    if problem:
        raise HfplanError(f"{target.source.framework} cannot run this plan: {problem}; search within what it runs "
                          f"with `hfplan search --target {to}`")
    return target


def model_path(ref: str) -> str:
    """A model as the frameworks load it: the Hugging Face repository of a catalog model, or the folder of a
    config.json checkpoint."""
    if ref in HF_REPOS:
        return HF_REPOS[ref]
    if ref in CATALOG or ref in DEMO_MODELS:
        raise HfplanError(f"model {ref!r} is hfplan's own demo model, with no checkpoint other frameworks load")
    path = Path(ref)
    return str(path.parent if path.name == "config.json" or path.suffix == ".json" else path)


def pool_shape(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of a set: whole nodes, or part of one."""
    return (gpus // gpus_per_node, gpus_per_node) if gpus >= gpus_per_node else (1, gpus)


@functools.cache
def known(name: str) -> frozenset[str]:
    """The keys or flags one framework defines (known/<name>.txt, comment lines naming the source)."""
    text = resources.files("hfplan.export").joinpath("known", f"{name}.txt").read_text()
    return frozenset(line for line in text.splitlines() if line and not line.startswith("#"))


def check_known(keys: list[str], name: str) -> None:
    unknown = [k for k in keys if k not in known(name)]
    if unknown:
        raise AssertionError(f"exporter wrote keys {name} does not define: {unknown}")


def vllm_memory_fraction(plan: Plan, gen: GenConfig) -> float:
    """vLLM's gpu_memory_utilization for a plan: the plan's (the search writes the one that gives vLLM's KV cache
    the room the plan was costed with), else that one computed now (PlanCosts.vllm_memory_utilization)."""
    if gen.gpu_memory_utilization is not None:
        return gen.gpu_memory_utilization
    return PlanCosts.of_plan(plan).vllm_memory_utilization()
