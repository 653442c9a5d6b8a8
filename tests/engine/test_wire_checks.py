"""The whole-list checks of an engine's answer (``as_token_ids``, ``as_logprobs``) accept and
refuse exactly what the value-by-value checks do, with the same values and messages."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sdp_cli.engine.base import EngineError
from sdp_cli.engine.wire import (
    LOGPROB_TOLERANCE,
    Segment,
    as_logprob,
    as_logprobs,
    as_token_ids,
    check_scores,
    check_segment_version,
    expand_spans,
)


class _Server:
    url = "http://127.0.0.1:1"


SERVER = _Server()

# what a JSON decoder can put in a list, biased towards the edges of the checks
json_scalars = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-50.0, max_value=0.0),
    st.floats(min_value=0.0, max_value=2 * LOGPROB_TOLERANCE),
    st.sampled_from([0, -0.0, 0.0, LOGPROB_TOLERANCE, -1, 3, True, False, None, "x", 10**400, -(10**400)]),
    st.integers(min_value=-(10**6), max_value=10**6),
)


def _outcome(call):
    try:
        return ("ok", call())
    except EngineError as exc:
        return ("refused", str(exc))


def _same(a, b) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "refused":
        return a[1] == b[1]
    return len(a[1]) == len(b[1]) and all(
        type(x) is type(y) and (x == y and math.copysign(1, x) == math.copysign(1, y)) for x, y in zip(a[1], b[1])
    )


@given(st.lists(json_scalars, max_size=12))
def test_logprobs_of_a_list_are_the_value_by_value_checks(values):
    one_by_one = _outcome(lambda: [as_logprob(SERVER, "/generate", x, "a logprob") for x in values])
    whole = _outcome(lambda: as_logprobs(SERVER, "/generate", values, "a logprob"))
    assert _same(whole, one_by_one), (values, whole, one_by_one)


@given(st.lists(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False), min_size=1))
def test_valid_logprobs_come_back_as_the_same_floats(values):
    assert as_logprobs(SERVER, "/score", values, "a score") == values


@pytest.mark.parametrize(
    "bad", [[float("nan")], [-1.0, float("-inf")], [0.5], [-1.0, True], [None], ["-1"], [-(10**400)]]
)
def test_a_bad_logprob_is_refused_with_its_value(bad):
    with pytest.raises(EngineError, match="not a finite log-probability"):
        as_logprobs(SERVER, "/score", bad, "a score")


def _token_ids_one_by_one(value):
    # the check before it became whole-list
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise EngineError(f"{SERVER.url}/generate answered a malformed response (token_ids is not a list of token ids)")
    return list(value)


@given(
    st.one_of(
        st.lists(
            st.one_of(st.integers(min_value=-3, max_value=10**9), st.booleans(), st.floats(), st.none()), max_size=8
        ),
        st.none(),
        st.integers(),
        st.text(max_size=3),
    )
)
@example([7, -1]).via("a negative id after a valid one")
@example([-1, 7]).via("a negative id first")
@example([0, True]).via("a bool among ints")
def test_token_ids_are_checked_as_one_by_one(value):
    expected = _outcome(lambda: _token_ids_one_by_one(value))
    got = _outcome(lambda: as_token_ids(SERVER, "/generate", value, "token_ids"))
    assert got[0] == expected[0], (value, got, expected)
    if got[0] == "ok":
        assert got[1] == expected[1] and got[1] is not value  # a copy, never the answer's own list


def test_a_logprob_up_to_the_tolerance_above_zero_reads_as_zero_and_one_past_it_is_refused():
    assert as_logprob(SERVER, "/g", LOGPROB_TOLERANCE, "logprob") == 0.0  # a certain token's rounding
    assert as_logprobs(SERVER, "/g", [-1.5, LOGPROB_TOLERANCE], "logprob") == [-1.5, 0.0]
    past = math.nextafter(LOGPROB_TOLERANCE, 1.0)
    with pytest.raises(EngineError, match="not a finite log-probability"):
        as_logprob(SERVER, "/g", past, "logprob")


def _segment(versions, prefill_version=None, tokens=(4, 5)):
    return Segment(token_ids=list(tokens), logprobs=[-1.0] * len(tokens), finish_reason="length",
                   token_versions=versions, prefill_version=prefill_version)  # fmt: skip


@pytest.mark.parametrize(
    ("segment", "refused"),
    [
        (_segment(["4", "4"]), None),
        (_segment(["4", "4"], prefill_version="4"), None),
        (_segment(None, tokens=()), None),  # nothing generated: nothing to label
        (_segment(["4", "3"]), "ran a request under weight version(s) ['3', '4'] while sdp tagged it version 4"),
        (_segment(["3", "3"]), "ran a request under weight version(s) ['3'] while sdp tagged it version 4"),
        (_segment(["4", "4"], prefill_version="5"), "ran a request under weight version(s) ['4', '5']"),
        (_segment(None), "reports no weight version for its tokens"),
    ],
)
def test_a_segment_must_have_run_under_the_version_sdp_tags_it_with(segment, refused):
    if refused is None:
        check_segment_version(SERVER, segment, 4)
        return
    with pytest.raises(EngineError) as err:
        check_segment_version(SERVER, segment, 4)
    assert refused in str(err.value) and str(err.value).startswith(SERVER.url)


@pytest.mark.parametrize(
    ("spans", "labels"),
    [
        ([{"version": "3", "start": 0, "end": 2}, {"version": 4, "start": 2, "end": 3}], ["3", "3", "4"]),
        # an empty span labels nothing
        ([{"version": "3", "start": 0, "end": 0}, {"version": "4", "start": 0, "end": 3}], ["4", "4", "4"]),
        ([{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 2, "end": 3}], "do not tile the output"),  # a gap
        ([{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 1, "end": 3}], "do not tile the output"),  # an overlap
        # a span that ends before it starts
        ([{"version": "3", "start": 0, "end": 3}, {"version": "4", "start": 3, "end": 2}], "do not tile the output"),
        ([{"version": "3", "start": 0, "end": 2}], "weight_versions cover 2 tokens, the output has 3"),
        ([{"version": "3", "start": 0}], "weight_versions span {'version': '3', 'start': 0}"),
        ({"version": "3"}, "weight_versions is not a list"),
    ],
)
def test_version_spans_must_tile_the_output(spans, labels):
    if isinstance(labels, list):
        assert expand_spans(SERVER, "/generate", spans, 3) == labels
        return
    with pytest.raises(EngineError) as err:
        expand_spans(SERVER, "/generate", spans, 3)
    assert labels in str(err.value)


def test_a_scoring_answer_of_the_wrong_length_or_version_is_refused():
    assert check_scores(SERVER, [1, 2, 3, 4], 1, "7", [-0.5, -0.25, -1.0], "7") == [-0.5, -0.25, -1.0]
    assert check_scores(SERVER, [1, 2, 3, 4], 1, "7", [-0.5, -0.25, -1.0], None) == [-0.5, -0.25, -1.0]
    with pytest.raises(EngineError, match="2 prefill logprobs for 3 scored tokens"):
        check_scores(SERVER, [1, 2, 3, 4], 1, "7", [-0.5, -0.25], "7")
    with pytest.raises(EngineError, match="scored under weight version '6', sdp expected '7'"):
        check_scores(SERVER, [1, 2, 3, 4], 1, "7", [-0.5, -0.25, -1.0], "6")
