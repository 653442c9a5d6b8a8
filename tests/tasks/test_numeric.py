"""Final-number extraction and value comparison for GSM8K-style answers."""

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdp_cli.tasks.numeric import extract_final_number, numbers_equal, parse_number


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        ("1,000", "1000", True),
        ("1000", "1000.0", True),
        ("1,000", "1000.00", True),
        ("$1,000", "1000", True),
        ("-5", "-5.0", True),
        ("0.5", ".5", True),
        ("1000", "100", False),
        ("-5", "5", False),
        ("abc", "abc", False),  # not numbers: never equal
        ("", "0", False),
    ],
)
def test_numbers_equal(a, b, equal):
    assert numbers_equal(a, b) is equal


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is 42", "42"),
        ("3 + 4 = 7 apples.\n#### 7", "7"),
        ("#### 1,250", "1,250"),
        ("It costs $18.50 in total", "$18.50"),
        ("first 5 then #### 6 and later 9", "6"),  # the number after the last #### wins
        ("#### 3\n#### 4", "4"),
        ("The total was 1000.", "1000"),  # a sentence-final period is not a decimal point
        ("7 - 12 = -5", "-5"),
        ("12-3", "3"),  # a minus glued to a digit is an operator, not a sign
        ("no digits here", None),
        ("#### none", None),
        ("", None),
    ],
)
def test_extract_final_number(text, expected):
    assert extract_final_number(text) == expected


def test_parse_number_rejects_non_numbers():
    assert parse_number("1,000.5") == Decimal("1000.5")
    assert parse_number("NaN") is None
    assert parse_number("Infinity") is None
    assert parse_number("12 apples") is None


@given(st.integers(-10**9, 10**9))
def test_thousands_separated_form_round_trips(n):
    text = f"The answer is {n:,}"
    found = extract_final_number(text)
    assert found is not None and numbers_equal(found, str(n))
