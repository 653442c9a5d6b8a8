"""bfloat16 on a CPU without bf16 instructions is emulated and slow: `sdp train` says so in one
line at the start (docs/real-models.md). The detection reads /proc/cpuinfo; tests give it files."""

from __future__ import annotations

import pytest

import sdp_cli.train.session.policy_setup as policy_setup
from sdp_cli.config.compose import compose_config
from sdp_cli.train.session.policy_setup import bf16_note, native_bf16

from ..fast_run import FAST, fast_with, train_run

X86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw {extra}\nmodel name\t: x\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd sve {extra}\nCPU part\t: 0xd40\n"


@pytest.mark.parametrize(
    ("text", "native"),
    [
        (X86.format(extra=""), False),  # AVX-512 without its BF16 extension: emulated
        (X86.format(extra="avx512_bf16"), True),
        (X86.format(extra="amx_tile amx_bf16"), True),
        (ARM.format(extra=""), False),
        (ARM.format(extra="bf16 i8mm"), True),
        ("model name\t: has bf16 in its name only\n", False),  # not a flags line
    ],
)
def test_native_bf16_reads_the_flags(tmp_path, text, native):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    assert native_bf16(cpuinfo) is native


def _note(native, *overrides, device="cpu"):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(policy_setup, "native_bf16", lambda: native)
        return bf16_note(compose_config(fast_with(overrides))[0], device)


def test_the_note_only_when_bfloat16_would_be_emulated():
    assert _note(False, "train.dtype=bfloat16").startswith("note: this CPU has no bfloat16 instructions")
    assert _note(False, "engine.dtype=bfloat16") is not None  # the engine alone runs bf16
    assert "\n" not in _note(False, "train.dtype=bfloat16")
    assert _note(True, "train.dtype=bfloat16") is None  # native
    assert _note(None, "train.dtype=bfloat16") is None  # unknown: say nothing
    assert _note(False) is None  # float32 everywhere
    assert _note(False, "train.dtype=bfloat16", device="cuda") is None  # not the CPU's business
    # a server's dtype is computed by the server, not by this CPU
    assert _note(False, "engine=sglang") is None


def test_a_run_prints_the_note_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(policy_setup, "native_bf16", lambda: False)
    train_run(tmp_path, [*FAST, "train.steps=1", "train.checkpoint_every=0", "engine.dtype=bfloat16"])
    err = capsys.readouterr().err
    assert err.count("note: this CPU has no bfloat16 instructions") == 1


def test_without_cpuinfo_nothing_is_known(tmp_path):
    assert native_bf16(tmp_path / "absent") is None
