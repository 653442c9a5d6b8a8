"""Logic shared by the HTTP engines (vLLM, SGLang): segments, versions, pause and resubmission.

A server answers one *segment* per request: the tokens it generated until it stopped
(``stop``/``length``: the sample is done) or was aborted (``abort``: resume later). The client
owns the rollout record and accumulates (token, logprob, version) triples across segments; the
tokens of a segment carry the client's version at submission, cross-checked against the
weight-version label the server reports (a disagreement is an ``EngineError``).

Pause protocol (DESIGN.md §2), as seen from the servers:

- ``pause()``: stop admitting requests, abort everything in flight on the servers and let
  them run again (so that the recompute pass can ``score`` while generation is paused), and
  return once every request has ended and its partial output is recorded in its sample. From
  then until ``resume()`` no sample is mutated: the recompute pass owns them.
- ``update_weights()``: pause the servers (aborting anything that slipped in), load the new
  weights, reset the prefix cache, relabel the weight version, resume the servers.
- ``resume()``: admit again. A partial sample is resubmitted as prompt + partial output with
  the remaining token budget and a fresh request id; when it holds tokens of version
  (new − 1) without π_prox_t, the resubmission also asks for the prefill logprobs of its
  input, and those become π_prox_t of the tokens (DESIGN.md §2 step 4, patched by absolute
  index). Tokens whose resubmission was aborted before its prefill are left to the next
  recompute pass (step 2).

Outages and restarts (docs/reliability.md). A server that stops answering (after the transport's
retries) or answers under a weight-version label sdp never sets (a number is sdp's; a restarted
vLLM reports ``default``) is *suspect*: before it is used again, sdp waits for it to answer
(up to ``reconnect_timeout_s``), reads its label and, unless it is sdp's, reloads the current
version's weights (or sets the label while the servers still run their start-up weights). The
answer that revealed the restart is discarded, so no token is ever tagged with a version that
did not produce it; the sample keeps the tokens it had and is resubmitted (prompt + partial
output) like after a pause. A server that is down when ``pause()`` aborts is not waited for
beyond its requests, which end on their own; scoring and weight updates wait for it too.
"""

from __future__ import annotations

import abc
import functools
import logging
import math
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from sdp_cli.engine.base import (
    EngineError,
    EngineUnavailable,
    InferenceEngine,
    SamplingParams,
    WeightUpdate,
)
from sdp_cli.engine.http import HttpOptions, HttpServer
from sdp_cli.engine.servers import LaunchSpec, ManagedServer
from sdp_cli.rollout.records import RolloutSample

logger = logging.getLogger(__name__)

FINISHED = ("stop", "length")
#: restores of one server in a row, with no good answer in between, before a request fails
MAX_RESTORES_IN_A_ROW = 3


@dataclass(frozen=True)
class RemoteOptions:
    """Settings shared by the vLLM and SGLang clients."""

    #: sampling temperature; scoring uses the same one (see ``allow_temperature_mismatch``)
    temperature: float = 1.0
    #: accept temperature != 1 although the servers' logprobs are then wrong (check_temperature)
    allow_temperature_mismatch: bool = False
    #: keep generating past the model's end-of-sequence token (benchmarks)
    ignore_eos: bool = False
    #: requests in flight at once over all servers (generation; scoring has its own pool)
    max_concurrent_requests: int = 64
    #: an abort that no pause explains is retried this many times before it is an error
    max_unexplained_aborts: int = 3
    #: how long a server that stopped answering may take to come back before its work fails
    reconnect_timeout_s: float = 300.0
    #: transport settings: timeouts, retries, keep-alive, API key
    http: HttpOptions = field(default_factory=HttpOptions)

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be >= 1")
        if not self.reconnect_timeout_s > 0:
            raise ValueError(f"reconnect_timeout_s must be > 0, got {self.reconnect_timeout_s}")


@dataclass(frozen=True)
class SegmentRequest:
    """One generation request: continue ``input_ids`` by at most ``max_new_tokens`` tokens."""

    request_id: str
    input_ids: list[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    seed: int | None
    #: first input position whose prefill logprob is wanted (>= 1), or None for none
    prefill_from: int | None = None


@dataclass
class Segment:
    """A server's parsed answer to a ``SegmentRequest``."""

    token_ids: list[int]
    logprobs: list[float]
    #: "stop", "length" or "abort"
    finish_reason: str
    #: the server's weight-version label of each output token; None when it reports none
    token_versions: list[str] | None
    #: prefill logprobs of input positions ``prefill_from ..``; None when not returned
    prefill_logprobs: list[float] | None = None
    #: the weight-version label the prefill ran under, when the server reports it
    prefill_version: str | None = None
    #: the server's explanation of an abort
    message: str = ""


@dataclass
class RemoteServer:
    """One server the engine talks to, with the number of its requests in flight."""

    http: HttpServer
    load: int = 0
    #: ids of this client's requests in flight on the server
    request_ids: set[str] = field(default_factory=set)
    #: the server may have lost sdp's weights (it stopped answering or restarted): check its
    #: label and restore the weights before it is used again
    suspect: bool = False
    #: generation threads restoring the server now; pause() waits for them
    restoring: int = 0
    #: incremented by every restore: an abort or error that spans one was caused by it
    restore_epoch: int = 0
    #: serialises restores and weight updates of this server
    weights_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return self.http.base_url


def version_label(version: int) -> str:
    """The weight-version label sdp gives the servers: the version number as a string."""
    return str(int(version))


def is_version_label(label: str) -> bool:
    """Whether sdp could have set ``label``; a restarted server reports its start-up label
    instead (vLLM: ``default``; SGLang: ``default`` or its ``--weight-version``)."""
    return label.isdecimal()


def new_request_id() -> str:
    """A fixed-length id; SGLang aborts by rid *prefix*, so ids must not prefix one another."""
    return uuid.uuid4().hex


def request_seed(seed: int | None, position: int, output_len: int) -> int | None:
    """The server-side seed of one segment: distinct for every sample of a call (a GRPO group
    with one seed must not get identical samples) and for every resubmission (which must not
    replay the random stream of the first segment)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + position * 65_537 + output_len) % 2**31


#: why each server's logprobs are wrong at T != 1 (docs/engines.md, "Temperature")
TEMPERATURE_PROBLEMS = {
    "vllm": (
        "vLLM reports raw logprobs, log softmax(z) without the 1/T, for sampled and prompt tokens "
        "alike, so old_logprobs would not be those of the distribution the tokens were sampled "
        "from (--logprobs-mode processed_logprobs scales the sampled ones only: prompt logprobs, "
        "which the π_prox_t scores use, stay unscaled)"
    ),
    "sglang": (
        "SGLang's sampled-token logprobs are log softmax(z / T) but its prefill logprobs are not "
        "temperature-scaled, so the π_prox_t scores would not match old_logprobs "
        "(SGLANG_RETURN_ORIGINAL_LOGPROB=1 unscales the sampled ones too, making old_logprobs wrong)"
    ),
}


def check_temperature(options: RemoteOptions, engine_name: str) -> None:
    """Refuse T != 1, saying why the server's logprobs would be wrong (``TEMPERATURE_PROBLEMS``)."""
    if options.temperature == 1.0:
        return
    problem = TEMPERATURE_PROBLEMS.get(
        engine_name, "the server's logprobs are not known to be temperature-scaled"
    )
    message = f"engine={engine_name} with temperature={options.temperature}: {problem}"
    if not options.allow_temperature_mismatch:
        raise EngineError(
            message
            + "; use temperature=1.0 or set engine.allow_temperature_mismatch=true to accept it"
        )
    warnings.warn(
        message + " (allowed by engine.allow_temperature_mismatch)", RuntimeWarning, stacklevel=3
    )
    logger.warning("%s (allowed by engine.allow_temperature_mismatch)", message)


# ------------------------------------------------------------------ response parsing helpers
def malformed(server: RemoteServer, path: str, problem: str) -> EngineError:
    return EngineError(
        f"{server.url}{path} answered a malformed response ({problem}); the sample is not used"
    )


def as_token_ids(server: RemoteServer, path: str, value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise malformed(server, path, f"{what} is not a list of token ids")
    return list(value)


def as_logprob(server: RemoteServer, path: str, value: Any, what: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value > 1e-4
    ):
        raise malformed(server, path, f"{what} is {value!r}, not a finite log-probability")
    return min(float(value), 0.0)


def expand_spans(server: RemoteServer, path: str, spans: Any, n_tokens: int) -> list[str]:
    """Per-token labels from ``[{version, start, end}, ...]`` spans that must tile ``[0, n)``."""
    if not isinstance(spans, list):
        raise malformed(server, path, "weight_versions is not a list")
    labels: list[str] = []
    for span in spans:
        try:
            version, start, end = str(span["version"]), int(span["start"]), int(span["end"])
        except (TypeError, KeyError, ValueError):
            raise malformed(server, path, f"weight_versions span {span!r}") from None
        if start != len(labels) or end < start:
            raise malformed(server, path, f"weight_versions spans {spans!r} do not tile the output")
        labels.extend([version] * (end - start))
    if len(labels) != n_tokens:
        raise malformed(
            server, path, f"weight_versions cover {len(labels)} tokens, the output has {n_tokens}"
        )
    return labels


class RemoteEngine(InferenceEngine):
    """An ``InferenceEngine`` whose model runs in one or more HTTP servers.

    Subclasses speak one server's dialect (the ``_server_*`` methods); this class owns the
    rollout records, versions, pause/resume, load spreading and resubmission, and stops on
    ``close()`` the ``managed`` servers it was started with (see ``_attach_launched``).
    """

    #: name used in messages and config keys ("vllm", "sglang")
    engine_name = "remote"

    def __init__(
        self,
        base_urls: Sequence[str],
        options: RemoteOptions | None = None,
        *,
        version: int = 0,
        managed: Sequence[ManagedServer] = (),
    ):
        self._managed = list(managed)
        options = options or RemoteOptions()
        if not base_urls:
            raise EngineError(
                f"engine={self.engine_name} needs at least one server address (engine.urls)"
            )
        check_temperature(options, self.engine_name)
        self.options = options
        self.temperature = options.temperature
        self.servers = [
            RemoteServer(
                HttpServer(
                    url,
                    options.http,
                    label=f"{self.engine_name} server",
                    unavailable_hint=self._unavailable_hint(),
                )
            )
            for url in base_urls
        ]
        self._cond = threading.Condition()
        self._version = int(version)
        #: directory of the current version's weights; None while the servers run their
        #: start-up weights, which sdp takes to be version ``version``
        self._weights_path: Path | None = None
        self._paused = False
        self._closed = False
        #: incremented by every pause(): an abort with an unchanged epoch was not ours
        self._pause_epoch = 0
        self._inflight: dict[int, RolloutSample] = {}
        self._stats = {
            "segments": 0,
            "resubmissions": 0,
            "aborted_segments": 0,
            "prefill_proximal_tokens": 0,
            "restore_checks": 0,
            "restores": 0,
        }
        self._generate_pool = ThreadPoolExecutor(
            options.max_concurrent_requests, thread_name_prefix=f"sdp-{self.engine_name}-gen"
        )
        self._score_pool = ThreadPoolExecutor(
            max(1, min(options.max_concurrent_requests, 16 * len(self.servers))),
            thread_name_prefix=f"sdp-{self.engine_name}-score",
        )
        try:
            for server in self.servers:
                self._server_connect(server)
                self._server_set_version(server, version_label(self._version))
        except EngineUnavailable as exc:
            self.close()
            http = options.http
            waited = sum(http.backoff(i) for i in range(http.max_retries))
            raise EngineUnavailable(
                f"{exc}; gave up after {1 + http.max_retries} attempt(s) over {waited:.1f} s "
                f"(engine.retries={http.max_retries})"
            ) from None
        except BaseException:
            self.close()
            raise

    @classmethod
    def _attach_launched(cls, spec: LaunchSpec, options: RemoteOptions, **kwargs: Any) -> Self:
        """Start the server of ``spec`` and attach to it (``kwargs`` go to the constructor);
        ``close()`` stops it, and so does a failed attach."""
        server = ManagedServer(spec).start()
        try:
            return cls([server.base_url], options, managed=[server], **kwargs)
        except BaseException:
            server.stop()
            raise

    # -------------------------------------------------------------- dialect (subclasses)
    @abc.abstractmethod
    def _unavailable_hint(self) -> str:
        """What to do when a server cannot be reached (one clause)."""

    @abc.abstractmethod
    def _server_connect(self, server: RemoteServer) -> None:
        """Check that the server answers and has the routes sdp needs."""

    @abc.abstractmethod
    def _server_generate(
        self, server: RemoteServer, request: SegmentRequest, refresh_id: Callable[[], str]
    ) -> Segment:
        """Run one generation request; ``refresh_id()`` gives a fresh request id for a retry."""

    @abc.abstractmethod
    def _server_score(
        self, server: RemoteServer, sequence: list[int], start: int
    ) -> tuple[list[float], str | None]:
        """Prefill logprobs of ``sequence[start:]`` and the weight-version label they ran under."""

    @abc.abstractmethod
    def _server_abort_all(self, server: RemoteServer) -> None:
        """Abort every request in flight (they answer with their partial output); keep serving."""

    @abc.abstractmethod
    def _server_abort_requests(self, server: RemoteServer, request_ids: list[str]) -> None:
        """Abort this client's requests ``request_ids`` (pause stragglers, engine close)."""

    @abc.abstractmethod
    def _server_load_weights(self, server: RemoteServer, path: Path, label: str) -> None:
        """Pause, load ``path``, reset the prefix cache, set the label ``label``, resume."""

    @abc.abstractmethod
    def _server_set_version(self, server: RemoteServer, label: str) -> None:
        """Relabel the loaded weights without loading anything."""

    def _server_get_version(self, server: RemoteServer) -> str | None:
        """The server's weight-version label, or None where the dialect cannot read it (then
        a suspect server always gets the current weights again)."""
        return None

    # ------------------------------------------------------------------ versions
    def get_version(self) -> int:
        with self._cond:
            return self._version

    def set_version(self, version: int) -> None:
        for server in self.servers:
            self._server_set_version(server, version_label(version))
        with self._cond:
            self._version = int(version)

    # ------------------------------------------------------------------ generation
    def generate(self, samples: Sequence[RolloutSample], params: SamplingParams) -> None:
        pending = [s for s in samples if not s.is_finished]
        with self._cond:
            self._raise_if_closed()
            for sample in pending:
                self._inflight[sample.sample_id] = sample
        futures: list[Future[None]] = []
        try:
            futures = [
                self._generate_pool.submit(self._run_sample, s, params, i)
                for i, s in enumerate(pending)
            ]
        finally:
            errors: list[BaseException] = []
            for future in futures:
                try:
                    future.result()
                except BaseException as exc:  # collected so every sample settles first
                    errors.append(exc)
            with self._cond:
                for sample in pending:
                    self._inflight.pop(sample.sample_id, None)
        if errors:
            distinct = list(dict.fromkeys(str(e) for e in errors))
            if len(distinct) > 1 and all(isinstance(e, EngineError) for e in errors):
                # every failure of the call is reported (the run's ledger records the reason)
                raise EngineError(
                    f"{len(errors)} of {len(pending)} samples failed: " + " | ".join(distinct)
                )
            raise errors[0]

    def _run_sample(self, sample: RolloutSample, params: SamplingParams, position: int) -> None:
        """Generate segments for the ``position``-th sample of a call until it stops or runs
        out of budget."""
        server: RemoteServer | None = None  # sticky: every resubmission goes to the same server
        unexplained_aborts = 0
        restores = 0  # restores of the server since this sample last got a good answer
        while True:
            with self._cond:
                self._wait_running()
                budget = params.max_new_tokens - sample.output_len
                if budget <= 0:
                    sample.finish("length")
                    return
                if server is None:
                    server = min(self.servers, key=lambda s: s.load)
                restore = server.suspect
                if restore:
                    server.restoring += 1  # like a request: pause() waits for it
                else:
                    version, epoch = self._version, self._pause_epoch
                    restore_epoch = server.restore_epoch
                    proximal_indices = [
                        t
                        for t, (v, pv) in enumerate(
                            zip(sample.versions, sample.proximal_t_versions)
                        )
                        if v == version - 1 and pv != version
                    ]
                    server.load += 1
                    # Registered while admitted: a pause() from now on waits for this request.
                    segment_ids = [new_request_id()]
                    server.request_ids.add(segment_ids[0])
                    if sample.output_len:
                        self._stats["resubmissions"] += 1
            if restore:
                restores += 1
                try:
                    if restores > MAX_RESTORES_IN_A_ROW:
                        raise EngineError(
                            f"{server.url} lost sdp's weights or stopped answering {restores - 1} times "
                            f"in a row while generating sample {sample.sample_id}; check the server's log"
                        )
                    self._restore(server)
                finally:
                    with self._cond:
                        server.restoring -= 1
                        self._cond.notify_all()
                continue
            fresh_id = functools.partial(self._register_request_id, server, segment_ids)
            request = SegmentRequest(
                request_id=segment_ids[0],
                input_ids=sample.input_ids,
                max_new_tokens=budget,
                stop_token_ids=tuple(params.stop_token_ids),
                seed=request_seed(params.seed, position, sample.output_len),
                prefill_from=sample.prompt_len + proximal_indices[0] if proximal_indices else None,
            )
            try:
                segment = self._server_generate(server, request, fresh_id)
                self._check_segment(server, request, segment)
            except BaseException as exc:
                with self._cond:
                    self._end_request(server, segment_ids)
                    lost_server = isinstance(exc, EngineUnavailable) and not self._closed
                    if lost_server:
                        server.suspect = True
                if lost_server:
                    continue  # the sample is as it was: resubmit it once the server is back
                raise
            with self._cond:
                # Ending the request and recording its tokens in one critical section: once
                # pause() has seen every request end, every partial output is in its sample.
                self._end_request(server, segment_ids)
                self._raise_if_closed()
                if self._restarted(segment):
                    # Generated by a server that lost sdp's weights: discard it, restore, resubmit.
                    server.suspect = True
                    continue
                restores = 0
                self._stats["segments"] += 1
                self._check_versions(server, segment, version)
                self._patch_proximal(sample, request, segment, proximal_indices, version)
                sample.append_tokens(segment.token_ids, segment.logprobs, version)
                if segment.finish_reason in FINISHED:
                    sample.finish(segment.finish_reason)
                    return
                self._stats["aborted_segments"] += 1
                if sample.output_len >= params.max_new_tokens:
                    sample.finish("length")
                    return
                if epoch != self._pause_epoch or restore_epoch != server.restore_epoch:
                    unexplained_aborts = 0
                    continue
                unexplained_aborts += 1
                if unexplained_aborts > self.options.max_unexplained_aborts:
                    raise EngineError(
                        f"{server.url} aborted sample {sample.sample_id} {unexplained_aborts} times without a "
                        f"pause ({segment.message or 'no reason given'}); check the server's log"
                    )

    @staticmethod
    def _restarted(segment: Segment) -> bool:
        """Whether the answer carries a label sdp never sets: the server restarted with its
        start-up weights, so the tokens were not produced by the version sdp tags them with."""
        labels = [*(segment.token_versions or ()), *filter(None, [segment.prefill_version])]
        return any(not is_version_label(label) for label in labels)

    def _restore(self, server: RemoteServer) -> None:
        """Make a suspect server run sdp's current weights under sdp's label again.

        Waits up to ``reconnect_timeout_s`` for it to answer. A server that reports sdp's label
        is trusted as it is; one that reports a label sdp never sets (it restarted) gets the
        current version's weights reloaded, or only the label while the servers still run their
        start-up weights; another version number means another client changed it: an error.
        """
        with server.weights_lock:
            if not server.suspect:
                return  # another thread restored it meanwhile
            label = self._wait_until_answering(server)
            with self._cond:
                version, path = self._version, self._weights_path
            expected = version_label(version)
            if label != expected:
                if label is not None and is_version_label(label):
                    raise EngineError(
                        f"{server.url} reports weight version {label!r} while sdp is at {expected!r}; "
                        "another client may be changing this server's weights (give each run its own servers)"
                    )
                logger.warning(
                    "%s reports weight version %r, sdp is at %r (the server restarted?): %s",
                    server.url,
                    label,
                    expected,
                    f"reloading {path}" if path else "relabelling its start-up weights",
                )
                try:
                    if path is None:
                        self._server_set_version(server, expected)
                    else:
                        self._server_load_weights(server, path, expected)
                except EngineUnavailable:
                    return  # it went away again: still suspect, the caller tries again
                with self._cond:
                    self._stats["restores"] += 1
            with self._cond:
                server.suspect = False
                server.restore_epoch += 1
                self._stats["restore_checks"] += 1

    def _wait_until_answering(self, server: RemoteServer) -> str | None:
        """The server's label once it answers again; EngineUnavailable after
        ``reconnect_timeout_s`` (each try already retries with the transport's backoff)."""
        deadline = time.monotonic() + self.options.reconnect_timeout_s
        while True:
            try:
                return self._server_get_version(server)
            except EngineUnavailable as exc:
                if time.monotonic() > deadline:
                    raise EngineUnavailable(
                        f"{exc}; it did not come back within engine.reconnect_timeout_s="
                        f"{self.options.reconnect_timeout_s:g}"
                    ) from None
            with self._cond:
                if self._cond.wait_for(lambda: self._closed, timeout=1.0):
                    self._raise_if_closed()

    def _end_request(self, server: RemoteServer, segment_ids: list[str]) -> None:
        """Forget a finished request (lock held); wakes a pause() waiting for it."""
        server.load -= 1
        server.request_ids.difference_update(segment_ids)
        self._cond.notify_all()

    def _register_request_id(self, server: RemoteServer, segment_ids: list[str]) -> str:
        """A new request id for a retry, remembered so that pause() and close() can abort it."""
        request_id = new_request_id()
        with self._cond:
            segment_ids.append(request_id)
            server.request_ids.add(request_id)
        return request_id

    def _check_segment(
        self, server: RemoteServer, request: SegmentRequest, segment: Segment
    ) -> None:
        """Reject answers that cannot be right; the sample is left as it was."""
        n = len(segment.token_ids)
        if len(segment.logprobs) != n:
            raise malformed(server, "", f"{n} token ids but {len(segment.logprobs)} logprobs")
        if segment.token_versions is not None and len(segment.token_versions) != n:
            raise malformed(
                server, "", f"{n} token ids but {len(segment.token_versions)} version labels"
            )
        if n > request.max_new_tokens:
            raise malformed(server, "", f"{n} tokens for a budget of {request.max_new_tokens}")
        if segment.finish_reason not in ("stop", "length", "abort"):
            raise malformed(server, "", f"finish reason {segment.finish_reason!r}")
        if segment.prefill_logprobs is not None and request.prefill_from is not None:
            expected = len(request.input_ids) - request.prefill_from
            if len(segment.prefill_logprobs) != expected:
                raise malformed(
                    server,
                    "",
                    f"{len(segment.prefill_logprobs)} prefill logprobs for {expected} scored input tokens",
                )

    def _check_versions(self, server: RemoteServer, segment: Segment, version: int) -> None:
        """The server must have run the segment under the version sdp tags it with.

        pause() returns only after every request in flight has ended, so no weight update can
        fall inside a request: a different label means someone else changed the weights.
        """
        if segment.token_ids and segment.token_versions is None:
            raise EngineError(
                f"{server.url} reports no weight version for its tokens; sdp needs the server versions "
                "listed in docs/engines.md"
            )
        labels = set(segment.token_versions or ())
        if segment.prefill_version is not None:
            labels.add(segment.prefill_version)
        if not labels <= {version_label(version)}:
            raise EngineError(
                f"{server.url} ran a request under weight version(s) {sorted(labels)} while sdp tagged it "
                f"version {version}; another client may be changing this server's weights (give each run "
                "its own servers)"
            )

    def _patch_proximal(
        self,
        sample: RolloutSample,
        request: SegmentRequest,
        segment: Segment,
        proximal_indices: list[int],
        version: int,
    ) -> None:
        """π_prox_t of tokens of version − 1 from the resubmission's prefill (DESIGN.md §2 step 4)."""
        if not proximal_indices or segment.prefill_logprobs is None or request.prefill_from is None:
            return
        if segment.prefill_version is None and not segment.token_ids:
            return  # aborted before anything ran: nothing tells which weights scored it
        offset = request.prefill_from - sample.prompt_len
        for t in proximal_indices:
            sample.set_proximal_t(t, segment.prefill_logprobs[t - offset], version)
        self._stats["prefill_proximal_tokens"] += len(proximal_indices)

    # ------------------------------------------------------------------ pause / weights
    def pause(self) -> None:
        """Stop admitting requests, abort the ones in flight and return once every one of them
        has ended and its partial output is recorded in its sample."""
        with self._cond:
            self._raise_if_closed()
            if self._paused:
                return
            self._paused = True
            self._pause_epoch += 1
        self._on_all_servers(lambda server: self._abort(self._server_abort_all, server))
        # A request sent just before the pause may reach a server after the abort: abort the
        # stragglers by id until none is left (the first wait normally ends by notification).
        # Restores in progress are waited for like requests (they may reload weights).
        deadline = time.monotonic() + self.options.http.admin_timeout_s
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closed
                    or not any(s.request_ids or s.restoring for s in self.servers),
                    0.1,
                )
                self._raise_if_closed()
                busy = [s for s in self.servers if s.request_ids or s.restoring]
                stragglers = [
                    (s, sorted(s.request_ids)) for s in busy if s.request_ids and not s.suspect
                ]
            if not busy:
                return
            if time.monotonic() > deadline:
                raise EngineError(
                    f"engine={self.engine_name}: {sum(len(s.request_ids) + s.restoring for s in busy)} "
                    f"request(s) did not end within {self.options.http.admin_timeout_s:.0f} s of an abort; "
                    "check the servers' logs"
                )
            for server, request_ids in stragglers:
                self._abort(
                    lambda srv, ids=request_ids: self._server_abort_requests(srv, ids), server
                )

    def _abort(self, action: Callable[[RemoteServer], None], server: RemoteServer) -> None:
        """Run an abort on ``server``. A failed one is not an error: pause() keeps waiting for
        the requests (and aborting stragglers) until its deadline; a server that cannot be
        reached is marked suspect (its requests end on their own when their connections fail)."""
        try:
            action(server)
        except EngineUnavailable:
            with self._cond:
                server.suspect = True
        except EngineError as exc:
            logger.warning("abort on %s failed, pause keeps waiting: %s", server.url, exc)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def is_paused(self) -> bool:
        with self._cond:
            return self._paused

    def update_weights(self, update: WeightUpdate) -> None:
        with self._cond:
            self._raise_if_closed()
            if not self._paused:
                raise EngineError(
                    f"engine={self.engine_name}: update_weights needs a paused engine; call pause() first"
                )
        if update.path is None:
            raise EngineError(
                f"engine={self.engine_name} loads weights from disk; pass WeightUpdate(path=<safetensors directory>)"
            )
        path = Path(update.path).resolve()
        if not path.is_dir():
            raise EngineError(
                f"weight directory {path} does not exist; save the policy there before the update"
            )
        label = version_label(update.version)
        self._on_all_servers(lambda server: self._load_weights(server, path, label))
        with self._cond:
            self._version = int(update.version)
            self._weights_path = path

    def _load_weights(self, server: RemoteServer, path: Path, label: str) -> None:
        """Load ``path`` on ``server``, waiting up to ``reconnect_timeout_s`` if it is down."""
        with server.weights_lock:
            deadline = time.monotonic() + self.options.reconnect_timeout_s
            waited = False
            while True:
                try:
                    self._server_load_weights(server, path, label)
                    break
                except EngineUnavailable:
                    if time.monotonic() > deadline:
                        raise
                    self._wait_until_answering(server)
                    waited = True
            with self._cond:
                if server.suspect or waited:  # this load also restored a server that was lost
                    self._stats["restores"] += 1
                server.suspect = False

    def inflight_samples(self) -> list[RolloutSample]:
        with self._cond:
            return list(self._inflight.values())

    # ------------------------------------------------------------------ scoring
    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        if len(sequences) != len(starts):
            raise ValueError(f"score: {len(sequences)} sequences but {len(starts)} starts")
        for seq, k in zip(sequences, starts):
            if not 1 <= k <= len(seq):
                raise ValueError(f"score: start {k} outside [1, {len(seq)}]")
        with self._cond:
            self._raise_if_closed()
            expected = version_label(self._version)
        futures = [
            self._score_pool.submit(
                self._score_one, self.servers[i % len(self.servers)], list(seq), int(k), expected
            )
            for i, (seq, k) in enumerate(zip(sequences, starts))
        ]
        return [f.result() for f in futures]

    def _score_one(
        self, server: RemoteServer, sequence: list[int], start: int, expected: str
    ) -> list[float]:
        if start == len(sequence):
            return []
        last: EngineError | str = "it kept restarting"
        for _ in range(MAX_RESTORES_IN_A_ROW):
            if server.suspect:
                self._restore(server)
            restore_epoch = server.restore_epoch
            try:
                logprobs, label = self._server_score(server, sequence, start)
                if label is not None and not is_version_label(label):
                    with self._cond:
                        server.suspect = True  # restarted: restore, then score again
                    continue
                return self._checked_scores(server, sequence, start, expected, logprobs, label)
            except EngineError as exc:
                # Scoring has no side effects, so a lost server, an answer cut short by a restore
                # on another thread or a malformed answer is simply scored again.
                last = exc
                if isinstance(exc, EngineUnavailable):
                    with self._cond:
                        server.suspect = True
                elif server.restore_epoch == restore_epoch:
                    logger.warning("scoring on %s failed, trying again: %s", server.url, exc)
        raise EngineError(
            f"scoring on {server.url} failed {MAX_RESTORES_IN_A_ROW} times in a row; check the "
            f"server's log (last failure: {last})"
        )

    def _checked_scores(
        self,
        server: RemoteServer,
        sequence: list[int],
        start: int,
        expected: str,
        logprobs: list[float],
        label: str | None,
    ) -> list[float]:
        """``logprobs`` once their count and weight-version label are checked."""
        if len(logprobs) != len(sequence) - start:
            raise malformed(
                server,
                "",
                f"{len(logprobs)} prefill logprobs for {len(sequence) - start} scored tokens",
            )
        if label is not None and label != expected:
            raise EngineError(
                f"{server.url} scored under weight version {label!r}, sdp expected {expected!r}; "
                "another client may be changing this server's weights"
            )
        return logprobs

    # ------------------------------------------------------------------ misc
    def stats(self) -> dict[str, int]:
        """Counters since start: segments, resubmissions, aborted segments, tokens whose
        π_prox_t came from a resubmission's prefill, suspect servers checked and restores
        (weights reloaded, or relabelled, into a server that had lost them)."""
        with self._cond:
            return dict(self._stats)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            outstanding = [
                (server, sorted(server.request_ids)) for server in getattr(self, "servers", [])
            ]
        for server, request_ids in outstanding:
            if request_ids:
                try:
                    # Best effort: a closed client should not leave the server generating for nobody.
                    self._server_abort_requests(server, request_ids)
                except EngineError as exc:
                    logger.warning(
                        "could not abort %d request(s) on %s: %s", len(request_ids), server.url, exc
                    )
        for server in getattr(self, "servers", []):
            server.http.close()
        for pool in (getattr(self, "_generate_pool", None), getattr(self, "_score_pool", None)):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        for server in getattr(self, "_managed", []):
            server.stop()

    def _wait_running(self) -> None:
        """Block while paused (lock held by the caller); raise once the engine is closed."""
        while self._paused and not self._closed:
            self._cond.wait()
        self._raise_if_closed()

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise EngineError(f"engine={self.engine_name} was closed")

    def _on_all_servers(self, action: Any) -> None:
        """Run ``action(server)`` on every server at once; raise the first failure."""
        if len(self.servers) == 1:
            action(self.servers[0])
            return
        futures = [self._score_pool.submit(action, server) for server in self.servers]
        errors = []
        for future in futures:
            try:
                future.result()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
