"""Saved batches (docs/design.md §5): round trip, padded view, atomic writes, and malformed files
refused with one clear line each."""

import dataclasses
import json
import os
import pickle
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save, save_file

from sdp_cli.errors import UserError
from sdp_cli.rollout import batch_file, batch_header
from sdp_cli.rollout.batch_file import (
    BatchFormatError,
    SavedBatch,
    read_batch,
    write_batch,
)
from sdp_cli.rollout.records import RolloutGroup, RolloutSample


def two_samples():
    """Sample a: prompt [1, 2], output [3, 4, 5] of versions [0, 0, 1]; token 0 got π_1 = −0.4.
    Sample b: prompt [7], output [8] of version 1."""
    a = RolloutSample(prompt_ids=[1, 2])
    a.append_tokens([3, 4], [-0.5, -0.25], 0)
    a.append_tokens([5], [-1.0], 1)
    a.set_proximal_t(0, -0.4, 1)
    a.reward = 1.0
    b = RolloutSample(prompt_ids=[7])
    b.append_tokens([8], [-0.125], 1)
    b.reward = 0.0
    return a, b


def good_batch(**extra):
    a, b = two_samples()
    return SavedBatch.from_samples(
        [RolloutGroup(0, [a]), b],
        trainer_version=1,
        temperature=0.7,
        model="tiny",
        mode="segment_wise",
        **extra,
    )


def test_round_trip_and_layout(tmp_path):
    batch = good_batch(advantages=[[0.5, 0.5, 0.5], [-1.0]], loss_mask=[[1, 1, 0], [1]])
    # packed by hand: a = [1, 2 | 3, 4, 5], b = [7 | 8]
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 7, 8]
    assert batch.cu_seqlens.tolist() == [0, 5, 7]
    assert batch.prompt_lens.tolist() == [2, 1]
    assert batch.versions.tolist() == [-1, -1, 0, 0, 1, -1, 1]
    assert batch.proximal_t_versions.tolist() == [-1, -1, 1, 0, 1, -1, 1]
    assert batch.proximal_logprobs_t.tolist() == [
        0.0,
        0.0,
        pytest.approx(-0.4),
        -0.25,
        -1.0,
        0.0,
        -0.125,
    ]
    assert batch.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert batch.rewards.tolist() == [1.0, 0.0]  # taken from the samples

    path = write_batch(tmp_path / "b.safetensors", batch)
    assert os.listdir(tmp_path) == ["b.safetensors"]  # no temporary file left
    back = read_batch(path)
    for name, tensor in batch.tensors().items():
        assert torch.equal(getattr(back, name), tensor), name
    assert back.proximal_logprobs is None and back.logprobs is None
    assert (back.trainer_version, back.temperature, back.model, back.mode) == (
        1,
        0.7,
        "tiny",
        "segment_wise",
    )
    assert back.metadata()["format"] == "sdp-batch" and back.sdp_version == batch.sdp_version

    padded = back.to_padded()
    assert padded.response_ids.tolist() == [[3, 4, 5], [8, 0, 0]]
    assert padded.mask.tolist() == [[True, True, False], [True, False, False]]
    assert padded.versions.tolist() == [[0, 0, 1], [1, -1, -1]]
    assert padded.old_logprobs.tolist() == [[-0.5, -0.25, -1.0], [-0.125, 0.0, 0.0]]
    assert padded.advantages.tolist() == [[0.5, 0.5, 0.5], [-1.0, 0.0, 0.0]]
    assert padded.response_lens.tolist() == [3, 1]


def test_missing_loss_mask_means_all_output_tokens(tmp_path):
    batch = good_batch()
    tensors = {k: v for k, v in batch.tensors().items() if k != "loss_mask"}
    save_file(tensors, tmp_path / "b.safetensors", metadata=batch.metadata())
    back = read_batch(tmp_path / "b.safetensors")
    assert back.loss_mask is None
    assert back.effective_loss_mask().tolist() == [0, 0, 1, 1, 1, 0, 1]


@given(
    st.lists(
        st.tuples(st.integers(1, 4), st.lists(st.integers(0, 3), max_size=5)),
        min_size=1,
        max_size=5,
    )
)
def test_round_trip_of_random_samples(tmp_path_factory, spec):
    """Random prompts and version histories survive write → read → to_padded unchanged."""
    samples = []
    for prompt_len, versions in spec:
        s = RolloutSample(prompt_ids=list(range(1, prompt_len + 1)))
        for v in sorted(versions):
            s.append_tokens([10 + v], [-0.5 - v], v)
        samples.append(s)
    batch = SavedBatch.from_samples(
        samples, trainer_version=3, temperature=1.0, model="m", mode="decoupled"
    )
    path = write_batch(tmp_path_factory.mktemp("b") / "x.safetensors", batch)
    padded = read_batch(path).to_padded()
    for i, s in enumerate(samples):
        n = s.output_len
        assert padded.response_ids[i, :n].tolist() == s.output_ids
        assert padded.versions[i, :n].tolist() == s.versions
        assert padded.old_logprobs[i, :n].tolist() == s.old_logprobs
        assert padded.mask[i].sum().item() == n


def test_from_samples_rejects_wrong_lengths_and_bad_values():
    with pytest.raises(ValueError, match="2 values for 3 output tokens"):
        good_batch(advantages=[[0.5, 0.5], [1.0]])
    with pytest.raises(ValueError, match="1 entries for 2 samples"):
        good_batch(logprobs=[[0.0, 0.0, 0.0]])
    with pytest.raises(BatchFormatError, match="outside \\[0, trainer_version=0\\]"):
        a, b = two_samples()
        SavedBatch.from_samples(
            [a, b], trainer_version=0, temperature=1.0, model="m", mode="decoupled"
        )
    # any identifier may name a mode of the user's (main 82aec23); other text cannot
    with pytest.raises(BatchFormatError, match="mode 'no mode!' is not a mode name"):
        SavedBatch.from_samples(
            two_samples(), trainer_version=1, temperature=1.0, model="m", mode="no mode!"
        )


def test_write_is_atomic(tmp_path, monkeypatch):
    target = tmp_path / "b.safetensors"
    write_batch(target, good_batch())
    before = target.read_bytes()

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(batch_file.os, "replace", broken_replace)
    with pytest.raises(UserError, match="No space left on device"):
        write_batch(target, good_batch(advantages=[[1.0, 1.0, 1.0], [1.0]]))
    assert os.listdir(tmp_path) == ["b.safetensors"]  # the temporary file was removed
    assert target.read_bytes() == before  # the old file is intact
    monkeypatch.undo()

    with pytest.raises(UserError, match="does not exist; create it first"):
        write_batch(tmp_path / "missing" / "b.safetensors", good_batch())
    bad = good_batch()
    bad.old_logprobs[3] = float("nan")
    with pytest.raises(BatchFormatError, match="non-finite"):
        write_batch(tmp_path / "nan.safetensors", bad)
    assert not (tmp_path / "nan.safetensors").exists()


# ------------------------------------------------------------------ malformed files
def write_raw(path, overrides=None, drop=(), metadata=None):
    """A safetensors file from the good batch with some tensors replaced or removed."""
    batch = good_batch()
    tensors = {**batch.tensors(), **(overrides or {})}
    for name in drop:
        tensors.pop(name)
    meta = batch.metadata() if metadata is None else {**batch.metadata(), **metadata}
    save_file(tensors, path, metadata={k: v for k, v in meta.items() if v is not None})
    return path


def mutated(name, fn):
    tensor = getattr(good_batch(), name).clone()
    fn(tensor)
    return {name: tensor}


def set_at(index, value):
    def fn(t):
        t[index] = value

    return fn


def truncated(path):
    data = write_raw(path).read_bytes()
    path.write_bytes(data[:-5])


def tiny(path):
    path.write_bytes(b"\x10\x00")


def pickled(path):
    path.write_bytes(pickle.dumps({"input_ids": [1, 2, 3]}))


def torch_saved(path):
    torch.save(good_batch().tensors(), path)


def huge_header(path):
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")


def header_past_end(path):
    path.write_bytes(struct.pack("<Q", 5000) + b'{"__metadata__": {}}')


def not_json(path):
    path.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{]")


def not_a_file(path):
    path.mkdir()


def raw(**kwargs):
    return lambda path: write_raw(path, **kwargs)


MALFORMED = {
    "truncated data": (truncated, "is truncated: tensor"),
    "shorter than 8 bytes": (tiny, "is truncated: 2 bytes"),
    "pickle": (pickled, "is a Python pickle"),
    "torch.save": (torch_saved, "is a zip archive (a torch.save file?)"),
    "huge header length": (huge_header, "exceeds the 1 MB limit"),
    "header past the end": (header_past_end, "the header claims 5000 bytes"),
    "header not JSON": (not_json, "header is not valid JSON"),
    "directory": (not_a_file, "is not a regular file"),
    "wrong dtype": (
        raw(overrides={"versions": good_batch().versions.to(torch.int32)}),
        "tensor versions has dtype I32, expected I64",
    ),
    "2-D tensor": (
        raw(overrides={"old_logprobs": good_batch().old_logprobs.reshape(7, 1)}),
        "tensor old_logprobs has shape [7, 1], expected 1-D",
    ),
    "mismatched lengths": (
        raw(overrides={"old_logprobs": good_batch().old_logprobs[:6]}),
        "tensor old_logprobs has 6 entries, expected 7",
    ),
    "missing keys": (
        raw(drop=("proximal_t_versions", "versions")),
        "missing required tensor(s) versions, proximal_t_versions",
    ),
    "unexpected tensor": (raw(overrides={"extra": torch.zeros(1)}), "unexpected tensor 'extra'"),
    "NaN logprob": (
        raw(overrides=mutated("proximal_logprobs_t", set_at(3, float("nan")))),
        "tensor proximal_logprobs_t holds a non-finite value at index 3",
    ),
    "cu_seqlens wrong length": (
        raw(overrides={"cu_seqlens": torch.tensor([0, 5, 5, 7])}),
        "tensor cu_seqlens has 4 entries, expected 3",
    ),
    "non-monotone cu_seqlens": (
        raw(overrides={"cu_seqlens": torch.tensor([0, 0, 7])}),
        "cu_seqlens is not strictly increasing at index 1 (0 → 0)",
    ),
    "cu_seqlens wrong start": (
        raw(overrides={"cu_seqlens": torch.tensor([1, 5, 7])}),
        "cu_seqlens starts at 1",
    ),
    "cu_seqlens wrong end": (
        raw(overrides={"cu_seqlens": torch.tensor([0, 5, 6])}),
        "cu_seqlens ends at 6 but input_ids has 7 tokens",
    ),
    "prompt longer than sequence": (
        raw(overrides={"prompt_lens": torch.tensor([2, 3])}),
        "prompt_lens[1] = 3 is outside [1, 2]",
    ),
    "wrong format tag": (
        raw(metadata={"format": "verl-batch"}),
        "format tag is 'verl-batch', expected 'sdp-batch'",
    ),
    "no metadata": (lambda p: save_file(good_batch().tensors(), p), "format tag is None"),
    "missing metadata key": (raw(metadata={"mode": None}), "metadata lacks mode"),
    "newer format version": (raw(metadata={"format_version": "2"}), "format version 2 is newer"),
    "bad temperature": (raw(metadata={"temperature": "hot"}), "is not a number"),
    "mode not a name": (raw(metadata={"mode": "p p o"}), "mode 'p p o' is not a mode name"),
    "version out of range": (
        raw(overrides=mutated("versions", set_at(6, 2)), metadata=None),
        "version of output token 6 (sequence 1) is 2, outside [0, trainer_version=1]",
    ),
    "proximal_t_version not v or v+1": (
        raw(overrides=mutated("proximal_t_versions", set_at(3, 2))),
        "proximal_t_versions of output token 3 (sequence 0) is 2 for version 0",
    ),
    "proximal_t_version above trainer": (
        raw(
            overrides={
                **mutated("versions", set_at(6, 1)),
                **mutated("proximal_t_versions", set_at(6, 2)),
            }
        ),
        "is 2 for version 1, must be 1 or 2 and <= trainer_version=1",
    ),
    "prompt token with a version": (
        raw(overrides=mutated("versions", set_at(0, 0))),
        "versions of prompt token 0 (sequence 0) is 0, prompt tokens must have -1",
    ),
    "prompt token with a logprob": (
        raw(overrides=mutated("old_logprobs", set_at(5, -1.0))),
        "old_logprobs of prompt token 5 (sequence 1) is -1.0",
    ),
    "loss_mask not 0/1": (
        raw(overrides=mutated("loss_mask", set_at(2, 2))),
        "loss_mask of token 2 (sequence 0) is 2, must be 0 or 1",
    ),
    # token 2 is a valid 1 before it: the error names the first value that is not 0/1
    "loss_mask not 0/1 after a valid 1": (
        raw(overrides=mutated("loss_mask", set_at(3, 2))),
        "loss_mask of token 3 (sequence 0) is 2, must be 0 or 1",
    ),
}


def header_edited(edit):
    """A batch whose header JSON ``edit`` changes in place (tensor data kept as written)."""

    def make(path):
        data = write_raw(path).read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + n])
        edit(header)
        new = json.dumps(header).encode()
        new += b" " * (-len(new) % 8)
        path.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + n :])

    return make


def set_entry(name, key, value):
    return header_edited(lambda header: header[name].__setitem__(key, value))


# a tensor that claims more bytes than its shape
MALFORMED["offsets inconsistent"] = (set_entry("rewards", "shape", [3]), "tensor rewards has data_offsets")


# the header's entries are checked before any tensor is read: a shape or offsets that are not
# what a 1-D tensor has get one line, never a TypeError from looking inside them
MALFORMED["shape not a list"] = (set_entry("rewards", "shape", 2), "tensor rewards has shape 2, expected 1-D")
MALFORMED["shape negative"] = (set_entry("rewards", "shape", [-2]), "tensor rewards has shape [-2], expected 1-D")
MALFORMED["shape not an int"] = (set_entry("rewards", "shape", [2.0]), "tensor rewards has shape [2.0], expected 1-D")
MALFORMED["offsets not a pair"] = (
    set_entry("rewards", "data_offsets", 8),
    "tensor rewards has malformed data_offsets 8",
)
MALFORMED["offsets not ints"] = (
    set_entry("rewards", "data_offsets", ["0", "8"]),
    "tensor rewards has malformed data_offsets ['0', '8']",
)
MALFORMED["entry not an object"] = (
    header_edited(lambda header: header.__setitem__("rewards", [1, 2])),
    "header entry of tensor rewards is not an object",
)
def trailing_garbage(path):
    """Valid header and tensors, then 8 stray bytes: only safetensors itself notices."""
    write_raw(path)
    with open(path, "ab") as f:
        f.write(b"\0" * 8)


MALFORMED["trailing bytes"] = (trailing_garbage, "safetensors cannot load it (")
MALFORMED["metadata not a string"] = (
    set_entry("__metadata__", "trainer_version", 1),
    "metadata value of 'trainer_version' is not a string",
)


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_gives_one_clear_line(tmp_path, case):
    make, expected = MALFORMED[case]
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(BatchFormatError) as err:
        read_batch(path)
    message = str(err.value)
    assert isinstance(err.value, UserError)
    assert message.startswith(f"{path}: ") and "; " in message and "\n" not in message
    assert expected in message, message


def test_missing_file(tmp_path):
    with pytest.raises(BatchFormatError, match="nope.safetensors: file not found; check the path"):
        read_batch(tmp_path / "nope.safetensors")


class _Trap:
    """Unpickling this would create a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_is_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    path = tmp_path / "evil.safetensors"
    path.write_bytes(pickle.dumps(_Trap(str(marker))))
    with pytest.raises(BatchFormatError, match="Python pickle"):
        read_batch(path)
    assert not marker.exists()


# ------------------------------------------------------------------ hostile numbers
def three_sequences():
    """Three sequences packed by hand: [1, 2 | 3, 4, 5], [7 | 8], [9 | 10]: N = 9, cu = [0, 5, 7, 9]."""
    a, b = two_samples()
    c = RolloutSample(prompt_ids=[9])
    c.append_tokens([10], [-0.5], 1)
    return SavedBatch.from_samples(
        [a, b, c], trainer_version=1, temperature=1.0, model="m", mode="segment_wise"
    )


def write_tensors(path, batch, overrides=None, metadata=None):
    save_file({**batch.tensors(), **(overrides or {})}, path, metadata={**batch.metadata(), **(metadata or {})})
    return path


HOSTILE_NUMBERS = {
    # every difference is positive in int64 arithmetic: 2^62 − 0; (−2^63 + 100) − 2^62 wraps to
    # 2^62 + 100; 9 − (−2^63 + 100) wraps to 2^63 − 91. Unbounded, the token layout asked
    # repeat_interleave for 2^62 copies and the process died with SIGSEGV.
    "cu_seqlens wraps int64": (
        {"cu_seqlens": torch.tensor([0, 2**62, -(2**63) + 100, 9])},
        {},
        "cu_seqlens[1] = 4611686018427387904 is outside [0, 9]",
    ),
    "cu_seqlens negative": (
        {"cu_seqlens": torch.tensor([0, -3, 5, 9])},
        {},
        "cu_seqlens[1] = -3 is outside [0, 9]",
    ),
    "trainer_version 2^70": ({}, {"trainer_version": str(2**70)}, "trainer_version 1180591620717411303424 is outside [0, 9007199254740991]"),
    "trainer_version with a sign": ({}, {"trainer_version": "+1"}, "trainer_version '+1' is not a plain decimal integer"),
    "trainer_version in other digits": ({}, {"trainer_version": "١"}, "trainer_version '١' is not a plain decimal integer"),
    "temperature 1e-300": ({}, {"temperature": "1e-300"}, "temperature 1e-300 is outside [0.01, 100]"),
    "temperature 1e6": ({}, {"temperature": "1e6"}, "temperature 1000000.0 is outside [0.01, 100]"),
    "temperature inf": ({}, {"temperature": "inf"}, "temperature inf is outside [0.01, 100]"),
    "log-prob above 0": (
        {"old_logprobs": torch.tensor([0, 0, -0.5, 0.25, -1, 0, -0.125, 0, -0.5])},
        {},
        "old_logprobs of output token 3 (sequence 0) is 0.25, must be <= 0",
    ),
    "log-prob near -3e38": (
        {"proximal_logprobs_t": torch.tensor([0, 0, -0.4, -0.25, -1, 0, -3e38, 0, -0.5])},
        {},
        "proximal_logprobs_t of output token 6 (sequence 1) is -3e+38, below the floor -100000",
    ),
    "token id negative": (
        {"input_ids": torch.tensor([1, 2, 3, 4, 5, 7, -8, 9, 10])},
        {},
        "input_ids[6] = -8 is outside [0, 2147483647]",
    ),
    "token id past int32": (
        {"input_ids": torch.tensor([1, 2, 3, 4, 5, 7, 2**40, 9, 10])},
        {},
        "input_ids[6] = 1099511627776 is outside [0, 2147483647]",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_NUMBERS))
def test_hostile_numbers_are_refused_in_one_line(tmp_path, case):
    overrides, metadata, expected = HOSTILE_NUMBERS[case]
    path = write_tensors(tmp_path / "bad.safetensors", three_sequences(), overrides, metadata)
    with pytest.raises(BatchFormatError) as err:
        read_batch(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    assert expected in message, message


def test_the_limits_themselves_are_accepted(tmp_path):
    """The bounds are inclusive: log-prob 0 and the floor, temperature 0.01 and 100, token id
    2^31 − 1 and trainer version 2^53 − 1 (with every output token at that version)."""
    batch = three_sequences()
    out = batch.versions >= 0
    big = 2**53 - 1
    overrides = {
        "old_logprobs": torch.where(out, torch.tensor([0.0, 0, -1e5, 0, -0.5, 0, -0.125, 0, -0.5]), 0.0),
        "proximal_logprobs_t": torch.where(out, torch.tensor([0.0, 0, -1e5, 0, -0.5, 0, -0.125, 0, -0.5]), 0.0),
        "input_ids": torch.tensor([1, 2, 3, 4, 5, 7, 2**31 - 1, 9, 10]),
        "versions": torch.where(out, big, -1),
        "proximal_t_versions": torch.where(out, big, -1),
    }
    for temperature in ("0.01", "100.0"):
        path = write_tensors(
            tmp_path / "edge.safetensors", batch, overrides, {"temperature": temperature, "trainer_version": str(big)}
        )
        back = read_batch(path)
        assert back.trainer_version == big and back.temperature == float(temperature)
        assert float(back.old_logprobs.min()) == -1e5 and float(back.old_logprobs.max()) == 0.0


def _batch_with_header_length(tmp_path, target: int) -> Path:
    """A valid batch whose 8-byte header length is ``target``: the shortest header sdp writes
    (required tensors only) is 624 bytes; the model name is lengthened one character at a time
    (safetensors pads the header to a multiple of 8)."""
    base = dataclasses.replace(good_batch(), rewards=None, loss_mask=None, mode="bypass")  # 624 bytes
    for n in range(1, 4000):
        batch = dataclasses.replace(base, model="m" * n)
        length = struct.unpack("<Q", save(batch.tensors(), metadata=batch.metadata())[:8])[0]
        if length >= target:
            assert length == target, f"cannot reach a header of {target} bytes (got {length})"
            return write_batch(tmp_path / f"h{target}.safetensors", batch)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("length", [640, 896, 1152, 1408])
def test_a_valid_batch_whose_header_length_looks_like_a_pickle_is_read(tmp_path, length):
    """640 = 0x280, 896 = 0x380, 1152 = 0x480, 1408 = 0x580: the file starts with 0x80 and a
    pickle protocol byte 2–5, yet it is a well-formed safetensors batch."""
    path = _batch_with_header_length(tmp_path, length)
    assert path.read_bytes()[0] == 0x80 and 2 <= path.read_bytes()[1] <= 5
    assert read_batch(path).model.startswith("m")


@given(
    protocol=st.integers(2, 5),
    length_bytes=st.binary(min_size=6, max_size=6),
    ninth=st.sampled_from([b"{", b"}", b"\x95"]),
    tail=st.binary(max_size=64),
)
def test_a_pickle_is_named_unless_its_whole_header_is_plausible(tmp_path_factory, protocol, length_bytes, ninth, tail):
    """A file with a pickle's first two bytes is called a pickle unless all of the safetensors
    structure holds at once (a header length that fits the file and is followed by "{"): one
    part alone — a "{" ninth byte — does not make it a batch."""
    data = bytes([0x80, protocol]) + length_bytes + ninth + tail
    header_len = int.from_bytes(data[:8], "little")
    plausible = 2 <= header_len <= batch_header.MAX_HEADER_BYTES and 8 + header_len <= len(data) and ninth == b"{"
    path = tmp_path_factory.mktemp("p") / "b.safetensors"
    path.write_bytes(data)
    with pytest.raises(BatchFormatError) as err:
        read_batch(path)
    assert ("is a Python pickle" in str(err.value)) is not plausible, str(err.value)


def test_a_batch_rewritten_in_place_while_it_is_read_is_never_a_crash(tmp_path):
    """Another process rewrites a 6.6 MB batch in place (the same inode), cutting it to half its
    length at random moments, while it is read at least 100 times: each read gives the batch or
    one BatchFormatError line, never SIGBUS (a memory map of a file that shrinks under it; before
    the reader copied the file, 3 of 3 runs of this test died that way). Every tenth time the
    whole file stays 0.3 s, and the reader goes on until one read got the batch: on a loaded
    machine the random windows alone were once all shorter than a read (CI: 0 of 100)."""
    sample = RolloutSample(prompt_ids=[1])
    sample.append_tokens([3] * 200_000, [-0.5] * 200_000, 0)
    batch = SavedBatch.from_samples([sample], trainer_version=0, temperature=1.0, model="m", mode="bypass")
    path = write_batch(tmp_path / "b.safetensors", batch)
    data = path.read_bytes()
    reader = (
        "import sys\n"
        "from sdp_cli.rollout.batch_file import BatchFormatError, read_batch\n"
        "ok = bad = 0\n"
        "while ok + bad < 100 or (ok == 0 and bad < 2000):\n"
        "    try:\n"
        "        read_batch(sys.argv[1]); ok += 1\n"
        "    except BatchFormatError as err:\n"
        "        assert '\\n' not in str(err); bad += 1\n"
        "print(ok, bad)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", reader, str(path)], stdout=subprocess.PIPE, text=True)
    rng = random.Random(0)
    rewrites = 0
    while proc.poll() is None:
        with open(path, "r+b") as f:
            f.write(data)
        time.sleep(0.3 if rewrites % 10 == 9 else rng.random() * 0.02)
        with open(path, "r+b") as f:
            f.truncate(len(data) // 2)
        rewrites += 1
    out = proc.stdout.read()
    assert proc.returncode == 0, f"the reader died with {proc.returncode} ({out!r})"
    ok, bad = map(int, out.split())
    assert ok + bad >= 100 and ok > 0, (ok, bad)


# ------------------------------------------------------------- sparse huge files (issue 24)
def sparse_batch(path: Path, tokens: int) -> Path:
    """A batch file whose header is consistent with ``tokens`` tokens in one sequence (every
    required tensor, byte ranges laid end to end) and whose data is a hole: the file has the
    size the header claims but takes a few kB on disk."""
    entries, offset = {}, 0
    for name, (dtype, itemsize) in [
        ("input_ids", ("I64", 8)), ("cu_seqlens", ("I64", 8)), ("prompt_lens", ("I64", 8)),
        ("old_logprobs", ("F32", 4)), ("versions", ("I64", 8)), ("proximal_logprobs_t", ("F32", 4)),
        ("proximal_t_versions", ("I64", 8)),
    ]:  # fmt: skip
        n = {"cu_seqlens": 2, "prompt_lens": 1}.get(name, tokens)
        entries[name] = {"dtype": dtype, "shape": [n], "data_offsets": [offset, offset + n * itemsize]}
        offset += n * itemsize
    entries["__metadata__"] = {
        "format": "sdp-batch", "format_version": "1", "trainer_version": "1", "temperature": "1.0",
        "model": "m", "mode": "decoupled", "sdp_version": "0",
    }  # fmt: skip
    header = json.dumps(entries).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + offset)
    return path


def test_a_sparse_64_gib_batch_is_refused_before_it_is_read(tmp_path):
    """2³¹ tokens × (8 + 4 + 8 + 4 + 8 bytes) = 64 GiB of declared data in a 4 kB file: on main
    the reader allocated the whole size (a MemoryError traceback in inspect-weights and
    recompute). It is refused by its size, reading nothing past the first bytes."""
    import tracemalloc

    path = sparse_batch(tmp_path / "huge.safetensors", 2**31)
    assert path.stat().st_size > 64 * 2**30 and path.stat().st_blocks * 512 < 2**20
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(BatchFormatError) as err:
        read_batch(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(path)), message
    assert f"over the {batch_header.MAX_BATCH_BYTES // 2**30} GiB limit" in message, message
    assert peak < 2**20 and time.perf_counter() - started < 1.0, (peak, time.perf_counter() - started)


def test_a_batch_just_over_the_limit_is_refused_and_one_at_it_is_measured_not_refused(tmp_path, monkeypatch):
    """The limit is on the file's size: at the limit the file is read (here it then fails its
    checks, its data being zeros), one byte more and it is refused unread."""
    path = sparse_batch(tmp_path / "b.safetensors", 1000)
    size = path.stat().st_size
    monkeypatch.setattr(batch_header, "MAX_BATCH_BYTES", size - 1)
    with pytest.raises(BatchFormatError, match="over the .* limit"):
        read_batch(path)
    monkeypatch.setattr(batch_header, "MAX_BATCH_BYTES", size)
    with pytest.raises(BatchFormatError) as err:
        read_batch(path)
    assert "limit" not in str(err.value)  # read, then refused for its content (zero cu_seqlens)


def test_not_enough_memory_to_read_a_batch_is_one_line(tmp_path, monkeypatch):
    """Within the limit, a machine may still lack the memory: one line, not a MemoryError."""
    path = tmp_path / "b.safetensors"
    write_batch(path, good_batch())

    def starved(f, size):
        raise MemoryError

    monkeypatch.setattr(batch_header, "read_whole", starved)
    with pytest.raises(BatchFormatError, match="not enough memory to read its"):
        read_batch(path)


def test_a_batch_that_grows_while_it_is_read_is_one_line(tmp_path, monkeypatch):
    """A writer appends while sdp reads: the bytes read differ from the size seen first."""
    path = tmp_path / "b.safetensors"
    write_batch(path, good_batch())

    def grown(f, size):
        return f.read(size) + b"\0"

    monkeypatch.setattr(batch_header, "read_whole", grown)
    size = path.stat().st_size
    with pytest.raises(BatchFormatError, match=rf"changed while it was read \({size} bytes, then {size + 1}\)"):
        read_batch(path)


def test_a_directory_given_as_a_batch_is_one_line(tmp_path):
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(BatchFormatError, match="d.safetensors: is not a regular file; pass the path of a batch file"):
        read_batch(tmp_path / "d.safetensors")


def test_an_io_error_while_reading_names_the_os_reason(tmp_path, monkeypatch):
    """The OS's reason, not Python's whole exception text with its errno."""
    path = tmp_path / "b.safetensors"
    write_batch(path, good_batch())

    def failing_disk(f, size):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(batch_header, "read_whole", failing_disk)
    with pytest.raises(BatchFormatError) as err:
        read_batch(path)
    assert str(err.value) == f"{path}: cannot be read (Input/output error); check the file"


def lopsided_batch(sequences: int, longest: int) -> SavedBatch:
    """``sequences − 1`` sequences of one prompt and one output token, and one of one prompt
    token and ``longest`` output tokens: few tokens, but ``sequences × longest`` when padded."""
    lens = [2] * (sequences - 1) + [1 + longest]
    n = sum(lens)
    cu = torch.tensor([0, *lens]).cumsum(0)
    versions = torch.zeros(n, dtype=torch.int64)
    versions[cu[:-1]] = -1  # the prompt tokens
    old = torch.where(versions >= 0, torch.full((n,), -0.5), torch.zeros(n))
    return SavedBatch(
        input_ids=torch.zeros(n, dtype=torch.int64), cu_seqlens=cu, prompt_lens=torch.ones(sequences, dtype=torch.int64),
        old_logprobs=old, versions=versions, proximal_logprobs_t=old.clone(), proximal_t_versions=versions.clone(),
        trainer_version=0, temperature=1.0, model="m", mode="decoupled",
    )  # fmt: skip


def test_a_batch_whose_padded_view_would_not_fit_is_refused_in_one_line(tmp_path, monkeypatch):
    """100000 sequences, one of them 100000 tokens long: an 11 MB file, but its padded view is
    10¹⁰ entries per tensor (80 GB as int64); on main inspect-weights died with an allocation
    traceback. Over the limit it is one line, at the limit it is padded."""
    path = tmp_path / "lopsided.safetensors"
    write_batch(path, lopsided_batch(100_000, 100_000))
    with pytest.raises(UserError) as err:
        read_batch(path).to_padded()
    message = str(err.value)
    assert "\n" not in message
    # 100000 sequences × 100000 response tokens = 10000000000 entries
    assert "100000 sequences × 100000 response tokens = 10000000000 entries" in message, message
    assert f"over the {batch_file.MAX_PADDED_ENTRIES}" in message, message
    # the limit itself: 3 sequences × 4 response tokens = 12 entries pass a limit of 12, × 5 do not
    monkeypatch.setattr(batch_file, "MAX_PADDED_ENTRIES", 12)
    assert lopsided_batch(3, 4).to_padded().old_logprobs.shape == (3, 4)
    with pytest.raises(UserError, match="3 sequences × 5 response tokens = 15 entries"):
        lopsided_batch(3, 5).to_padded()
