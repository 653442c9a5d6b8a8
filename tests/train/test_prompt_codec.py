"""PromptCodec: the producer's prompt ids come from a cache that must never change what it gives."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_cli.models.policy import PROMPT_CACHE_SIZE, PromptCodec


@dataclass
class CountingPolicy:
    """A policy whose tokenizer maps each character to its code point after a BOS of 1."""

    eos_token_id: int = 2
    calls: list[str] = field(default_factory=list)

    def encode_prompt(self, text: str) -> list[int]:
        self.calls.append(text)
        return [1, *map(ord, text)]

    def decode(self, token_ids) -> str:
        return "".join(map(chr, token_ids))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(max_size=8), min_size=1, max_size=40))
def test_cached_ids_equal_the_tokenizers_and_each_text_is_encoded_once(texts):
    policy = CountingPolicy()
    codec = PromptCodec(policy)
    for text in texts:
        assert codec.encode_prompt(text) == [1, *map(ord, text)]
    assert sorted(policy.calls) == sorted(set(texts))  # len(set(texts)) ≤ 40 < the cache's size


def test_a_caller_that_changes_its_ids_does_not_change_the_next_callers():
    codec = PromptCodec(CountingPolicy())
    first = codec.encode_prompt("3+4=")
    first.append(99)
    first[0] = 7
    assert codec.encode_prompt("3+4=") == [1, ord("3"), ord("+"), ord("4"), ord("=")]


def test_the_cache_is_bounded_and_what_it_dropped_is_encoded_again():
    policy = CountingPolicy()
    codec = PromptCodec(policy)
    for i in range(PROMPT_CACHE_SIZE + 1):
        codec.encode_prompt(str(i))
    codec.encode_prompt("0")  # the least recently used, dropped by the last insertion
    assert policy.calls.count("0") == 2
    assert codec._encoded.cache_info().currsize == PROMPT_CACHE_SIZE
