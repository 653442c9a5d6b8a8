"""One sample's way through a remote engine's ``generate``: admit, send, record, per segment.

- *admit*: wait while the engine is paused, pick the sample's server (the least loaded one at
  its first request; every resubmission goes to the same one), restore it if it is suspect, and
  register the request in the same critical section, so that a ``pause()`` starting right after
  waits for it;
- *send*: the dialect's request and the checked answer (``sdp_cli.engine.wire``); a lost server
  leaves the sample as it was, to be admitted again once the server is back;
- *record*: the tokens with the version they were admitted under, π_prox_t from the prefill of a
  resubmission (docs/design.md §2 step 4), then finish, or resubmit after an abort.

Two drivers run these steps: ``SampleRun.run`` sends one request per segment from its own thread
(vLLM, SGLang: the server batches concurrent requests itself); ``run_rounds`` drives all samples
of a call together from the calling thread, a round at a time, and sends each server one request
holding every segment of the round (the local engine's process, which decodes a request's
samples as one batch). Admission, answer checks and recording are the same code in both.
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
#: a batched dialect's request: (server, requests, fresh ids for a retry) → each request's answer
#: or the error that stands for it (a failure of the whole request stands for every one)
GenerateBatch = Callable[[RemoteServer, list[SegmentRequest], Callable[[], list[str]]], list[Segment | BaseException]]


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
        """Generate segment after segment, one request each, until the sample is finished."""
        while (admitted := self._admit()) is not None:
            try:
                outcome: Segment | BaseException = self.generate(
                    admitted.server, admitted.request, functools.partial(admitted.server.retry_id, admitted.request_ids)
                )
            except BaseException as exc:
                outcome = exc
            segment = self.settle(admitted, outcome)
            if segment is not None and self.record(admitted, segment):
                return

    def _admit(self) -> _Admitted | None:
        """Wait while paused, then admit the next request, restoring a suspect server first.
        None when the sample has no budget left (it is then finished)."""
        while True:
            with self.state.cond:
                self.state.wait_running()
                outcome = self.admit_locked()
            if not isinstance(outcome, RemoteServer):
                return outcome
            self.restore_server(outcome)

    def admit_locked(self) -> _Admitted | RemoteServer | None:
        """Admit the next request (lock held, engine running). Returns the admitted request; None
        when the sample has no budget left (it is then finished); or its server when that is
        suspect, counted in ``server.restoring`` (the caller then calls ``restore_server``)."""
        sample, params, state = self.sample, self.params, self.state
        budget = params.max_new_tokens - sample.output_len
        if budget <= 0:
            sample.finish("length")
            return None
        if self.server is None:
            self.server = min(self.servers, key=lambda s: s.load)
        server = self.server
        if server.suspect:
            server.restoring += 1  # like a request: pause() waits for it
            return server
        version, pause_epoch = state.version, state.pause_epoch
        restore_epoch = server.restore_epoch
        proximal_indices = missing_proximal(sample, version)
        request_ids = server.admit()
        if sample.output_len:
            state.counters["resubmissions"] += 1
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

    def restore_server(self, server: RemoteServer) -> None:
        """Restore the suspect server (counted in ``server.restoring`` by ``admit_locked``); too
        many restores without a good answer in between fail the sample."""
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

    def settle(self, admitted: _Admitted, outcome: Segment | BaseException) -> Segment | None:
        """The server's checked answer; None when the server was lost (it is then suspect); any
        other failure is raised (the sample is left as it was)."""
        server = admitted.server
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            check_segment(server, admitted.request, outcome)
        except BaseException as exc:
            with self.state.cond:
                server.end_request(admitted.request_ids)
                lost_server = isinstance(exc, EngineUnavailable) and not self.state.closed
                if lost_server:
                    server.suspect = True
            if lost_server:
                return None
            raise
        return outcome

    def record(self, admitted: _Admitted, segment: Segment) -> bool:
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


def run_rounds(runs: list[SampleRun], state: RemoteState, generate_batch: GenerateBatch) -> list[BaseException]:
    """Generate every sample of ``runs`` to its end, a round of segments at a time; returns the
    failures (a failed sample leaves the rounds, the others go on).

    A round admits every unfinished sample in one critical section (so a ``pause()`` comes
    before the whole round or waits for all of it), restores suspect servers, sends each server
    its requests in one ``generate_batch`` call (servers one after another), and records every
    answer; aborted and lost segments are admitted again in the next round."""
    errors: list[BaseException] = []
    pending = list(runs)
    while pending:
        admitted: list[tuple[SampleRun, _Admitted]] = []
        suspect: list[tuple[SampleRun, RemoteServer]] = []
        with state.cond:
            try:
                state.wait_running()
            except EngineError as exc:  # closed
                return [*errors, *[exc] * len(pending)]
            for run in pending:
                try:
                    outcome = run.admit_locked()
                except BaseException as exc:
                    errors.append(exc)
                    continue
                if isinstance(outcome, RemoteServer):
                    suspect.append((run, outcome))
                elif outcome is not None:
                    admitted.append((run, outcome))
        pending = []
        for run, server in suspect:
            try:
                run.restore_server(server)
                pending.append(run)
            except BaseException as exc:
                errors.append(exc)
        by_server: dict[RemoteServer, list[tuple[SampleRun, _Admitted]]] = {}
        for run, admission in admitted:
            by_server.setdefault(admission.server, []).append((run, admission))
        for server, items in by_server.items():
            requests = [admission.request for _, admission in items]

            def retry_ids(server: RemoteServer = server, items: list = items) -> list[str]:
                return [server.retry_id(admission.request_ids) for _, admission in items]

            try:
                outcomes = generate_batch(server, requests, retry_ids)
                assert len(outcomes) == len(items), f"{len(outcomes)} answers for {len(items)} requests"
            except BaseException as exc:
                outcomes = [exc] * len(items)
            for (run, admission), outcome in zip(items, outcomes, strict=True):
                try:
                    segment = run.settle(admission, outcome)
                    if segment is None or not run.record(admission, segment):
                        pending.append(run)
                except BaseException as exc:
                    errors.append(exc)
    return errors


def missing_proximal(sample: RolloutSample, version: int) -> list[int]:
    """Output positions of version − 1 tokens whose π_prox_t is not from ``version`` yet: the
    prefill of a resubmission under ``version`` provides it."""
    return [
        t
        for t, (v, pv) in enumerate(zip(sample.versions, sample.proximal_t_versions))
        if v == version - 1 and pv != version
    ]
