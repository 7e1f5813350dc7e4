"""Small HF models for the engine tests, built directly from configs (random weights, fp32)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification, Qwen2Config, Qwen2ForCausalLM

from hfplan.executor.local import single_process_world
from hfplan.executor.mesh import ParallelDims
from hfplan.layout import LayoutLike

PAD = 0
VOCAB = 260


def dp_mesh(world: int, shard: bool) -> DeviceMesh:
    """A data-parallel CPU mesh of `world` ranks: fully sharded (ZeRO-3) or replicated (DDP-like)."""
    return (ParallelDims(1, 1, world, 1) if shard else ParallelDims(1, world, 1, 1)).build("cpu")


def llama_config(**overrides) -> LlamaConfig:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD,
                classifier_dropout=0.0)
    return LlamaConfig(**(base | overrides))


def llama_actor(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config()).float()


def llama_critic(seed: int = 0) -> LlamaForTokenClassification:
    torch.manual_seed(seed)
    return LlamaForTokenClassification(llama_config(num_labels=1)).float()


def qwen2_actor(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=PAD, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).float()


def random_sequences(batch: int, prompt_len: int, response_len: int, seed: int = 0):
    """Left-padded prompts and right-padded responses with varied lengths (at least one real token each)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, VOCAB, (batch, prompt_len), generator=gen)
    responses = torch.randint(1, VOCAB, (batch, response_len), generator=gen)
    prompt_lens = torch.randint(1, prompt_len + 1, (batch,), generator=gen)
    response_lens = torch.randint(1, response_len + 1, (batch,), generator=gen)
    prompt_lens[0], response_lens[0] = prompt_len, response_len  # one sequence without padding
    columns = torch.arange(prompt_len)
    prompts = torch.where(columns >= prompt_len - prompt_lens[:, None], prompts, PAD)
    response_mask = (torch.arange(response_len) < response_lens[:, None]).long()
    responses = torch.where(response_mask.bool(), responses, PAD)
    return prompts, responses, response_mask


def mesh_of(layout: LayoutLike) -> DeviceMesh:
    """A new CPU mesh of a layout (each call makes new process groups: a collective over the world)."""
    return ParallelDims.of(layout).build("cpu")


@contextlib.contextmanager
def one_rank_world() -> Iterator[None]:
    """The test process as a world of one (hfplan.executor.local.single_process_world) on one thread, as the
    spawned ranks run: single-rank references run in process (the engines need a process group)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with single_process_world():
            yield
    finally:
        torch.set_num_threads(threads)
