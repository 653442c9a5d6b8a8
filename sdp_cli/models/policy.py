"""The policy bundle every engine and trainer receives: model, tokenizer and its token ids."""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Policy:
    """A causal LM with its tokenizer.

    Attributes:
        model: the transformers model (eval mode, on its device).
        tokenizer: its tokenizer; ``encode_prompt``/``decode`` are the only text conversions used.
        eos_token_id: the stop token id; a completion stops when it is generated.
        pad_token_id: padding id (the EOS id when the tokenizer has no pad token).
        bos_token_id: the id the tokenizer prepends to prompts, or None.
        name: identifies the policy in batch metadata and logs (a path or a warm-start key).
        warm_start_accuracy: a warm-started tiny model's greedy accuracy and the number of
            validation problems it was measured on; None for any other policy.
        load_note: the line ``sdp train`` prints on how the weights were read (a GGUF file's:
            dequantised, and from or into its cached copy); None where there is nothing to say.
    """

    model: "PreTrainedModel"
    tokenizer: "PreTrainedTokenizerBase"
    eos_token_id: int
    pad_token_id: int
    bos_token_id: int | None
    name: str
    warm_start_accuracy: tuple[float, int] | None = None
    load_note: str | None = None

    def encode_prompt(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return decode(self.tokenizer, token_ids)


def encode_prompt(tokenizer: "PreTrainedTokenizerBase", text: str) -> list[int]:
    """Prompt ids with the tokenizer's special tokens (BOS for the character tokenizer)."""
    return list(tokenizer.encode(text, add_special_tokens=True))


def decode(tokenizer: "PreTrainedTokenizerBase", token_ids: Sequence[int]) -> str:
    """Completion text; special tokens are kept so that a stray one cannot look like a right answer."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=False)


#: prompts whose ids ``PromptCodec`` keeps (a built-in task has fewer; a data set's epochs repeat)
PROMPT_CACHE_SIZE = 4096


class PromptCodec:
    """Prompt encoding and completion decoding of a policy (the stop token is not text).

    Prompt ids are cached: the producer encodes every group's prompt, in sdp's process with
    ``engine.in_process=true`` holding the GIL the trainer's step needs (docs/benchmarks.md),
    and a tokenizer maps the same text to the same ids."""

    def __init__(self, policy: Any):
        self.policy = policy
        self.stop_token_ids = {int(policy.eos_token_id)}
        self._encoded = functools.lru_cache(maxsize=PROMPT_CACHE_SIZE)(
            lambda text: tuple(policy.encode_prompt(text))
        )

    @classmethod
    def of_tokenizer(cls, tokenizer: Any, eos_token_id: int) -> PromptCodec:
        """The codec of a policy of which only the tokenizer is here (the rollout process)."""
        return cls(
            types.SimpleNamespace(
                encode_prompt=functools.partial(encode_prompt, tokenizer),
                decode=functools.partial(decode, tokenizer),
                eos_token_id=eos_token_id,
            )
        )

    def encode_prompt(self, text: str) -> list[int]:
        return list(self._encoded(text))

    def decode_completion(self, token_ids: list[int]) -> str:
        if token_ids and token_ids[-1] in self.stop_token_ids:
            token_ids = token_ids[:-1]
        return self.policy.decode(token_ids)
