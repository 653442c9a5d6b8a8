"""Benchmark of the trainer's forward + backward with each distinct prompt run once
(``train.share_prefixes``, sdp_cli/train/step/shared_prefix.py) against the plain forward, on
GRPO-shaped batches: ``--groups`` prompts × ``--group-size`` samples.

The tiny model by default (arith1's shape: 5-token prompts, responses of up to 4 tokens); with
``--model DIR`` an HF model directory (e.g. SmolLM2-135M converted by scripts/gguf_to_hf.py)
with ``--prompt-len`` and ``--response-len`` tokens. Prints a table and writes
bench/results/shared_prefix.json.

    python bench/shared_prefix.py
    python bench/shared_prefix.py --model /tmp/smollm2-135m --groups 1 --group-size 4 \\
        --prompt-len 100 --response-len 48 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from _results import write_results

from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.train.step.batch import assemble_batch
from sdp_cli.train.step.response_logprobs import ResponseLogprobs


def grpo_batch(groups: int, group_size: int, prompt_len: int, response_len: int, vocab: int, seed: int):
    """``groups`` random prompts of ``prompt_len`` tokens, each with ``group_size`` responses of
    1..``response_len`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for gid in range(groups):
        prompt = [1, *torch.randint(3, vocab, (prompt_len - 1,), generator=gen).tolist()]
        samples = []
        for _ in range(group_size):
            length = int(torch.randint(1, response_len + 1, (1,), generator=gen))
            sample = RolloutSample(prompt_ids=list(prompt), group_id=gid)
            sample.append_tokens(torch.randint(3, vocab, (length,), generator=gen).tolist(), [0.0] * length, 0)
            sample.finish("length")
            sample.reward = 0.0
            samples.append(sample)
        out.append(RolloutGroup(gid, samples))
    return assemble_batch(out, pad_token_id=0, trainer_version=0)


def time_forward_backward(model: torch.nn.Module, batch, share: bool, repeats: int) -> tuple[float, float]:
    """Median seconds of one forward + backward, and the fraction of positions saved."""
    logprobs = ResponseLogprobs(
        temperature=1.0, device=torch.device("cpu"), autocast_dtype=None, unwrap=lambda m: m, share_prefixes=share
    )
    times = []
    for i in range(repeats + 1):  # the first run warms up (and runs sharing's one-time check)
        start = time.perf_counter()
        values, _ = logprobs.forward(model, batch, grad=True, with_entropy=False)
        values.sum().backward()
        model.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times), logprobs.positions_saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="an HF model directory (default: the tiny model)")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=5)
    parser.add_argument("--response-len", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "shared_prefix.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from sdp_cli.models.tiny import build_tiny_model

        model, name, vocab = build_tiny_model(20), "tiny (h128-L4)", 20
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
        name, vocab = args.model.name, int(model.config.vocab_size)
    model.train()
    batch = grpo_batch(args.groups, args.group_size, args.prompt_len, args.response_len, vocab, seed=0)
    plain, _ = time_forward_backward(model, batch, False, args.repeats)
    shared, saved = time_forward_backward(model, batch, True, args.repeats)
    print(f"{'model':<18}{'rows':>6}{'prompt':>8}{'response ≤':>12}{'threads':>9}{'plain s':>10}{'shared s':>10}{'speed-up':>10}{'positions saved':>17}")
    print(
        f"{name:<18}{batch.num_sequences:>6}{args.prompt_len:>8}{args.response_len:>12}{torch.get_num_threads():>9}"
        f"{plain:>10.4f}{shared:>10.4f}{plain / shared:>9.2f}×{100 * saved:>16.1f}%"
    )
    write_results(
        args.out,
        "shared_prefix",
        model=name,
        rows=batch.num_sequences,
        groups=args.groups,
        group_size=args.group_size,
        prompt_len=args.prompt_len,
        response_len_max=args.response_len,
        threads=torch.get_num_threads(),
        repeats=args.repeats,
        plain_seconds_median=plain,
        shared_seconds_median=shared,
        speedup=plain / shared,
        positions_saved=saved,
    )


if __name__ == "__main__":
    main()
