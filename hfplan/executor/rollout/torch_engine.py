"""A native torch rollout engine: its own decode loop over an HF Llama / Qwen2 / Mistral model's weights.

A prefill over left-padded prompts fills a KV cache preallocated for P + max_new_tokens columns; each
decode step then runs one token per row through the layers, reading the weights the model holds (shared,
not copied). Rows run in static waves or through continuously refilled slots (TorchRolloutEngine). The
model's train or eval mode does not matter: the loop has no dropout. The arithmetic follows the HF modules
it replaces (RMSNorm in fp32, rotary tables from the model's own inverse frequencies, grouped-query
attention, SwiGLU), so the log-probs it returns match a training-side forward over `sequences.join(...)`.

Tensor parallel generation: given a tensor-parallel process group, a rank keeps its own heads/tp query
heads and their KV heads (the KV cache holds only those), ffn/tp MLP columns, and a vocabulary slice
of the embedding and the head (Megatron's column / row splits, as `engines.tensor_parallel` lays
them out); o and down outputs and embedding lookups are all-reduced, the head's logits all-gathered, so
every rank of the group samples the same tokens from the same generator state. A tp larger than the
KV heads gives each rank a copy of the one KV head its query heads read. Weights come from DTensor
shards of the same group as they are (no gather), from any other DTensor gathered whole then cut, or
from plain tensors cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.activations import ACT2FN

from hfplan.errors import HfplanError
from hfplan.executor.engines.decoder_math import causal_mask, rms_norm, rotate
from hfplan.executor.rollout.base import Rollout, SamplingParams
from hfplan.executor.sequences import positions
from hfplan.layout import chunk_range, kv_head_copies, kv_heads_per_rank
from hfplan.plan import Batching

# Rotary types whose frequencies change with the sequence length at run time; a fixed table cannot follow them.
_DYNAMIC_ROPE = ("dynamic", "longrope")


def _full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor of a parameter: a DTensor (FSDP2, tensor parallel) is gathered, a plain one shared."""
    if tensor is None:
        return None
    if hasattr(tensor, "full_tensor"):
        return tensor.full_tensor().detach()
    return tensor.detach()


@dataclass(frozen=True)
class _TensorParallel:
    """This rank's place in a tensor-parallel group (size 1: no group, no collectives)."""

    group: dist.ProcessGroup | None
    size: int = 1
    rank: int = 0
    # The tensor-parallel rank of each member in the group's own rank order, where it is not that order
    # (a hybrid actor generating in hfplan.layout's generation places); None: the group's order.
    order: tuple[int, ...] | None = None
    presharded: bool = False  # the weights handed over are already this rank's pieces (engines.reshard)

    @staticmethod
    def of(group: dist.ProcessGroup | None, tp_ranks: Sequence[int] | None = None) -> _TensorParallel:
        """`tp_ranks`: each global rank's tensor-parallel rank, where the group's own order is not it."""
        if group is None or dist.get_world_size(group) == 1:
            return _TensorParallel(None)
        if tp_ranks is None:
            return _TensorParallel(group, dist.get_world_size(group), dist.get_rank(group))
        order = tuple(tp_ranks[r] for r in dist.get_process_group_ranks(group))
        return _TensorParallel(group, len(order), tp_ranks[dist.get_rank()], order)

    def shard(self, tensor: torch.Tensor | None, dim: int, rows: tuple[int, int] | None = None
              ) -> torch.Tensor | None:
        """This rank's chunk of `tensor` along `dim` (or, given `rows`, that [start, end) range of it)."""
        if tensor is None:
            return None
        if self.presharded:
            return tensor.detach()
        if self.size == 1 and rows is None:
            return _full(tensor)
        if rows is None and self._own_shard(tensor, dim):
            return tensor.to_local().detach()
        full = _full(tensor)
        start, end = rows or chunk_range(full.shape[dim], self.size, self.rank)
        return full.narrow(dim, start, end - start)

    def _own_shard(self, tensor: torch.Tensor, dim: int) -> bool:
        from torch.distributed.tensor import DTensor, Shard

        return (isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 1
                and tuple(tensor.placements) == (Shard(dim),)
                and dist.get_process_group_ranks(tensor.device_mesh.get_group())
                == dist.get_process_group_ranks(self.group))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor, full: int) -> torch.Tensor:
        """The pieces of every rank along the last dim, joined (chunk_range pieces, padded to one width)."""
        if self.group is None:
            return x
        width = -(-full // self.size)
        padded = F.pad(x, (0, width - x.shape[-1]))
        pieces = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(pieces, padded.contiguous(), group=self.group)
        if self.order is not None:
            pieces = [pieces[i] for i in sorted(range(self.size), key=self.order.__getitem__)]
        return torch.cat(pieces, dim=-1)[..., :full]


@dataclass(frozen=True)
class _Linear:
    weight: torch.Tensor
    bias: torch.Tensor | None
    reduce: _TensorParallel | None = None  # row-parallel: partial outputs summed over the group, then the bias

    @staticmethod
    def columns(module: torch.nn.Module, tp: _TensorParallel, rows: tuple[int, int] | None = None) -> _Linear:
        return _Linear(tp.shard(module.weight, 0, rows), tp.shard(module.bias, 0, rows))

    @staticmethod
    def rows(module: torch.nn.Module, tp: _TensorParallel) -> _Linear:
        return _Linear(tp.shard(module.weight, 1), _full(module.bias), tp if tp.size > 1 else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce is None:
            return F.linear(x, self.weight, self.bias)
        out = self.reduce.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


@dataclass(frozen=True)
class _Norm:
    weight: torch.Tensor
    eps: float

    @staticmethod
    def of(module: torch.nn.Module) -> _Norm:
        return _Norm(_full(module.weight), float(module.variance_epsilon))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True)
class _Layer:
    attn_norm: _Norm
    q: _Linear
    k: _Linear
    v: _Linear
    o: _Linear
    mlp_norm: _Norm
    gate: _Linear
    up: _Linear
    down: _Linear


@dataclass(frozen=True)
class _Weights:
    embed: torch.Tensor  # this rank's vocabulary rows [embed_start, embed_start + rows)
    embed_start: int
    layers: list[_Layer]
    norm: _Norm
    lm_head: torch.Tensor  # this rank's vocabulary rows of the head
    vocab: int
    tp: _TensorParallel
    inv_freq: torch.Tensor
    rope_scale: float  # the rotary tables' post-scaling (attention_scaling of the HF rotary module)
    heads: int  # query heads on this rank
    kv_heads: int  # KV heads on this rank (the KV cache's)
    head_dim: int
    scaling: float
    act: torch.nn.Module
    sliding_window: int | None

    @staticmethod
    def of(model: torch.nn.Module, tp: _TensorParallel) -> _Weights:
        config = model.config
        base = model.model
        rotary = base.rotary_emb
        if getattr(rotary, "rope_type", "default") in _DYNAMIC_ROPE:
            raise HfplanError(f"the torch rollout engine does not run rotary type {rotary.rope_type!r}")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % tp.size:
            raise ValueError(f"tensor-parallel generation with tp={tp.size}: it must divide the {heads} heads")
        local_kv_heads = kv_heads_per_rank(kv_heads, tp.size)  # raises unless tp divides or is a multiple of them
        attn = base.layers[0].self_attn
        kv_rows = None  # KV heads copied: the rows of the one KV head this rank's query heads read
        if kv_head_copies(kv_heads, tp.size) > 1:
            head = tp.rank * kv_heads // tp.size
            kv_rows = (head * attn.head_dim, (head + 1) * attn.head_dim)
        layers = [
            _Layer(
                attn_norm=_Norm.of(layer.input_layernorm),
                q=_Linear.columns(layer.self_attn.q_proj, tp), k=_Linear.columns(layer.self_attn.k_proj, tp, kv_rows),
                v=_Linear.columns(layer.self_attn.v_proj, tp, kv_rows), o=_Linear.rows(layer.self_attn.o_proj, tp),
                mlp_norm=_Norm.of(layer.post_attention_layernorm),
                gate=_Linear.columns(layer.mlp.gate_proj, tp), up=_Linear.columns(layer.mlp.up_proj, tp),
                down=_Linear.rows(layer.mlp.down_proj, tp),
            )
            for layer in base.layers[: config.num_hidden_layers]
        ]
        vocab = config.vocab_size
        return _Weights(
            embed=tp.shard(base.embed_tokens.weight, 0), embed_start=chunk_range(vocab, tp.size, tp.rank)[0],
            layers=layers, norm=_Norm.of(base.norm), lm_head=tp.shard(model.lm_head.weight, 0), vocab=vocab, tp=tp,
            inv_freq=rotary.inv_freq, rope_scale=float(rotary.attention_scaling),
            heads=heads // tp.size, kv_heads=local_kv_heads, head_dim=attn.head_dim,
            scaling=float(attn.scaling), act=ACT2FN[config.hidden_act],
            sliding_window=getattr(config, "sliding_window", None),
        )

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings of flat token ids; vocabulary-parallel: each rank looks up its rows, the lookups summed."""
        if self.tp.size == 1:
            return F.embedding(tokens, self.embed)
        local = tokens - self.embed_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.embed).masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(h, self.lm_head), self.vocab)


def top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool mask of the nucleus: the most probable tokens whose mass first reaches `top_p` (at least one)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probs [B] under log_softmax(logits / temperature) (1 when greedy)."""
    temperature = params.logit_temperature
    log_probs = F.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    if params.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        probs = log_probs.exp()
        if params.top_p < 1.0:
            probs = probs * top_p_keep(probs, params.top_p)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return tokens, log_probs.gather(1, tokens[:, None]).squeeze(1)


@dataclass
class GenerationStats:
    """The forward passes of the last `generate`: prefills (one per batch of prompts taken in) and decode steps
    (one token for every row of the running batch)."""

    prefills: int = 0
    decode_steps: int = 0


Tables = tuple[torch.Tensor, torch.Tensor]  # rotary cos and signed sin [columns, D]
Cache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer, (keys, values) [B, KV, columns, D]


class TorchRolloutEngine:
    """Batched generation with a preallocated KV cache; see the module docstring.

    `batching`: "static" runs the rows in waves of at most `max_batch` (as equal as can be; the first ones a
    row larger), each until its longest response ends; "continuous" keeps `max_batch` KV-cache slots busy:
    when a sequence ends (EOS or max_new_tokens) its slot takes the next waiting prompt, prefilled into that
    slot, and the slots decode together, each at its own column and rotary position. `max_batch` None: every
    row at once (both then run one batch). Either way the rollout has the same layout, rows in their order."""

    def __init__(self, model: torch.nn.Module | None, pad_id: int, eos_id: int,
                 tp_group: dist.ProcessGroup | None = None, batching: Batching = "static",
                 max_batch: int | None = None, tp_ranks: Sequence[int] | None = None) -> None:
        """`model`: the weights to start with (None: none until `load_weights`). `tp_group`: the
        tensor-parallel group this rank generates with (None: alone, whole weights); every rank of a group
        must call `load_weights` and `generate` together, with the same prompts. `tp_ranks`: each global
        rank's tensor-parallel rank where the group's own order is not it."""
        self.copies_weights = False  # it generates from the weights it is handed
        if batching not in get_args(Batching):
            raise ValueError(f"batching must be one of {', '.join(get_args(Batching))}, got {batching!r}")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.batching = batching
        self.max_batch = max_batch
        self.stats = GenerationStats()
        self._tp = _TensorParallel.of(tp_group, tp_ranks)
        self._w: _Weights | None = None
        if model is not None:
            self.load_weights(model)

    def load_weights(self, model: torch.nn.Module, presharded: bool = False) -> None:
        """`presharded`: the model's tensors are already this rank's pieces (its heads, columns, vocabulary
        rows), as the hybrid engine's plan-driven switch builds them; else they are cut here."""
        self._w = _Weights.of(model, replace(self._tp, presharded=presharded) if self._tp.size > 1 else self._tp)

    def release_weights(self) -> None:
        """Drop the engine's hold on the weights: frees gathered copies of sharded parameters (ZeRO-3
        keeps its memory savings while training); the next `generate` needs `load_weights` first."""
        self._w = None

    def close(self) -> None:
        """Nothing beyond the weights to free: it lets them go."""
        self.release_weights()

    @torch.inference_mode()
    def generate(
        self, prompts: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
    ) -> Rollout:
        """Sample `params.n` responses per row of `prompts` [B, P] (left-padded); `generator`, if given,
        lives on the model's device and makes sampling reproducible."""
        w = self._w
        if w is None:
            raise RuntimeError("the rollout engine holds no weights: call load_weights(model) first")
        if prompts.dim() != 2 or prompts.dtype != torch.long or prompts.shape[0] == 0:
            raise ValueError(f"prompts must be a non-empty [B, P] long tensor, got {tuple(prompts.shape)} "
                             f"{prompts.dtype}")
        device = w.embed.device
        prompts = prompts.to(device).repeat_interleave(params.n, dim=0)
        rows, prompt_len = prompts.shape
        total = prompt_len + params.max_new_tokens
        if w.sliding_window is not None and total > w.sliding_window:
            raise HfplanError(f"prompt + response length {total} exceeds the model's sliding window {w.sliding_window}")
        tables = self._rope_tables(total, device)
        self.stats = GenerationStats()
        slots = min(self.max_batch or rows, rows)
        if self.batching == "continuous" and slots < rows:
            responses, log_probs = self._continuous(prompts, params, generator, slots, tables)
        else:
            waves = [self._static(wave, params, generator, tables) for wave in prompts.tensor_split(-(-rows // slots))]
            responses, log_probs = (torch.cat(parts) for parts in zip(*waves, strict=True))
        # A row's tokens are real up to its first EOS included; what a finished row went on sampling is dropped.
        is_eos = responses == self.eos_id
        ended = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
        responses.masked_fill_(ended, self.pad_id)
        log_probs.masked_fill_(ended, 0.0)
        return Rollout(prompts, responses, (~ended).float(), log_probs)

    def _static(self, prompts: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                tables: Tables) -> tuple[torch.Tensor, torch.Tensor]:
        """Responses and log-probs [B, R] of one batch, decoded until every row has sampled EOS or R tokens."""
        rows, prompt_len = prompts.shape
        steps = params.max_new_tokens
        device = prompts.device
        prompt_mask = prompts != self.pad_id
        cache = self._new_cache(rows, prompt_len + steps)[1]
        logits = self._prefill(prompts, prompt_mask, tables, cache)
        # Decode: response token i sits at column P+i, rotary position (real prompt length + i); it sees
        # the real prompt tokens and every response column up to its own.
        key_mask = torch.cat([prompt_mask, prompt_mask.new_ones(rows, steps)], dim=1)[:, None, None]
        response_positions = prompt_mask.sum(dim=1, keepdim=True) + torch.arange(steps, device=device)
        step_cos, step_sin = (table[response_positions] for table in tables)
        responses = prompts.new_full((rows, steps), self.pad_id)
        log_probs = torch.zeros(rows, steps, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        for step in range(steps):
            tokens, log_probs[:, step] = sample_tokens(logits, params, generator)
            responses[:, step] = tokens
            finished |= tokens == self.eos_id
            if step + 1 == steps or bool(finished.all()):
                break
            column = prompt_len + step
            self.stats.decode_steps += 1
            logits = self._forward(
                responses[:, step: step + 1], step_cos[:, step: step + 1], step_sin[:, step: step + 1], cache,
                column, key_mask[..., : column + 1],
            )
        return responses, log_probs

    def _continuous(self, prompts: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                    slots: int, tables: Tables) -> tuple[torch.Tensor, torch.Tensor]:
        """Responses and log-probs [B, R] of B > `slots` rows through `slots` KV-cache slots, taken in row order.

        A slot's prompt fills cache columns 0..P-1 (left-padded, as a static batch's) and its response token
        i column P+i, so each step every running slot writes its own column and its query sees its real
        prompt tokens and its response columns up to its own. A slot that does not decode this step (it has
        just ended, or is idle) still runs through the batch, as a pad token at column P seeing its prompt;
        its output is dropped, and a slot's next sequence overwrites column P before it reads it. Every rank
        of a tensor-parallel group samples the same tokens, so all take the same host-side decisions."""
        rows, prompt_len = prompts.shape
        steps = params.max_new_tokens
        device = prompts.device
        cos, sin = tables
        prompt_mask = prompts != self.pad_id
        storage, cache = self._new_cache(slots, prompt_len + steps)
        slot_mask = prompt_mask[:slots].clone()  # the prompt mask of each slot's sequence
        slot_len = slot_mask.sum(dim=1)  # its real prompt length: the rotary position of response token 0
        logits = self._prefill(prompts[:slots], slot_mask, tables, cache)
        row_of: list[int | None] = list(range(slots))  # the row each slot holds; None once idle
        made = [0] * slots  # response tokens the slot's sequence has sampled
        waiting = slots  # the next row to take in
        responses = prompts.new_full((rows, steps), self.pad_id)
        log_probs = torch.zeros(rows, steps, device=device)
        while True:
            tokens, token_log_probs = sample_tokens(logits, params, generator)
            live = [s for s in range(slots) if row_of[s] is not None]
            # One host-to-device copy a step: (row, response column, slot) of each live sequence.
            row, column, slot = torch.tensor([[row_of[s] for s in live], [made[s] for s in live], live],
                                             device=device)
            responses[row, column] = tokens[slot]
            log_probs[row, column] = token_log_probs[slot]
            ended = (tokens == self.eos_id).tolist()
            for s in live:
                made[s] += 1
                if ended[s] or made[s] == steps:
                    row_of[s] = None
            going = [row_of[s] is not None for s in range(slots)]
            refill = [s for s in live if row_of[s] is None][: rows - waiting]
            if not any(going) and not refill:
                return responses, log_probs
            if any(going):
                offsets = [made[s] - 1 if going[s] else 0 for s in range(slots)]
                offset, decodes = torch.tensor([offsets, going], device=device)
                width = prompt_len + max(offsets) + 1
                seen = torch.arange(width - prompt_len, device=device)[None, :] <= offset[:, None]
                mask = torch.cat([slot_mask, seen], dim=1)[:, None, None]
                feed = torch.where(decodes.bool(), tokens, self.pad_id)[:, None]
                where = (slot_len + offset)[:, None]
                self.stats.decode_steps += 1
                logits = self._forward(feed, cos[where], sin[where], cache, prompt_len + offset, mask)
            if refill:
                taken = slice(waiting, waiting + len(refill))
                waiting = taken.stop
                into = torch.tensor(refill, device=device)
                new_storage, new_cache = self._new_cache(len(refill), prompt_len)
                logits[into] = self._prefill(prompts[taken], prompt_mask[taken], tables, new_cache)
                storage[:, :, into, :, :prompt_len] = new_storage
                slot_mask[into] = prompt_mask[taken]
                slot_len[into] = prompt_mask[taken].sum(dim=1)
                for s, row in zip(refill, range(taken.start, taken.stop), strict=True):
                    row_of[s], made[s] = row, 0

    def _new_cache(self, rows: int, columns: int) -> tuple[torch.Tensor, Cache]:
        """One allocation [layers, 2, rows, KV, columns, D] and each layer's (keys, values) views of it. Zeroed:
        a masked key still enters attention's product (weight 0), so it must not hold a stray NaN or inf."""
        w = self._w
        storage = w.embed.new_zeros((len(w.layers), 2, rows, w.kv_heads, columns, w.head_dim))
        return storage, [(storage[i, 0], storage[i, 1]) for i in range(len(w.layers))]

    def _prefill(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, tables: Tables, cache: Cache
                 ) -> torch.Tensor:
        """Logits [B, V] after the left-padded `prompts` [B, P], their keys and values in cache columns 0..P-1.
        Causal over real prompt tokens; a padded query also sees itself, so no row is empty."""
        where = positions(prompt_mask.long())
        self.stats.prefills += 1
        return self._forward(prompts, tables[0][where], tables[1][where], cache, 0, causal_mask(prompt_mask))

    def _rope_tables(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [length, D] of positions 0..length-1, computed as HF's rotary module does. The sin
        table carries the sign of HF's rotate_half (decoder_math.rotate)."""
        w = self._w
        angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * w.inv_freq.float()[None, :]
        cos = torch.cat([angles, angles], dim=-1).cos() * w.rope_scale
        sin = angles.sin() * w.rope_scale
        signed_sin = torch.cat([-sin, sin], dim=-1)
        return cos.to(w.embed.dtype), signed_sin.to(w.embed.dtype)

    def _forward(
        self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Cache, start: int | torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Run `tokens` [B, T] through the model; fp32 logits [B, V] of the last one. Their keys and values go
        to cache columns start..start+T-1, or with `start` a tensor [B] (T = 1), each row's to its own column;
        rotary tables cos, sin [B, T, D]. `mask` [B, 1, T, W]: which of the first W cached keys each query sees."""
        w = self._w
        rows, length = tokens.shape
        width = mask.shape[-1]
        cos, sin = cos[:, None], sin[:, None]
        # Per-row columns: one scatter index [B, KV, 1, D] for every layer's keys and values.
        column = None if isinstance(start, int) else start.view(rows, 1, 1, 1).expand(rows, w.kv_heads, 1, w.head_dim)
        h = w.embed_tokens(tokens.reshape(-1))  # [B*T, hidden]: 2-D matmuls are the cheapest on CPU
        for index, (layer, (keys, values)) in enumerate(zip(w.layers, cache, strict=True)):
            x = layer.attn_norm(h)
            k = rotate(layer.k(x).view(rows, length, w.kv_heads, w.head_dim).transpose(1, 2), cos, sin)
            v = layer.v(x).view(rows, length, w.kv_heads, w.head_dim).transpose(1, 2)
            if column is None:
                keys.narrow(2, start, length).copy_(k)
                values.narrow(2, start, length).copy_(v)
            else:
                keys.scatter_(2, column, k)
                values.scatter_(2, column, v)
            if index == len(w.layers) - 1 and length > 1:
                # Only the last token's logits are read: the last layer's queries, attention output and MLP are
                # computed for it alone (every token's keys and values are in the cache already).
                h, x = h.view(rows, length, -1)[:, -1], x.view(rows, length, -1)[:, -1]
                cos, sin, mask, length = cos[:, :, -1:], sin[:, :, -1:], mask[:, :, -1:], 1
            q = rotate(layer.q(x).view(rows, length, w.heads, w.head_dim).transpose(1, 2), cos, sin)
            attn = F.scaled_dot_product_attention(
                q, keys.narrow(2, 0, width), values.narrow(2, 0, width), attn_mask=mask, scale=w.scaling,
                enable_gqa=w.heads != w.kv_heads,
            )
            h = h + layer.o(attn.transpose(1, 2).reshape(rows * length, -1))
            x = layer.mlp_norm(h)
            h = h + layer.down(w.act(layer.gate(x)) * layer.up(x))
        last = h.view(rows, length, -1)[:, -1]
        return w.logits(w.norm(last)).float()
