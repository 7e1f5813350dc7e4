"""The tokenizers of the models as transformers objects: the built-in ones (hfplan.executor.codec's backends,
wrapped) and a checkpoint's own.

The built-in tokenizers are real `PreTrainedTokenizerFast` objects (so `save_pretrained` writes a folder
`AutoTokenizer` reads back) over the same backends the controller's codec encodes with; they parse no special
tokens out of text. Workers read their special ids from here, exported model folders get them from here.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hfplan.errors import HfplanError
from hfplan.executor.codec import BOS, EOS, PAD, UNK, builtin_backend, checkpoint_folder


def _wrap(backend: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        split_special_tokens=True, padding_side="left",
    )


def build_tokenizer(model_ref: str) -> PreTrainedTokenizerFast:
    """The tokenizer of a model reference: its folder's own, the word-level one of the arithmetic demo models, or
    bytes."""
    folder = checkpoint_folder(model_ref)
    if folder is not None:
        return _checkpoint_tokenizer(folder)
    return _wrap(builtin_backend(model_ref))


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
