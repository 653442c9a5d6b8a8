"""What goes over the wire to a vLLM or SGLang server and what comes back, checked.

A server answers one *segment* per request (``SegmentRequest`` → ``Segment``): the tokens it
generated until it stopped (``stop``/``length``: the sample is done) or was aborted (``abort``:
resume later), with their logprobs and the weight-version label each ran under. The dialects
(vllm.py, sglang.py) parse their server's JSON into these types with the helpers below; the
checks here refuse an answer that cannot be right before it touches a sample
(docs/engines.md "How the remote engines keep versions and π_prox_t right").

Version labels: sdp labels the weights it loads with the version number (``"12"``); a label
that is not a number is a server's start-up label (vLLM: ``default``), so its answer was not
produced by weights sdp loaded (docs/reliability.md "Engine faults").
"""

from __future__ import annotations

import itertools
import math
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sdp_cli.choices import FINISH_REASONS
from sdp_cli.engine.base import EngineError

#: the largest logprob an answer may hold (rounding of a certain token's log-softmax); it is
#: read as 0
LOGPROB_TOLERANCE = 1e-4
#: the types a JSON decoder gives integers and numbers (bool, a subclass of int, is neither)
_INT = frozenset({int})
_NUMBER = frozenset({int, float})
_FLOAT = frozenset({float})

#: finish reasons of a segment: a finished sample, or an abort (resubmitted later)
SEGMENT_FINISH_REASONS = (*FINISH_REASONS, "abort")


class HasUrl(Protocol):
    """Anything that names the server an answer came from (``RemoteServer``)."""

    @property
    def url(self) -> str: ...


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


def version_label(version: int) -> str:
    """The weight-version label sdp gives the servers: the version number as a string."""
    return str(int(version))


def is_version_label(label: str) -> bool:
    """Whether sdp could have set ``label``; a restarted server reports its start-up label
    instead (vLLM: ``default``; SGLang: ``default`` or its ``--weight-version``)."""
    return label.isdecimal()


def _new_id_prefix() -> None:
    global _id_prefix, _id_counter
    _id_prefix, _id_counter = uuid.uuid4().hex[:16], itertools.count()


_new_id_prefix()
if hasattr(os, "register_at_fork"):  # POSIX: a forked child must not repeat the parent's ids
    os.register_at_fork(after_in_child=_new_id_prefix)


def new_request_id() -> str:
    """A fixed-length id (32 hex digits); SGLang aborts by rid *prefix*, so ids must not prefix
    one another. A random prefix per process and a counter: unique without a call into the
    operating system's random source per request (there is one per segment)."""
    return f"{_id_prefix}{next(_id_counter):016x}"


def request_seed(seed: int | None, position: int, output_len: int) -> int | None:
    """The server-side seed of one segment: distinct for every sample of a call (a GRPO group
    with one seed must not get identical samples) and for every resubmission (which must not
    replay the random stream of the first segment)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + position * 65_537 + output_len) % 2**31


# ------------------------------------------------------------------ parsing an answer
def malformed(server: HasUrl, path: str, problem: str) -> EngineError:
    return EngineError(
        f"{server.url}{path} answered a malformed response ({problem}); the sample is not used"
    )


def as_token_ids(server: HasUrl, path: str, value: Any, what: str) -> list[int]:
    # whole-list checks at C speed: a JSON answer's numbers are exactly int or float, and these
    # run for every token of every answer in the trainer's interpreter (docs/training.md)
    if not isinstance(value, list) or (value and (not set(map(type, value)) <= _INT or min(value) < 0)):
        raise malformed(server, path, f"{what} is not a list of token ids")
    return list(value)


def as_logprobs(server: HasUrl, path: str, values: list[Any], what: str) -> list[float]:
    """``[as_logprob(server, path, x, what) for x in values]``, checked a whole list at a time."""
    kinds = set(map(type, values))
    if kinds and kinds <= _NUMBER and _all_finite(values) and max(values) <= 0:
        return list(values) if kinds == _FLOAT else [float(x) for x in values]
    # empty, within the tolerance above 0, or something to refuse (named by the first bad value)
    return [as_logprob(server, path, x, what) for x in values]


def _all_finite(values: Sequence[int | float]) -> bool:
    """Whether every number is finite; an integer too large for a float is not (``math.isfinite``
    would raise)."""
    try:
        return all(map(math.isfinite, values))
    except OverflowError:
        return False


def as_logprob(server: HasUrl, path: str, value: Any, what: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not _all_finite((value,))
        or value > LOGPROB_TOLERANCE
    ):
        raise malformed(server, path, f"{what} is {value!r}, not a finite log-probability")
    return min(float(value), 0.0)


def expand_spans(server: HasUrl, path: str, spans: Any, n_tokens: int) -> list[str]:
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


# ------------------------------------------------------------------ checking an answer
def check_segment(server: HasUrl, request: SegmentRequest, segment: Segment) -> None:
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
    if segment.finish_reason not in SEGMENT_FINISH_REASONS:
        raise malformed(server, "", f"finish reason {segment.finish_reason!r}")
    if segment.prefill_logprobs is not None and request.prefill_from is not None:
        expected = len(request.input_ids) - request.prefill_from
        if len(segment.prefill_logprobs) != expected:
            raise malformed(
                server,
                "",
                f"{len(segment.prefill_logprobs)} prefill logprobs for {expected} scored input tokens",
            )


def has_foreign_label(segment: Segment) -> bool:
    """Whether the answer carries a label sdp never sets: the server restarted with its
    start-up weights, so the tokens were not produced by the version sdp tags them with."""
    labels = [*(segment.token_versions or ()), *filter(None, [segment.prefill_version])]
    return any(not is_version_label(label) for label in labels)


def check_segment_version(server: HasUrl, segment: Segment, version: int) -> None:
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


def check_scores(
    server: HasUrl,
    sequence: list[int],
    start: int,
    expected: str,
    logprobs: list[float],
    label: str | None,
) -> list[float]:
    """``logprobs`` of a scoring answer once their count and weight-version label are checked."""
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
