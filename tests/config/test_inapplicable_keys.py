"""A key set on the command line that the run never reads is refused (another model's, another
engine's, LoRA's without LoRA).

`sdp train model.path=./my-model` without `model=hf` trained the tiny model for as long as the
user let it; `engine.urls=[http://gpu-box:8000]` without `engine=vllm` trained on the local
engine; `engine=vllm engine.in_process=true` was accepted and meant nothing. Each was accepted
without a word, against the promise of strict overrides (tests/config/test_strict_overrides.py).
Which runs read a key is what its `--help-config` text opens with ("tiny:", "hf:", "LoRA:",
"local engine:", "remote engines:", "launched servers:", "launched vllm:", "attached vllm:",
"reward_errors=zero:"). Only keys the command line names are judged.
"""

import json

import pytest

from sdp_cli.config.compose import compose_config
from sdp_cli.config.schema import field_docs
from sdp_cli.config.scopes import KEY_SCOPES
from sdp_cli.errors import UserError

from ..cli.run_main import run_main
from ..fast_run import FAST

URL = "engine.urls=[http://127.0.0.1:9]"


def _refused(overrides: list[str], **kwargs) -> str:
    with pytest.raises(UserError) as info:
        compose_config(overrides, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.path=/models/mine"],
         "model.path applies to model.kind=hf, not model.kind=tiny; add model=hf to train the model it names, or remove it"),
        (["model.gguf_cache=false"],
         "model.gguf_cache applies to model.kind=hf, not model.kind=tiny; add model=hf to train the model it names, or remove it"),
        (["model=hf", "model.path=/m", "model.hidden_size=256"],
         "model.hidden_size applies to model.kind=tiny, not model.kind=hf; remove it"),
        (["model=hf", "model.path=/m", "model.warm_start_steps=5"],
         "model.warm_start_steps applies to model.kind=tiny, not model.kind=hf; remove it"),
        (["model=hf", "model.path=/m", "model.charset=ascii"],
         "model.charset applies to model.kind=tiny, not model.kind=hf; remove it"),
        ([URL],
         "engine.urls applies to remote engines (engine=vllm, engine=sglang), not engine.kind=local; "
         "choose one of them, or remove it"),
        (["engine.api_key_env=KEY"],
         "engine.api_key_env applies to remote engines (engine=vllm, engine=sglang), not engine.kind=local; "
         "choose one of them, or remove it"),
        (["engine.python=/opt/vllm/bin/python"],
         "engine.python applies to a server sdp launches (engine=vllm, engine=sglang without engine.urls), "
         "not engine.kind=local; remove it"),
        (["engine=vllm", "engine.in_process=true"],
         "engine.in_process applies to the local engine (engine=local), not engine.kind=vllm; remove it"),
        (["engine=sglang", "engine.max_batch_size=8"],
         "engine.max_batch_size applies to the local engine (engine=local), not engine.kind=sglang; remove it"),
        (["engine=vllm", URL, "engine.port=8000"],
         "engine.port applies to a server sdp launches (engine=vllm, engine=sglang without engine.urls), "
         "not the servers of engine.urls, which sdp attaches to; remove it"),
        (["engine=vllm", URL, "engine.extra_args=[--x]"],
         "engine.extra_args applies to a server sdp launches (engine=vllm, engine=sglang without engine.urls), "
         "not the servers of engine.urls, which sdp attaches to; remove it"),
        (["engine=vllm", URL, "+engine.env.A=b"],
         "engine.env applies to a server sdp launches (engine=vllm, engine=sglang without engine.urls), "
         "not the servers of engine.urls, which sdp attaches to; remove it"),
        (["engine=sglang", "engine.enforce_eager=false"],
         "engine.enforce_eager applies to a vLLM server sdp launches (engine=vllm without engine.urls), "
         "not engine.kind=sglang; remove it"),
        (["engine=vllm", URL, "engine.cpu_kv_cache_gib=4"],
         "engine.cpu_kv_cache_gib applies to a vLLM server sdp launches (engine=vllm without engine.urls), "
         "not the servers of engine.urls, which sdp attaches to; remove it"),
        # a launched vLLM server always reloads with sdp's worker extension (reload_weights_cpu)
        (["engine=vllm", "engine.reload_method=reload_weights"],
         "engine.reload_method applies to vLLM servers sdp attaches to (engine=vllm with engine.urls), "
         "not a server sdp launches; remove it"),
        # LoRA's keys without model.lora.r: full fine-tuning, whatever they say
        (["model.lora.alpha=32"],
         "model.lora.alpha applies to LoRA (model.lora.r > 0), not model.lora.r=0; set model.lora.r too, or remove it"),
        (["model.lora.target_modules=[q_proj]"],
         "model.lora.target_modules applies to LoRA (model.lora.r > 0), not model.lora.r=0; "
         "set model.lora.r too, or remove it"),
        (["model.lora.dropout=0.1"],
         "model.lora.dropout applies to LoRA (model.lora.r > 0), not model.lora.r=0; set model.lora.r too, or remove it"),
        (["task.reward_error_window=10"],
         "task.reward_error_window applies to task.reward_errors=zero, not task.reward_errors=raise; remove it"),
        (["engine=sglang", URL, "engine.reload_method=reload_weights"],
         "engine.reload_method applies to vLLM servers sdp attaches to (engine=vllm with engine.urls), "
         "not engine.kind=sglang; remove it"),
    ],
)  # fmt: skip
def test_a_key_the_run_does_not_read_is_refused_in_one_line(overrides, message):
    assert _refused(overrides) == message


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=hf", "model.path=/m"],
        ["model.hidden_size=64", "model.warm_start_steps=0", "model.charset=ascii"],
        ["engine=vllm", URL, "engine.api_key_env=KEY", "engine.reload_method=reload_weights_cpu"],
        ["engine=vllm", "engine.port=8000", "engine.python=/opt/vllm/bin/python", "engine.max_model_len=128",
         "+engine.env.A=b", "engine.extra_args=[--x]"],
        ["engine=sglang", "engine.host=127.0.0.2", "engine.api_key_env=KEY"],
        ["engine.in_process=true", "engine.max_batch_size=8"],
        ["model.lora.r=4", "model.lora.alpha=32", "model.lora.target_modules=[q_proj]"],
        ["task.reward_errors=zero", "task.reward_max_error_rate=0.5", "task.reward_error_window=10"],
        # the context prompts are kept within, on every engine (a launched vLLM server also gets it)
        ["engine.max_model_len=64"], ["engine=sglang", URL, "engine.max_model_len=64"],
        # what sdp's own files set is not judged: the fast debug run's tiny model keys on a real model
        ["+debug=fast", "model=hf", "model.path=/m"],
        # a key set to its default asks for nothing that does not happen
        ["engine=vllm", "engine.in_process=false", "model.path=null"],
    ],
)  # fmt: skip
def test_a_key_the_run_reads_is_accepted(overrides):
    compose_config(overrides)


def test_the_overrides_a_run_was_accepted_with_are_not_judged_again():
    # a resumed run's saved overrides (an older sdp accepted them): the resume goes on
    saved = ["engine=vllm", URL, "engine.port=8000"]
    cfg, _ = compose_config(saved, accepted=saved)
    assert cfg.engine.port == 8000
    # what the resume adds is judged
    message = _refused([*saved, "engine.extra_args=[--x]"], accepted=saved)
    assert message.startswith("engine.extra_args applies to a server sdp launches")


def test_every_scoped_key_is_where_its_help_text_says():
    # the scope a key's --help-config text opens with is the one the check applies; a key that
    # gains or loses such an opening changes this table
    scoped: dict[str, set[str]] = {}
    for key, _, doc in field_docs():
        label = doc.partition(":")[0]
        if label in KEY_SCOPES:
            scoped.setdefault(label, set()).add(key)
    assert scoped == {
        "tiny": {f"model.{k}" for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                                        "charset", "warm_start_steps", "warm_start_lr", "warm_start_batch",
                                        "warm_start_target")},
        "hf": {"model.path", "model.gguf_cache"},
        "LoRA": {"model.lora.alpha", "model.lora.dropout", "model.lora.target_modules"},
        "local engine": {"engine.in_process", "engine.max_batch_size"},
        "remote engines": {"engine.urls", "engine.launch", "engine.retries", "engine.api_key_env",
                           "engine.allow_temperature_mismatch"},
        "launched servers": {"engine.python", "engine.host", "engine.port", "engine.extra_args", "engine.env"},
        "launched vllm": {"engine.enforce_eager", "engine.cpu_kv_cache_gib"},
        "attached vllm": {"engine.reload_method"},
        "reward_errors=zero": {"task.reward_max_error_rate", "task.reward_error_window"},
    }  # fmt: skip


def test_sdp_train_with_a_key_it_would_ignore_exits_2_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    code, out, err = run_main(["train", *FAST, "model.path=/models/mine", f"run.dir={run}"], capsys)
    assert code == 2
    assert err.strip() == (
        "error: model.path applies to model.kind=hf, not model.kind=tiny; add model=hf to train the model it "
        "names, or remove it"
    )
    assert out == ""
    assert list(tmp_path.iterdir()) == []


def test_a_resume_keeps_its_saved_keys_and_judges_the_ones_it_adds(tmp_path, monkeypatch, capsys):
    import torch

    from sdp_cli.train.session.run import run_training

    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    # a run begun before the check, whose saved overrides hold a key the run never read
    overrides = [*FAST, "train.steps=1", "engine.enforce_eager=false", f"run.dir={run}"]
    threads = torch.get_num_threads()
    cfg, raw = compose_config(overrides, accepted=overrides)
    run_training(cfg, raw, overrides=overrides)
    torch.set_num_threads(threads)
    code, _, err = run_main(["train", f"resume={run}", "train.steps=2"], capsys)
    assert code == 0, err
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    code, _, err = run_main(["train", f"resume={run}", "train.steps=3", "engine.cpu_kv_cache_gib=4"], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "error: engine.cpu_kv_cache_gib applies to a vLLM server sdp launches (engine=vllm without engine.urls), "
        "not engine.kind=local; remove it"
    )
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
