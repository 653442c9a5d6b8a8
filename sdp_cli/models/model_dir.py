"""Where ``model.path`` lives: a local directory, or a Hugging Face hub id resolved to its cached
snapshot (downloaded first unless ``HF_HUB_OFFLINE`` is set). No torch or transformers import:
the run's checks before anything is written use it (``sdp_cli.models.context``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from sdp_cli.errors import UserError
from sdp_cli.models.gguf import gguf_metadata, is_gguf

#: `name` or `org/name` as the hub spells repository ids
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
#: what a hub download fetches: configs, safetensors weights, tokenizer and chat-template files
#: (never pickle weights, never code)
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def is_hub_id(path: str | Path) -> bool:
    """Whether ``model.path`` names a hub model: no such local path, and shaped like ``org/name``."""
    text = str(path)
    return not Path(text).expanduser().exists() and bool(_HUB_ID.match(text)) and ".." not in text


def resolve_model_dir(path: str | Path) -> Path:
    """The local directory of ``model.path``: the path itself, or a hub id's cached snapshot,
    downloaded first unless ``HF_HUB_OFFLINE`` is set. One-line UserError when neither works."""
    if not is_hub_id(path):
        return Path(path).expanduser()
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo = str(path)
    try:
        return Path(snapshot_download(repo, allow_patterns=HUB_FILES))
    except GatedRepoError:
        raise UserError(f"model.path={repo} is a gated hub model; accept its terms on huggingface.co and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise UserError(
            f"model.path={repo} is no local directory and no model on the Hugging Face hub "
            "(or a private one: log in with hf auth login); check the name"
        ) from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise UserError(
                f"model.path={repo} is no local directory and not in the Hugging Face cache, and HF_HUB_OFFLINE is set; "
                "unset HF_HUB_OFFLINE to download it, or pass a local model directory"
            ) from None
        raise UserError(f"model.path={repo}: the Hugging Face hub cannot be reached; check the network or pass a local directory") from None
    except (HfHubHTTPError, OSError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"model.path={repo}: download from the Hugging Face hub failed ({first}); retry or pass a local directory") from None


#: the ``model_type`` of sdp's tiny model (``sdp_cli/models/tiny.py`` builds a Qwen2)
TINY_MODEL_TYPE = "qwen2"


def model_type_hint(cfg: Any) -> str | None:
    """The ``model_type`` of the run's model where it is known without loading anything: the
    tiny model's, that of a local directory's ``config.json``, or a GGUF file's architecture
    (transformers' name for most); None otherwise (a hub id, a file that does not parse). A hint
    only (the engine's process imports that model's code ahead, ``sdp_cli/engine/process.py``
    ``WarmProcess``), never an error."""
    if cfg.model.kind == "tiny":
        return TINY_MODEL_TYPE
    path = cfg.model.path
    if not path or is_hub_id(path):
        return None
    if is_gguf(path):
        try:
            model_type = gguf_metadata(path, ["general.architecture"]).get("general.architecture")
        except UserError:
            return None
    else:
        try:
            model_type = json.loads((Path(path).expanduser() / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            return None
    return model_type if isinstance(model_type, str) else None
