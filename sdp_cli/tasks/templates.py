"""Prompt formatting: record fields, ``task.prompt_template`` and the tokenizer's chat template.

A template names record fields in braces: ``"Question: {question}\\nAnswer: "``. Only
``{name}`` (a field name, dotted for nested fields: ``{meta.topic}``) is a placeholder; every
other brace is text, so templates can hold JSON or LaTeX, and ``{{``/``}}`` write a literal
brace around a name. Values are inserted once, never re-read as a template.

A prompt is a string or a list of chat messages (``[{"role": "user", "content": ...}]``, the
conversational format of TRL and verl data). ``task.chat_template=true`` renders it with the
tokenizer's chat template (generation prompt added, ``task.system_prompt`` first).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from sdp_cli.errors import UserError

_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)\}")
_MISSING = object()


def field(record: Mapping[str, Any], key: str) -> Any:
    """``record[key]``, following dots into nested objects (``reward_model.ground_truth``);
    a top-level key that itself contains dots wins. A missing field gives ``_MISSING``."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def has_field(record: Mapping[str, Any], key: str) -> bool:
    return field(record, key) is not _MISSING


def render(template: str, record: Mapping[str, Any], where: str) -> str:
    """The template with each ``{name}`` replaced by the record's field (str() of non-strings)."""

    def replace(match: re.Match[str]) -> str:
        token = match.group(0)
        if token in ("{{", "}}"):
            return token[0]
        value = field(record, match.group(1))
        if value is _MISSING:
            fields = ", ".join(sorted(record)) or "none"
            raise UserError(
                f"{where}: task.prompt_template uses {{{match.group(1)}}}, which the record does not have "
                f"(its fields: {fields}); fix the template or the data"
            )
        return value if isinstance(value, str) else str(value)

    return _PLACEHOLDER.sub(replace, template)


def as_messages(value: Any, where: str, key: str) -> list[dict[str, str]] | None:
    """A prompt field holding chat messages as a list of ``{"role", "content"}`` dicts; None when
    the field is a plain string. Anything else is a one-line UserError."""
    if isinstance(value, str):
        return None
    if isinstance(value, list) and value and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise UserError(
        f"{where}: field {key!r} must be a string or a list of chat messages "
        f"[{{'role': ..., 'content': ...}}], got {type(value).__name__}; fix the data or task.prompt_key"
    )


def chat_prompt(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], system_prompt: str | None, where: str
) -> str:
    """The prompt text the tokenizer's chat template makes of ``messages`` (with the generation
    prompt), ready for ``tokenizer.encode(text, add_special_tokens=True)``: a BOS token the
    template writes is removed when encoding adds one anyway, so the prompt has exactly one."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "task.chat_template=true, but the model's tokenizer has no chat template; "
            "set task.chat_template=false and format prompts with task.prompt_template"
        )
    conversation = [dict(m) for m in messages]
    if system_prompt is not None and not any(m["role"] == "system" for m in conversation):
        conversation.insert(0, {"role": "system", "content": system_prompt})
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja raises its own types for templates that reject a conversation
        raise UserError(
            f"{where}: the tokenizer's chat template cannot render this conversation "
            f"({type(err).__name__}: {err}); fix the messages or set task.chat_template=false"
        ) from None
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and _encoding_adds_bos(tokenizer):
        text = text[len(bos) :]
    return text


def _encoding_adds_bos(tokenizer: Any) -> bool:
    bos_id = getattr(tokenizer, "bos_token_id", None)
    ids = tokenizer.encode("a", add_special_tokens=True)
    return bos_id is not None and bool(ids) and ids[0] == bos_id
