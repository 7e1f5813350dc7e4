"""Tokenizers made in code for the demo models, and a checkpoint's own tokenizer.

The tokenizers built here are real `PreTrainedTokenizerFast` objects (so `save_pretrained` writes a
folder `AutoTokenizer` reads back). They parse no special tokens out of text: encoding never yields
the pad id, so `prompts != pad_id` is always the prompt mask (see hfplan.executor.sequences).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hfplan.errors import HfplanError
from hfplan.executor.prompts import ARITH_MAX
from hfplan.profiles.models import resolve_model

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ARITH_WORDS = ("add", "sub", "=")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def printable_bytes() -> list[str]:
    """One printable character per byte value (the byte-level BPE convention): bytes that print stand for
    themselves, the others are moved past 255 in order, so that every byte is a visible vocabulary entry."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, moved = {}, 0
    for byte in range(256):
        if byte in keep:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + moved)
            moved += 1
    return [chars[byte] for byte in range(256)]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens and 4 specials (260 ids, byte b is id 4 + b): every text encodes, byte by byte.
    Decoding replaces only the bytes that are not valid UTF-8, so a response of random bytes keeps its
    ASCII characters (what a rule reward reads)."""
    specials = [PAD, BOS, EOS, UNK]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab |= {char: len(specials) + byte for byte, char in enumerate(printable_bytes())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return _wrap(backend, specials)


def arith_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level over `add`, `sub`, `=` and the numbers 0-40, split on whitespace (48 ids)."""
    words = [UNK, *ARITH_WORDS, *(str(i) for i in range(ARITH_MAX + 1))]
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Pad, bos and eos stay out of the word vocabulary (a word "<pad>" in text becomes <unk>); they are
    # added after it. Without a decoder, tokens decode joined by spaces.
    return _wrap(backend, [PAD, BOS, EOS])


def _wrap(backend: Tokenizer, added_specials: list[str]) -> PreTrainedTokenizerFast:
    backend.add_special_tokens(added_specials)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, backend.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        split_special_tokens=True, padding_side="left",
    )


def build_tokenizer(model_ref: str) -> PreTrainedTokenizerFast:
    """The tokenizer of a model reference: its folder's own, the word-level one of `tiny-arith`, or bytes."""
    folder = Path(model_ref)
    if folder.is_dir() and any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return _checkpoint_tokenizer(folder)
    if model_ref == "tiny-arith":
        return arith_tokenizer()
    arch = resolve_model(model_ref)
    tokenizer = byte_tokenizer()
    if arch.vocab < len(tokenizer):
        raise HfplanError(
            f"model {model_ref}: vocabulary of {arch.vocab} is smaller than the byte-level tokenizer's "
            f"{len(tokenizer)}; give a checkpoint folder with its own tokenizer"
        )
    return tokenizer


def _checkpoint_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as bad:
        raise HfplanError(f"tokenizer in {folder} does not load: {bad}") from None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise HfplanError(f"tokenizer in {folder} is not a fast (tokenizers-backed) tokenizer")
    if tokenizer.eos_token_id is None:
        raise HfplanError(f"tokenizer in {folder} has no eos token")
    if tokenizer.pad_token_id is None:
        # Reuse an existing id rather than grow the vocabulary past the model's embedding.
        tokenizer.pad_token = tokenizer.unk_token if tokenizer.unk_token_id is not None else tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def encode_prompts(tokenizer: PreTrainedTokenizerFast, texts: list[str], prompt_len: int) -> torch.Tensor:
    """[B, prompt_len] token ids, left-padded; a longer prompt keeps its last `prompt_len` tokens."""
    if prompt_len <= 0:
        raise HfplanError(f"prompt length must be positive, got {prompt_len}")
    rows = [ids[-prompt_len:] for ids in tokenizer(list(texts), add_special_tokens=True)["input_ids"]]
    out = torch.full((len(rows), prompt_len), tokenizer.pad_token_id, dtype=torch.long)
    for i, ids in enumerate(rows):
        if ids:
            out[i, prompt_len - len(ids):] = torch.tensor(ids, dtype=torch.long)
    return out


def decode_responses(
    tokenizer: PreTrainedTokenizerFast, responses: torch.Tensor, response_mask: torch.Tensor
) -> list[str]:
    """The text of each response: its real tokens (mask 1), special tokens skipped."""
    lengths = response_mask.gt(0).sum(dim=1).tolist()
    rows = [row[:n] for row, n in zip(responses.tolist(), lengths, strict=True)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
