"""The definitions the suite's numbers rest on, checked by hand: the ledger audit (what "lost"
and "duplicated" mean), the fault-hook parser, and the transport's request timeout."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from sdp_cli.engine.base import EngineError
from sdp_cli.engine.http import HttpOptions, HttpServer
from sdp_cli.faults import _parse, _stall_seconds
from sdp_cli.train.asyncloop.ledger import Audit, LedgerLog, audit, parse_events, record_fate

pytestmark = pytest.mark.reliability


def _snapshot(ledger: LedgerLog, **stats) -> dict:
    """A loop snapshot after: groups 0-3 consumed at step 1, 4 dropped, 5 rejected, 6 held in
    the queue, 7 in flight; 8 groups handed out (next_group_id = 8)."""
    counters = dict(submitted=8, accepted=6, rejected=1, running=1, filtered=1, enqueued=0)
    counters.update(stats)
    return {
        "step": 1,
        "next_group_id": 8,
        "queue": [{"group_id": 6, "samples": []}],
        "cache": [],
        "in_flight_group_ids": [7],
        "manager": {"stats": counters},
        "ledger_offset": ledger.offset(),
    }


def _ledger(tmp_path) -> LedgerLog:
    log = LedgerLog(tmp_path / "ledger.jsonl")
    log.write("consumed", [0, 1, 2, 3], step=1, samples=[4, 4, 4, 4])
    log.write("dropped", [4], version=1, where="cache")
    log.write("rejected", [5], reason="engine fault")
    return log


def test_a_consistent_ledger_has_one_fate_per_group(tmp_path):
    log = _ledger(tmp_path)
    result = audit(log.path, _snapshot(log), group_size=4)
    # 4 consumed + 1 dropped + 1 rejected + 1 held + 1 in flight = the 8 groups handed out
    assert dict(result.fates) == {"consumed": 4, "dropped": 1, "rejected": 1, "held": 1, "in_flight": 1}
    assert result.ok and result.samples_lost == 0 and result.samples_duplicated == 0


def test_a_group_with_no_fate_is_lost_and_one_with_two_is_duplicated(tmp_path):
    log = _ledger(tmp_path)
    log.write("consumed", [6], step=2, samples=[4])  # consumed, yet still in the queue
    snap = _snapshot(log)
    snap["step"] = 2
    snap["in_flight_group_ids"] = []  # group 7 vanished
    result = audit(log.path, snap, group_size=4)
    assert result.lost == [7] and result.duplicated == [6]
    assert result.samples_lost == 4 and result.samples_duplicated == 4  # one group of 4 each
    # and the counters disagree: running says 1 group in flight, the ledger none
    assert "running: 1 vs 0" in result.counter_mismatches


def test_a_fate_of_a_group_never_handed_out_is_a_duplicate(tmp_path):
    # ids 0-7 were handed out (next_group_id = 8): a fate of group 8 cannot be its first
    log = _ledger(tmp_path)
    log.write("dropped", [8], version=1, where="queue")
    assert audit(log.path, _snapshot(log), group_size=4).duplicated == [8]


def test_events_after_the_checkpoint_offset_are_not_part_of_its_lineage(tmp_path):
    log = _ledger(tmp_path)
    snap = _snapshot(log)
    log.write("consumed", [6, 7], step=2, samples=[4, 4])  # a crashed session's later step
    assert audit(log.path, snap, group_size=4).ok
    resumed = LedgerLog(log.path, truncate_to=snap["ledger_offset"])  # what a resume does
    assert resumed.offset() == snap["ledger_offset"]
    assert audit(resumed.path, snap, group_size=4).ok


def test_an_abandoned_group_gave_its_capacity_back_like_a_rejected_one(tmp_path):
    # a resumed run: group 7 was in flight when its checkpoint was taken; the resume abandons it
    # and the manager counts it rejected (its capacity came back)
    log = _ledger(tmp_path)
    log.write("abandoned", [7], checkpoint_step=1)
    snap = _snapshot(log, rejected=2, running=0)
    snap["in_flight_group_ids"] = []
    result = audit(log.path, snap, group_size=4)
    assert result.ok and result.fates["abandoned"] == 1
    snap["manager"]["stats"]["rejected"] = 1
    assert audit(log.path, snap, group_size=4).counter_mismatches == ["rejected: 1 vs 2"]


def test_every_step_up_to_the_snapshots_consumes_once(tmp_path):
    log = _ledger(tmp_path)
    log.write("consumed", [6], step=1, samples=[4])  # step 1 twice
    snap = _snapshot(log, accepted=6)
    snap["queue"] = []
    assert audit(log.path, snap, group_size=4).counter_mismatches == ["consumed steps [1] vs 1..1 once each"]
    (tmp_path / "gap").mkdir()
    log = _ledger(tmp_path / "gap")
    snap = _snapshot(log)
    snap["step"] = 2  # step 2 never consumed
    assert audit(log.path, snap, group_size=4).counter_mismatches == ["consumed steps [1] vs 1..2 once each"]


def test_a_fate_of_no_groups_or_without_a_ledger_writes_nothing(tmp_path):
    log = LedgerLog(tmp_path / "ledger.jsonl")
    record_fate(log, "dropped", [], version=1, where="cache")
    record_fate(None, "dropped", [3], version=1, where="cache")
    assert log.offset() == 0 and log.path.read_bytes() == b""


@pytest.mark.parametrize("samples", ["3", "4", '["4"]', "[4, -1]", "null"])
def test_a_consumed_event_whose_samples_are_not_counts_is_refused(samples):
    line = f'{{"event": "consumed", "time": 1.0, "groups": [0, 1], "step": 1, "samples": {samples}}}\n'
    with pytest.raises(ValueError, match="^line 1: samples is not a list of sample counts$"):
        parse_events(line.encode())


def test_problems_show_five_groups_then_an_ellipsis():
    assert Audit(group_size=4, lost=[4, 3, 2, 1, 0]).problems() == "groups 0, 1, 2, 3, 4 lost"
    assert Audit(group_size=4, lost=[5, 4, 3, 2, 1, 0]).problems() == "groups 0, 1, 2, 3, 4, ... lost"
    assert Audit(group_size=4, duplicated=[6]).problems() == "group 6 duplicated"


def test_fault_specs_are_parsed_and_typos_refused():
    assert _parse("kill:checkpoint.state@2, raise:local.generate") == {
        "checkpoint.state": [("kill", 2)],
        "local.generate": [("raise", 1)],
    }
    for bad in ("kill:checkpoint.stat", "explode:local.generate", "kill:local.generate@x"):
        with pytest.raises(ValueError, match="SDP_TEST_FAULTS"):
            _parse(bad)


def test_the_stall_is_a_number_of_seconds_or_refused():
    assert _stall_seconds("10") == 10.0 and _stall_seconds("0.5") == 0.5
    for bad in ("", "ten", "0", "-3", "nan", "inf", "1e9"):
        with pytest.raises(ValueError, match="SDP_TEST_STALL_S"):
            _stall_seconds(bad)


def test_the_request_timeout_applies_to_requests_without_their_own():
    class Slow(BaseHTTPRequestHandler):
        def do_GET(self):
            time.sleep(1.0)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        http = HttpServer(url, HttpOptions(request_timeout_s=0.2))
        started = time.perf_counter()
        with pytest.raises(EngineError, match="got no answer within 0.2 s"):
            http.get("/")
        assert time.perf_counter() - started < 0.9  # not the server's 1 s
    finally:
        server.shutdown()
        server.server_close()
