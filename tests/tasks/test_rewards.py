"""Built-in rewards: final_number, boxed, regex — hand-picked cases with the reason for each."""

import pytest

from sdp_cli.tasks.rewards import boxed, check_record, final_number, last_boxed, math_equal, normalize_math, regex


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so she has 15 apples", "7 + 8 = 15\n#### 15", 1.0),  # last number of the completion vs after '####'
        ("#### 1,000", "1000", 1.0),  # reference without '####': its last number; 1,000 == 1000
        ("#### 3.50", "#### 3.5", 1.0),  # by value
        ("15 then 16", "#### 15", 0.0),  # without '####' the last number counts
        ("#### 15 then 16", "#### 15", 1.0),  # after '####' the first number counts
        ("no number", "#### 15", 0.0),
    ],
)
def test_final_number(completion, answer, expected):
    assert final_number("p", completion, {"answer": answer}) == expected


def test_final_number_reads_the_configured_key_and_nested_keys():
    record = {"reward_model": {"ground_truth": "42"}}
    assert final_number("p", "it is 42", record, answer_key="reward_model.ground_truth") == 1.0


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{1} and finally \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # the last one, nested braces
        (r"\fbox{x+1}", "x+1"),
        (r"\boxed{unclosed", None),
        ("no box", None),
    ],
)
def test_last_boxed(text, content):
    assert last_boxed(text) == content


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        (r"\frac{1}{2}", "0.5", True),  # 1/2 == 0.5 by value
        (r"\dfrac{1}{2}", "1/2", True),
        (r"\frac12", "0.5", True),  # short form \frac12
        ("1,000", "1000", True),
        (r"10\%", "10", True),
        (r"5\text{ cm}", "5", True),  # a unit in \text{} after a number is dropped
        (r"5\text{ cm}", "5 cm", True),  # one side a number, the other not: compared as text
        (r"\frac{a}{2}", r"\frac{a}{2}", True),  # not a number (a symbol over a number): as text
        ("a/b", "a/b", True),
        ("a/2", "b/2", False),
        (r"\text{five}", "five", True),  # no number: \text{} content compared as text
        (r"\left(1,2\right)", "(1,2)", True),  # \left/\right dropped, compared as text
        ("x = 3", "3", True),
        (r"90^\circ", "90", True),
        (r"\sqrt2", r"\sqrt{2}", True),
        ("3", "4", False),
        ("", "", False),  # nothing is not an answer
    ],
)
def test_math_equal(a, b, equal):
    assert math_equal(a, b) is equal


def test_normalize_math_is_idempotent_on_its_output():
    for text in [r"\left( \dfrac{1}{2} \right)", r"5\text{ cm}.", "x = 3"]:
        once = normalize_math(text)
        assert normalize_math(once) == once


def test_boxed_reward():
    assert boxed("p", r"... \boxed{\dfrac{1}{2}}", {"answer": "0.5"}) == 1.0
    assert boxed("p", r"\boxed{2}", {"answer": r"the answer is \boxed{2}"}) == 1.0  # reference's own box
    assert boxed("p", "0.5", {"answer": "0.5"}) == 0.0  # no \boxed{} in the completion


@pytest.mark.parametrize(
    ("pattern", "full", "completion", "expected"),
    [
        (r"\d+", False, "it is 42", 1.0),
        (r"\d+", True, "it is 42", 0.0),  # full_match needs the whole completion to match
        (r"<think>.*</think>", False, "<think>a\nb</think> 3", 1.0),  # '.' crosses lines (DOTALL)
        (r"^\d+$", False, "x", 0.0),
    ],
)
def test_regex_reward(pattern, full, completion, expected):
    assert regex("p", completion, {}, pattern=pattern, full_match=full) == expected


@pytest.mark.parametrize(
    ("name", "record", "problem"),
    [
        ("final_number", {"answer": "#### 3"}, None),
        ("final_number", {"answer": "three"}, "holds no number"),
        ("final_number", {"q": 1}, "has no field 'answer'"),
        ("boxed", {"answer": "  "}, "is empty"),
        ("regex", {}, None),
    ],
)
def test_check_record(name, record, problem):
    found = check_record(name, record, "answer")
    assert (found is None) if problem is None else (problem in found)
