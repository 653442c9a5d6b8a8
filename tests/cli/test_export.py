"""`sdp export` (issue 24 item 9): a LoRA run's checkpoint and version, and a full fine-tuning
run, written as plain Hugging Face directories that transformers loads with the trained
model's logits; refusals in one line with nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sdp_cli.models import load_policy, save_policy

from ..fast_run import FAST, train_run
from .run_main import run_main

SMALL = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128)
IDS = torch.tensor([[1, 5, 9, 12, 4, 7, 20, 3, 11]])


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """The tiny Qwen2 (arith tokenizer) as a Hugging Face directory: the base of the runs."""
    path = tmp_path_factory.mktemp("hf") / "tiny-qwen2"
    save_policy(load_policy("tiny", task="arith1", warm_start_steps=0, seed=1, **SMALL), path)
    return path


def _train(root, hf_model, *extra):
    """Two steps on the untrained base. The reward (a response with a digit below 5) is 1 for
    some samples of a group and 0 for others, so advantages are not 0 and the weights move."""
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(8)))
    overrides = [
        *FAST,
        "model=hf",
        f"model.path={hf_model}",
        "task=dataset",
        f"task.path={data}",
        "task.reward=regex",
        "+task.reward_kwargs.pattern='[0-4]'",
        "task.require_stop=false",
        "rollout.max_new_tokens=6",
        "train.steps=2",
        "train.checkpoint_every=1",
        "optim.lr=0.02",
    ]
    return train_run(root, [*overrides, *extra])


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, hf_model):
    return _train(tmp_path_factory.mktemp("lora"), hf_model, "model.lora.r=4", "train.keep_version_checkpoints=true")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, hf_model):
    return _train(tmp_path_factory.mktemp("full"), hf_model)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def _trained_lora(hf_model, adapters) -> torch.nn.Module:
    """The trained model as peft runs it, adapters unmerged, on the base read from ``hf_model``:
    an independent path to the logits the export must reproduce."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(hf_model)
    return PeftModel.from_pretrained(base, adapters).eval()


def _export(capsys, source, out, *options) -> str:
    code, stdout, stderr = run_main(["export", source, out, *options], capsys)
    assert code == 0, stderr
    return stdout


def _loaded(out) -> torch.nn.Module:
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    assert not (out / "adapter_config.json").exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]  # no temporary left
    tokenizer = AutoTokenizer.from_pretrained(out)
    # arith ids by hand: BOS 1, digit d = 4 + d, "+" 14, "=" 18, space 23 (the 10th of "+-*/=()., ")
    assert tokenizer.encode("12 + 3 = 15") == [1, 5, 6, 23, 14, 23, 7, 23, 18, 23, 5, 9]
    return AutoModelForCausalLM.from_pretrained(out).eval()


@pytest.mark.parametrize("with_base", [True, False])
def test_a_lora_checkpoint_exports_as_its_merged_model(lora_run, hf_model, tmp_path, capsys, with_base):
    """With versions/base, and without it (the base is then loaded from the run's config, as a
    resume loads it). The logits equal peft's unmerged forward within 1e-5."""
    run = lora_run
    if not with_base:
        run = tmp_path / "run"
        shutil.copytree(lora_run, run)
        shutil.rmtree(run / "versions")
    out = tmp_path / "exported"
    stdout = _export(capsys, run, out)
    assert "checkpoint step-000002" in stdout and "float32" in stdout
    exported = _logits(_loaded(out))
    trained = _logits(_trained_lora(hf_model, lora_run / "checkpoints" / "step-000002" / "policy"))
    assert float((exported - trained).abs().max()) <= 1e-5
    # the adapters moved the model far beyond that tolerance: an export without them would fail
    base = _logits(AutoModelForCausalLM.from_pretrained(hf_model))
    assert float((base - trained).abs().max()) > 1e-2


def test_a_version_of_a_lora_run_and_another_dtype(lora_run, hf_model, tmp_path, capsys):
    out = tmp_path / "v1"
    stdout = _export(capsys, lora_run / "versions" / "v000001", out, "--dtype", "bfloat16")
    assert "version v000001" in stdout and "bfloat16" in stdout
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = _loaded(out)
    assert next(model.parameters()).dtype == torch.bfloat16
    trained = _logits(_trained_lora(hf_model, lora_run / "versions" / "v000001"))
    # bfloat16 weights: about 3 significant digits of each logit (measured max 0.02 here)
    assert float((_logits(model) - trained).abs().max()) <= 0.05


def test_a_full_fine_tuning_run_exports_its_checkpoint_weights(full_run, tmp_path, capsys):
    (checkpoint,) = [p for p in (full_run / "checkpoints").iterdir() if p.name == "step-000002"]
    out = tmp_path / "empty"
    out.mkdir()  # an existing empty directory is taken
    _export(capsys, checkpoint, out)
    expected = _logits(AutoModelForCausalLM.from_pretrained(checkpoint / "policy"))
    assert torch.equal(_logits(_loaded(out)), expected)


@pytest.mark.parametrize("named", ["the run", "its checkpoint"])
def test_a_checkpoint_the_run_prunes_while_it_is_read_still_exports(full_run, tmp_path, capsys, monkeypatch, named):
    """A run that is training keeps only its newest checkpoints: the one an export chose can go
    before it is loaded. On main the export then failed in one misleading line ("cannot load
    model directory ...: FileNotFoundError ...; point model.path at ...") every time on a run
    checkpointing each step; the export holds the checkpoint's files before it loads them."""
    import sdp_cli.models as models

    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    checkpoint = run / "checkpoints" / "step-000002"
    expected = _logits(AutoModelForCausalLM.from_pretrained(checkpoint / "policy"))
    load = models.load_policy

    def pruned_first(*args, **kwargs):  # the run prunes its checkpoints just before the load
        shutil.rmtree(run / "checkpoints")
        return load(*args, **kwargs)

    monkeypatch.setattr(models, "load_policy", pruned_first)
    out = tmp_path / "exported"
    stdout = _export(capsys, run if named == "the run" else checkpoint, out)
    assert "checkpoint step-000002" in stdout
    assert torch.equal(_logits(_loaded(out)), expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "run"]  # nothing held is left


def test_exports_of_a_run_writing_and_pruning_checkpoints_succeed(full_run, tmp_path, capsys):
    """A live run's pace, made extreme: a thread writes a checkpoint after another, keeping one,
    while the run is exported five times; each export is a complete model of some checkpoint."""
    import threading

    from sdp_cli.train.session import checkpoint as ckpt

    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    original = tmp_path / "original"
    shutil.copytree(run / "checkpoints" / "step-000002", original)
    shutil.rmtree(run / "checkpoints")  # the thread's checkpoints only: keep=1 prunes older ones
    expected = _logits(AutoModelForCausalLM.from_pretrained(original / "policy"))
    state = json.loads((original / "state.json").read_text())
    state = {k: v for k, v in state.items() if k not in ("format", "format_version", "step", "optimizer")}
    written = ckpt.write_checkpoint  # the run's own writer: temporary directory, manifest, rename, prune
    stop = threading.Event()

    def train_on():
        step = 3
        while not stop.is_set():
            written(run / "checkpoints", step, keep=1, optimizer_state=None, state=state,
                    save_policy=lambda d: shutil.copytree(original / "policy", d))  # fmt: skip
            step += 1

    writer = threading.Thread(target=train_on, daemon=True)
    written(run / "checkpoints", 2, keep=1, optimizer_state=None, state=state,
            save_policy=lambda d: shutil.copytree(original / "policy", d))  # fmt: skip
    writer.start()
    try:
        for i in range(5):
            out = tmp_path / f"exported{i}"
            assert "checkpoint step-" in _export(capsys, run, out)
            assert torch.equal(_logits(_loaded(out)), expected)
    finally:
        stop.set()
        writer.join()


def test_a_named_checkpoint_the_run_prunes_before_it_is_held_is_one_line(full_run, tmp_path, capsys, monkeypatch):
    import sdp_cli.train.session.saved_policy as saved_policy

    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    checkpoint = run / "checkpoints" / "step-000001"
    find = saved_policy.find_saved_policy

    def found_then_pruned(source):
        saved = find(source)
        shutil.rmtree(checkpoint)
        return saved

    monkeypatch.setattr(saved_policy, "find_saved_policy", found_then_pruned)
    outs = tmp_path / "outs"
    outs.mkdir()
    # nothing held is left, and OUT's missing parents are not made for a failed export
    line = _refused(capsys, ["export", checkpoint, outs / "new" / "dirs" / "out"], outs)
    assert line == (
        f"error: {checkpoint} was removed while it was read (its run is training and keeps only its newest "
        "checkpoints); pass the run directory to take its newest one"
    )


def test_the_export_prints_its_line_and_no_progress_bars_of_transformers(full_run, tmp_path):
    # a process of its own: in this one an earlier run turned transformers' bars off for good
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "sdp_cli", "export", full_run, tmp_path / "out"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("exported checkpoint step-000002 of ") and done.stdout.count("\n") == 1
    assert done.stderr == ""  # on main: "Loading weights: 100%|...|" and "Writing model shards: ..."


def _refused(capsys, argv, root) -> str:
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    code, _, stderr = run_main(argv, capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before, "something was written"
    return lines[0]


def test_refusals_are_one_line_and_write_nothing(lora_run, hf_model, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert "not empty" in _refused(capsys, ["export", lora_run, taken], tmp_path)
    assert (taken / "keep.txt").read_text() == "mine"
    assert "no run, checkpoint or version" in _refused(capsys, ["export", hf_model, tmp_path / "a"], tmp_path)
    assert "not a directory" in _refused(capsys, ["export", tmp_path / "missing", tmp_path / "b"], tmp_path)
    no_checkpoints = tmp_path / "run"
    no_checkpoints.mkdir()
    (no_checkpoints / "overrides.json").write_text("[]")
    assert "no complete checkpoint" in _refused(capsys, ["export", no_checkpoints, tmp_path / "c"], tmp_path)
    assert "--dtype" in _refused(capsys, ["export", lora_run, tmp_path / "d", "--dtype", "int8"], tmp_path)



@pytest.mark.parametrize("where", ["weights", "tokenizer"])
def test_a_full_disk_while_writing_is_one_line_and_writes_nothing(full_run, tmp_path, capsys, monkeypatch, where):
    """The disk fills up after part of the export was written (the weights, or the tokenizer's
    files after them): one line naming the directory and the cause, exit 2, and nothing left
    beside the output (before: a traceback of transformers' save)."""
    import errno

    from sdp_cli.models import loader

    real_save = loader._save_model

    def save_then_fill(model, directory, dtype):
        real_save(model, directory, dtype)
        if where == "weights":
            raise OSError(errno.ENOSPC, "No space left on device", str(directory / "model.safetensors"))

    monkeypatch.setattr(loader, "_save_model", save_then_fill)
    if where == "tokenizer":
        from transformers import PreTrainedTokenizerBase

        def fill(self, *args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", fill)
    out = tmp_path / "out" / "model"
    line = _refused(capsys, ["export", full_run, out], tmp_path)
    assert str(out) in line and "No space left on device" in line and "nothing was written" in line, line

def test_help_shows_an_example(capsys):
    code, stdout, _ = run_main(["export", "--help"], capsys)
    assert code == 0 and "sdp export runs/my-run exported/my-model" in stdout
