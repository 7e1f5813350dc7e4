"""HF transformers models of a model reference: a catalog name, a `config.json`, or a checkpoint folder.

head="lm" is the causal LM (actor, reference); head="scalar" is the same backbone with a hidden->1
projection per position (critic, reward and cost models: `<Arch>ForTokenClassification`, one label).
Built models are randomly initialised under a seed, so the reference built with the actor's seed
starts from the actor's weights, and a scalar model's backbone equals the LM's.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    AutoConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForTokenClassification,
    MistralForCausalLM,
    MistralForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForTokenClassification,
)

from hfplan.errors import HfplanError
from hfplan.executor.tokenizers import build_tokenizer
from hfplan.profiles.models import CATALOG, ModelArch, resolve_model

Head = Literal["lm", "scalar"]

# SDPA: with left padding and position_ids it matches unpadded sequences and leaves no NaN in the rows
# of padded positions (NaN there would poison gradients even under a zero loss mask); tests pin both.
ATTENTION = "sdpa"

_CLASSES: dict[str, dict[str, type[PreTrainedModel]]] = {
    "llama": {"lm": LlamaForCausalLM, "scalar": LlamaForTokenClassification},
    "qwen2": {"lm": Qwen2ForCausalLM, "scalar": Qwen2ForTokenClassification},
    "mistral": {"lm": MistralForCausalLM, "scalar": MistralForTokenClassification},
}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def model_config_for(model_ref: str, layers: int | None = None) -> PretrainedConfig:
    """The HF config of a model reference (validated against the architectures hfplan runs); `layers`: a catalog
    model's with that many decoder layers (the profiler's deeper copy of the demo model)."""
    arch = resolve_model(model_ref)  # raises HfplanError for unknown or unsupported models
    path = Path(model_ref)
    if layers is not None:
        if model_ref not in CATALOG:
            raise HfplanError(f"model {model_ref}: only a catalog model is built with another layer count")
        config = _catalog_config(replace(arch, layers=layers))
    elif model_ref.endswith(".json") or path.is_dir() or path.is_file():
        file = path / "config.json" if path.is_dir() else path
        data = json.loads(file.read_text())
        data.pop("transformers_version", None)
        config = AutoConfig.for_model(data.pop("model_type", _model_type(data)), **data)
    else:
        config = _catalog_config(arch)
    config.use_cache = False
    config._attn_implementation = ATTENTION
    return config


def _model_type(data: dict) -> str:
    archs = data.get("architectures") or []
    return "qwen2" if "Qwen2ForCausalLM" in archs else "mistral" if "MistralForCausalLM" in archs else "llama"


def _catalog_config(arch: ModelArch) -> PretrainedConfig:
    tokenizer = build_tokenizer(arch.name)  # its special ids go into the config (save_pretrained, generate)
    common = dict(
        vocab_size=arch.vocab, hidden_size=arch.hidden, intermediate_size=arch.ffn,
        num_hidden_layers=arch.layers, num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads,
        head_dim=arch.dim_per_head, tie_word_embeddings=arch.tied_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch.attention_bias:
        return Qwen2Config(**common)
    return LlamaConfig(**common)


def build_model(model_ref: str, head: Head, *, seed: int, dtype: torch.dtype = torch.float32,
                layers: int | None = None) -> PreTrainedModel:
    """The model of a reference with the given head: loaded from a checkpoint folder with weights,
    else built from its config with random weights drawn under `seed`. `layers`: that many decoder layers in
    place of the config's (built, never loaded: the profiler times the demo model at two depths)."""
    if head not in ("lm", "scalar"):
        raise HfplanError(f"unknown model head {head!r}; known: lm, scalar")
    config = model_config_for(model_ref, layers)
    if head == "scalar":
        config.num_labels = 1
        config.classifier_dropout = 0.0  # value and reward heads read the hidden state as it is
    classes = _CLASSES.get(config.model_type)
    if classes is None:
        raise HfplanError(f"model {model_ref}: model type {config.model_type} is not supported")
    cls = classes[head]
    folder = Path(model_ref)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # also draws a scalar head over a loaded LM checkpoint deterministically
        if layers is None and folder.is_dir() and any((folder / name).is_file() for name in _WEIGHT_FILES):
            try:
                return cls.from_pretrained(str(folder), config=config, dtype=dtype, local_files_only=True)
            except (OSError, ValueError) as bad:
                raise HfplanError(f"model {model_ref}: weights do not load: {bad}") from None
        return cls(config).to(dtype)
