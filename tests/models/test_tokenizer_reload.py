"""Every directory sdp writes reloads to sdp's character tokenizer (docs/design.md, "Character tokenizer").

The tiny model's config.json says ``model_type: qwen2``, and transformers 5 loads the tokenizer of
any qwen2 directory as ``Qwen2Tokenizer`` whatever tokenizer_config.json names: the saved
vocabulary with Qwen's NFC normalizer, regex split, byte-level pre-tokenizer and decoder, and no
``<unk>``. These tests reload each kind of directory sdp writes through plain ``AutoTokenizer``
(what vLLM and users do with an export) and through sdp's loader, and compare with
``build_tokenizer``; directories written before the byte-level spelling still load through
sdp's loader.
"""

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import sdp_cli.models.warm_start as ws
from sdp_cli.config.compose import compose_config
from sdp_cli.models import load_policy, save_policy
from sdp_cli.models.export import export_policy
from sdp_cli.models.tiny import tiny_arch
from sdp_cli.models.tokenizer import CHARSETS, CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer, load_tokenizer
from sdp_cli.tasks import build_task
from sdp_cli.train.session.policy_setup import save_checkpoint_policy, save_version

from ..fast_run import FAST
from ..gpu.qwen_shape import build_model, padded_tokenizer

SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
# Strings that the byte-level pre-tokenizer treats specially: spaces before words, runs of
# whitespace and newlines, contractions, digits, and special-token spellings (plain text here).
AWKWARD = ["Tom has 3 apples.", "  a  \n\n b ", "x\n", " ", "\n\n", "it's 'LL 'd", "</s><s> <pad><unk>", "12 + 34 = 46"]
UNK = 3


def _tiny(charset):
    return load_policy("tiny", task="arith1", charset=charset, warm_start_steps=0, **SMALL)


def _saved(tmp_path_factory, charset):
    """A tiny policy written by ``save_policy`` (config.json says qwen2), and its directory."""
    policy = _tiny(charset)
    return policy, save_policy(policy, tmp_path_factory.mktemp(f"saved-{charset}"))


def _auto(directory):
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


@pytest.fixture(scope="module", params=sorted(CHARSETS))
def saved(request, tmp_path_factory):
    charset = request.param
    _, directory = _saved(tmp_path_factory, charset)
    return charset, build_tokenizer(charset), _auto(directory), load_tokenizer(directory)


def test_config_names_qwen2(tmp_path_factory):
    # the premise: a directory that transformers resolves by its qwen2 model type
    _, directory = _saved(tmp_path_factory, "arith")
    assert json.loads((directory / "config.json").read_text())["model_type"] == "qwen2"


def test_spaces_and_newlines_survive_autotokenizer_reload_by_hand(tmp_path_factory):
    _, directory = _saved(tmp_path_factory, "ascii")
    loaded = _auto(directory)
    # ascii charset = string.printable without \t\r\x0b\x0c: digits 0-9, a-z 10-35, A-Z 36-61,
    # punctuation 62-93, space 94, newline 95; each shifted by the 4 special ids.
    # T=36+19+4=59 o=10+14+4=28 m=10+12+4=26 space=94+4=98 h=21 a=14 s=32 3=3+4=7 p=29 l=25 e=18
    # "."=62+13+4=79 (string.punctuation.index(".") == 13) newline=95+4=99 k=24; BOS=1 first.
    text = "Tom has 3 apples.\nok"
    expected = [1, 59, 28, 26, 98, 21, 14, 32, 98, 7, 98, 14, 29, 29, 25, 18, 32, 79, 99, 28, 24]
    assert build_tokenizer("ascii").encode(text) == expected
    assert loaded.encode(text) == expected
    assert loaded.decode(expected, skip_special_tokens=True) == text
    # byte-level spelling (GPT-2's table moves bytes 0-32 to U+0100 + byte): " " -> U+0120, "\n" -> U+010A
    assert loaded.convert_ids_to_tokens([98, 99, 59]) == ["\u0120", "\u010a", "T"]


def _assert_same(reference, loaded, text):
    for special in (True, False):
        ids = reference.encode(text, add_special_tokens=special)
        assert loaded.encode(text, add_special_tokens=special) == ids
        assert loaded.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
        assert loaded.decode(ids, skip_special_tokens=True) == text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_reload_encodes_every_charset_string_as_built(saved, data):
    charset, reference, auto, ours = saved
    text = data.draw(st.text(alphabet=CHARSETS[charset], max_size=60))
    _assert_same(reference, auto, text)
    _assert_same(reference, ours, text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_characters_outside_the_charset(saved, data):
    # sdp's loader: one <unk> per such character, as built. Plain AutoTokenizer (Qwen2Tokenizer
    # has no unknown token) drops them and keeps every other id: the one documented difference.
    charset, reference, auto, ours = saved
    text = data.draw(st.text(alphabet=string.printable, max_size=60))
    ids = reference.encode(text)
    assert ours.encode(text) == ids
    assert auto.encode(text) == [i for i in ids if i != UNK]
    anything = data.draw(st.text(max_size=30))
    assert ours.encode(anything) == reference.encode(anything)


def test_reload_awkward_strings_and_special_ids(saved):
    charset, reference, auto, ours = saved
    for loaded in (auto, ours):
        for text in [*AWKWARD, CHARSETS[charset]]:
            if set(text) <= set(CHARSETS[charset]):
                _assert_same(reference, loaded, text)
        assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2, 3)
        assert len(loaded) == len(reference)
        # special tokens decode to their spelling wherever they are
        assert loaded.decode([2, 0, 1, 3]) == reference.decode([2, 0, 1, 3]) == "</s><pad><s><unk>"
        assert loaded.padding_side == "left"
        chat = loaded.apply_chat_template([{"role": "user", "content": "1 + 2="}], tokenize=False, add_generation_prompt=True)
        assert chat == "1 + 2="


def test_saved_policy_reloads_and_encodes_decodes_identically(tmp_path_factory):
    policy, directory = _saved(tmp_path_factory, "ascii")
    reloaded = load_policy("hf", path=directory)
    reference = build_tokenizer("ascii")
    for text in [*AWKWARD, CHARSETS["ascii"], "a\u00fcb"]:  # "ü" is outside the charset: one <unk>, as built
        assert reloaded.encode_prompt(text) == policy.encode_prompt(text) == reference.encode(text)
    # 59 28 26 98 = "Tom " (ids by hand above), 2 = EOS
    assert reloaded.decode([59, 28, 26, 98, 2]) == policy.decode([59, 28, 26, 98, 2]) == "Tom </s>"
    assert (reloaded.eos_token_id, reloaded.pad_token_id, reloaded.bos_token_id) == (2, 0, 1)


def test_train_setup_reads_the_saved_tokenizer(tmp_path_factory):
    # what `sdp train` renders and length-filters prompts with, before the weights load
    from sdp_cli.train.session.task_setup import build_task_from
    from sdp_cli.train.session.task_setup import load_tokenizer as setup_tokenizer

    _, directory = _saved(tmp_path_factory, "ascii")
    cfg = compose_config([*FAST, "model=hf", f"model.path={directory}"])[0]
    loaded = setup_tokenizer(cfg, build_task_from(cfg))
    for text in [*AWKWARD, "a\u00fcb"]:
        assert loaded.encode(text) == build_tokenizer("ascii").encode(text)


def _write_save_policy(tmp_path, policy):
    return save_policy(policy, tmp_path / "saved")


def _write_checkpoint(tmp_path, policy):
    save_checkpoint_policy(policy, tmp_path / "checkpoint")
    return tmp_path / "checkpoint"


def _write_version(tmp_path, policy):
    cfg = compose_config([*FAST, "engine.dtype=bfloat16"])[0]
    save_version(policy, cfg, tmp_path / "v000001")
    return tmp_path / "v000001"


def _write_export(tmp_path, policy):
    return export_policy(policy, tmp_path / "export")


WRITERS = {"save_policy": _write_save_policy, "checkpoint": _write_checkpoint, "version": _write_version, "export": _write_export}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_writer_produces_a_directory_autotokenizer_reads(tmp_path, writer):
    directory = WRITERS[writer](tmp_path, _tiny("ascii"))
    assert json.loads((directory / "config.json").read_text())["model_type"] == "qwen2"
    reference = build_tokenizer("ascii")
    for loaded in (_auto(directory), load_tokenizer(directory), load_policy("hf", path=directory).tokenizer):
        for text in [*AWKWARD, CHARSETS["ascii"]]:
            _assert_same(reference, loaded, text)


def test_warm_start_entry_reloads_with_spaces(tmp_path):
    # the cache entry is written by warm_start itself (model.save_pretrained + tokenizer.save_pretrained)
    task = build_task("arith1")
    entry, _ = ws.warm_start(
        task, arch=tiny_arch(**SMALL), charset="ascii", steps=1, lr=1e-3, batch_size=2, seed=0,
        cache_dir=tmp_path, eval_n=2,
    )  # fmt: skip
    reference = build_tokenizer("ascii")
    for loaded in (_auto(entry), load_policy("hf", path=entry).tokenizer):
        for text in ["Tom has 3 apples.\n12 + 34 =", *AWKWARD]:
            _assert_same(reference, loaded, text)


def test_gpu_check_padded_tokenizer_reloads(tmp_path):
    # tests/gpu/qwen_shape.py: the arith tokenizer with filler tokens, saved next to a qwen2 config
    build_model("tiny").save_pretrained(tmp_path)
    padded = padded_tokenizer(512)
    padded.save_pretrained(tmp_path)
    reference = build_tokenizer("arith")
    for loaded in (_auto(tmp_path), load_tokenizer(tmp_path)):
        for text in ["12 + 34 = 46", " (1, 2)", "  9 "]:
            _assert_same(reference, loaded, text)
        assert len(loaded) == 512 and loaded.decode([24, 511]) == "<f24><f511>"


def _pre_fix_tokenizer(charset: str) -> PreTrainedTokenizerFast:
    """The character tokenizer as sdp built it before the byte-level spelling: the raw
    characters (" ", "\\n") as tokens, split per character, a Fuse decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARSETS[charset]))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        split_special_tokens=True,
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.mark.parametrize("charset", sorted(CHARSETS))
def test_pre_fix_directory_loads_through_sdp(tmp_path, charset):
    policy = _tiny(charset)
    policy.model.save_pretrained(tmp_path)
    _pre_fix_tokenizer(charset).save_pretrained(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    assert spec["pre_tokenizer"]["pattern"] == {"String": ""} and spec["model"]["vocab"][" "] == 4 + CHARSETS[charset].index(" ")
    reference = build_tokenizer(charset)
    reloaded = load_tokenizer(tmp_path)
    for text in [*AWKWARD, CHARSETS[charset]]:
        if set(text) <= set(CHARSETS[charset]):
            _assert_same(reference, reloaded, text)
    assert load_policy("hf", path=tmp_path).encode_prompt("12 + 3") == reference.encode("12 + 3")
    # saved again by sdp, the directory is in the new format that plain AutoTokenizer reads
    save_policy(load_policy("hf", path=tmp_path), tmp_path / "again")
    _assert_same(reference, _auto(tmp_path / "again"), "12 + 3 = 15")


def test_other_tokenizers_load_through_autotokenizer(tmp_path):
    # a tokenizer that is not sdp's character tokenizer (a vocabulary entry longer than one
    # character) is left to transformers
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "ab": 4, "c": 5}
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("ab c", add_special_tokens=False) == [4, 5]


def test_charset_sizes_unchanged():
    # ids are what the model's weights index: printable ASCII is 100 characters, minus
    # \t \r \x0b \x0c = 96, plus 4 special tokens; arith is 10 digits + "+-*/=()., " + 4
    assert len(build_tokenizer("ascii")) == 100 and len(build_tokenizer("arith")) == 24
    assert build_tokenizer("ascii").encode(string.digits, add_special_tokens=False) == list(range(4, 14))
