"""Character-level tokenizer defined in code, saved and loaded as a Hugging Face tokenizer.

One id per character (``add_special_tokens=False``); with special tokens on (the HF default, and
what vLLM does with a text prompt) the encoding is ``<s>`` followed by one id per character.
The tokenizer is a ``tokenizers`` WordLevel model behind a split-into-characters pre-tokenizer and
a ``Fuse`` decoder, wrapped in ``PreTrainedTokenizerFast`` so that ``save_pretrained`` writes a
directory that ``AutoTokenizer`` and vLLM both read. Characters outside the
charset encode to ``<unk>``. Special tokens are never parsed out of text: they enter only as ids.
"""

from __future__ import annotations

import string

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


def build_tokenizer(charset: str = "arith") -> PreTrainedTokenizerFast:
    """Tokenizer with ids pad=0, bos=1, eos=2, unk=3, then the characters of ``CHARSETS[charset]``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    if charset not in CHARSETS:
        raise UserError(f"unknown charset {charset!r}; choose one of {', '.join(sorted(CHARSETS))}")
    chars = CHARSETS[charset]
    assert len(set(chars)) == len(chars), f"charset {charset!r} repeats a character"
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *chars))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
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
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer
