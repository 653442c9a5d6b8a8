"""One sample's way through a remote engine's ``generate``: admit, send, record, per segment.

- *admit*: wait while the engine is paused, pick the sample's server (the least loaded one at
  its first request; every resubmission goes to the same one), restore it if it is suspect, and
  register the request in the same critical section, so that a ``pause()`` starting right after
  waits for it;
- *send*: the dialect's request and the checked answer (``sdp_cli.engine.wire``); a lost server
  leaves the sample as it was, to be admitted again once the server is back;
- *record*: the tokens with the version they were admitted under, π_prox_t from the prefill of a
  resubmission (docs/design.md §2 step 4), then finish, or resubmit after an abort.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from sdp_cli.choices import FINISH_REASONS
from sdp_cli.engine.base import EngineError, EngineUnavailable, SamplingParams
from sdp_cli.engine.remote_server import RemoteServer
from sdp_cli.engine.remote_state import RemoteState
from sdp_cli.engine.wire import (
    Segment,
    SegmentRequest,
    check_segment,
    check_segment_version,
    has_foreign_label,
    request_seed,
)
from sdp_cli.rollout.records import RolloutSample

#: restores of one server in a row, with no good answer in between, before a request fails
MAX_RESTORES_IN_A_ROW = 3

#: the dialect's request: (server, request, fresh id for a retry) → the parsed answer
Generate = Callable[[RemoteServer, SegmentRequest, Callable[[], str]], Segment]


@dataclass(frozen=True)
class _Admitted:
    """A request admitted for a sample, and the state it was admitted under."""

    server: RemoteServer
    request: SegmentRequest
    #: the request's id and the ids of its retries (aborted by pause() and close())
    request_ids: list[str]
    version: int
    pause_epoch: int
    restore_epoch: int
    #: output positions whose π_prox_t the resubmission's prefill provides
    proximal_indices: list[int] = field(default_factory=list)


@dataclass
class SampleRun:
    """Generates segments for the ``position``-th sample of a call until it stops or runs out
    of budget (``run``)."""

    sample: RolloutSample
    params: SamplingParams
    #: its index in the ``generate`` call (seeds differ per sample)
    position: int
    state: RemoteState
    servers: list[RemoteServer]
    generate: Generate
    #: brings a suspect server back (``RemoteServer.restore`` with the engine's weights)
    restore: Callable[[RemoteServer], None]
    #: aborts no pause or restore explains that are retried before the sample fails
    max_unexplained_aborts: int
    server: RemoteServer | None = None
    unexplained_aborts: int = 0
    #: restores of its server since the sample last got a good answer
    restores: int = 0

    def run(self) -> None:
        while (admitted := self._admit()) is not None:
            segment = self._send(admitted)
            if segment is not None and self._record(admitted, segment):
                return

    def _admit(self) -> _Admitted | None:
        """Wait while paused, then admit the next request, restoring a suspect server first.
        None when the sample has no budget left (it is then finished)."""
        sample, params, state = self.sample, self.params, self.state
        while True:
            with state.cond:
                state.wait_running()
                budget = params.max_new_tokens - sample.output_len
                if budget <= 0:
                    sample.finish("length")
                    return None
                if self.server is None:
                    self.server = min(self.servers, key=lambda s: s.load)
                server = self.server
                if not server.suspect:
                    version, pause_epoch = state.version, state.pause_epoch
                    restore_epoch = server.restore_epoch
                    proximal_indices = missing_proximal(sample, version)
                    request_ids = server.admit()
                    if sample.output_len:
                        state.counters["resubmissions"] += 1
                    break
                server.restoring += 1  # like a request: pause() waits for it
            self._restore(server)
        request = SegmentRequest(
            request_id=request_ids[0],
            input_ids=sample.input_ids,
            max_new_tokens=budget,
            stop_token_ids=tuple(params.stop_token_ids),
            seed=request_seed(params.seed, self.position, sample.output_len),
            prefill_from=sample.prompt_len + proximal_indices[0] if proximal_indices else None,
        )
        return _Admitted(
            server, request, request_ids, version, pause_epoch, restore_epoch, proximal_indices
        )

    def _restore(self, server: RemoteServer) -> None:
        """Restore the suspect server (counted in ``server.restoring`` by the caller); too many
        restores without a good answer in between fail the sample."""
        self.restores += 1
        try:
            if self.restores > MAX_RESTORES_IN_A_ROW:
                raise EngineError(
                    f"{server.url} lost sdp's weights or stopped answering {self.restores - 1} times "
                    f"in a row while generating sample {self.sample.sample_id}; check the server's log"
                )
            self.restore(server)
        finally:
            with self.state.cond:
                server.restoring -= 1
                self.state.cond.notify_all()

    def _send(self, admitted: _Admitted) -> Segment | None:
        """The server's checked answer; None when the server was lost (it is then suspect)."""
        server = admitted.server
        retry_id = functools.partial(server.retry_id, admitted.request_ids)
        try:
            segment = self.generate(server, admitted.request, retry_id)
            check_segment(server, admitted.request, segment)
        except BaseException as exc:
            with self.state.cond:
                server.end_request(admitted.request_ids)
                lost_server = isinstance(exc, EngineUnavailable) and not self.state.closed
                if lost_server:
                    server.suspect = True
            if lost_server:
                return None
            raise
        return segment

    def _record(self, admitted: _Admitted, segment: Segment) -> bool:
        """Record the answer in the sample; True when the sample is finished, False when it is
        to be resubmitted (aborted, or answered by a server that lost sdp's weights)."""
        sample, server, state = self.sample, admitted.server, self.state
        with state.cond:
            # Ending the request and recording its tokens in one critical section: once
            # pause() has seen every request end, every partial output is in its sample.
            server.end_request(admitted.request_ids)
            state.raise_if_closed()
            if has_foreign_label(segment):
                # Generated by a server that lost sdp's weights: discard it, restore, resubmit.
                server.suspect = True
                return False
            self.restores = 0
            state.counters["segments"] += 1
            check_segment_version(server, segment, admitted.version)
            self._patch_proximal(admitted, segment)
            sample.append_tokens(segment.token_ids, segment.logprobs, admitted.version)
            if segment.finish_reason in FINISH_REASONS:
                sample.finish(segment.finish_reason)
                return True
            state.counters["aborted_segments"] += 1
            if sample.output_len >= self.params.max_new_tokens:
                sample.finish("length")
                return True
            if (
                admitted.pause_epoch != state.pause_epoch
                or admitted.restore_epoch != server.restore_epoch
            ):
                self.unexplained_aborts = 0
                return False
            self.unexplained_aborts += 1
            if self.unexplained_aborts > self.max_unexplained_aborts:
                raise EngineError(
                    f"{server.url} aborted sample {sample.sample_id} {self.unexplained_aborts} times without a "
                    f"pause ({segment.message or 'no reason given'}); check the server's log"
                )
            return False

    def _patch_proximal(self, admitted: _Admitted, segment: Segment) -> None:
        """π_prox_t of tokens of version − 1 from the resubmission's prefill (docs/design.md §2
        step 4), patched by absolute token index (lock held)."""
        request, sample = admitted.request, self.sample
        if (
            not admitted.proximal_indices
            or segment.prefill_logprobs is None
            or request.prefill_from is None
        ):
            return
        if segment.prefill_version is None and not segment.token_ids:
            return  # aborted before anything ran: nothing tells which weights scored it
        offset = request.prefill_from - sample.prompt_len
        for t in admitted.proximal_indices:
            sample.set_proximal_t(t, segment.prefill_logprobs[t - offset], admitted.version)
        self.state.counters["prefill_proximal_tokens"] += len(admitted.proximal_indices)


def missing_proximal(sample: RolloutSample, version: int) -> list[int]:
    """Output positions of version − 1 tokens whose π_prox_t is not from ``version`` yet: the
    prefill of a resubmission under ``version`` provides it."""
    return [
        t
        for t, (v, pv) in enumerate(zip(sample.versions, sample.proximal_t_versions))
        if v == version - 1 and pv != version
    ]
