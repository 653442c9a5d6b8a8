"""Upper bounds of the numbers a user sets (issue 24, item 22): `train.threads=20000` failed in
libgomp after the run directory was made, 50000 segfaulted. Thread and worker counts are bounded
by the machine's CPUs, the tiny model and the KV cache by its memory, and every other count by a
fixed, documented bound; each is refused in one line at validation, before anything is written."""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from sdp_cli.config import validation
from sdp_cli.config.compose import compose_config
from sdp_cli.config.schema import SdpConfig
from sdp_cli.errors import UserError

from ..cli.run_main import run_main

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


@pytest.fixture
def two_cpus_8_gib(monkeypatch):
    """A machine of 2 CPUs and 8 GiB, whatever this one has."""
    monkeypatch.setattr(validation, "machine_cpus", lambda: 2)
    monkeypatch.setattr(validation, "machine_memory_bytes", lambda: 8 << 30)


def _refused(overrides: list[str]) -> str:
    with pytest.raises(UserError) as info:
        compose_config(overrides)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # 4 threads per CPU on 2 CPUs: 8
        (["train.threads=20000"], "train.threads=20000 is more than 4 per CPU (8 on this machine's 2 CPUs)"),
        (["train.threads=50000"], "train.threads=50000 is more than 4 per CPU (8 on this machine's 2 CPUs)"),
        (["train.threads=9"], "train.threads=9 is more than 4 per CPU (8 on this machine's 2 CPUs)"),
        # 8 reward workers per CPU on 2 CPUs: 16
        (["task.reward_workers=17"], "task.reward_workers=17 is more than 8 per CPU (16 on this machine's 2 CPUs)"),
    ],
)
def test_thread_and_worker_counts_are_bounded_by_the_cpus(two_cpus_8_gib, overrides, message):
    assert _refused(overrides) == f"{message}; choose at most {message.split('(')[1].split()[0]}"


def test_thread_and_worker_counts_at_the_bound_are_accepted(two_cpus_8_gib):
    cfg, _ = compose_config(["train.threads=8", "task.reward_workers=16"])
    assert (cfg.train.threads, cfg.task.reward_workers) == (8, 16)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("rollout.max_new_tokens=2000000", f"rollout.max_new_tokens=2000000 is more than {validation.MAX_TOKENS}"),
        ("train.eval_max_new_tokens=2000000", "train.eval_max_new_tokens=2000000 is more than"),
        ("loss.norm_length=2000000", "loss.norm_length=2000000 is more than"),
        ("engine.max_model_len=2000000", "engine.max_model_len=2000000 is more than"),
        ("engine.max_batch_size=100000", f"engine.max_batch_size=100000 is more than {validation.MAX_SAMPLES}"),
        ("model.warm_start_batch=100000", "model.warm_start_batch=100000 is more than"),
        ("engine.retries=2000", f"engine.retries=2000 is more than {validation.MAX_RETRIES}"),
        ("model.lora.r=100000", f"model.lora.r=100000 is more than {validation.MAX_LORA_RANK}"),
        ("train.steps=3000000000", f"train.steps=3000000000 is more than {validation.MAX_INT}"),
        ("optim.ppo_epochs=99999999999", "optim.ppo_epochs=99999999999 is more than"),
    ],
)
def test_counts_have_fixed_bounds(two_cpus_8_gib, override, fragment):
    assert fragment in _refused([override])


def test_samples_per_batch_and_in_flight_are_bounded(two_cpus_8_gib):
    # 65,536 samples per batch: 4,096 groups of 16 is the bound, 4,097 is over it
    cfg, _ = compose_config(["rollout.batch_groups=4096", "rollout.group_size=16"])
    assert cfg.rollout.batch_groups * cfg.rollout.group_size == validation.MAX_SAMPLES == 65536
    message = _refused(["rollout.batch_groups=4097", "rollout.group_size=16"])
    assert message.startswith("rollout.batch_groups=4097 × rollout.group_size=16 = 65552 samples per batch is more than 65536")
    # in flight: 2·65,536 samples; 8,193 groups of 16 = 131,088
    message = _refused(["rollout.max_concurrent_rollouts=8193", "rollout.group_size=16"])
    assert message.startswith("rollout.max_concurrent_rollouts=8193 × rollout.group_size=16 = 131088 samples in flight is more than 131072")


def test_the_tiny_model_must_fit_the_machines_memory(two_cpus_8_gib):
    # 16 layers of width 8192, MLP 32768: 16·(4·8192² + 3·8192·32768) = 16·(268,435,456 +
    # 805,306,368) = 17,179,869,184 parameters at least, 16 bytes each to train: 256 GiB > 8 GiB
    message = _refused(["model.hidden_size=8192", "model.num_layers=16", "model.intermediate_size=32768", "model.num_heads=64"])
    assert message.startswith("the tiny model (model.hidden_size=8192, model.num_layers=16, model.intermediate_size=32768) has")
    assert "17.2 G parameters" in message and "256 GiB to train" in message and "this machine's 8 GiB" in message
    # 2·(4·1024² + 3·1024·4096) = 33,554,432 parameters, 0.5 GiB to train: within 8 GiB
    compose_config(["model.num_layers=2", "model.hidden_size=1024", "model.intermediate_size=4096"])
    # the tiny model's keys do not describe an hf model (its own config.json does): not estimated
    cfg = SdpConfig()
    cfg.model.kind, cfg.model.path, cfg.model.hidden_size, cfg.model.num_layers = "hf", "org/name", 8192, 16
    cfg.model.intermediate_size, cfg.model.num_heads = 32768, 64
    validation.validate(cfg)


def test_the_kv_cache_must_fit_the_machines_memory(two_cpus_8_gib):
    assert _refused(["engine.cpu_kv_cache_gib=1000"]).startswith(
        "engine.cpu_kv_cache_gib=1000.0 is more than this machine's memory (8 GiB)"
    )
    vllm = ["engine=vllm", "model=hf", "model.path=org/name"]
    compose_config([*vllm, "engine.cpu_kv_cache_gib=8"])  # all of it: the edge the rule allows
    assert _refused([*vllm, "engine.cpu_kv_cache_gib=8.01"]).startswith("engine.cpu_kv_cache_gib=8.01 is more than")


def test_the_tiny_model_may_need_exactly_the_machines_memory(two_cpus_8_gib, monkeypatch):
    """The rule is "more than the memory": a model that needs all of it is allowed, one byte less
    memory is not (8 layers of width 1024: about 2 GiB to train, above the KV cache's 1 GiB)."""
    model = ["model.num_layers=8", "model.hidden_size=1024", "model.intermediate_size=4096"]
    cfg, _ = compose_config(model)
    need = validation._tiny_model_parameters(cfg.model) * validation.TRAIN_BYTES_PER_PARAMETER
    monkeypatch.setattr(validation, "machine_memory_bytes", lambda: need)
    compose_config(model)
    monkeypatch.setattr(validation, "machine_memory_bytes", lambda: need - 1)
    assert _refused(model).startswith("the tiny model (model.hidden_size=1024, model.num_layers=8")


def _int_keys(cls: type = SdpConfig, prefix: str = "") -> list[str]:
    """Every integer field of the schema (``int`` or ``int | None``), read from the schema."""
    hints = typing.get_type_hints(cls)
    keys: list[str] = []
    for f in fields(cls):
        hint = hints[f.name]
        if is_dataclass(hint):
            keys += _int_keys(hint, f"{prefix}{f.name}.")
        elif hint is int or (typing.get_origin(hint) in (typing.Union, types.UnionType) and int in typing.get_args(hint)):
            keys.append(f"{prefix}{f.name}")
    return keys


def test_every_integer_of_the_schema_is_bounded():
    """2^63 in any integer field is refused in one line naming the key: the generic bound covers
    fields added later without a list to update (validated directly: composing 30 configs
    through Hydra would take half a minute; the parametrized cases above go through it)."""
    keys = _int_keys()
    assert "train.threads" in keys and "model.lora.r" in keys and len(keys) > 20
    for key in keys:
        cfg = SdpConfig()
        *sections, name = key.split(".")
        owner = functools.reduce(getattr, sections, cfg)
        setattr(owner, name, 2**63)
        with pytest.raises(validation.ConfigValueError) as info:
            validation.validate(cfg)
        assert key in str(info.value) and "\n" not in str(info.value), (key, str(info.value))


def test_a_refused_count_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(["train", "train.threads=20000"], capsys)
    assert code == 2 and err.startswith("error: train.threads=20000 is more than 4 per CPU")
    assert list(tmp_path.iterdir()) == []


def test_the_bounds_are_documented():
    text = DOCS.read_text()
    for key, bound in validation.COUNT_BOUNDS.items():
        assert f"`{key}`" in text, key
        assert f"{bound:,}" in text, (key, bound)
    for number in (validation.THREADS_PER_CPU, validation.REWARD_WORKERS_PER_CPU):
        assert f"{number} per CPU" in text
    assert f"{validation.MAX_SAMPLES:,}" in text and f"{validation.MAX_INT:,}" in text
