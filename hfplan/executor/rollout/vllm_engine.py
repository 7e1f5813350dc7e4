"""vLLM as a rollout engine (a plan's `gen.engine: vllm`): its paged KV cache and continuous batching, behind
hfplan's RolloutEngine interface.

The engine runs in the worker's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0). A worker already belongs to its
set's torch.distributed world, and vLLM would otherwise start a world of its own; so inside a world it runs with
vLLM's `external_launcher` backend, as verl does: every rank of the set builds one engine at once, vLLM cuts its
tensor-parallel groups from the existing world (consecutive ranks, tp innermost: hfplan.layout's rank order, so
they are the generation layout's tp groups), and the ranks of a group schedule alike and sample alike from the
same per-request seeds. One engine process per replica, the other choice, would copy every weight update across
processes and own its own devices, which the hybrid engine's one-process-per-GPU design excludes.

vLLM builds its model from the HF config alone (dummy weights); `load_weights` then reloads its weights in place
from the actor's tensors in memory (the worker's `reload_weights`, whole tensors by HF name: vLLM cuts its own
tensor-parallel pieces) and drops the prefix cache, which holds keys of the old weights. Where the platform has
vLLM's sleep mode (CUDA, ROCm, XPU), `release_weights` puts the engine to sleep (level 2: weights and KV cache
freed), `load_weights` wakes its weights and `generate` its KV cache (after the hybrid engine has freed what it
gathered); on CPU the engine keeps both between generations.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from hfplan.errors import HfplanError
from hfplan.executor.rollout.base import Rollout, SamplingParams
from hfplan.executor.rollout.installed import vllm_missing
from hfplan.layout import kv_heads_per_rank


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor of a parameter (a DTensor gathered: a collective every rank of its mesh calls in turn)."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def _kv_bytes(config, dtype: torch.dtype, tokens: int, tp: int) -> int:
    """Bytes of one tensor-parallel rank's KV cache holding `tokens` tokens (every layer's keys and values of the
    rank's KV heads: a share of them, or one copied head where tp exceeds them)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    heads = kv_heads_per_rank(config.num_key_value_heads, tp)
    return 2 * config.num_hidden_layers * heads * head_dim * itemsize * tokens


class VllmRolloutEngine:
    """One vLLM engine of a generation replica (see the module docstring).

    `max_num_seqs`: the sequences it runs at once (the plan's gen.max_batch, or the replica's share of an
    iteration); `max_model_len`: prompt + response length. `gpu_memory_utilization`: on GPUs, the fraction of
    the device vLLM budgets for its weights, activations and KV cache (vLLM's default where None). On CPU the
    KV cache gets the room of `max_num_seqs` sequences at `max_model_len` (vLLM's CPU default is most of the
    host's memory). `eos_id` < 0: no token ends a response (as the torch engine's)."""

    def __init__(self, config, pad_id: int, eos_id: int, *, max_num_seqs: int, max_model_len: int,
                 dtype: torch.dtype, device: torch.device, tp: int = 1,
                 gpu_memory_utilization: float | None = None) -> None:
        problem = vllm_missing()
        if problem:
            raise HfplanError(problem)
        import torch.distributed as dist

        self.pad_id, self.eos_id, self.tp = pad_id, eos_id, tp
        self.copies_weights = True  # reload_weights copies into vLLM's own parameters
        self._device = torch.device(device)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, its steps deterministic
        # hfplan's CPU workers share the host's cores (one Ray CPU each): vLLM's own binding would pin every
        # worker's threads to the same cores. A user who binds (VLLM_CPU_OMP_THREADS_BIND) keeps that.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # vLLM logs its configuration and warm-up at INFO on stdout; errors only, unless the user says otherwise
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        if self._device.type == "cpu":
            _check_cpu_head_dim(config)
        self._folder = tempfile.TemporaryDirectory(prefix="hfplan-vllm-")
        config.to_json_file(os.path.join(self._folder.name, "config.json"))
        args: dict = dict(model=self._folder.name, skip_tokenizer_init=True, load_format="dummy",
                          dtype=str(dtype).removeprefix("torch."), tensor_parallel_size=tp,
                          max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          # log-probs of the sampled tokens after temperature (the interface's), not raw ones
                          logprobs_mode="processed_logprobs")
        self._ident: str | None = None  # the name of this group of engines (in a world)
        if dist.is_available() and dist.is_initialized():
            args["distributed_executor_backend"] = "external_launcher"
            ident = [f"hfplan-vllm-{uuid.uuid4().hex[:12]}"]
            dist.broadcast_object_list(ident, src=0)  # every rank of the world builds its engine now
            self._ident = ident[0]
        if self._device.type == "cpu":
            args["enforce_eager"] = True  # no torch.compile of the model on CPU: minutes of start-up for nothing
            block = _cpu_block_tokens()
            blocks = max_num_seqs * -(-max_model_len // block) + 1  # vLLM keeps one block aside (its null block)
            args |= dict(block_size=block, kv_cache_memory_bytes=_kv_bytes(config, dtype, blocks * block, tp))
        elif gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = gpu_memory_utilization
        from vllm import LLM
        from vllm.platforms import current_platform

        self._sleeps = current_platform.is_sleep_mode_available()
        if self._sleeps:
            args["enable_sleep_mode"] = True
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it process-wide; put it back
        try:
            with _external_launcher(self._ident, self._device):
                self._llm = LLM(**args)
        finally:
            torch.set_num_threads = set_num_threads
        self._loaded = self._asleep = self._kv_asleep = False
        if self._sleeps:
            self._sleep()

    def load_weights(self, model: torch.nn.Module, presharded: bool = False) -> None:
        """Reload vLLM's weights in place from `model`'s tensors by HF name. `presharded` tensors are this rank's
        tensor-parallel pieces: whole ones at tp = 1, which is the only size vLLM takes them at."""
        if presharded and self.tp > 1:
            raise ValueError("vLLM cuts its own tensor-parallel pieces: it needs whole weights at tp > 1")
        if self._asleep:
            self._llm.wake_up(tags=["weights"])
            self._asleep, self._kv_asleep = False, True  # its KV cache waits for the next generate: by then the
            # caller has freed what it gathered
        weights = ((name, _whole(tensor)) for name, tensor in model.state_dict().items())
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self._llm.reset_prefix_cache()
        self._loaded = True

    def release_weights(self) -> None:
        """Where vLLM can sleep, free its weights and KV cache until the next `load_weights`."""
        if self._sleeps and self._loaded:
            self._sleep()
        self._loaded = False

    def _sleep(self) -> None:
        self._llm.sleep(level=2)  # level 2: its weights are dropped, not kept on the host (reloaded anyway)
        self._asleep, self._kv_asleep = True, False

    def close(self) -> None:
        """Stop the engine. vLLM's teardown also ends this process's torch.distributed world (it ends the
        distributed state it joined): for the end of a worker, or of a test."""
        self._llm.llm_engine.engine_core.shutdown()
        self._folder.cleanup()
        if self._ident is not None:  # the CPU workers' shared-memory segments, which vLLM leaves behind
            for segment in Path("/dev/shm").glob(f"{self._ident}-*"):
                segment.unlink(missing_ok=True)

    def generate(
        self, prompts: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
    ) -> Rollout:
        """`params.n` responses per row of left-padded `prompts` [B, P], each request seeded from `generator`
        (so every rank of a tensor-parallel group samples the same tokens)."""
        if not self._loaded:
            raise RuntimeError("the rollout engine holds no weights: call load_weights(model) first")
        if self._kv_asleep:
            self._llm.wake_up(tags=["kv_cache"])
            self._kv_asleep = False
        if prompts.dim() != 2 or prompts.dtype != torch.long or prompts.shape[0] == 0:
            raise ValueError(f"prompts must be a non-empty [B, P] long tensor, got {tuple(prompts.shape)} "
                             f"{prompts.dtype}")
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt

        rows = prompts.cpu()
        device = generator.device if generator is not None else torch.device("cpu")
        seeds = torch.randint(0, 2**31 - 1, (rows.shape[0],), generator=generator, device=device).tolist()
        # vLLM samples greedily only once a request: a greedy group is n requests of one sample
        n, copies = (1, params.n) if params.greedy else (params.n, 1)
        requests = [TokensPrompt(prompt_token_ids=[t for t in row.tolist() if t != self.pad_id])
                    for row in rows for _ in range(copies)]
        sampling = [VllmParams(n=n, temperature=0.0 if params.greedy else params.temperature,
                               top_p=params.top_p, max_tokens=params.max_new_tokens, logprobs=0,
                               # the engine's EOS alone ends a response (not the config's too)
                               ignore_eos=True, stop_token_ids=[self.eos_id] if self.eos_id >= 0 else [],
                               detokenize=False, seed=seed)
                    for seed in seeds for _ in range(copies)]
        outputs = self._llm.generate(requests, sampling, use_tqdm=False)
        total, length = rows.shape[0] * params.n, params.max_new_tokens
        responses = torch.full((total, length), self.pad_id, dtype=torch.long)
        log_probs = torch.zeros(total, length)
        for i, output in enumerate(outputs):
            for sample in sorted(output.outputs, key=lambda s: s.index):
                row, tokens = i * n + sample.index, list(sample.token_ids)[:length]
                responses[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
                # logprobs=0: each step's dict holds the sampled token alone
                log_probs[row, : len(tokens)] = torch.tensor([step[t].logprob for step, t in
                                                              zip(sample.logprobs, tokens, strict=False)])
        mask = torch.zeros(total, length)
        for row in range(total):
            ended = (responses[row] == self.eos_id).nonzero()
            mask[row, : int(ended[0]) + 1 if len(ended) else length] = 1.0
        out_device = prompts.device
        return Rollout(prompts.repeat_interleave(params.n, dim=0), responses.to(out_device), mask.to(out_device),
                       log_probs.to(out_device))


@contextlib.contextmanager
def _external_launcher(ident: str | None, device: torch.device) -> Iterator[None]:
    """What vLLM's `external_launcher` reads while an engine starts in a world: RANK and LOCAL_RANK (set for the
    start only), and a name for the group. vLLM's CPU workers name their tensor-parallel shared-memory segments
    after the launcher's init method, which the launcher fixes to env://: every engine group of a host would
    share names, and a segment an ended run left behind would collide with the next. On CPU the group's engines
    get `ident` as that name (a file:// init method whose base name it is; the method itself goes unused, as the
    world exists). `ident` None: no world, nothing to set."""
    if ident is None:
        yield
        return
    import torch.distributed as dist
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    original = ExecutorWithExternalLauncher._distributed_args
    local_rank = (device.index or 0) if device.type == "cuda" else 0

    def named(executor) -> tuple[str, int, int]:
        method, rank, local = original(executor)  # env:// and the ranks set here
        return (f"file:///{ident}" if device.type == "cpu" else method), rank, local

    saved = {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK")}
    os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(local_rank))
    ExecutorWithExternalLauncher._distributed_args = named
    try:
        yield
    finally:
        ExecutorWithExternalLauncher._distributed_args = original
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _cpu_block_tokens() -> int:
    """The smallest KV-cache block vLLM's CPU attention takes (it runs multiples of one size)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    size = min(CPUAttentionBackend.get_supported_kernel_block_sizes(), key=lambda s: getattr(s, "base", s))
    return getattr(size, "base", size)


def _check_cpu_head_dim(config) -> None:
    """vLLM's CPU attention runs a fixed set of head sizes; refuse others before building anything."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        raise HfplanError(f"vLLM's CPU attention does not run head_dim {head_dim} (it runs "
                          f"{', '.join(map(str, sizes))}); use the torch rollout engine (--rollout torch)")
