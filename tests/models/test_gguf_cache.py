"""The dequantised copy of a GGUF file in sdp's cache (sdp_cli/models/gguf_cache.py): the first
load writes it, later loads read exactly what a conversion gives, an edited file or a damaged
copy is converted again, a copy that cannot be written costs a warning line and nothing else.
Files are written by tests/models/gguf_files.py from a tiny random Llama."""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from sdp_cli.models import gguf_cache
from sdp_cli.models.gguf import dequantised_note
from sdp_cli.models.loader import load_hf_policy

from .gguf_files import CHAT_TEMPLATE, tiny_llama, tokens, write_gguf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf extra")

TEXTS = ["12+3=", "  two  spaces", "<|im_start|>user\nhi<|im_end|>", "ünïcode ✓"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {
        "Q8_0": write_gguf(root / "tiny-Q8_0.gguf", tiny_llama(seed=3), quant="Q8_0"),
        "F32": write_gguf(root / "tiny-F32.gguf", tiny_llama(seed=3), quant="F32"),
        "other": write_gguf(root / "other-F32.gguf", tiny_llama(seed=4), quant="F32"),
    }


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SDP_CACHE_DIR", str(root))
    return root


@pytest.fixture
def converted(files):
    """The policy of the Q8_0 file as a conversion gives it, without the cache."""
    return load_hf_policy(files["Q8_0"], gguf_cache=False)


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "gguf").iterdir()) if (cache / "gguf").is_dir() else []


def _no_conversion(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was converted although its copy is cached")

    monkeypatch.setattr(gguf_cache, "load_gguf", refuse)
    monkeypatch.setattr(gguf_cache, "load_gguf_tokenizer", refuse)


def _assert_same_policy(got, want, file: Path) -> None:
    got_state, want_state = got.model.state_dict(), want.model.state_dict()
    assert sorted(got_state) == sorted(want_state)
    for name, tensor in want_state.items():
        assert torch.equal(got_state[name], tensor), name
    assert got.model.dtype == torch.float32 and not got.model.training
    assert not hasattr(got.model.config, "quantization_config")
    assert got.model.config.name_or_path == str(file)
    assert (got.eos_token_id, got.pad_token_id, got.bos_token_id) == (want.eos_token_id, want.pad_token_id, want.bos_token_id)
    assert len(got.tokenizer) == len(want.tokenizer) == len(tokens())
    for text in TEXTS:
        assert got.tokenizer.encode(text) == want.tokenizer.encode(text), text
        ids = want.tokenizer.encode(text)
        assert got.tokenizer.decode(ids) == want.tokenizer.decode(ids), text
    assert got.tokenizer.chat_template == CHAT_TEMPLATE
    chat = [{"role": "user", "content": "1+1?"}]
    assert got.tokenizer.apply_chat_template(chat, add_generation_prompt=True) == want.tokenizer.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert got.name == want.name == str(file.resolve())


def test_the_first_load_writes_the_copy_and_later_loads_read_exactly_the_conversion(files, cache, converted, monkeypatch):
    file = files["Q8_0"]
    first = load_hf_policy(file)
    (entry,) = _entries(cache)
    said = rf"{re.escape(dequantised_note(file))}; the dequantised copy is cached in {re.escape(str(entry))} \(\d+ KiB\) for later starts"
    assert re.fullmatch(said, first.load_note), first.load_note
    _assert_same_policy(first, converted, file)
    info = json.loads((entry / gguf_cache.INFO_FILE).read_text())
    assert info["inputs"]["gguf_sha256"] == gguf_cache.file_digest(file)[1] and info["source"] == str(file.resolve())
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(info["files"])

    _no_conversion(monkeypatch)
    second = load_hf_policy(file)
    assert second.load_note == f"{dequantised_note(file)}; read from the dequantised copy cached in {entry}"
    _assert_same_policy(second, converted, file)
    assert _entries(cache) == [entry]
    # the tokenizer alone (task setup, the rollout process) is read from the copy too
    tokenizer = gguf_cache.load_gguf_tokenizer_cached(file)
    assert [tokenizer.encode(t) for t in TEXTS] == [converted.tokenizer.encode(t) for t in TEXTS]


def test_without_the_cache_nothing_is_written_or_read(files, cache, converted, monkeypatch):
    load_hf_policy(files["Q8_0"])  # a copy exists ...
    calls = []
    real = gguf_cache.load_gguf
    monkeypatch.setattr(gguf_cache, "load_gguf", lambda *a, **k: calls.append(a) or real(*a, **k))
    policy = load_hf_policy(files["Q8_0"], gguf_cache=False)  # ... and is not used
    assert len(calls) == 1 and policy.load_note == dequantised_note(files["Q8_0"])
    _assert_same_policy(policy, converted, files["Q8_0"])
    other = load_hf_policy(files["other"], gguf_cache=False)
    assert other.load_note == dequantised_note(files["other"]) and len(_entries(cache)) == 1


def test_a_file_edited_in_place_is_converted_again_not_served_the_old_copy(files, cache, tmp_path):
    """The key is the file's bytes: the same path and modification time with other weights
    inside (a file replaced by `cp -p`) gets a copy of its own."""
    path = tmp_path / "model.gguf"
    path.write_bytes(files["F32"].read_bytes())
    stamp = path.stat()
    load_hf_policy(path)
    path.write_bytes(files["other"].read_bytes())
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    policy = load_hf_policy(path)
    want = load_hf_policy(files["other"], gguf_cache=False)
    for name, tensor in want.model.state_dict().items():
        assert torch.equal(policy.model.state_dict()[name], tensor), name
    assert "the dequantised copy is cached in" in policy.load_note and len(_entries(cache)) == 2


def _truncate_weights(entry: Path) -> None:
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def _flip_a_tokenizer_byte(entry: Path) -> None:
    data = bytearray((entry / "tokenizer.json").read_bytes())
    data[len(data) // 2] ^= 0x01
    (entry / "tokenizer.json").write_bytes(bytes(data))


def _drop_the_info(entry: Path) -> None:
    (entry / gguf_cache.INFO_FILE).unlink()


@pytest.mark.parametrize("damage", [_truncate_weights, _flip_a_tokenizer_byte, _drop_the_info])
def test_a_damaged_copy_is_converted_again_with_one_warning(files, cache, converted, caplog, damage):
    file = files["Q8_0"]
    load_hf_policy(file)
    (entry,) = _entries(cache)
    damage(entry)
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        policy = load_hf_policy(file)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warnings[0].startswith(f"warning: GGUF cache entry {entry} for {file.name} ")
    assert warnings[0].endswith("; converting the GGUF file again")
    _assert_same_policy(policy, converted, file)
    assert _entries(cache) == [entry] and gguf_cache.holds_copy(entry, file)  # written again, whole


def test_a_copy_whose_checksums_match_but_that_cannot_be_read_is_converted_again(files, cache, converted, caplog):
    file = files["Q8_0"]
    load_hf_policy(file)
    (entry,) = _entries(cache)
    config = entry / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "no-such-architecture"}))
    info = json.loads((entry / gguf_cache.INFO_FILE).read_text())
    size, digest = gguf_cache.file_digest(config)
    info["files"]["config.json"] = {"size": size, "sha256": digest}
    (entry / gguf_cache.INFO_FILE).write_text(json.dumps(info))
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        policy = load_hf_policy(file)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warnings[0].startswith(f"warning: GGUF cache entry {entry} for {file.name} cannot be read (")
    _assert_same_policy(policy, converted, file)
    assert _entries(cache) == [entry] and json.loads(config.read_text())["model_type"] == "llama"


def test_the_tokenizer_alone_does_not_read_or_check_the_weights(files, cache, monkeypatch, caplog):
    file = files["Q8_0"]
    load_hf_policy(file)
    (entry,) = _entries(cache)
    _truncate_weights(entry)
    _no_conversion(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        tokenizer = gguf_cache.load_gguf_tokenizer_cached(file)
    assert tokenizer.encode("12+3=") == [tokens().index(c) for c in "12+3="] and not caplog.records
    assert not gguf_cache.holds_copy(entry, file)  # the whole entry's check finds the damage


def _fail_publish(code: int):
    def publish(tmp, entry, info, info_file):
        (tmp / "half-written").write_bytes(b"x")
        raise OSError(code, os.strerror(code), str(tmp / "model.safetensors"))

    return publish


@pytest.mark.parametrize(
    "cause,expected",
    [
        ("full disk", "(No space left on device); free space there, set SDP_CACHE_DIR to another directory"),
        ("read-only", "(Read-only file system); remount it read-write, set SDP_CACHE_DIR to another directory"),
        ("not a directory", "; check disk space and permissions, set SDP_CACHE_DIR to another directory"),
        ("no room kept", "kept free); free space there, set SDP_CACHE_DIR to another directory"),
    ],
)
def test_a_copy_that_cannot_be_written_costs_one_warning_line_and_nothing_else(
    files, cache, converted, monkeypatch, caplog, cause, expected
):
    file = files["Q8_0"]
    if cause == "full disk":
        monkeypatch.setattr(gguf_cache, "publish", _fail_publish(errno.ENOSPC))
    elif cause == "read-only":
        monkeypatch.setattr(gguf_cache, "publish", _fail_publish(errno.EROFS))
    elif cause == "not a directory":
        cache.mkdir()
        (cache / "gguf").write_text("a file where the cache's directory would be")
    else:
        monkeypatch.setattr(gguf_cache, "MIN_FREE_BYTES", 1 << 62)
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        policy = load_hf_policy(file)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warnings[0].startswith("warning: ") and f"of {file.name}" in warnings[0]
    assert expected in warnings[0] and warnings[0].endswith("or set model.gguf_cache=false not to cache GGUF files")
    assert policy.load_note == dequantised_note(file)
    _assert_same_policy(policy, converted, file)
    if cause != "not a directory":
        assert _entries(cache) == [], "a staging directory or a partial entry was left"


def test_two_loads_writing_the_same_copy_at_once_both_succeed_and_one_entry_stays(files, cache, monkeypatch):
    """Both stage a complete entry before either publishes: one rename wins, the other finds
    the equivalent entry in place and removes its own. (Two runs are two processes; here two
    threads, the second started once the first waits to publish: transformers' loading is not
    thread-safe, its meta-device patch of torch.nn.Module can outlive two loads at once.)"""
    real = gguf_cache.publish
    both_staged = threading.Barrier(2, timeout=60)

    def publish_together(*args):
        both_staged.wait()
        real(*args)

    monkeypatch.setattr(gguf_cache, "publish", publish_together)
    results, errors = [], []

    def load():
        try:
            results.append(load_hf_policy(files["Q8_0"]))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=load) for _ in range(2)]
    threads[0].start()
    deadline = time.monotonic() + 60
    while both_staged.n_waiting < 1:  # the first has converted and staged its entry
        assert time.monotonic() < deadline and threads[0].is_alive(), errors
        time.sleep(0.01)
    threads[1].start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(results) == 2, errors
    (entry,) = _entries(cache)
    assert gguf_cache.holds_copy(entry, files["Q8_0"])
    assert all("the dequantised copy is cached in" in r.load_note for r in results)


def test_a_rank_other_than_0_reads_the_copy_but_never_writes_one(files, cache, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    policy = load_hf_policy(files["Q8_0"])
    assert policy.load_note == dequantised_note(files["Q8_0"]) and _entries(cache) == []
