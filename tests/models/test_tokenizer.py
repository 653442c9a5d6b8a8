"""Character tokenizer: one id per character, fixed special ids, save/load through AutoTokenizer."""

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoTokenizer

from sdp_cli.errors import UserError
from sdp_cli.models.tokenizer import CHARSETS, build_tokenizer


@pytest.fixture(scope="module")
def ascii_tok():
    return build_tokenizer("ascii")


def test_special_ids_and_sizes():
    tok = build_tokenizer("arith")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    # 4 special tokens + 10 digits + "+-*/=()., " (10 characters)
    assert len(tok) == 24
    # printable ASCII is 100 characters; minus \t \r \x0b \x0c = 96, plus 4 special tokens
    assert len(build_tokenizer("ascii")) == 100
    # the first character follows the special tokens
    assert tok.convert_tokens_to_ids("0") == 4


def test_arith_prompt_ids_by_hand():
    tok = build_tokenizer("arith")
    # "0".."9" are ids 4..13, then "+"=14, "-"=15, "*"=16, "/"=17, "="=18
    assert tok.encode("3+4=", add_special_tokens=False) == [7, 14, 8, 18]
    assert tok.encode("3+4=") == [1, 7, 14, 8, 18]  # BOS prepended by default


@given(st.text(alphabet=CHARSETS["ascii"], max_size=80))
def test_round_trip_one_id_per_character(ascii_tok, text):
    ids = ascii_tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert ascii_tok.decode(ids) == text
    assert ascii_tok.decode(ascii_tok.encode(text), skip_special_tokens=True) == text


def test_whitespace_runs_and_newlines_are_kept(ascii_tok):
    text = "  a  \n\n b "
    assert ascii_tok.decode(ascii_tok.encode(text, add_special_tokens=False)) == text


def test_special_token_strings_in_text_are_plain_characters(tmp_path, ascii_tok):
    # "</s>" typed in a prompt must not end the sequence: it is the characters <, /, s, >.
    expected = [ascii_tok.convert_tokens_to_ids(c) for c in "</s>"]
    assert ascii_tok.encode("</s>", add_special_tokens=False) == expected
    ascii_tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.encode("</s>", add_special_tokens=False) == expected


def test_unknown_characters_become_unk(ascii_tok):
    ids = ascii_tok.encode("a\u00fcb", add_special_tokens=False)
    assert ids == [ascii_tok.convert_tokens_to_ids("a"), 3, ascii_tok.convert_tokens_to_ids("b")]


def test_ids_past_the_vocabulary_decode_to_nothing():
    # The model's vocabulary is padded to a multiple of 32; those ids have no text.
    tok = build_tokenizer("arith")
    assert tok.decode([7, 30, 8]) == "34"


def test_save_and_load_through_autotokenizer(tmp_path, ascii_tok):
    ascii_tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "").replace("\x0c", "")
    assert loaded.encode(text) == ascii_tok.encode(text)
    assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    chat = loaded.apply_chat_template([{"role": "user", "content": "2+2="}], tokenize=False, add_generation_prompt=True)
    assert chat == "2+2="


def test_unknown_charset_is_a_user_error():
    with pytest.raises(UserError) as err:
        build_tokenizer("emoji")
    assert str(err.value) == "unknown charset 'emoji'; choose one of arith, ascii"
