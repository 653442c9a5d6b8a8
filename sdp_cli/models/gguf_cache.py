"""The dequantised copy of a GGUF file, kept in sdp's cache so that only the first start of a
model pays for reading the file (``model.gguf_cache``, default true; docs/real-models.md).

Reading a GGUF file through transformers costs far more than dequantising it: on SmolLM2-135M's
Q4_1 file the conversion (``sdp_cli.models.gguf.load_gguf``) parses the file's header three
times (for the config, the tokenizer and the weights) and rebuilds its tensor-name table once per
tensor, where the dequantisation itself is a small part (bench/gguf_start.py measures both). The
first load writes what it produced, the plain float32 model and the tokenizer, as a Hugging Face
directory ``$SDP_CACHE_DIR/gguf/<key>/``; later loads read that directory. The key hashes the
file's bytes (sha256) with the versions of transformers and gguf that converted it and
``FORMAT_VERSION``: an edited or replaced file, or another converter, is never served
another file's copy. Entries appear whole and are checked before use like the warm start's
(sdp_cli/models/cache_entry.py); a damaged one is converted again with a one-line warning.

The copy is an optimisation, never a reason to stop: where it cannot be written (it takes 4
bytes a parameter and must leave ``MIN_FREE_BYTES`` free; a read-only or full disk) a warning
line says why and the run goes on with the model it converted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdp_cli.errors import UserError, write_fix
from sdp_cli.fileio import written_by_safetensors
from sdp_cli.models.cache_entry import cache_root, file_digest, publish, set_aside, staging_dir, verified_info
from sdp_cli.models.gguf import check_gguf_file, load_gguf, load_gguf_tokenizer

log = logging.getLogger(__name__)

#: bump when the entry's layout or what is converted changes, so old entries are not reused
FORMAT_VERSION = 1
INFO_FILE = "gguf_cache.json"
#: an entry is not written where it would leave less than this free on the cache's disk
MIN_FREE_BYTES = 1 << 30
_WHAT = "GGUF cache entry"


def gguf_cache_key(file: Path) -> tuple[str, dict[str, Any]]:
    """``(key, inputs)``: the hex digest and the JSON-able inputs it hashes."""
    size, digest = file_digest(file)
    inputs = {
        "format_version": FORMAT_VERSION,
        "gguf_sha256": digest,
        "gguf_size": size,
        "transformers": _version("transformers"),
        "gguf": _version("gguf"),
    }
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32], inputs


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version  # 30 ms: not at task setup's import

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def cache_entry_of(file: Path, cache_dir: str | Path | None = None) -> tuple[Path, dict[str, Any]]:
    """``(entry, inputs)``: where the copy of the GGUF ``file`` is kept, and its key's inputs."""
    key, inputs = gguf_cache_key(file)
    return cache_root(cache_dir) / "gguf" / key, inputs


def holds_copy(entry: Path, file: Path, *, weights: bool = True) -> bool:
    """Whether ``entry`` holds a verified copy; a damaged entry is removed with a warning.
    ``weights=False``: the weight files are not checked (a reader of the tokenizer alone does
    not read them)."""
    if not entry.exists():
        return False
    info, problem = verified_info(entry, INFO_FILE, weights=weights)
    if info is not None:
        return True
    log.warning("warning: %s %s for %s %s; converting the GGUF file again", _WHAT, entry, file.name, problem)
    _discard(entry)
    return False


def _discard(entry: Path) -> None:
    """Remove a damaged entry; where it cannot be removed, a warning (the run goes on without it)."""
    try:
        set_aside(entry, _WHAT)
    except UserError as err:
        log.warning("warning: %s", err)


def load_gguf_tokenizer_cached(path: str | Path, *, cache: bool = True, cache_dir: str | Path | None = None) -> Any:
    """The tokenizer of a GGUF file: from its cached copy when there is one (``cache``), else
    read from the file."""
    from sdp_cli.models.tokenizer import load_tokenizer  # transformers: only when it is used

    file = check_gguf_file(path)
    if cache:
        entry, _ = cache_entry_of(file, cache_dir)
        if holds_copy(entry, file, weights=False):
            return load_tokenizer(entry)
    return load_gguf_tokenizer(file)


def load_gguf_cached(
    path: str | Path,
    *,
    tokenizer: Any = None,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[Any, Any, str]:
    """``(model, tokenizer, where)`` of a GGUF file as ``load_gguf`` gives them, from the
    file's cached copy when there is one (``cache``), else converted from the file and, with
    ``cache``, written to the cache for the next start. ``where``: a few words on the cached
    copy for the line ``sdp train`` prints (empty without one)."""
    from transformers import AutoModelForCausalLM

    from sdp_cli.models.tokenizer import load_tokenizer

    file = check_gguf_file(path)
    if not cache:
        return (*load_gguf(file, tokenizer=tokenizer), "")
    entry, inputs = cache_entry_of(file, cache_dir)
    if holds_copy(entry, file):
        try:
            model = AutoModelForCausalLM.from_pretrained(entry, dtype="float32", use_safetensors=True, local_files_only=True)
            model.config.name_or_path = str(file)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(entry)
            return model.eval(), tokenizer, f"read from the dequantised copy cached in {entry}"
        except (OSError, ValueError, KeyError, RuntimeError) as err:  # checksums match: written wrong
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            log.warning(
                "warning: %s %s for %s cannot be read (%s: %s); converting the GGUF file again",
                _WHAT, entry, file.name, type(err).__name__, first,
            )  # fmt: skip
            _discard(entry)
    if progress is not None:
        progress(f"reading {file.name} (once: its dequantised copy is cached for later starts)")
    model, tokenizer = load_gguf(file, tokenizer=tokenizer)
    if progress is not None:
        progress(f"caching the dequantised copy in {entry}")
    return model, tokenizer, _write_entry(file, entry, inputs, model, tokenizer)


def _write_entry(file: Path, entry: Path, inputs: dict[str, Any], model: Any, tokenizer: Any) -> str:
    """Write the cache entry of ``file``; the ``where`` words of ``load_gguf_cached`` (empty
    where nothing was written: a warning line has said why)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return ""  # rank 0 writes it: it loads first (main_first, sdp_cli/train/asyncloop/distributed.py)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    needed = sum(storages.values())
    fix = "or set model.gguf_cache=false not to cache GGUF files"
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(entry.parent).free
    except OSError as err:
        log.warning(
            "warning: cannot cache the dequantised copy of %s in %s (%s); %s, set SDP_CACHE_DIR to another directory %s",
            file.name, entry.parent, err.strerror or err, write_fix(err), fix,
        )  # fmt: skip
        return ""
    if free - needed < MIN_FREE_BYTES:
        log.warning(
            "warning: not caching the dequantised copy of %s: it takes %s and %s has %s free (%s kept free); "
            "free space there, set SDP_CACHE_DIR to another directory %s",
            file.name, _size(needed), entry.parent, _size(free), _size(MIN_FREE_BYTES), fix,
        )  # fmt: skip
        return ""
    tmp = None
    try:
        tmp = staging_dir(entry)
        with written_by_safetensors(tmp, shown_as=entry):
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        publish(tmp, entry, {"inputs": inputs, "source": str(file.resolve())}, INFO_FILE)
    except OSError as err:
        log.warning(
            "warning: cannot cache the dequantised copy of %s in %s (%s); %s, set SDP_CACHE_DIR to another directory %s",
            file.name, entry, err.strerror or err, write_fix(err), fix,
        )  # fmt: skip
        return ""
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return f"the dequantised copy is cached in {entry} ({_size(needed)}) for later starts"


def _size(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"
