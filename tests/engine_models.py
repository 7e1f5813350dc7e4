"""Small HF models for the engine tests, built directly from configs (random weights, fp32)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification, Qwen2Config, Qwen2ForCausalLM

PAD = 0
VOCAB = 260


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
