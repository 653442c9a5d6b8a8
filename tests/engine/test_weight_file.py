"""``PackedWeights`` (sdp_cli/engine/weight_file.py): a weight push packed into one buffer in the
trainer's thread and written as a safetensors file on the push's thread. The file must be one
that safetensors' own reader and sdp's layout check accept, with exactly the tensors given
(tied ones once), and the pack must share nothing with the tensors it copied."""

from __future__ import annotations

import gc
import json
import sys
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from sdp_cli.engine import weight_file
from sdp_cli.engine.weight_file import DTYPE_NAMES, PackedWeights, WeightSlots
from sdp_cli.safetensors_layout import check_file

from ..small_tmpfs import run_with_tmpfs

DTYPES = list(DTYPE_NAMES)


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


@st.composite
def state_dicts(draw):
    """Mixed dtypes and shapes (scalars, empty tensors, transposed views), some names tied to an
    earlier tensor (one storage under two names), some views into the middle of another's."""
    n = draw(st.integers(1, 8))
    tensors: dict[str, torch.Tensor] = {}
    for i in range(n):
        kind = draw(st.sampled_from(["new", "new", "tied", "transposed", "slice"])) if tensors else "new"
        earlier = list(tensors.values())
        if kind == "tied":
            tensors[f"t{i}"] = earlier[draw(st.integers(0, len(earlier) - 1))]
            continue
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        base = make_tensor(dtype, shape if kind == "new" else (4, 6), draw(st.integers(0, 10**6)))
        if kind == "transposed":
            base = base.t()  # not contiguous
        elif kind == "slice":
            base = base[1:3]  # shares storage at an offset: not tied
        tensors[f"t{i}"] = base
    return tensors


def first_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a file keeps: one name per (storage, offset), the first."""
    seen, kept = set(), {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            kept[name] = tensor
    return kept


@settings(max_examples=60, deadline=None)
@given(state=state_dicts())
def test_the_file_holds_exactly_the_tensors_given_and_the_pack_is_a_copy(tmp_path_factory, state):
    path = tmp_path_factory.mktemp("w") / "v000001" / "model.safetensors"
    expected = {name: tensor.clone() for name, tensor in first_names(state).items()}
    packed = PackedWeights(state)
    assert list(packed) == list(expected)  # tied names once, the first one
    for name, tensor in expected.items():
        assert packed[name].dtype == tensor.dtype and torch.equal(packed[name], tensor)
    # the trainer changes its tensors right after packing: the pack and its file do not follow
    with torch.no_grad():
        for tensor in first_names(state).values():
            tensor.logical_not_() if tensor.dtype == torch.bool else tensor.add_(1)
    packed.write(path)
    check_file(path)
    read = load_file(path)
    assert set(read) == set(expected) and not list(path.parent.glob(".*"))
    for name, tensor in expected.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape, name
        assert torch.equal(read[name], tensor), name
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    assert (8 + header_len) % 8 == 0, "the data starts 8-byte aligned"
    for name, tensor in expected.items():  # each tensor's bytes at a multiple of its element size
        assert header[name]["data_offsets"][0] % tensor.element_size() == 0, name


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits, so that equality is bit for bit (signed zeros too)."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


@settings(max_examples=40, deadline=None)
@given(state=state_dicts(), engine_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
def test_packed_in_the_engines_dtype_the_engine_gets_bit_for_bit_what_its_own_cast_gives(
    tmp_path_factory, state, engine_dtype
):
    # A push packed in the engine's dtype must load exactly the weights the engine would get by
    # casting the trainer's tensors itself (copy_ into its own parameters); other dtypes stay
    path = tmp_path_factory.mktemp("w") / "model.safetensors"
    packed = PackedWeights(state, engine_dtype)
    packed.write(path)
    check_file(path)
    read = load_file(path)
    assert list(packed) == list(first_names(state)) and set(read) == set(packed)
    for name, tensor in first_names(state).items():
        if tensor.is_floating_point():
            own_cast = torch.empty(tensor.shape, dtype=engine_dtype).copy_(tensor)
            assert read[name].dtype == engine_dtype, name
            assert torch.equal(bits(read[name]), bits(own_cast)), name
        else:
            assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name


def test_a_bfloat16_pack_is_half_the_bytes_of_a_float32_one(tmp_path):
    state = {"w": torch.randn(64, 32), "b": torch.randn(32), "step": torch.arange(3)}
    PackedWeights(state).write(tmp_path / "f32.safetensors")
    PackedWeights(state, torch.bfloat16).write(tmp_path / "bf16.safetensors")
    data = {name: (tmp_path / f"{name}.safetensors").stat().st_size for name in ("f32", "bf16")}
    # floats 4 → 2 bytes each (2080 values), the int64 tensor's 24 bytes unchanged; headers differ a little
    assert 2080 * 2 - 64 <= data["f32"] - data["bf16"] <= 2080 * 2 + 64


@settings(max_examples=30, deadline=None)
@given(first=state_dicts(), second=state_dicts())
def test_a_pack_into_a_released_buffer_writes_the_same_file_as_a_fresh_one(tmp_path_factory, first, second):
    # The next push packs into the buffer of the last one (its pages are mapped already): the
    # file must be byte for byte the one a fresh buffer gives, whatever the buffer held before
    # and whether it is large enough (too small: a fresh one is taken)
    d = tmp_path_factory.mktemp("w")
    spare = PackedWeights(first).release()
    reused = PackedWeights(second, spare=spare)
    reused.write(d / "reused.safetensors")
    PackedWeights(second).write(d / "fresh.safetensors")
    assert (d / "reused.safetensors").read_bytes() == (d / "fresh.safetensors").read_bytes()
    needed = sum(t.numel() * t.element_size() for t in first_names(second).values())
    buffer = reused.release()
    assert (buffer.data_ptr() == spare.data_ptr()) == (spare.numel() >= needed)


def test_a_released_pack_is_empty_and_cannot_be_written(tmp_path):
    packed = PackedWeights({"w": torch.ones(3)})
    buffer = packed.release()
    assert buffer.dtype == torch.uint8 and buffer.numel() == 12 and len(packed) == 0
    with pytest.raises(RuntimeError, match="released weight pack cannot be written"):
        packed.write(tmp_path / "model.safetensors")
    with pytest.raises(RuntimeError, match="released already"):
        packed.release()
    assert not list(tmp_path.iterdir())


def test_a_second_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "model.safetensors"
    PackedWeights({"w": torch.zeros(3, 4)}).write(path)
    PackedWeights({"w": torch.ones(3, 4), "b": torch.arange(5)}).write(path)
    read = load_file(path)
    assert torch.equal(read["w"], torch.ones(3, 4)) and torch.equal(read["b"], torch.arange(5))
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_a_dtype_safetensors_cannot_name_is_refused_by_name():
    with pytest.raises(TypeError, match="lora_scale: dtype torch.complex64"):
        PackedWeights({"w": torch.zeros(2), "lora_scale": torch.zeros(2, dtype=torch.complex64)})


# ------------------------------------------------------------------ WeightSlots
@settings(max_examples=40, deadline=None)
@given(first=state_dicts(), second=state_dicts(), engine_dtype=st.sampled_from([None, torch.bfloat16]))
def test_a_slot_holds_byte_for_byte_the_file_a_pack_writes(tmp_path_factory, first, second, engine_dtype):
    # the push's weights written into a mapped slot file, over whatever the slot held before and
    # whatever its size was: the very bytes PackedWeights writes, which safetensors reads back
    d = tmp_path_factory.mktemp("w")
    slots = WeightSlots(d / "scratch", "model.safetensors")
    try:
        slots.write(3, first, engine_dtype)
        target = slots.write(6, second, engine_dtype)  # the same slot (6 % 3 == 3 % 3)
        assert target == d / "scratch" / "push0"
        PackedWeights(second, engine_dtype).write(d / "packed.safetensors")
        written = (target / "model.safetensors").read_bytes()
        assert written == (d / "packed.safetensors").read_bytes()
        check_file(target / "model.safetensors")
        read = load_file(target / "model.safetensors")
        assert set(read) == set(first_names(second))
    finally:
        slots.close()


def test_writing_a_version_leaves_the_two_before_it_untouched(tmp_path):
    # docs/training.md "Three processes": v + 1 is written while the push of v may still load
    # its slot and the engine may still run v − 1 (a restarted engine reads that slot again)
    slots = WeightSlots(tmp_path, "model.safetensors")
    try:
        paths = {v: slots.write(v, {"w": torch.full((4, 4), float(v))}, None) for v in (7, 8)}
        before = {v: (p / "model.safetensors").read_bytes() for v, p in paths.items()}
        third = slots.write(9, {"w": torch.full((4, 4), 9.0)}, None)
        assert third not in paths.values() and len({*paths.values(), third}) == WeightSlots.SLOTS
        assert {v: (p / "model.safetensors").read_bytes() for v, p in paths.items()} == before
        assert torch.equal(load_file(third / "model.safetensors")["w"], torch.full((4, 4), 9.0))
        assert slots.write(10, {"w": torch.zeros(4, 4)}, None) == paths[7]  # the oldest slot again
    finally:
        slots.close()


def test_a_slot_of_another_size_is_made_again(tmp_path):
    slots = WeightSlots(tmp_path, "model.safetensors")
    try:
        slots.write(0, {"w": torch.ones(64)}, None)
        path = slots.write(3, {"w": torch.arange(3.0)}, None) / "model.safetensors"
        assert torch.equal(load_file(path)["w"], torch.arange(3.0))
        assert path.stat().st_size == 8 + int.from_bytes(path.read_bytes()[:8], "little") + 3 * 4
    finally:
        slots.close()


@settings(max_examples=40, deadline=None)
@given(
    start=state_dicts(),
    changes=st.lists(
        st.tuples(
            st.sampled_from(["in_place", "new_tensor", "retyped", "new_view", "tie", "dtype"]), st.integers(0, 10**6)
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_each_push_writes_its_own_weights_whatever_changed_since_the_last(tmp_path_factory, start, changes):
    # the slots keep the last push's layout while nothing it depends on changed: values changed
    # in place, a tensor made anew, one in another dtype, a view taken differently, a name tied
    # to another tensor, another engine dtype must each give the file a fresh pack gives
    d = tmp_path_factory.mktemp("w")
    slots = WeightSlots(d / "scratch", "model.safetensors")
    state, engine_dtype = dict(start), None
    try:
        for version, (change, seed) in enumerate(changes):
            rng = torch.Generator().manual_seed(seed)
            name = list(state)[seed % len(state)]
            tensor = state[name]
            if change == "in_place" and tensor.numel():
                with torch.no_grad():
                    tensor.copy_(make_tensor(tensor.dtype, tuple(tensor.shape), seed))
            elif change == "new_tensor":
                state[name] = make_tensor(tensor.dtype, tuple(tensor.shape), seed)
            elif change == "retyped":  # the same name and shape in another dtype
                other = [x for x in DTYPES if x != tensor.dtype][seed % (len(DTYPES) - 1)]
                state[name] = make_tensor(other, tuple(tensor.shape), seed)
            elif change == "new_view" and tensor.dim() == 2:
                state[name] = tensor.t()
            elif change == "tie":
                state[name] = state[list(state)[int(torch.randint(0, len(state), (1,), generator=rng))]]
            elif change == "dtype":
                engine_dtype = None if engine_dtype is not None else torch.bfloat16
            target = slots.write(version, state, engine_dtype)
            PackedWeights(state, engine_dtype).write(d / "packed.safetensors")
            assert (target / "model.safetensors").read_bytes() == (d / "packed.safetensors").read_bytes(), change
    finally:
        slots.close()


@pytest.fixture
def layouts_made(monkeypatch) -> list[int]:
    """One entry for each layout ``WeightSlots`` makes anew (a call of ``weight_file._layout``)."""
    made: list[int] = []
    real_layout = weight_file._layout
    monkeypatch.setattr(weight_file, "_layout", lambda *args: made.append(1) or real_layout(*args))
    return made


def test_pushes_of_the_same_parameters_keep_the_layout(tmp_path, layouts_made):
    params = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
    slots = WeightSlots(tmp_path, "model.safetensors")
    try:
        for version in range(4):
            with torch.no_grad():
                params["w"].fill_(version)  # an optimizer step: in place
            detached = {name: p.detach() for name, p in params.items()}  # a fresh state dict each push
            path = slots.write(version, detached, None) / "model.safetensors"
            assert torch.equal(load_file(path)["w"], torch.full((4, 4), float(version)))
        assert len(layouts_made) == 1
    finally:
        slots.close()


def test_new_tensors_of_the_same_shapes_keep_the_layout_and_none_is_held(tmp_path, layouts_made):
    # merged LoRA weights are new tensors every push: the layout is made once, and the slots
    # hold on to none of them (a kept copy would double the merged layers' memory)
    slots = WeightSlots(tmp_path, "model.safetensors")
    try:
        for version in range(3):
            merged = torch.full((8, 8), float(version))
            gone = weakref.ref(merged)
            path = slots.write(version, {"w": merged, "tied": merged}, None) / "model.safetensors"
            assert torch.equal(load_file(path)["w"], torch.full((8, 8), float(version)))
            del merged
            gc.collect()
            assert gone() is None
        assert len(layouts_made) == 1
    finally:
        slots.close()


@pytest.mark.parametrize("view", ["transposed", "shifted"])
def test_a_view_of_the_same_storage_taken_differently_is_written_as_it_reads_now(tmp_path, view):
    # same storage and shape as the push before: only the strides (a square transposed) or the
    # offset (a window moved along) tell the two apart
    base = torch.arange(16.0).reshape(4, 4)
    before, after = (base, base.t()) if view == "transposed" else (base.view(-1)[0:8], base.view(-1)[8:16])
    slots = WeightSlots(tmp_path, "model.safetensors")
    try:
        slots.write(0, {"w": before}, None)
        path = slots.write(1, {"w": after}, None) / "model.safetensors"
        assert torch.equal(load_file(path)["w"], after)
    finally:
        slots.close()


def test_a_slot_that_does_not_fit_its_file_system_is_an_oserror_not_a_bus_error(tmp_path):
    """A slot's file was sized with ftruncate and written through its mapping: on a tmpfs without
    room for it (a container's 64 MB /dev/shm and a real model) the write faulted in pages the
    file system could not give, and the kernel killed the trainer with SIGBUS, no line and no
    checkpoint. Its room is now taken before it is mapped: ENOSPC, which a run stops on."""
    code = (
        "import errno, sys, torch\n"
        "from pathlib import Path\n"
        "from sdp_cli.engine.weight_file import WeightSlots\n"
        "slots = WeightSlots(Path(sys.argv[1]), 'model.safetensors')\n"
        "try:\n"
        "    slots.write(0, {'w': torch.ones(100_000)}, None)\n"  # 400 KB into a 128 KB file system
        "except OSError as err:\n"
        "    print('raised', errno.errorcode[err.errno])\n"
    )
    done = run_with_tmpfs("128k", tmp_path, [sys.executable, "-c", code, str(tmp_path)], timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "raised ENOSPC", done.stdout


def test_bytes_kept_counts_the_start_once_and_each_slot_in_the_push_dtype():
    weight = torch.zeros(10)  # 40 bytes in float32
    state = {"embed": weight, "lm_head": weight, "steps": torch.zeros(3, dtype=torch.int64)}  # tied: once
    # start: 40 + 24; a push in bfloat16: 20 + 24 (integers keep their dtype); three slots
    assert weight_file.bytes_kept(state, torch.bfloat16) == 64 + 3 * 44
    assert weight_file.bytes_kept(state, None) == 64 + 3 * 64
    assert WeightSlots.SLOTS == 3
