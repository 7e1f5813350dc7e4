"""Model catalog: exact decoder-only transformer architectures, and loading of HF `config.json` files.

Figures (context length included: `max_position_embeddings`) are the published `config.json` values of each
checkpoint on the Hugging Face hub
(meta-llama/Llama-2-*-hf, codellama/CodeLlama-34b-hf, meta-llama/Llama-3.1-*, Qwen/Qwen2.5-*).
Parameter counts are derived from the architecture, never stored.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from hfplan.errors import HfplanError, known_names
from hfplan.files import read_mapping

# Architectures hfplan can cost and run: dense decoder-only models with RMSNorm, rotary embeddings,
# grouped-query attention and a SwiGLU MLP (gate, up and down projections).
SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


# MLP kinds and their h x ffn weight matrices (ModelArch.mlp).
MLP_KINDS = {"swiglu": 3, "gelu": 2}


@dataclass(frozen=True)
class ModelArch:
    """One decoder-only transformer architecture (Llama family layout)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k and v projections
    # Every projection of a block has a bias (q, k, v, the attention's output, the MLP's): GPT-2, and MPT as its
    # benchmark runs built it (MPTConfig's no_bias False). Only what the cost model describes: hfplan's executor
    # builds none.
    linear_bias: bool = False
    head_dim: int | None = None  # None: hidden // heads
    # Longest sequence (prompt + response) the model was built for: config.json's max_position_embeddings.
    # None when unknown (a config.json without the field, a synthetic model): not checked.
    context_len: int | None = None
    # The MLP: "swiglu" (gate, up and down projections, silu(gate) * up: Llama, Qwen2, Mistral) or "gelu" (up and
    # down, GeLU between: GPT-2/3, MPT, GPT-J). Only what the cost model describes: hfplan's executor builds the
    # catalog's and the supported HF architectures, all SwiGLU.
    mlp: str = "swiglu"
    # Dimensions of each head rotary embeddings rotate: None every one (Llama); 0 none (ALiBi or learned
    # positions: MPT, GPT-2); GPT-J rotates 64 of its 256.
    rotary_dim: int | None = None
    # Attention and MLP side by side on one norm's output, their outputs added to the residual together (GPT-J's
    # GPTJBlock: ln_1 only, `attn_output + feed_forward_hidden_states + residual`; GPT-NeoX's use_parallel_residual):
    # one norm a layer, not two. Only what the cost model describes: hfplan's executor builds sequential blocks.
    parallel_block: bool = False

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.heads, self.kv_heads, self.ffn, self.vocab) <= 0:
            raise HfplanError(f"model {self.name}: every size must be positive")
        if self.heads % self.kv_heads:
            raise HfplanError(f"model {self.name}: heads ({self.heads}) not a multiple of kv_heads")
        if self.head_dim is None and self.hidden % self.heads:
            raise HfplanError(f"model {self.name}: hidden ({self.hidden}) not divisible by heads")
        if self.context_len is not None and self.context_len <= 0:
            raise HfplanError(f"model {self.name}: context length (max_position_embeddings) must be positive")
        if self.mlp not in MLP_KINDS:
            raise HfplanError(f"model {self.name}: unknown MLP {self.mlp!r}; known: {', '.join(MLP_KINDS)}")
        if self.rotary_dim is not None and not 0 <= self.rotary_dim <= self.dim_per_head:
            raise HfplanError(f"model {self.name}: rotary_dim must be between 0 and the head dimension")

    @functools.cached_property  # the cost model reads these in its inner loops
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @functools.cached_property  # the cost model reads these in its inner loops
    def q_dim(self) -> int:
        return self.heads * self.dim_per_head

    @functools.cached_property  # the cost model reads these in its inner loops
    def kv_dim(self) -> int:
        return self.kv_heads * self.dim_per_head

    @functools.cached_property  # the cost model reads these in its inner loops
    def params_per_layer(self) -> int:
        h = self.hidden
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.attention_bias or self.linear_bias:
            attn += self.q_dim + 2 * self.kv_dim
        mlp = self.mlp_matrices * h * self.ffn
        if self.linear_bias:
            attn += h
            mlp += (self.mlp_matrices - 1) * self.ffn + h
        return attn + mlp + self.norms * h

    @property
    def norms(self) -> int:
        """Norms of one layer: before the attention and before the MLP, or one for both (parallel_block)."""
        return 1 if self.parallel_block else 2

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of h x ffn in the MLP: gate, up and down (SwiGLU), up and down (GeLU)."""
        return MLP_KINDS[self.mlp]

    @property
    def rotary_share(self) -> float:
        """Share of q's and k's values the rotary embedding reads and writes."""
        return 1.0 if self.rotary_dim is None else self.rotary_dim / self.dim_per_head

    @functools.cached_property  # the cost model reads these in its inner loops
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def params(self, head: str = "lm") -> int:
        """Total parameters. head='lm' for a language model, 'scalar' for a critic or reward model
        (the LM head replaced by a hidden->1 projection, as in value and reward models)."""
        body = self.layers * self.params_per_layer + self.embedding_params + self.hidden
        return body + self.head_params(head)

    def head_params(self, head: str) -> int:
        if head == "scalar":
            return self.hidden + 1
        if head != "lm":
            raise ValueError(f"unknown head {head!r}")
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def head_out_dim(self, head: str) -> int:
        return self.vocab if head == "lm" else 1

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """Bytes of KV cache one token occupies across all layers (K and V, bf16 by default)."""
        return 2 * self.layers * self.kv_dim * bytes_per_value


CATALOG: dict[str, ModelArch] = {
    m.name: m
    for m in [
        ModelArch("llama2-7b", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000,
                  context_len=4096),
        ModelArch("llama2-13b", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000,
                  context_len=4096),
        # Llama 2 34B was never released; CodeLlama-34B is the published architecture at that size.
        ModelArch("llama2-34b", layers=48, hidden=8192, heads=64, kv_heads=8, ffn=22016, vocab=32000,
                  context_len=16384),
        ModelArch("llama2-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000,
                  context_len=4096),
        ModelArch("llama3.1-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                  context_len=131072),
        ModelArch("llama3.1-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
                  context_len=131072),
        ModelArch("qwen2.5-0.5b", layers=24, hidden=896, heads=14, kv_heads=2, ffn=4864, vocab=151936,
                  tied_embeddings=True, attention_bias=True, context_len=32768),
        ModelArch("qwen2.5-1.5b", layers=28, hidden=1536, heads=12, kv_heads=2, ffn=8960, vocab=151936,
                  tied_embeddings=True, attention_bias=True, context_len=131072),
        ModelArch("qwen2.5-7b", layers=28, hidden=3584, heads=28, kv_heads=4, ffn=18944, vocab=152064,
                  attention_bias=True, context_len=131072),
        ModelArch("qwen2.5-14b", layers=48, hidden=5120, heads=40, kv_heads=8, ffn=13824, vocab=152064,
                  attention_bias=True, context_len=131072),
        ModelArch("qwen2.5-32b", layers=64, hidden=5120, heads=40, kv_heads=8, ffn=27648, vocab=152064,
                  attention_bias=True, context_len=131072),
        ModelArch("qwen2.5-72b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=29568, vocab=152064,
                  attention_bias=True, context_len=131072),
        # The demo models have no published checkpoint; their context of 256 tokens covers the workloads
        # built on them (demo: 16 + 16, arith-grpo: 5 + 4).
        # The demo model: small enough to train on CPU processes; byte-level vocabulary (256 + specials).
        ModelArch("tiny", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=260,
                  context_len=256),
        # Arithmetic prompts ("add 3 5 ="): a word-level vocabulary of 4 specials, the words add, sub
        # and =, and the numbers 0-40 (hfplan.executor.tokenizers builds it in code).
        ModelArch("tiny-arith", layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=48,
                  context_len=256),
        # Their larger counterparts (12M parameters), with the same vocabularies: a CPU run whose GEMMs, not
        # the per-call fixed costs, take most of its time (bench/validate.py --small).
        ModelArch("small", layers=4, hidden=512, heads=8, kv_heads=4, ffn=1376, vocab=260, context_len=256),
        ModelArch("small-arith", layers=4, hidden=512, heads=8, kv_heads=4, ffn=1376, vocab=48, context_len=256),
    ]
}


# Models built for CPU demos and tests: they have no published checkpoint and no built-in workloads
# of the <algorithm>-<model> kind. Each names its vocabulary: "bytes" (the byte-level tokenizer, the demo's
# phrases as its built-in prompts) or "arith" (tiny-arith's words, its arithmetic prompts).
DEMO_MODELS: dict[str, str] = {"tiny": "bytes", "tiny-arith": "arith", "small": "bytes", "small-arith": "arith"}
LARGER_DEMO_MODELS = {"tiny": "small", "tiny-arith": "small-arith"}  # each tiny demo model's larger counterpart


def arch_from_hf_config(config: dict, name: str) -> ModelArch:
    """Build a ModelArch from the dict of a Hugging Face `config.json`."""
    archs = config.get("architectures") or []
    model_type = config.get("model_type", "?")
    if not any(a in SUPPORTED_HF_ARCHITECTURES for a in archs):
        shown = ", ".join(archs) or f"model_type {model_type}"
        raise HfplanError(
            f"model {name}: unsupported architecture {shown}; supported: "
            f"{', '.join(SUPPORTED_HF_ARCHITECTURES)} (dense decoder-only)"
        )
    if config.get("num_local_experts") or config.get("num_experts"):
        raise HfplanError(f"model {name}: mixture-of-experts models are not supported")
    try:
        heads = int(config["num_attention_heads"])
        return ModelArch(
            name=name,
            layers=int(config["num_hidden_layers"]),
            hidden=int(config["hidden_size"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            ffn=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", "Qwen2ForCausalLM" in archs)),
            head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
            context_len=int(config["max_position_embeddings"]) if config.get("max_position_embeddings") else None,
        )
    except KeyError as missing:
        raise HfplanError(f"model {name}: config.json lacks field {missing}") from None
    except (TypeError, ValueError) as bad:
        raise HfplanError(f"model {name}: config.json has a malformed size ({bad})") from None


def resolve_model(ref: str) -> ModelArch:
    """A catalog name, or the path of a HF `config.json` or of a folder holding one."""
    if ref in CATALOG:
        return CATALOG[ref]
    path = Path(ref)
    looks_like_path = "/" in ref or ref.endswith(".json") or path.exists()
    if not looks_like_path:
        raise HfplanError(f"unknown model {ref!r}; known models: {known_names(CATALOG)} (or a config.json path)")
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise HfplanError(f"model config not found: {path}")
    return arch_from_hf_config(read_mapping(path, "model config"), name=str(ref))
