"""Text to token ids and back, as the controller needs them, without importing torch or transformers.

The controller encodes prompts and decodes responses (for rule rewards) while Ray starts. Importing torch and
transformers for that took seconds of the same two cores Ray's own processes start on, and held this process's
interpreter lock against `ray.init`; the demo models' tokenizers need only the `tokenizers` library, which is
what transformers' fast tokenizers run on. `hfplan.executor.tokenizers` wraps the same backends as
`PreTrainedTokenizerFast` objects (for the workers' special ids and the exported folders), so both sides encode
alike; a checkpoint folder's own tokenizer is read through transformers, here as there.

The backends parse no special tokens out of text (transformers' `split_special_tokens`): encoding never yields
the pad id, so `prompts != pad_id` is always the prompt mask (see hfplan.executor.sequences).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from hfplan.dataflow.rewards import ARITH_MAX
from hfplan.errors import HfplanError
from hfplan.profiles.models import DEMO_MODELS, resolve_model

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ARITH_WORDS = ("add", "sub", "=")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BYTE_SPECIALS = (PAD, BOS, EOS, UNK)  # the byte tokenizer's first ids, in this order
ARITH_SPECIALS = (UNK, PAD, BOS, EOS)  # <unk> is tiny-arith's word 0; the others are added after its words


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


def byte_backend() -> Tokenizer:
    """256 byte tokens and 4 specials (260 ids, byte b is id 4 + b): every text encodes, byte by byte.
    Decoding replaces only the bytes that are not valid UTF-8, so a response of random bytes keeps its
    ASCII characters (what a rule reward reads)."""
    vocab = {token: i for i, token in enumerate(BYTE_SPECIALS)}
    vocab |= {char: len(BYTE_SPECIALS) + byte for byte, char in enumerate(printable_bytes())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return _with_specials(backend, BYTE_SPECIALS)


def arith_backend() -> Tokenizer:
    """Word-level over `add`, `sub`, `=` and the numbers 0-40, split on whitespace (48 ids)."""
    words = [UNK, *ARITH_WORDS, *(str(i) for i in range(ARITH_MAX + 1))]
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Pad, bos and eos stay out of the word vocabulary (a word "<pad>" in text becomes <unk>); they are
    # added after it, and <unk> is marked special (decoding skips it). Without a decoder, tokens decode joined
    # by spaces.
    return _with_specials(backend, ARITH_SPECIALS)


def _with_specials(backend: Tokenizer, specials: Sequence[str]) -> Tokenizer:
    """The specials registered (ids they already have are kept), <bos> put before every text, and special
    tokens in text encoded as plain text."""
    backend.add_special_tokens(list(specials))
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, backend.token_to_id(BOS))]
    )
    backend.encode_special_tokens = True
    return backend


def checkpoint_folder(model_ref: str) -> Path | None:
    """The model reference as a folder holding a tokenizer of its own, or None (a built-in tokenizer)."""
    folder = Path(model_ref)
    if folder.is_dir() and any((folder / name).is_file() for name in TOKENIZER_FILES):
        return folder
    return None


def builtin_backend(model_ref: str) -> Tokenizer:
    """The word-level tokenizer of the arithmetic demo models (`tiny-arith`, `small-arith`), or bytes for every
    other model whose vocabulary holds them."""
    if DEMO_MODELS.get(model_ref) == "arith":
        return arith_backend()
    arch = resolve_model(model_ref)
    backend = byte_backend()
    if arch.vocab < backend.get_vocab_size():
        raise HfplanError(
            f"model {model_ref}: vocabulary of {arch.vocab} is smaller than the byte-level tokenizer's "
            f"{backend.get_vocab_size()}; give a checkpoint folder with its own tokenizer"
        )
    return backend


@dataclass(frozen=True)
class TextCodec:
    """A tokenizer as the controller uses it: texts to ids (with the tokenizer's own special tokens, such as a
    leading <bos>), ids back to text (special tokens skipped), and the pad id prompts are padded with."""

    encode_batch: Callable[[list[str]], list[list[int]]]
    decode_batch: Callable[[list[list[int]]], list[str]]
    pad_id: int

    def encode(self, texts: Sequence[str], prompt_len: int) -> np.ndarray:
        """[B, P] int64 token ids, left-padded to the batch's longest prompt (P at most `prompt_len`, at least 1); a
        longer prompt keeps its last `prompt_len` tokens. Columns that are padding in every row would only cost
        every forward work (positions skip left padding, so no real token's output depends on them)."""
        if prompt_len <= 0:
            raise HfplanError(f"prompt length must be positive, got {prompt_len}")
        kept = [ids[-prompt_len:] for ids in self.encode_batch(list(texts))]
        width = max([1, *(len(ids) for ids in kept)])
        out = np.full((len(texts), width), self.pad_id, dtype=np.int64)
        for i, ids in enumerate(kept):
            if ids:
                out[i, width - len(ids):] = ids
        return out

    def decode_responses(self, responses: np.ndarray, mask: np.ndarray) -> list[str]:
        """The text of each response: its real tokens (mask > 0, a prefix of the row), special tokens skipped."""
        lengths = (np.asarray(mask) > 0).sum(axis=1).tolist()
        return self.decode_batch([row[:n] for row, n in zip(np.asarray(responses).tolist(), lengths, strict=True)])

    def decode(self, ids: np.ndarray) -> list[str]:
        """Each row's text, special tokens (padding included) skipped."""
        return self.decode_batch(np.asarray(ids).tolist())


def backend_codec(backend: Tokenizer) -> TextCodec:
    """Text one row at a time: the library's batch calls hand the rows to a thread pool, which waits for a core
    where the workers keep them busy (the controller's batches are too small for threads to pay)."""

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [backend.encode(text, add_special_tokens=True).ids for text in texts]

    def decode_batch(rows: list[list[int]]) -> list[str]:
        return [backend.decode(row, skip_special_tokens=True) for row in rows]

    return TextCodec(encode_batch, decode_batch, backend.token_to_id(PAD))


def build_codec(model_ref: str) -> TextCodec:
    """The codec of a model reference: a checkpoint folder's own tokenizer (read through transformers, which
    this imports), else the built-in one (`tokenizers` only)."""
    if checkpoint_folder(model_ref) is None:
        return backend_codec(builtin_backend(model_ref))
    from hfplan.executor.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(model_ref)

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=True)["input_ids"]

    def decode_batch(rows: list[list[int]]) -> list[str]:
        return tokenizer.batch_decode(rows, skip_special_tokens=True)

    return TextCodec(encode_batch, decode_batch, tokenizer.pad_token_id)
