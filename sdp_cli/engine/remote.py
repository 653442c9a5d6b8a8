"""Logic shared by the HTTP engines (vLLM, SGLang, the local engine's process): versions, pause,
weights and scoring.

The client owns the rollout records and accumulates (token, logprob, version) triples across the
segments a server answers (``sdp_cli.engine.wire``); the tokens of a segment carry the client's
version at submission, cross-checked against the weight-version label the server reports (a
disagreement is an ``EngineError``). Each sample goes through ``remote_sample.SampleRun``, three
steps per segment: *admit* (wait while paused, pick its server, register the request), *send*
(the dialect's request, the answer checked), *record* (tokens, π_prox_t, finish or resubmit);
a dialect with ``batched_requests`` sends every segment of a round in one request
(``remote_sample.run_rounds``), the others one request per segment from its own thread.
The state the threads share (pause switch, version, counters) is ``remote_state.RemoteState``;
a server's outage and restore is ``remote_server.RemoteServer``.

Pause protocol (docs/design.md §2; docs/engines.md "How the remote engines keep versions and
π_prox_t right"): ``pause()`` stops admitting requests, aborts everything in flight and returns
once every request has ended and its partial output is in its sample, leaving the servers
running so that the recompute pass can ``score``; until ``resume()`` no sample is mutated.
``update_weights()`` loads, resets the prefix cache and relabels every server. After
``resume()`` a partial sample is resubmitted as prompt + partial output, and the prefill of the
resubmission gives π_prox_t of its tokens of version new − 1 (step 4).
"""

from __future__ import annotations

import abc
import logging
import time
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
from sdp_cli.engine.remote_sample import MAX_RESTORES_IN_A_ROW, SampleRun, run_rounds
from sdp_cli.engine.remote_server import RemoteServer
from sdp_cli.engine.remote_state import RemoteState
from sdp_cli.engine.servers import LaunchSpec, ManagedServer, Prestarted
from sdp_cli.engine.wire import (
    Segment,
    SegmentRequest,
    check_scores,
    is_version_label,
    version_label,
)
from sdp_cli.rollout.records import RolloutSample

logger = logging.getLogger(__name__)


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
        # temperature and reconnect_timeout_s are trusted: the config validated rollout.temperature
        # and engine.reconnect_timeout_s (sdp recompute passes temperature 1)
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be >= 1")


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


class RemoteEngine(InferenceEngine):
    """An ``InferenceEngine`` whose model runs in one or more HTTP servers.

    Subclasses speak one server's dialect (the ``_server_*`` methods); this class owns the
    rollout records, versions, pause/resume, load spreading and resubmission, and stops on
    ``close()`` the ``managed`` servers it was started with (see ``_attach_launched``).
    """

    #: name used in messages and config keys ("vllm", "sglang", "local")
    engine_name = "remote"
    #: the dialect answers many segments (or scores) in one request (``_server_generate_batch``,
    #: ``_server_score_batch``); otherwise one request each (``_server_generate``, ``_server_score``),
    #: sent concurrently (docs/engines.md "How the remote engines keep versions and π_prox_t right")
    batched_requests = False
    #: the server's sampled and prefill logprobs are both those of softmax(z / T) at any T
    #: (otherwise T != 1 is refused: ``check_temperature``)
    temperature_exact = False
    #: the servers are sdp's own processes on loopback: ``HttpServer``'s lean client
    #: (``sdp_cli/engine/loopback_http.py``) instead of httpx
    loopback_http = False

    def __init__(
        self,
        base_urls: Sequence[str],
        options: RemoteOptions | None = None,
        *,
        version: int = 0,
        managed: Sequence[ManagedServer] = (),
    ):
        self._managed = list(managed)
        self.log_paths = tuple(server.spec.log_path for server in self._managed)
        launched = {server.base_url: server for server in self._managed}
        options = options or RemoteOptions()
        if not base_urls:
            raise EngineError(
                f"engine={self.engine_name} needs at least one server address (engine.urls)"
            )
        if not self.temperature_exact:
            check_temperature(options, self.engine_name)
        self.options = options
        self.temperature = options.temperature
        self._state = RemoteState(self.engine_name, int(version))
        self.servers = [
            RemoteServer(
                HttpServer(
                    url,
                    options.http,
                    label=f"{self.engine_name} server",
                    unavailable_hint=self._unavailable_hint(),
                    loopback=self.loopback_http,
                ),
                engine_name=self.engine_name,
                cond=self._state.cond,
                reconnect_timeout_s=options.reconnect_timeout_s,
                revive=launched[url].revive if url in launched else None,
            )
            for url in base_urls
        ]
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
                self._server_set_version(server, version_label(version))
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
    def _attach_launched(
        cls, spec: LaunchSpec, options: RemoteOptions, *, prestarted: Prestarted | None = None, **kwargs: Any
    ) -> Self:
        """Start the server of ``spec`` (``prestarted``: see ``ManagedServer``) and attach to it
        (``kwargs`` go to the constructor); ``close()`` stops it, and so does a failed attach."""
        server = ManagedServer(spec, prestarted=prestarted).start()
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

    def _server_generate(
        self, server: RemoteServer, request: SegmentRequest, refresh_id: Callable[[], str]
    ) -> Segment:
        """Run one generation request; ``refresh_id()`` gives a fresh request id for a retry
        (dialects without ``batched_requests``)."""
        raise NotImplementedError(f"{type(self).__name__} sends batches: _server_generate_batch")

    def _server_generate_batch(
        self, server: RemoteServer, requests: list[SegmentRequest], refresh_ids: Callable[[], list[str]]
    ) -> list[Segment | BaseException]:
        """Run the requests of a round in one call: each one's answer, or the error that stands for
        it; a failure of the whole call is raised (dialects with ``batched_requests``)."""
        raise NotImplementedError(f"{type(self).__name__} sends one request per segment: _server_generate")

    def _server_score(
        self, server: RemoteServer, sequence: list[int], start: int
    ) -> tuple[list[float], str | None]:
        """Prefill logprobs of ``sequence[start:]`` and the weight-version label they ran under."""
        raise NotImplementedError(f"{type(self).__name__} scores in batches: _server_score_batch")

    def _server_score_batch(
        self, server: RemoteServer, sequences: list[list[int]], starts: list[int]
    ) -> list[tuple[list[float], str | None]]:
        """``_server_score`` of each sequence (a batched dialect scores them in one request)."""
        return [self._server_score(server, seq, start) for seq, start in zip(sequences, starts)]

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
        with self._state.cond:
            return self._state.version

    def current_weights(self) -> tuple[int, Path | None]:
        """The version and the directory of its weights (None: the start-up weights)."""
        with self._state.cond:
            return self._state.version, self._state.weights_path

    def set_version(self, version: int) -> None:
        for server in self.servers:
            self._server_set_version(server, version_label(version))
        with self._state.cond:
            self._state.version = int(version)

    # ------------------------------------------------------------------ generation
    def generate(self, samples: Sequence[RolloutSample], params: SamplingParams) -> None:
        pending = [s for s in samples if not s.is_finished]
        with self._state.cond:
            self._state.raise_if_closed()
            for sample in pending:
                self._state.inflight[sample.sample_id] = sample
        futures: list[Future[None]] = []
        errors: list[BaseException] = []
        try:
            if self.batched_requests:
                runs = [self._sample_run(s, params, i) for i, s in enumerate(pending)]
                errors = run_rounds(runs, self._state, self._server_generate_batch)
            else:
                futures = [
                    self._generate_pool.submit(self._sample_run(s, params, i).run)
                    for i, s in enumerate(pending)
                ]
        finally:
            for future in futures:
                try:
                    future.result()
                except BaseException as exc:  # collected so every sample settles first
                    errors.append(exc)
            with self._state.cond:
                for sample in pending:
                    self._state.inflight.pop(sample.sample_id, None)
        if errors:
            distinct = list(dict.fromkeys(str(e) for e in errors))
            if len(distinct) > 1 and all(isinstance(e, EngineError) for e in errors):
                # every failure of the call is reported (the run's ledger records the reason)
                raise EngineError(
                    f"{len(errors)} of {len(pending)} samples failed: " + " | ".join(distinct)
                )
            raise errors[0]

    def _sample_run(self, sample: RolloutSample, params: SamplingParams, position: int) -> SampleRun:
        """The way of the ``position``-th sample of a call (``sdp_cli.engine.remote_sample``)."""
        return SampleRun(
            sample,
            params,
            position,
            state=self._state,
            servers=self.servers,
            generate=self._server_generate,
            restore=lambda server: server.restore(self),
            max_unexplained_aborts=self.options.max_unexplained_aborts,
        )

    # ------------------------------------------------------------------ pause / weights
    def pause(self) -> None:
        """Stop admitting requests, abort the ones in flight and return once every one of them
        has ended and its partial output is recorded in its sample."""
        with self._state.cond:
            self._state.raise_if_closed()
            if self._state.paused:
                return
            self._state.paused = True
            self._state.pause_epoch += 1
        self._on_all_servers(lambda server: self._abort(self._server_abort_all, server))
        # A request sent just before the pause may reach a server after the abort: abort the
        # stragglers by id until none is left (the first wait normally ends by notification).
        # Restores in progress are waited for like requests (they may reload weights).
        deadline = time.monotonic() + self.options.http.admin_timeout_s
        while True:
            with self._state.cond:
                self._state.cond.wait_for(
                    lambda: self._state.closed or not any(s.busy for s in self.servers), 0.1
                )
                self._state.raise_if_closed()
                busy = [s for s in self.servers if s.busy]
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
            server.mark_suspect()
        except EngineError as exc:
            logger.warning("abort on %s failed, pause keeps waiting: %s", server.url, exc)

    def resume(self) -> None:
        with self._state.cond:
            self._state.paused = False
            self._state.cond.notify_all()

    def is_paused(self) -> bool:
        with self._state.cond:
            return self._state.paused

    def update_weights(self, update: WeightUpdate) -> None:
        with self._state.cond:
            self._state.raise_if_closed()
            if not self._state.paused:
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
        self._on_all_servers(lambda server: server.load_weights(self, path, label))
        with self._state.cond:
            self._state.version = int(update.version)
            self._state.weights_path = path

    def inflight_samples(self) -> list[RolloutSample]:
        with self._state.cond:
            return list(self._state.inflight.values())

    # ------------------------------------------------------------------ scoring
    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        if len(sequences) != len(starts):
            raise ValueError(f"score: {len(sequences)} sequences but {len(starts)} starts")
        for seq, k in zip(sequences, starts):
            if not 1 <= k <= len(seq):
                raise ValueError(f"score: start {k} outside [1, {len(seq)}]")
        with self._state.cond:
            self._state.raise_if_closed()
            expected = version_label(self._state.version)
        # a batched dialect gets each server's share in one request, the others one per sequence
        n = len(self.servers)
        units = (
            [list(range(i, len(sequences), n)) for i in range(n)]
            if self.batched_requests
            else [[i] for i in range(len(sequences))]
        )
        units = [unit for unit in units if unit]

        def score_unit(unit: list[int]) -> list[list[float]]:
            return self._score_unit(
                self.servers[unit[0] % n], [list(sequences[i]) for i in unit], [int(starts[i]) for i in unit], expected
            )

        # one unit (one server, batched) is scored here: a hand-off to a pool thread and back
        # would cost the trainer's step the interpreter twice (docs/training.md)
        if len(units) == 1:
            answers = [score_unit(units[0])]
        else:
            answers = [future.result() for future in [self._score_pool.submit(score_unit, unit) for unit in units]]
        results: list[list[float]] = [[] for _ in sequences]
        for unit, answer in zip(units, answers, strict=True):
            for i, values in zip(unit, answer, strict=True):
                results[i] = values
        return results

    def _score_unit(
        self, server: RemoteServer, sequences: list[list[int]], starts: list[int], expected: str
    ) -> list[list[float]]:
        """Scores of ``sequences`` on ``server``, asked again for those a failure left without."""
        results: list[list[float] | None] = [[] if k == len(s) else None for s, k in zip(sequences, starts)]
        last: EngineError | str = "it kept restarting"
        for _ in range(MAX_RESTORES_IN_A_ROW):
            todo = [i for i, r in enumerate(results) if r is None]
            if not todo:
                break
            if server.suspect:
                server.restore(self)
            restore_epoch = server.restore_epoch
            try:
                answers = self._server_score_batch(server, [sequences[i] for i in todo], [starts[i] for i in todo])
                if any(label is not None and not is_version_label(label) for _, label in answers):
                    server.mark_suspect()  # restarted: restore, then score again
                    continue
                for i, (logprobs, label) in zip(todo, answers, strict=True):
                    results[i] = check_scores(server, sequences[i], starts[i], expected, logprobs, label)
            except EngineError as exc:
                # Scoring has no side effects, so a lost server, an answer cut short by a restore
                # on another thread or a malformed answer is simply scored again.
                last = exc
                if isinstance(exc, EngineUnavailable):
                    server.mark_suspect()
                elif server.restore_epoch == restore_epoch:
                    logger.warning("scoring on %s failed, trying again: %s", server.url, exc)
        if any(r is None for r in results):
            raise EngineError(
                f"scoring on {server.url} failed {MAX_RESTORES_IN_A_ROW} times in a row; check the "
                f"server's log (last failure: {last})"
            )
        return [r for r in results if r is not None]

    # ------------------------------------------------------------------ misc
    def stats(self) -> dict[str, int]:
        """Counters since start: segments, resubmissions, aborted segments, tokens whose
        π_prox_t came from a resubmission's prefill, suspect servers checked and restores
        (weights reloaded, or relabelled, into a server that had lost them)."""
        with self._state.cond:
            return {
                **self._state.counters,
                "restore_checks": sum(s.restore_checks for s in self.servers),
                "restores": sum(s.restores for s in self.servers),
            }

    def close(self) -> None:
        with self._state.cond:
            if self._state.closed:
                return
            self._state.closed = True
            for server in getattr(self, "servers", []):
                server.closed = True
            self._state.cond.notify_all()
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

