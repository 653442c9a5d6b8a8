"""The warm start never touches held-out problems (issue 24 item 2: it selected on the held-out
set, whose accuracy the run then reported as "held-out"). Every prompt that reaches the model
during a warm start (the SFT batches and every greedy decode, the early-stopping checks and the
recorded accuracy included) is captured and compared with the task's whole held-out split."""

import json

import pytest

import sdp_cli.models.evaluate as evaluate
import sdp_cli.models.warm_start as ws
from sdp_cli.models.tiny import tiny_arch
from sdp_cli.models.tokenizer import build_tokenizer
from sdp_cli.tasks import build_task

SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
#: more than any of these tasks holds out, so eval_items returns the whole held-out split
ALL = 10**6


def _dataset(tmp_path, split):
    records = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)]
    train = tmp_path / "train.jsonl"
    if split == "eval_fraction":
        train.write_text("".join(json.dumps(r) + "\n" for r in records))
        return build_task("dataset", path=str(train), reward="final_number", eval_fraction=0.25, max_new_tokens=3)
    held = tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records[:30]))
    held.write_text("".join(json.dumps(r) + "\n" for r in records[30:]))
    return build_task("dataset", path=str(train), reward="final_number", eval_path=str(held), max_new_tokens=3)


TASKS = {
    "arith1": lambda tmp_path: build_task("arith1"),
    "arith2": lambda tmp_path: build_task("arith2"),
    # 3 digits: 1000 sequences, so eval_items(ALL) lists the whole held-out side
    "runsum": lambda tmp_path: build_task("runsum", digits=3),
    "gsm8k eval_fraction": lambda tmp_path: build_task("gsm8k", eval_fraction=0.2, max_new_tokens=4),
    "dataset eval_fraction": lambda tmp_path: _dataset(tmp_path, "eval_fraction"),
    "dataset eval_path": lambda tmp_path: _dataset(tmp_path, "eval_path"),
}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_no_held_out_problem_reaches_the_warm_start(name, tmp_path, monkeypatch):
    task = TASKS[name](tmp_path)
    charset = task.charset
    tokenizer = build_tokenizer(charset)
    held_out = {item.prompt for item in task.eval_items(ALL, 0)}
    assert held_out, "the task holds nothing out: the test would prove nothing"

    trained, decoded = [], []
    real_batch, real_decode = ws.sft_batch, evaluate.greedy_decode

    def recording_batch(tok, task_, items):
        trained.extend(item.prompt for item in items)
        return real_batch(tok, task_, items)

    def recording_decode(model, prompts, **kwargs):
        decoded.extend(tokenizer.decode(ids, skip_special_tokens=True) for ids in prompts)
        return real_decode(model, prompts, **kwargs)

    monkeypatch.setattr(ws, "sft_batch", recording_batch)
    monkeypatch.setattr(evaluate, "greedy_decode", recording_decode)
    # target 1.0 is never reached: the accuracy check runs after step 5 (check_interval(10)),
    # then the recorded accuracy is measured after step 10
    _, info = ws.warm_start(
        task, arch=tiny_arch(**SMALL), charset=charset, steps=10, lr=1e-3, batch_size=8, seed=0,
        target=1.0, cache_dir=tmp_path / "cache", eval_n=64,
    )  # fmt: skip
    assert trained and decoded, "nothing was trained or measured"
    assert not set(trained) & held_out, f"SFT trained on held-out problems: {sorted(set(trained) & held_out)[:3]}"
    assert not set(decoded) & held_out, f"the warm start measured held-out problems: {sorted(set(decoded) & held_out)[:3]}"
    # both measurements (the check and the final one) ran on the recorded validation problems
    assert len(decoded) == 2 * info["validation_n"] and info["validation_accuracy"] is not None
