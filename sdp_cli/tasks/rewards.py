"""Built-in reward functions, usable as ``task.reward=NAME`` or imported into your own.

Each has the plug-in signature ``(prompt, completion, record, **task.reward_kwargs) -> float``
(docs/tasks.md). ``final_number`` and ``boxed`` compare with the record's reference answer,
``record[answer_key]`` (sdp passes ``answer_key=task.answer_key``); ``regex`` checks the format.

- ``final_number``: the completion's final number (after ``####`` if present, else its last
  number) equals the reference's (after ``####`` if present) by value: GSM8K's scoring.
- ``boxed``: the content of the completion's last ``\\boxed{...}`` equals the reference (its
  last ``\\boxed{}`` if it has one) after LaTeX normalisation: numbers by value
  (``\\dfrac{1}{2}`` = ``1/2`` = ``0.5``, ``1,000`` = ``1000``, a unit such as ``\\text{ cm}``
  after a number dropped), anything else as text without spaces, ``$``, ``\\left``/``\\right``.
- ``regex``: 1.0 when ``pattern`` matches the completion (``full_match=true``: all of it).
"""

from __future__ import annotations

import functools
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, Mapping

from sdp_cli.tasks.numeric import extract_final_number, numbers_equal

#: records must hold the reference answer at ``answer_key`` for these
NEEDS_ANSWER = ("final_number", "boxed")


def _reference(record: Mapping[str, Any], answer_key: str) -> str:
    from sdp_cli.tasks.templates import field

    value = field(record, answer_key)
    return value if isinstance(value, str) else str(value)


def final_number(prompt: str, completion: str, record: Mapping[str, Any], *, answer_key: str = "answer") -> float:
    """1.0 when the final numbers of completion and reference are equal by value."""
    predicted = extract_final_number(completion)
    expected = extract_final_number(_reference(record, answer_key))
    return 1.0 if predicted is not None and expected is not None and numbers_equal(predicted, expected) else 0.0


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None


_REMOVE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "$", "^\\circ", "^{\\circ}", "\\%", "%")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
_SHORT_FRAC = re.compile(r"\\frac(\d)(\d)")
_SQRT = re.compile(r"\\sqrt(\w)")


def normalize_math(answer: str) -> str:
    """A canonical form of a short LaTeX answer for string comparison."""
    text = answer.strip()
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _TEXT.sub(r"\1", text)
    for token in _REMOVE:
        text = text.replace(token, "")
    text = _SHORT_FRAC.sub(r"\\frac{\1}{\2}", text)
    text = _SQRT.sub(r"\\sqrt{\1}", text)
    text = "".join(text.split()).rstrip(".")
    if text.startswith("x=") or text.startswith("y="):  # "x = 3" answers "3"
        text = text[2:]
    return text


def _number(text: str) -> Fraction | None:
    """The value of ``3``, ``-1,000``, ``0.5``, ``1/2`` or ``\\frac{1}{2}`` (normalised), else None."""
    match = _FRAC.fullmatch(text)
    if match:
        num, den = _number(match.group(1)), _number(match.group(2))
        return num / den if num is not None and den not in (None, 0) else None
    if text.count("/") == 1:
        num, den = (_number(part) for part in text.split("/"))
        return num / den if num is not None and den not in (None, 0) else None
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None
    return Fraction(value) if value.is_finite() else None


def _value(answer: str) -> Fraction | None:
    """The number an answer states, a unit in ``\\text{}`` after it dropped (``5\\text{ cm}``)."""
    value = _number(normalize_math(answer))
    return value if value is not None else _number(normalize_math(_TEXT.sub("", answer)))


def math_equal(a: str, b: str) -> bool:
    """Whether two LaTeX answers agree: by value when both are numbers, else as normalised text."""
    na, nb = normalize_math(a), normalize_math(b)
    va, vb = _value(a), _value(b)
    if va is not None and vb is not None:
        return va == vb
    return na == nb and na != ""


def boxed(prompt: str, completion: str, record: Mapping[str, Any], *, answer_key: str = "answer") -> float:
    """1.0 when the completion's last ``\\boxed{}`` equals the reference (normalised)."""
    predicted = last_boxed(completion)
    reference = _reference(record, answer_key)
    expected = last_boxed(reference)
    return 1.0 if predicted is not None and math_equal(predicted, expected if expected is not None else reference) else 0.0


@functools.lru_cache(maxsize=64)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """``pattern`` compiled with DOTALL (``.`` crosses lines); cached."""
    return re.compile(pattern, re.DOTALL)


def regex(
    prompt: str, completion: str, record: Mapping[str, Any], *, pattern: str, full_match: bool = False
) -> float:
    """1.0 when ``pattern`` matches the completion (anywhere, or all of it with ``full_match``)."""
    compiled = compile_pattern(pattern)
    found = compiled.fullmatch(completion) if full_match else compiled.search(completion)
    return 1.0 if found else 0.0


def check_record(name: str, record: Mapping[str, Any], answer_key: str) -> str | None:
    """Why ``record`` cannot be scored by the built-in ``name`` (None when it can)."""
    from sdp_cli.tasks.templates import has_field

    if name not in NEEDS_ANSWER:
        return None
    if not has_field(record, answer_key):
        return f"has no field {answer_key!r} (task.answer_key), which task.reward={name} compares with"
    reference = _reference(record, answer_key)
    if name == "final_number" and extract_final_number(reference) is None:
        return f"field {answer_key!r} holds no number, which task.reward=final_number needs"
    if name == "boxed" and not normalize_math(last_boxed(reference) or reference):
        return f"field {answer_key!r} is empty, which task.reward=boxed compares with"
    return None


BUILTINS = {"final_number": final_number, "boxed": boxed, "regex": regex}
