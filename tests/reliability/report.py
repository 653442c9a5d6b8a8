"""The reliability report: every injected fault and every run it happened in, as a table.

Tests call :func:`run_result` once per training run (did it reach its target step, how many
samples the ledger audit found lost or duplicated) and :func:`fault` once per injected fault
(its kind, the run, the seconds until the run was working again). Hostile inputs are counted
with :func:`hostile_input`. ``conftest.py`` prints the tables at the end of the session and
writes them as JSON to ``$SDP_RELIABILITY_REPORT`` (under pytest-xdist, after adding what each
worker recorded: :func:`records`, :func:`merge`); ``.ci/reliability.sh`` checks the issue's
thresholds on that JSON.
"""

from __future__ import annotations

import json
import statistics
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

KINDS = ("engine", "kill -9", "signal", "hung reward")


@dataclass
class Run:
    survived: bool
    samples_lost: int
    samples_duplicated: int


@dataclass
class Fault:
    kind: str
    name: str
    run_id: str
    recover_s: float | None


@dataclass
class HostileInput:
    name: str
    one_line: bool
    nonzero_exit: bool
    nothing_written: bool


@dataclass
class Report:
    runs: dict[str, Run] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    inputs: list[HostileInput] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


REPORT = Report()


def run_result(run_id: str, *, survived: bool, samples_lost: int, samples_duplicated: int) -> None:
    with REPORT.lock:
        REPORT.runs[run_id] = Run(survived, samples_lost, samples_duplicated)


def fault(kind: str, name: str, run_id: str, recover_s: float | None = None) -> None:
    assert kind in KINDS, kind
    with REPORT.lock:
        REPORT.faults.append(Fault(kind, name, run_id, recover_s))


def hostile_input(name: str, *, one_line: bool, nonzero_exit: bool, nothing_written: bool) -> None:
    with REPORT.lock:
        REPORT.inputs.append(HostileInput(name, one_line, nonzero_exit, nothing_written))


def _row(label: str, faults: list[Fault]) -> dict[str, object]:
    run_ids = sorted({f.run_id for f in faults})
    runs = [REPORT.runs.get(r, Run(False, 0, 0)) for r in run_ids]
    times = [f.recover_s for f in faults if f.recover_s is not None]
    return {
        "fault": label,
        "injected": len(faults),
        "runs": len(runs),
        "survived": sum(r.survived for r in runs),
        # a fault counts as survived when its run reached the target step
        "faults_survived": sum(REPORT.runs.get(f.run_id, Run(False, 0, 0)).survived for f in faults),
        "samples_lost": sum(r.samples_lost for r in runs),
        "samples_duplicated": sum(r.samples_duplicated for r in runs),
        "recover_median_s": statistics.median(times) if times else None,
        "recover_max_s": max(times) if times else None,
    }


def rows() -> list[dict[str, object]]:
    """One row per (kind, fault), a total per kind and an overall total."""
    out = []
    for kind in KINDS:
        of_kind = [f for f in REPORT.faults if f.kind == kind]
        for name in sorted({f.name for f in of_kind}):
            out.append(_row(f"{kind}: {name}", [f for f in of_kind if f.name == name]))
        if of_kind:
            out.append(_row(f"{kind}: all", of_kind))
    if REPORT.faults:
        out.append(_row("all faults", REPORT.faults))
    return out


def _seconds(value: object) -> str:
    return "–" if value is None else f"{value:.1f}"


def table() -> str:
    header = (
        f"{'fault':<52} {'injected':>8} {'runs':>5} {'survived':>8} {'lost':>5} {'dup':>5} "
        f"{'recover s (median/max)':>23}"
    )
    lines = [header, "-" * len(header)] if REPORT.faults else []
    for row in rows():
        lines.append(
            f"{row['fault']:<52} {row['injected']:>8} {row['runs']:>5} {row['survived']:>8} "
            f"{row['samples_lost']:>5} {row['samples_duplicated']:>5} "
            f"{_seconds(row['recover_median_s']) + ' / ' + _seconds(row['recover_max_s']):>23}"
        )
    if REPORT.inputs:
        inputs = REPORT.inputs
        lines += [
            "",
            f"hostile inputs: {len(inputs)} tried; one-line error {sum(i.one_line for i in inputs)}, "
            f"non-zero exit {sum(i.nonzero_exit for i in inputs)}, nothing written "
            f"{sum(i.nothing_written for i in inputs)}",
        ]
    return "\n".join(lines)


def totals() -> dict[str, int]:
    engine = [f for f in REPORT.faults if f.kind == "engine"]
    kills = [f for f in REPORT.faults if f.kind == "kill -9"]
    signals = [f for f in REPORT.faults if f.kind == "signal"]
    hung = [f for f in REPORT.faults if f.kind == "hung reward"]

    def survived(faults: list[Fault]) -> int:
        return sum(REPORT.runs.get(f.run_id, Run(False, 0, 0)).survived for f in faults)

    good_inputs = [i for i in REPORT.inputs if i.one_line and i.nonzero_exit and i.nothing_written]
    return {
        "engine_faults_injected": len(engine),
        "engine_faults_survived": survived(engine),
        "kill_points_injected": len(kills),
        "kill_points_survived": survived(kills),
        "signals_injected": len(signals),
        "signals_survived": survived(signals),
        "signals_vllm_survived": survived([f for f in signals if "vLLM" in f.name]),
        "hung_rewards_injected": len(hung),
        "hung_rewards_survived": survived(hung),
        "engine_process_kills_injected": len([f for f in engine if "local engine process killed" in f.name]),
        "engine_process_kills_survived": survived([f for f in engine if "local engine process killed" in f.name]),
        "runs": len(REPORT.runs),
        "runs_survived": sum(r.survived for r in REPORT.runs.values()),
        "samples_lost": sum(r.samples_lost for r in REPORT.runs.values()),
        "samples_duplicated": sum(r.samples_duplicated for r in REPORT.runs.values()),
        "hostile_inputs": len(REPORT.inputs),
        "hostile_inputs_clean": len(good_inputs),
    }


def records() -> dict[str, object]:
    """What this process recorded, as plain data (a pytest-xdist worker hands it to the controller)."""
    with REPORT.lock:
        return {
            "runs": {k: asdict(v) for k, v in REPORT.runs.items()},
            "faults": [asdict(f) for f in REPORT.faults],
            "inputs": [asdict(i) for i in REPORT.inputs],
        }


def merge(recorded: dict) -> None:
    """Add another process's ``records()`` (a worker's, on the controller). Run ids name their
    test, so two workers never record the same one."""
    with REPORT.lock:
        for run_id, run in recorded["runs"].items():
            assert run_id not in REPORT.runs, f"run id {run_id!r} recorded by two workers"
            REPORT.runs[run_id] = Run(**run)
        REPORT.faults.extend(Fault(**f) for f in recorded["faults"])
        REPORT.inputs.extend(HostileInput(**i) for i in recorded["inputs"])


def write_json(path: Path) -> None:
    data = {"totals": totals(), "rows": rows(), **records()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
