"""What /proc/cpuinfo says of this machine's processor (torch-free): the first processor's entry
and the instruction-set flags. Linux only: elsewhere the file is absent and readers say None."""

from __future__ import annotations

from pathlib import Path

#: where Linux describes the processors
CPUINFO = Path("/proc/cpuinfo")


def read_cpuinfo(cpuinfo: Path = CPUINFO) -> str | None:
    """The text of ``cpuinfo`` (None: no such file, e.g. not Linux)."""
    try:
        return cpuinfo.read_text(errors="replace")
    except OSError:
        return None


def first_entry(text: str) -> dict[str, str]:
    """The first processor's fields, names lower-cased (``model name``, ``cpu family``, ...)."""
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip().lower(), value.strip())
    return fields


def flags_of(text: str) -> set[str]:
    """The instruction-set flags every processor lists: x86's ``flags`` lines, Arm's ``Features``."""
    return {
        flag
        for line in text.splitlines()
        if line.split(":")[0].strip().lower() in ("flags", "features")
        for flag in line.partition(":")[2].split()
    }
