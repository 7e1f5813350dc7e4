"""What to plan for: the Workload (algorithm, models, batch and lengths) and the Cluster (GPUs, hardware)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hfplan.dataflow.registry import BUILTIN_ALGORITHMS, get_algorithm
from hfplan.dataflow.rewards import RULE_PREFIX, check_reward_ref, is_rule  # noqa: F401 (RULE_PREFIX: re-exported)
from hfplan.errors import HfplanError, describe_validation_error, known_names
from hfplan.files import read_mapping
from hfplan.hyperparams import Hyperparameters
from hfplan.profiles.hardware import HardwareProfile, load_hardware
from hfplan.profiles.models import CATALOG, DEMO_MODELS, ModelArch, resolve_model

# Views of the built-in algorithms' registry entries (hfplan.dataflow.registry), for the built-in
# workload table and for tests; code that must handle any algorithm asks the registry (or
# hfplan.layout.facts_of) about the workload's own algorithm.
_BUILTIN = BUILTIN_ALGORITHMS
ALGORITHM_ROLES: dict[str, tuple[str, ...]] = {name: tuple(a.roles) for name, a in _BUILTIN.items()}
TRAINED_ROLES = frozenset(r for a in _BUILTIN.values() for r, f in a.roles.items() if f.trains)
# Roles whose model ends in a scalar head (value or score) instead of the language-model head.
SCALAR_HEAD_ROLES = frozenset(r for a in _BUILTIN.values() for r, f in a.roles.items() if f.head == "scalar")
# A role whose facts allow it (a reward or a cost) may be a reward computed on the controller: `rule:<name>` or
# `module:function` (hfplan.dataflow.rewards.is_rule).


@dataclass(frozen=True)
class ResponseLengths:
    """How long responses are: at most `max_len`, with either a histogram (`points`: (length, probability),
    probabilities summing to 1) or only a mean (`points` empty). A fixed length is the one-point histogram."""

    max_len: int
    mean: float
    points: tuple[tuple[int, float], ...] = ()

    @classmethod
    def fixed(cls, length: int) -> ResponseLengths:
        return cls(max_len=length, mean=float(length), points=((length, 1.0),))

    @property
    def mean_square(self) -> float:
        """E[l^2]; with only a mean known, the mean times the maximum (the largest any distribution on
        [0, max] with that mean can have: the conservative choice for the contexts it weighs)."""
        if not self.points:
            return self.mean * self.max_len
        return sum(length * length * p for length, p in self.points)

    @property
    def held_by_slot(self) -> float:
        """Response tokens a continuously refilled engine slot holds on average: at decode step t a sequence
        holds t of them, and a slot spends time on a sequence in proportion to its length, so the mean is
        E[l(l-1)/2] / E[l] = (E[l^2] / E[l] - 1) / 2."""
        return (self.mean_square / self.mean - 1) / 2

    def peak_held(self, prompt_len: int) -> float:
        """Tokens per sequence at the fullest step of a batch started together whose finished sequences free
        their room: the largest P(l >= length) x (prompt + length) over the histogram; with only a mean known,
        prompt + the maximum (a fixed length gives that too)."""
        if not self.points:
            return float(prompt_len + self.max_len)
        out, left = 0.0, 1.0
        for length, p in sorted(self.points):
            out = max(out, left * (prompt_len + length))
            left -= p
        return out

    def expected_max(self, draws: int) -> float:
        """Expected longest of `draws` independent responses: the steps a static batch of that many runs.
        With only a mean known, the maximum."""
        if not self.points:
            return float(self.max_len)
        out, below = 0.0, 0.0
        for length, p in self.points:
            out += length * ((below + p) ** draws - below**draws)
            below += p
        return out


class _Derived(BaseModel):
    """A frozen model whose cached properties derive from its fields: a copy with fields updated computes them
    anew (pydantic's model_copy copies the instance's __dict__, where functools.cached_property keeps them)."""

    def model_copy(self, *, update: dict | None = None, deep: bool = False):
        copied = super().model_copy(update=update, deep=deep)
        for name, value in vars(type(self)).items():
            if isinstance(value, cached_property):
                copied.__dict__.pop(name, None)
        return copied


class HistogramBin(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    length: int = Field(gt=0, description="response tokens")
    weight: float = Field(gt=0, description="relative frequency (the bins' weights are normalised)")


class Workload(_Derived):
    """One RLHF iteration's shape. Field names are the file format (YAML or JSON). Strict types: a number
    written as a string is an error, never read as the number."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    algorithm: str = Field(description="a registered algorithm (built-in, or from the hfplan.algorithms entry points)")
    models: dict[str, str]
    prompt_len: int = Field(default=1024, gt=0)
    response_len: int = Field(default=1024, gt=0, description="the longest response (what generation may reach)")
    response_len_mean: float | None = Field(default=None, ge=1, description="mean response length, if responses "
                                                                            "end before response_len (at least 1: "
                                                                            "every response has its first token)")
    response_len_histogram: list[HistogramBin] | None = Field(
        default=None, min_length=1, description="response lengths as a histogram (instead of a mean)")
    batch_prompts: int = Field(default=1024, gt=0, description="prompts per iteration")
    samples_per_prompt: int = Field(default=1, gt=0, description="responses per prompt (GRPO: n)")
    mini_batches: int = Field(default=8, gt=0, description="updates per epoch")
    epochs: int = Field(default=1, gt=0)
    reuse_policy_log_probs: bool = Field(
        default=False, description="skip the actor's log_prob call: with one optimizer step per iteration "
        "(mini_batches = epochs = 1) the loss's ratio is taken against the current policy's own log-probs, "
        "detached (the same values and gradients); only for algorithms that read them nowhere else (GRPO)")
    staleness: int = Field(
        default=0, ge=0, description="0: synchronous (each iteration generates with the weights of the update "
        "before it); k > 0: generation may use weights up to k updates old, so that it overlaps the training of "
        "earlier iterations on a separate rollout set (the actor's loss then corrects for the older policy)")
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters,
                                             description="what a real run learns with; ignored by the simulator")

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, name: str) -> str:
        try:
            get_algorithm(name)
        except HfplanError as error:
            raise ValueError(str(error)) from None
        return name

    @model_validator(mode="after")
    def _check(self) -> Workload:
        algorithm = get_algorithm(self.algorithm)
        expected = tuple(algorithm.roles)
        for role in self.models:
            if role not in expected:
                raise ValueError(f"role {role!r} is not used by {self.algorithm}; its roles: {', '.join(expected)}")
        for role in expected:
            if role not in self.models:
                raise ValueError(f"{self.algorithm} needs a model for role {role!r}")
        for role, ref in self.models.items():
            if is_rule(ref) and not algorithm.roles[role].may_be_rule:
                rules = [r for r, f in algorithm.roles.items() if f.may_be_rule]
                raise ValueError(f"role {role!r} cannot be a rule; only {' and '.join(rules) or 'no role'} can")
        if self.samples_per_prompt < algorithm.min_samples_per_prompt:
            raise ValueError(f"{self.algorithm} needs samples_per_prompt >= {algorithm.min_samples_per_prompt}")
        if self.response_len_mean is not None and self.response_len_histogram is not None:
            raise ValueError("give response_len_mean or response_len_histogram, not both")
        if self.response_len_mean is not None and self.response_len_mean > self.response_len:
            raise ValueError(f"response_len_mean {self.response_len_mean:g} exceeds response_len {self.response_len}")
        for b in self.response_len_histogram or ():
            if b.length > self.response_len:
                raise ValueError(f"response_len_histogram has length {b.length} > response_len {self.response_len}")
        if self.reuse_policy_log_probs and not algorithm.policy_log_probs_only_in_loss:
            raise ValueError(f"reuse_policy_log_probs: {self.algorithm} reads the actor's log-probs outside its "
                             "loss (in the rewards or advantages), so they must be computed")
        if self.reuse_policy_log_probs and (self.mini_batches, self.epochs) != (1, 1):
            raise ValueError(f"reuse_policy_log_probs needs one optimizer step per iteration (mini_batches = "
                             f"epochs = 1; here {self.mini_batches} and {self.epochs}): later steps need the "
                             "log-probs of the policy that generated")
        if self.sequences % self.mini_batches:
            raise ValueError(f"mini_batches ({self.mini_batches}) must divide the {self.sequences} sequences "
                             "per iteration")
        return self

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(get_algorithm(self.algorithm).roles)

    @property
    def model_roles(self) -> tuple[str, ...]:
        """Roles backed by a neural model (placed on GPUs), as opposed to rules on the controller."""
        return tuple(r for r in self.roles if not is_rule(self.models[r]))

    @property
    def sequences(self) -> int:
        """Responses generated per iteration."""
        return self.batch_prompts * self.samples_per_prompt

    def train_sequences_per_rank(self, dp: int) -> int:
        """Sequences one of `dp` data-parallel ranks trains on per mini-batch: the most a micro-batch holds."""
        return -(-(self.sequences // self.mini_batches) // dp)

    @cached_property
    def response_lengths(self) -> ResponseLengths:
        """The response-length distribution generation is costed with (fixed at response_len by default)."""
        if self.response_len_histogram is not None:
            merged: dict[int, float] = {}
            for b in self.response_len_histogram:
                merged[b.length] = merged.get(b.length, 0.0) + b.weight
            total = sum(merged.values())
            points = tuple((length, w / total) for length, w in sorted(merged.items()))
            return ResponseLengths(self.response_len, sum(length * p for length, p in points), points)
        if self.response_len_mean is not None:
            return ResponseLengths(self.response_len, float(self.response_len_mean))
        return ResponseLengths.fixed(self.response_len)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def tokens_per_iteration(self) -> int:
        """Prompt plus response tokens of all sequences: the numerator of tokens/s."""
        return self.sequences * self.seq_len

    def arch(self, role: str) -> ModelArch:
        return _resolve_cached(self.models[role])

    def check_models(self) -> None:
        """Resolve every model reference now, so that a bad name fails before any work starts, and check
        that every sequence fits each model's context length. A controller reward's function is not imported
        here (the planner runs without the user's packages): `hfplan execute` imports it before any worker
        starts."""
        algorithm = get_algorithm(self.algorithm)
        for role in self.roles:
            ref = self.models[role]
            looks_like_function = ":" in ref and "/" not in ref and not Path(ref).exists()
            if is_rule(ref) or (algorithm.roles[role].may_be_rule and looks_like_function):
                try:
                    check_reward_ref(ref)
                except HfplanError as error:
                    raise HfplanError(f"models.{role}: {error}") from None
                continue
            context = self.arch(role).context_len
            if context is not None and self.seq_len > context:
                raise HfplanError(f"prompt_len + response_len = {self.prompt_len} + {self.response_len} = "
                                  f"{self.seq_len} tokens exceeds the context length of {role} model {ref} "
                                  f"({context:,} tokens)")

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


_ARCH_CACHE: dict[str, ModelArch] = {}


def _resolve_cached(ref: str) -> ModelArch:
    if ref not in _ARCH_CACHE:
        _ARCH_CACHE[ref] = resolve_model(ref)
    return _ARCH_CACHE[ref]


def _builtin_workloads() -> dict[str, dict]:
    table: dict[str, dict] = {}
    for model in CATALOG:
        if model in DEMO_MODELS:
            continue
        for algorithm in _BUILTIN.values():
            spec: dict = {"algorithm": algorithm.name, "models": {role: model for role in algorithm.roles}}
            if algorithm.min_samples_per_prompt > 1:
                # Several responses per prompt (GRPO's groups): 256 prompts x 4 keeps 1024 responses per
                # iteration, like the other algorithms' defaults.
                spec |= {"batch_prompts": 256, "samples_per_prompt": 4}
            table[f"{algorithm.name}-{model}"] = spec
    table["demo"] = {
        "algorithm": "ppo",
        "models": {"actor": "tiny", "critic": "tiny", "reference": "tiny", "reward": "rule:vowel-fraction"},
        "prompt_len": 16,
        "response_len": 16,
        "batch_prompts": 8,
        "mini_batches": 2,
        "epochs": 1,
        # A 2-layer model learns in tens of iterations only with far larger steps than a real one.
        "hyperparameters": {"actor_lr": 1e-3, "critic_lr": 1e-3},
    }
    # GRPO on the arithmetic model: 8 prompts x 4 samples, answers scored with partial credit (a random
    # model almost never says the exact answer, and groups of equal rewards teach nothing). Every prompt of its
    # built-in set is 5 tokens (<bos> op A B =), so prompt_len is that: the executor pads an iteration's prompts to
    # their longest, and the search prices prompt_len.
    table["arith-grpo"] = {
        "algorithm": "grpo",
        "models": {"actor": "tiny-arith", "reference": "tiny-arith", "reward": "rule:arith-close"},
        "prompt_len": 5,
        "response_len": 4,
        "batch_prompts": 8,
        "samples_per_prompt": 4,
        "mini_batches": 1,
        "epochs": 1,
        "hyperparameters": {"actor_lr": 3e-3},
    }
    return table


BUILTIN_WORKLOADS = _builtin_workloads()
DEFAULT_WORKLOAD = "ppo-llama2-7b"


def _anchored(ref: object, folder: Path) -> object:
    """A model reference of a workload file: a relative path means relative to the file's folder, and is
    stored resolved (absolute), so the plan made from it works from any folder."""
    if not isinstance(ref, str) or ref in CATALOG or is_rule(ref) or Path(ref).is_absolute():
        return ref
    candidate = folder / ref
    if "/" in ref or ref.endswith(".json") or candidate.exists():
        return str(candidate.resolve())
    return ref


def workload_from_dict(data: object, source: str, folder: Path | None = None) -> Workload:
    """Validate a workload. `folder`: the folder of the file it came from, against which relative model
    paths resolve (None: the data is not from a file, and paths are taken as they are)."""
    if not isinstance(data, dict):
        raise HfplanError(f"workload {source}: expected a mapping at the top level")
    if folder is not None and isinstance(data.get("models"), dict):
        data = data | {"models": {role: _anchored(ref, folder) for role, ref in data["models"].items()}}
    try:
        workload = Workload.model_validate(data)
    except ValidationError as bad:
        raise HfplanError(f"workload {source}: {describe_validation_error(bad)}") from None
    try:
        workload.check_models()
    except HfplanError as error:
        raise HfplanError(f"workload {source}: {error}") from None
    return workload


def load_workload(ref: str) -> Workload:
    """A built-in workload name, or the path of a workload YAML or JSON file."""
    if ref in BUILTIN_WORKLOADS:
        return workload_from_dict(BUILTIN_WORKLOADS[ref], ref)
    path = Path(ref)
    if not (ref.endswith((".yaml", ".yml", ".json")) or "/" in ref):
        raise HfplanError(f"unknown workload {ref!r}; built-in workloads are <algorithm>-<model> "
                          f"(algorithms: {known_names(_BUILTIN)}; models: "
                          f"{known_names(m for m in CATALOG if m not in DEMO_MODELS)}) and demo, arith-grpo, "
                          "or give a .yaml/.json path")
    if not path.is_file():
        raise HfplanError(f"workload file not found: {path}")
    return workload_from_dict(read_mapping(path, "workload"), str(path), folder=path.parent)


def is_power_of_two(n: int) -> bool:
    return n > 0 and not n & (n - 1)


class Cluster(_Derived):
    """The GPUs to plan for. `hardware` is a shipped profile name or a profile path."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    gpus: int = Field(gt=0)
    gpus_per_node: int = Field(gt=0, description="a power of two")
    hardware: str

    @field_validator("gpus_per_node")
    @classmethod
    def _node_size(cls, value: int) -> int:
        if not is_power_of_two(value):
            raise ValueError(f"must be a power of two, got {value}")
        return value

    @cached_property
    def profile(self) -> HardwareProfile:
        return load_hardware(self.hardware)

    @property
    def nodes(self) -> int:
        """Nodes used; the last one is partial when gpus is not a multiple of gpus_per_node."""
        return -(-self.gpus // self.gpus_per_node)


def make_cluster(gpus: int, hardware: str = "a100-80g", gpus_per_node: int | None = None) -> Cluster:
    if gpus <= 0:
        raise HfplanError(f"--gpus must be positive, got {gpus}")
    profile = load_hardware(hardware)
    per_node = profile.gpus_per_node if gpus_per_node is None else gpus_per_node
    if not is_power_of_two(per_node):
        raise HfplanError(f"--gpus-per-node must be a power of two, got {per_node}")
    if gpus_per_node is not None and gpus_per_node > gpus:
        # A profile's node larger than the cluster is one partial node; an explicit one is a mistake.
        raise HfplanError(f"--gpus-per-node {gpus_per_node} is more than --gpus {gpus}")
    cluster = Cluster(gpus=gpus, gpus_per_node=per_node, hardware=hardware)
    cluster.__dict__["profile"] = profile  # already loaded: keep it
    return cluster
