"""Write a policy as a plain Hugging Face model directory that transformers and vLLM load, for
``sdp export`` (docs/real-models.md, "Exporting a trained model").

The directory is what ``save_policy`` writes: config.json, safetensors weights (a LoRA model's
adapters merged in, ``models.lora.merged_state_dict``) and the tokenizer's files. It is written
into a temporary sibling and renamed into place, so the output either does not exist or is
complete. An output that already holds anything is refused before any work.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from sdp_cli.errors import UserError, WriteFailed, write_fix
from sdp_cli.fileio import missing_dirs_made
from sdp_cli.models.loader import save_policy
from sdp_cli.models.policy import Policy


def check_export_target(out: str | Path) -> Path:
    """``out``, if an export may write it: absent, or an empty directory. One-line UserError otherwise."""
    target = Path(out).expanduser()
    if target.is_dir():
        if any(target.iterdir()):
            raise UserError(f"{target} already exists and is not empty; pass a new directory (nothing was written)")
    elif target.exists():
        raise UserError(f"{target} exists and is not a directory; pass a new directory (nothing was written)")
    return target


def export_policy(policy: Policy, out: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write ``policy`` to the new directory ``out`` (``check_export_target``), its weights cast
    to ``dtype`` (None: as they are), through a temporary sibling renamed into place. A failure
    (a full disk, an interrupt) leaves nothing: no temporary, and no parent directory made for
    ``out``; an OSError is one line."""
    target = check_export_target(out)
    with missing_dirs_made(target.parent):
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.export-", dir=target.parent))
        except OSError as err:
            raise WriteFailed(f"cannot write next to {target} ({err.strerror}); {write_fix(err)} or choose another place", err, target) from None
        try:
            written = save_policy(policy, tmp / "model", dtype=dtype)
            try:
                if target.is_dir():
                    target.rmdir()  # empty, as checked: a directory made meanwhile is not replaced
                os.rename(written, target)
            except OSError as err:
                raise UserError(f"cannot move the export into {target} ({err.strerror}); pass a new directory") from None
        except OSError as err:
            raise WriteFailed(f"cannot write {target} ({err.strerror or err}); nothing was written; {write_fix(err)}", err, target) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
