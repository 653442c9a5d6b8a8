"""Numbers in free text: find the final answer of a solution and compare answers by value.

GSM8K solutions end with ``#### <number>``; a model's completion may or may not follow that
format, so the final number is the one after the last ``####`` when there is one, else the last
number in the text. Comparison is by value: ``"1,000" == "1000" == "1000.0" == "$1000"``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number: optional sign (not when glued to a preceding digit, so "12-3" is 12 and 3),
# optional currency sign, then digits with thousands separators, plain digits, or a bare fraction.
_NUMBER = re.compile(r"(?<![\d.])-?\$?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")
_FINAL_MARK = "####"


def parse_number(text: str) -> Decimal | None:
    """Value of a number written like ``-1,234.50`` or ``$7``; None when ``text`` is not one."""
    cleaned = text.strip().replace(",", "").replace("$", "")
    if not cleaned:
        return None
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def extract_final_number(text: str) -> str | None:
    """The final answer's text in a solution or completion, or None when it has no number."""
    if _FINAL_MARK in text:
        after = text.rsplit(_FINAL_MARK, 1)[1]
        match = _NUMBER.search(after)
        return match.group(0) if match else None
    matches = _NUMBER.findall(text)
    return matches[-1] if matches else None


def numbers_equal(a: str, b: str) -> bool:
    """Whether two number strings have the same value (False if either is not a number)."""
    va, vb = parse_number(a), parse_number(b)
    return va is not None and vb is not None and va == vb
