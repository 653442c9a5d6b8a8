"""load_policy / save_policy / greedy_accuracy: round trips, one-line errors, lazy imports."""

import subprocess
import sys

import pytest
import torch

from sdp_cli.errors import UserError
from sdp_cli.models import greedy_accuracy, load_policy, save_policy
from sdp_cli.models.decode import greedy_decode
from sdp_cli.tasks.arith import AdditionTask

SMALL = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=256)


@pytest.fixture(scope="module")
def policy():
    return load_policy("tiny", task="arith1", warm_start_steps=0, seed=4, **SMALL)


def _logits(p, ids):
    with torch.no_grad():
        return p.model(torch.tensor([ids])).logits


def test_untrained_tiny_policy_bundle(policy):
    assert (policy.pad_token_id, policy.bos_token_id, policy.eos_token_id) == (0, 1, 2)
    assert policy.name == "tiny-qwen2:arith1:init:seed4"
    assert policy.encode_prompt("3+4=") == [1, 7, 14, 8, 18]
    assert policy.decode([7, 14, 8]) == "3+4"
    assert policy.decode([7, 2]) == "3</s>"  # a stray special token stays visible


def test_save_then_load_hf_gives_identical_logits(policy, tmp_path):
    save_policy(policy, tmp_path / "ckpt")
    loaded = load_policy("hf", path=tmp_path / "ckpt")
    ids = policy.encode_prompt("12+34=5 (6*7)")
    assert torch.equal(_logits(policy, ids), _logits(loaded, ids))
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.bos_token_id) == (policy.eos_token_id, policy.pad_token_id, policy.bos_token_id)
    assert loaded.encode_prompt("9+9=") == policy.encode_prompt("9+9=")
    assert loaded.name == str((tmp_path / "ckpt").resolve())
    assert loaded.model.config.tie_word_embeddings and loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight


def test_saving_again_replaces_the_weights_in_place(policy, tmp_path):
    other = load_policy("tiny", task="arith1", warm_start_steps=0, seed=5, **SMALL)
    target = tmp_path / "ckpt"
    save_policy(policy, target)
    save_policy(other, target)
    ids = other.encode_prompt("1+1=")
    assert torch.equal(_logits(load_policy("hf", path=target), ids), _logits(other, ids))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the temp sibling is gone


def test_dtype_and_tiny_arguments(tmp_path):
    p = load_policy("tiny", task="arith1", warm_start_steps=0, dtype="bfloat16", **SMALL)
    assert next(p.model.parameters()).dtype == torch.bfloat16
    assert load_policy("tiny", task="gsm8k", warm_start_steps=0, **SMALL).model.config.vocab_size == 128


class _FirstCharTask(AdditionTask):
    """Scores the text itself, so that an untrained model gets a mix of rewards: 1 for a completion
    starting with an even digit, plus 0.5 for stopping."""

    def reward(self, completion, item, *, stopped):
        return (1.0 if completion[:1] in set("02468") else 0.0) + (0.5 if stopped else 0.0)


def test_greedy_accuracy_matches_a_per_item_reference():
    policy = load_policy("tiny", task="arith1", warm_start_steps=0, seed=4, **SMALL)
    # Sharpen attention so that completions depend on the prompt (see test_tiny_and_decode.py).
    with torch.no_grad():
        for layer in policy.model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj):
                proj.weight.mul_(30)
    task = _FirstCharTask("first-char", 0, 99, max_new_tokens=6)
    items = task.eval_items(40, 3)  # greedy accuracy scores held-out problems only
    rewards = []
    for item in items:
        (result,) = greedy_decode(
            policy.model,
            [policy.encode_prompt(item.prompt)],
            max_new_tokens=6,
            eos_id=policy.eos_token_id,
            pad_id=policy.pad_token_id,
        )
        rewards.append(task.reward(policy.decode(result.token_ids), item, stopped=result.stopped))
    assert len(set(rewards)) >= 2, "the check is only meaningful when rewards differ between items"
    assert greedy_accuracy(policy, task, 40, seed=3, batch_size=7) == pytest.approx(sum(rewards) / 40)


@pytest.mark.parametrize(
    ("setup", "fragment"),
    [
        ("missing", "does not exist"),
        ("no_config", "has no config.json"),
        ("no_weights", "has no *.safetensors weights"),
        ("bin_only", "only .bin (pickle) weights"),
        ("no_tokenizer", "has no tokenizer files"),
        ("bad_config", "cannot load model directory"),
        ("weights cut in half", "model.safetensors is truncated: tensor"),
        ("weights cut to 4 bytes", "model.safetensors is truncated: 4 bytes"),
        ("weights cut inside the header", "model.safetensors is truncated: its header claims"),
        ("weights with trailing bytes", "model.safetensors has 8 bytes after its last tensor"),
        ("header length of 2^40", "model.safetensors has a header length of 1099511627776 bytes"),
    ],
)
def test_bad_hf_directories_are_one_line_user_errors(policy, tmp_path, setup, fragment):
    directory = tmp_path / "model"
    if setup != "missing":
        save_policy(policy, directory)
    if setup == "no_config":
        (directory / "config.json").unlink()
    elif setup in ("no_weights", "bin_only"):
        (directory / "model.safetensors").unlink()
        if setup == "bin_only":
            (directory / "pytorch_model.bin").write_bytes(b"")
    elif setup == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (directory / name).unlink()
    elif setup == "bad_config":
        (directory / "config.json").write_text('{"model_type": "no-such-architecture"}')
    elif setup.startswith(("weights", "header")):
        weights = directory / "model.safetensors"
        data = weights.read_bytes()
        # before: a SafetensorError traceback from transformers' loader
        weights.write_bytes(
            {
                "weights cut in half": data[: len(data) // 2],
                "weights cut to 4 bytes": data[:4],
                "weights cut inside the header": data[:100],
                "weights with trailing bytes": data + bytes(8),
                "header length of 2^40": (2**40).to_bytes(8, "little") + data[8:],
            }[setup]
        )
    with pytest.raises(UserError) as err:
        load_policy("hf", path=directory)
    message = str(err.value)
    assert "\n" not in message and fragment in message and str(directory) in message


@pytest.mark.parametrize(
    ("part", "source"),
    [
        ("", ""),  # the run directory itself
        ("checkpoints/step-000002", "checkpoints/step-000002"),
        ("checkpoints/step-000002/policy", "checkpoints/step-000002"),  # a LoRA checkpoint's adapters
        ("versions/v000001", "versions/v000001"),  # a LoRA version's adapters
    ],
)
def test_a_part_of_an_sdp_run_as_model_path_names_the_export_that_makes_it_one(tmp_path, part, source):
    """A user starting a new run from a trained one points model.path at the run; on main the
    line said only "point model.path at a directory written by save_pretrained"."""
    run = tmp_path / "runs" / "my-run"
    for directory in ("checkpoints/step-000002/policy", "versions/v000001"):
        (run / directory).mkdir(parents=True)
        (run / directory / "adapter_config.json").write_text("{}")
    (run / "overrides.json").write_text("[]")  # what a run writes first, then config.yaml
    (run / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(UserError) as err:
        load_policy("hf", path=run / part)
    directory = run / part
    assert str(err.value) == (
        f"model directory {directory} has no config.json; it is part of the sdp run {run}: "
        f"`sdp export {run / source} DIR` writes its policy as a model directory for model.path=DIR "
        f"(resume={run} continues that run)"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "gguf"}, "unknown model kind 'gguf'; choose one of tiny, hf"),
        ({"kind": "hf"}, "model kind 'hf' needs a path; set model.path to a model directory or a hub id (org/name)"),
        ({"kind": "tiny"}, "model kind 'tiny' needs a task to warm start on; set task (e.g. arith1)"),
        ({"kind": "tiny", "task": "arith1", "dtype": "fp8"}, "unknown dtype 'fp8'; choose one of float32, bfloat16, float16 or auto"),
        ({"kind": "tiny", "task": "nope"}, "unknown task 'nope'; choose one of arith1, arith2, dataset, gsm8k, runsum"),
        ({"kind": "tiny", "task": "arith1", "charset": "emoji", "warm_start_steps": 0}, "unknown charset 'emoji'; choose one of arith, ascii"),
    ],
)
def test_bad_arguments_are_user_errors(kwargs, message):
    kind = kwargs.pop("kind")
    with pytest.raises(UserError) as err:
        load_policy(kind, **kwargs)
    assert str(err.value) == message


def test_charset_that_misses_task_characters_is_a_user_error():
    with pytest.raises(UserError) as err:
        load_policy("tiny", task="gsm8k", charset="arith", warm_start_steps=0)
    # the sample's first problem starts with a capital letter; "arith" has no letters at all
    assert str(err.value).startswith("charset 'arith' lacks characters that task 'gsm8k' uses (e.g. ")
    assert str(err.value).endswith("use charset 'ascii' or leave it unset")
    # the other direction is fine: ascii covers the arithmetic characters
    assert len(load_policy("tiny", task="arith1", charset="ascii", warm_start_steps=0, **SMALL).tokenizer) == 100


def test_bad_warm_start_settings_are_user_errors():
    with pytest.raises(UserError, match="warm start needs steps >= 0"):
        load_policy("tiny", task="arith1", warm_start_steps=-1)
    with pytest.raises(UserError, match="warm start needs"):
        load_policy("tiny", task="arith1", warm_start_lr=0.0)
    with pytest.raises(UserError, match=r"target accuracy must be in \(0, 1\], got 1.5; 1.0 runs every step"):
        load_policy("tiny", task="arith1", warm_start_target=1.5)


def test_importing_the_package_does_not_import_torch():
    code = "import sys, sdp_cli.models; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
