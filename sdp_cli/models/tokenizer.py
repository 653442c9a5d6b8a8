"""Character-level tokenizer defined in code, saved and loaded as a Hugging Face tokenizer.

One id per character (``add_special_tokens=False``); with special tokens on (the HF default, and
what vLLM does with a text prompt) the encoding is ``<s>`` followed by one id per character.
The tokenizer is a ``tokenizers`` WordLevel model behind a split-into-characters pre-tokenizer,
wrapped in ``PreTrainedTokenizerFast``. Characters outside the charset encode to ``<unk>``.
Special tokens are never parsed out of text: they enter only as ids.

Characters are spelled as byte-level BPE spells bytes (space is ``Ġ``, newline ``Ċ``; GPT-2's
table), behind a byte-level pre-tokenizer and decoder. The reason: the tiny model's config.json
says ``qwen2``, and transformers 5 loads any qwen2 directory's tokenizer as ``Qwen2Tokenizer``,
which keeps the saved vocabulary but brings Qwen's byte-level pre-tokenizer; with raw characters
as tokens it dropped every space and newline. In this spelling it encodes every string of the
charset to the same ids (docs/design.md, "Character tokenizer"). sdp's own loader recognises the
vocabulary, in this spelling or the raw one sdp saved before, and rebuilds the tokenizer here
(``charset_of``).
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from sdp_cli.errors import UserError

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3

CHARSETS: dict[str, str] = {
    # arithmetic prompts and answers
    "arith": "0123456789+-*/=()., ",
    # printable ASCII and newline, for word problems
    "ascii": "".join(c for c in string.printable if c not in "\t\r\x0b\x0c"),
}

# The prompt and the answer are concatenated as they are; the model sees no role markers.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def _byte_level():
    """The byte-level pre-tokenizer, spelling each byte as one printable character."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def _vocabulary(charset: str, *, raw: bool = False) -> dict[str, int]:
    """Token -> id of ``charset``: the special tokens, then one token per character, spelled as
    byte-level BPE spells it, or as the character itself (``raw``: how sdp saved it before)."""
    chars = CHARSETS[charset]
    assert len(set(chars)) == len(chars), f"charset {charset!r} repeats a character"
    assert chars.isascii(), f"charset {charset!r} has a character of more than one byte"
    byte_level = _byte_level()
    spelled = chars if raw else [byte_level.pre_tokenize_str(c)[0][0] for c in chars]
    return {token: i for i, token in enumerate((*SPECIAL_TOKENS, *spelled))}


def charset_of(vocab: dict[str, int]) -> str | None:
    """The charset whose tokenizer has exactly the vocabulary ``vocab`` (token -> id), in the
    byte-level spelling or the raw one of sdp versions before it; None for any other vocabulary."""
    for charset in CHARSETS:
        if vocab in (_vocabulary(charset), _vocabulary(charset, raw=True)):
            return charset
    return None


def build_tokenizer(charset: str = "arith") -> PreTrainedTokenizerFast:
    """Tokenizer with ids pad=0, bos=1, eos=2, unk=3, then the characters of ``CHARSETS[charset]``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    if charset not in CHARSETS:
        raise UserError(f"unknown charset {charset!r}; choose one of {', '.join(sorted(CHARSETS))}")
    vocab = _vocabulary(charset)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # one piece per character, then its byte-level spelling (one token; "ü", two bytes, one <unk>)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(pattern="", behavior="isolated"), _byte_level()]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        # Text is characters: a literal "</s>" in a prompt is four tokens, never the EOS id.
        split_special_tokens=True,
        padding_side="left",  # an argument, so that tokenizer_config.json records it
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def load_tokenizer(directory: Path) -> Any:
    """The tokenizer saved in the local model directory ``directory``: sdp's character tokenizer
    rebuilt (``build_tokenizer``) when tokenizer.json holds one, in any sdp version's spelling,
    since ``AutoTokenizer`` swaps Qwen's byte-level pipeline in for it (the module's docstring);
    any other tokenizer as ``AutoTokenizer`` loads it."""
    charset = _saved_charset(directory / "tokenizer.json")
    if charset is not None:
        return build_tokenizer(charset)
    from transformers import AutoTokenizer  # torch comes with it: only for a tokenizer of another project

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def _saved_charset(path: Path) -> str | None:
    """The charset of the character tokenizer saved in ``path``; None for any other (or no,
    or unreadable: ``AutoTokenizer`` then names the problem) tokenizer.json."""
    try:
        model = json.loads(path.read_text(encoding="utf-8")).get("model")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(model, dict) or model.get("type") != "WordLevel" or not isinstance(model.get("vocab"), dict):
        return None
    return charset_of(model["vocab"])
