"""A checkpoint's trained roles as Hugging Face model folders: model.safetensors, config.json and the
tokenizer, which `transformers.AutoModelForCausalLM.from_pretrained` reads (the actor; a critic's folder
holds a token-classification model with one label, read by AutoModelForTokenClassification), and which
a workload can name as a model.

The full weights are gathered from the checkpoint's shards in this process alone (no process group): the export
needs the host memory of one full copy of the largest trained model. At the end of a run a worker process runs it
(SetWorker.export_model), `hfplan export-model` the command's own process.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hfplan.errors import HfplanError
from hfplan.executor import checkpoint, resume


def checkpoint_of(path: Path) -> Path:
    """A checkpoint folder itself, or the latest complete checkpoint of a run folder."""
    if (path / resume.MANIFEST_FILE).is_file():
        return path
    if not path.is_dir():
        raise HfplanError(f"{path}: not a run folder or a checkpoint folder")
    found = resume.latest(path)
    if found is None:
        raise HfplanError(f"{path}: no complete checkpoint (looked for {resume.checkpoints_folder(path)}/"
                          "iteration-N)")
    return found


def export_checkpoint(folder: Path, dest: Path) -> dict[str, Path]:
    """Write every trained role of the checkpoint at `folder` to `dest/<role>`; returns those folders.
    Each is written beside its target and renamed over it when complete."""
    found = resume.read_checkpoint(folder)
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as bad:
        raise HfplanError(f"cannot write {dest}: {bad.strerror}") from None
    return {role: _export_role(found, role, dest / role) for role in found.manifest.trained_roles}


def _export_role(found: resume.Checkpoint, role: str, target: Path) -> Path:
    from hfplan.executor.models import build_model
    from hfplan.executor.tokenizers import build_tokenizer

    ref = found.manifest.run.models[role]
    model = build_model(ref, found.manifest.heads[role], seed=found.manifest.run.seed)  # weights replaced below
    try:
        checkpoint.load_model_weights(checkpoint.role_folder(found.folder, role), model)
    except checkpoint.UnsafeCheckpoint as bad:
        raise HfplanError(f"checkpoint refused: {bad}") from None
    except (RuntimeError, ValueError, KeyError) as bad:
        first = str(bad).strip().splitlines()[0] if str(bad).strip() else type(bad).__name__
        raise HfplanError(f"checkpoint {found.folder}: {role} weights do not load into model {ref} ({first})") \
            from None
    model.config.use_cache = True  # the run turns the KV cache off for training; a user's generate wants it
    staging = target.parent / f".{target.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its shard-writing bar is noise in a run's output
    model.save_pretrained(staging)
    build_tokenizer(ref).save_pretrained(staging)
    if target.exists():
        aside = target.parent / f".{target.name}.old"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(target, aside)
        os.rename(staging, target)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(staging, target)
    return target
