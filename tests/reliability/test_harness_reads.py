"""The harness reads ``metrics.jsonl``, ``events.jsonl`` and ``ledger.jsonl`` while sdp is still
appending to them. sdp writes a line in one ``write``, but Linux copies a write into the file
page by page, so a reader can see the first 4 KiB of a long line before the rest: the harness
must take only whole lines (CI once failed on a metrics row cut at byte 4092)."""

from __future__ import annotations

import json
import subprocess
import sys

from .harness import read_jsonl, whole_lines


def test_a_line_the_writer_has_not_finished_is_not_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = json.dumps({"step": 1, "loss": 0.5}) + "\n"
    torn = json.dumps({"step": 2, "loss": 0.25})[:17]  # no closing brace, no newline
    path.write_text(whole + torn)
    assert read_jsonl(path) == [{"step": 1, "loss": 0.5}]
    path.write_text(whole)  # the writer has finished
    assert read_jsonl(path) == [{"step": 1, "loss": 0.5}]


def test_a_torn_multibyte_character_is_not_decoded(tmp_path):
    path = tmp_path / "events.jsonl"
    line = json.dumps({"event": "note", "text": "π"}, ensure_ascii=False).encode()
    path.write_bytes(line + b"\n" + line[: line.index("π".encode()) + 1])  # half of π's two bytes
    assert read_jsonl(path) == [{"event": "note", "text": "π"}]


def test_a_pid_cut_short_in_a_text_log_is_not_read(tmp_path):
    """The reliability tests find the processes to kill by the pid a log line names: a line
    seen up to "pid 12" of "pid 12345" would name another process."""
    log = tmp_path / "local_engine.log"
    assert whole_lines(log) == ""
    log.write_text("sdp local engine: pid 4242, 1 thread\nsdp local engine: pid 12")
    assert whole_lines(log) == "sdp local engine: pid 4242, 1 thread\n"


_WRITER = """
import sys
from pathlib import Path
from sdp_cli.train.session.reporting import MetricsLog

log = MetricsLog(Path(sys.argv[1]))
for step in range(1, int(sys.argv[2]) + 1):
    # ~12 KB a row, three pages: as long as a row with many metrics and trackers
    log.write(step, {f"metric/{i:04d}": step + i / 1000 for i in range(500)})
log.close()
"""


def test_rows_read_while_sdp_appends_them_are_whole_and_in_order(tmp_path):
    """Real writer processes (sdp's MetricsLog) against a reader polling as fast as it can; a
    short file keeps each poll quick, so several files give the reader many chances to land
    inside a write (on the code before this test, 1 in 3 runs of one file of 400 rows failed)."""
    rows = 300
    for attempt in range(8):
        path = tmp_path / f"metrics{attempt}.jsonl"
        path.touch()
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(rows)])
        reads = 0
        try:
            while True:
                finished = writer.poll() is not None
                seen = read_jsonl(path)
                reads += 1
                assert [row["step"] for row in seen] == list(range(1, len(seen) + 1))
                assert all(len(row) == 502 for row in seen)
                if finished:
                    break
        finally:
            writer.kill()
            writer.wait()
        assert writer.returncode == 0
        assert len(seen) == rows and reads > 1
