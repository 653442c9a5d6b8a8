"""The GPU check (docs/engines.md "Checking on a GPU"): what the CPU tests cannot check, in one
run of a few minutes on a lent GPU with no network. scripts/gpu_check.sh installs the carried
wheels and calls this; run it directly only where sdp and its dependencies already import.

On a GPU, with a Qwen2.5-0.5B-shaped model, randomly initialised (tests/gpu/qwen_shape.py):

  model      build it on the GPU, save it as a Hugging Face directory with a padded tokenizer;
  train      `sdp train` on it: embedded engine, bfloat16, segment-wise, η = 2, 20 steps;
  gpu_tests  `pytest -m gpu tests/gpu`: shared-prefix forward vs plain (fp32, bf16), the
             engine/trainer bf16 mismatch against the engine's own scores, a one-process FSDP2 step;
  engine     tokens/s of the embedded engine (bf16) at two batch sizes;
  fsdp       `torchrun --nproc_per_node 1 -m sdp_cli train ... train.parallel=fsdp`, 3 steps;
  async      the train part's run again at η = 0: what asynchrony buys when the engine and the
             trainer share one GPU (one run each: an indication, not a benchmark).

Each part is a child process with its own time limit, inside a total budget; the GPU's memory is
polled (nvidia-smi) while it runs. OUT/gpu_check.json and the table OUT/gpu_check.md are written
after every part, so a run killed midway keeps what finished. A reward that is 1 when the
completion holds a filler token whose id ends in 77 (about 1 % of tokens) gives the random
model's groups rewards that differ, so advantages and updates are not all zero.

``--dry-run``: the same parts on the CPU at a tiny shape, in about a minute: the check is known to
work before a GPU is lent. The CUDA tests then run on the CPU too (SDP_GPU_TEST_DEVICE=cpu), and
what exists only on a GPU (CUDA memory, nvidia-smi, NCCL) is marked "skipped (no CUDA)".

    python bench/gpu.py --out gpu_check_out [--dry-run] [--parts train,engine] [--budget 450]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# the model is the CUDA tests' own (tests/gpu/qwen_shape.py); the repository root makes it importable
sys.path.insert(0, str(REPO))

from sdp_cli.fileio import atomic_write_text, json_document  # noqa: E402

PARTS = ("model", "train", "gpu_tests", "engine", "fsdp", "async")
NO_CUDA = "skipped (no CUDA)"
#: module → distribution of what the report records (hydra, omegaconf, antlr4: the carried wheels)
DISTRIBUTIONS = {
    "torch": "torch", "transformers": "transformers", "accelerate": "accelerate", "hydra": "hydra-core",
    "omegaconf": "omegaconf", "antlr4": "antlr4-python3-runtime", "sdp_cli": "sdp-cli",
}  # fmt: skip
#: the rollout reward: 1 when the completion holds a filler token <fN> whose N ends in 77
REWARD_PATTERN = "77>"
#: every prompt starts with these 77 characters, then asks "a+b=" (a, b single digits): prompts
#: of 82 tokens (BOS first), long against the responses as GRPO's usually are, so the trainer's
#: shared-prompt forward has positions to save (it runs only where it saves 20 %)
FEW_SHOT = "3+4=7.8+1=9.2+2=4.6+3=9.5+0=5.1+7=8.9+9=18.4+6=10.7+5=12.0+8=8.2+9=11.6+6=12."


@dataclass(frozen=True)
class Plan:
    """The sizes of one run of the check."""

    shape: str  # tests/gpu/qwen_shape.py SHAPES
    device: str
    train_steps: int
    batch_groups: int
    group_size: int
    max_new_tokens: int
    eval_samples: int
    fsdp_steps: int
    engine_batches: tuple[int, ...]
    engine_new_tokens: int
    engine_repeats: int
    #: seconds each part may take at most (the budget may leave it less)
    limits: dict[str, float]


GPU_PLAN = Plan(
    shape="qwen2.5-0.5b", device="cuda", train_steps=20, batch_groups=8, group_size=8, max_new_tokens=64,
    eval_samples=8, fsdp_steps=3, engine_batches=(64, 256), engine_new_tokens=128, engine_repeats=3,
    limits={"model": 120, "train": 240, "gpu_tests": 180, "engine": 120, "fsdp": 150, "async": 180},
)  # fmt: skip
DRY_PLAN = Plan(
    shape="tiny", device="cpu", train_steps=4, batch_groups=4, group_size=4, max_new_tokens=8,
    eval_samples=4, fsdp_steps=2, engine_batches=(8,), engine_new_tokens=8, engine_repeats=1,
    limits={"model": 120, "train": 180, "gpu_tests": 300, "engine": 120, "fsdp": 180, "async": 180},
)  # fmt: skip


# ------------------------------------------------------------------------------------ report
class Report:
    """gpu_check.json and gpu_check.md in ``out``, rewritten after every part."""

    def __init__(self, out: Path, header: dict[str, Any]):
        self.json_path, self.table_path = out / "gpu_check.json", out / "gpu_check.md"
        self.doc: dict[str, Any] = {**header, "parts": {}}
        self.write()

    def set(self, part: str, result: dict[str, Any]) -> None:
        self.doc["parts"][part] = result
        self.write()
        line = result.get("summary") or result.get("reason") or ""
        print(f"[gpu_check] {part}: {result['status']}{' — ' + line if line else ''}", flush=True)

    def write(self) -> None:
        atomic_write_text(self.json_path, json_document(self.doc) + "\n")
        atomic_write_text(self.table_path, table(self.doc))


def table(doc: dict[str, Any]) -> str:
    """The short Markdown table of a report."""
    env = doc.get("environment", {})
    lines = [
        f"# sdp GPU check{' (dry run)' if doc.get('dry_run') else ''}: {env.get('gpu') or 'no GPU'}",
        "",
        f"{doc.get('started', '')}; torch {env.get('torch')}, transformers {env.get('transformers')}, "
        f"python {env.get('python')}; model {doc.get('shape')} on {doc.get('device')}",
        "",
        "| part | status | seconds | result |",
        "|---|---|---|---|",
    ]
    for name, part in doc["parts"].items():
        seconds = part.get("seconds")
        text = part.get("summary") or part.get("reason") or ""
        failed = [k for k, ok in part.get("checks", {}).items() if not ok]
        if failed:
            text += f" — failed checks: {', '.join(failed)}"
        text = text.replace("|", "\\|")  # a bar would end the cell
        lines.append(f"| {name} | {part['status']} | {'' if seconds is None else f'{seconds:.0f}'} | {text} |")
    return "\n".join(lines) + "\n"


def status_of(checks: dict[str, bool]) -> str:
    return "ok" if checks and all(checks.values()) else "failed"


# --------------------------------------------------------------------------- processes, GPU
class GpuMemoryPoll:
    """The largest ``memory.used`` nvidia-smi reports while the block runs (MiB, every 0.5 s):
    the device's whole use, CUDA contexts and allocator caches included."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.peak_mib: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=10,
                ).stdout  # fmt: skip
                used = max(float(v) for v in out.split())
                self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            self._stop.wait(0.5)

    def __enter__(self) -> "GpuMemoryPoll":
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()

    def result(self) -> float | str:
        return round(self.peak_mib / 1024, 2) if self.peak_mib is not None else NO_CUDA


def run_process(cmd: list[str], timeout: float, env: dict[str, str]) -> int | None:
    """Run ``cmd`` from the repository root with its output on ours; its exit status, or None
    when it outran ``timeout`` (then its whole process group is stopped: torchrun's workers too)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
                break
        return None


def child_env(plan: Plan) -> dict[str, str]:
    """The children's environment: sdp from this checkout, nothing fetched from the hub, the
    check's shape, and on a dry run no CUDA device at all."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["SDP_GPU_CHECK_SHAPE"] = plan.shape
    if plan.device == "cpu":
        env["SDP_GPU_TEST_DEVICE"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_child(
    name: str, args: argparse.Namespace, plan: Plan, timeout: float, extra: list[str] | None = None
) -> tuple[dict, float, float | str]:
    """``bench/gpu.py --child NAME`` in its own process: its result, seconds and peak GPU memory."""
    result_path = args.work / f"{name}.result.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--work", str(args.work),
           "--result", str(result_path), *(["--dry-run"] if args.dry_run else []), "--", *(extra or [])]  # fmt: skip
    started = time.monotonic()
    with GpuMemoryPoll(plan.device == "cuda") as poll:
        code = run_process(cmd, timeout, child_env(plan))
    seconds = time.monotonic() - started
    if code is None:
        return {"status": "timeout", "reason": f"stopped after {timeout:.0f} s"}, seconds, poll.result()
    if not result_path.exists():
        return {"status": "failed", "reason": f"exited with {code} before writing its result"}, seconds, poll.result()
    return json.loads(result_path.read_text()), seconds, poll.result()


# ---------------------------------------------------------------------------- the parts
def environment(args: argparse.Namespace) -> dict[str, Any]:
    """Versions, where the packages import from, the GPU (nvidia-smi, and torch asking NVML: no
    CUDA context in this process), and whether ``python -m sdp_cli`` runs from the checkout."""
    import importlib
    from importlib import metadata

    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    origins = {}
    for module, dist in DISTRIBUTIONS.items():
        try:
            imported = importlib.import_module(module)
        except ImportError as err:
            origins[module] = f"missing ({err})"
            continue
        origins[module] = str(Path(imported.__file__).parent)
        try:
            env[module] = metadata.version(dist)
        except metadata.PackageNotFoundError:  # sdp from the checkout, not installed
            env[module] = getattr(imported, "__version__", None)
    env["imported_from"] = origins
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        import torch

        env["cuda_available"] = torch.cuda.is_available()
        env["torch_cuda"] = torch.version.cuda
    except ImportError:
        env["cuda_available"] = False
    env["gpu"] = None
    if shutil.which("nvidia-smi"):
        query = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        env["gpu"] = query.stdout.strip() or None
    version = subprocess.run([sys.executable, "-m", "sdp_cli", "--version"], cwd=REPO, capture_output=True, text=True, timeout=120)
    env["sdp_cli_version"] = version.stdout.strip() if version.returncode == 0 else f"failed: {version.stderr.strip()[-300:]}"
    return env


def installed(args: argparse.Namespace) -> dict[str, Any]:
    """The carried wheels scripts/gpu_check.sh installed, and whether each one's distribution is
    the one this Python finds (from the site directory it went to, not from elsewhere)."""
    from importlib import metadata

    if not args.wheels:
        return {"status": "skipped", "reason": "no wheels carried; the installed packages are used"}
    site = args.site.resolve()
    found = {}
    for wheel in sorted(args.wheels.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]  # wheel file names: name-version-tags.whl
        try:
            dist = metadata.distribution(name)
            location = Path(str(dist.locate_file(""))).resolve()
            found[name] = {"wheel": version, "found": dist.version, "from_site": location == site}
        except metadata.PackageNotFoundError:
            found[name] = {"wheel": version, "found": None, "from_site": False}
    checks = {f"{name}_from_site": info["from_site"] and info["found"] == info["wheel"] for name, info in found.items()}
    return {
        "status": status_of(checks), "site": str(site), "wheels": found, "checks": checks,
        "summary": f"{len(found)} wheel(s) into {site}: " + ", ".join(f"{n} {i['wheel']}" for n, i in found.items()),
    }  # fmt: skip


#: small enough that the random model keeps a spread distribution for the run's 20 steps: at 5e-5
#: its entropy fell from 3.4 nats to exactly 0 by the third step (the H200 runs of 2026-11-27), and
#: the weights and the mismatch of a policy that puts probability 1 on one token say nothing
LEARNING_RATE = 1e-6


#: the train part's run directory under --work (the async part reads its summary)
TRAIN_RUN = "run-segment_wise"


def train_overrides(args: argparse.Namespace, plan: Plan, run_dir: Path, steps: int, eta: int = 2) -> list[str]:
    """The `sdp train` overrides of the check's runs (docs/training.md keys)."""
    work = args.work
    return [
        "model=hf", f"model.path={work / 'model'}",
        "task=dataset", f"task.path={work / 'data.jsonl'}", "task.eval_fraction=0.125",
        "task.reward=regex", f"+task.reward_kwargs.pattern='{REWARD_PATTERN}'", "task.require_stop=false",
        "+preset=segment_wise", f"rollout.max_head_offpolicyness={eta}",
        f"rollout.batch_groups={plan.batch_groups}", f"rollout.group_size={plan.group_size}",
        f"rollout.max_new_tokens={plan.max_new_tokens}",
        "train.dtype=bfloat16", f"train.steps={steps}", f"train.eval_samples={plan.eval_samples}",
        "train.checkpoint_every=0", "train.save_optimizer=false", "train.keep_checkpoints=1",
        f"optim.lr={LEARNING_RATE}", "seed=0", f"run.dir={run_dir}", "run.progress=false", "run.trackers=[]",
    ]  # fmt: skip


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
    return [r for r in rows if "loss/pg_loss" in r]  # training steps, not evaluations


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def second_half_step_s(rows: list[dict[str, Any]]) -> float | None:
    """The median time from one training step's row to the next over the run's second half.

    A run's steps per second (summary.json) counts its first steps too: CUDA's first kernels,
    the first batch's generation and, at η > 0, the steps that use the batches generated ahead
    meanwhile. On the H200 of 2026-12-04 the first step took 6 s of a 20-step run's 42 s.
    """
    times = [float(r["time"]) for r in rows if r.get("time") is not None]
    gaps = [times[i] - times[i - 1] for i in range(max(len(times) // 2, 1), len(times))]
    return statistics.median(gaps) if gaps else None


def train_metrics(run_dir: Path, steps: int, eta: int) -> tuple[dict[str, Any], dict[str, bool]]:
    """What a run's metrics.jsonl and summary.json say, and the checks on them."""
    rows = _rows(run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}

    def col(key: str) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key) is not None]

    lag0 = [r for r in rows if r.get("mismatch/lag0_tokens", 0) > 0]
    entropy = col("loss/entropy")
    found: dict[str, Any] = {
        "steps": summary.get("steps"),
        "tokens_per_second": summary.get("tokens_per_second"),
        "steps_per_second": summary.get("steps_per_second"),
        "wall_seconds": summary.get("wall_seconds"),
        "recompute_share": summary.get("recompute_share"),
        "recompute_blocking_share": summary.get("recompute_blocking_share"),
        # The first step's lag-0 mismatch is the informative one: there the random model's
        # distributions are spread. Later the policy may collapse onto the rewarded token, and
        # a log-prob of exactly 0 on both sides adds zeros to the mean (the H200 run of 2026-11-27).
        "mismatch_lag0_first_step": lag0[0]["step"] if lag0 else None,
        "mismatch_lag0_first_abs_mean": lag0[0]["mismatch/lag0_abs_mean"] if lag0 else None,
        "entropy_first": entropy[0] if entropy else None,
        "entropy_last": entropy[-1] if entropy else None,
        "mismatch_lag0_tokens": sum(col("mismatch/lag0_tokens")),
        "mismatch_lag0_abs_mean": _mean([r["mismatch/lag0_abs_mean"] for r in lag0]),
        "mismatch_lag0_abs_max": max((r["mismatch/lag0_abs_max"] for r in lag0), default=None),
        "mismatch_lag0_k3_kl": _mean([r["mismatch/lag0_k3_kl"] for r in lag0]),
        "positions_saved_min": min(col("batch/positions_saved"), default=None),
        "recompute_tokens": {k: sum(col(f"recompute/{k}")) for k in ("tokens", "tokens_ahead", "tokens_at_take", "tokens_at_push", "tokens_prefill")},
        "lag_mean": _mean(col("staleness/lag_mean")),
        "lag_max": max(col("staleness/lag_max"), default=None),
        "train_s_mean": _mean(col("time/train_s")),
        "push_s_mean": _mean(col("time/push_s")),
        "push_async_s_mean": _mean(col("time/push_async_s")),
        "wait_s_mean": _mean(col("time/wait_s")),
        "step_s_second_half_median": second_half_step_s(rows),
        # the behavioural weights' spread per lag: decoupled's carries the engine/trainer
        # mismatch, segment-wise's only the policy change (docs/engines.md "Engine dtype")
        "weight_std_by_lag": {
            mode: {f"lag{k}": _mean(col(f"shadow/{mode}/lag{k}/behav_imp_weight/std")) for k in range(eta + 1)}
            for mode in ("decoupled", "segment_wise")
        },
    }
    numbers = [v for r in rows for k, v in r.items() if isinstance(v, float) and k.startswith(("loss/", "weights/", "mismatch/"))]
    segment_lag0 = col("shadow/segment_wise/lag0/behav_imp_weight/std")
    checks = {
        "all_steps_ran": found["steps"] == steps and len(rows) == steps,
        "losses_and_weights_finite": bool(numbers) and all(math.isfinite(v) for v in numbers),
        "prompts_shared_every_step": bool(rows) and all(r.get("batch/positions_saved", 0) > 0 for r in rows),
        # by a recompute pass or a resumed sample's re-prefill, whichever timing chose
        "proximal_t_filled_for_stale_tokens": found["recompute_tokens"]["tokens"] + found["recompute_tokens"]["tokens_prefill"] > 0,
        "lag0_mismatch_measured": found["mismatch_lag0_tokens"] > 0,
        "segment_wise_lag0_weight_is_1": all(v == 0 for v in segment_lag0),
        "staleness_within_eta": found["lag_max"] is not None and found["lag_max"] <= eta,
    }
    return found, checks


def _fmt_s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.3g} s"


def part_model(args: argparse.Namespace, plan: Plan, timeout: float) -> dict[str, Any]:
    result, seconds, peak = run_child("model", args, plan, timeout)
    result.update(seconds=seconds, gpu_peak_gib=peak)
    if result["status"] == "ok":
        result["summary"] = (
            f"{plan.shape}: {result['parameters'] / 1e6:.1f} M parameters, vocabulary {result['vocab_size']}, "
            f"next-token entropy {result['next_token_entropy']:.2f} nats (max p {result['max_p']:.2f})"
        )
    return result


def part_train(args: argparse.Namespace, plan: Plan, timeout: float) -> dict[str, Any]:
    run_dir = args.work / TRAIN_RUN
    overrides = train_overrides(args, plan, run_dir, plan.train_steps)
    result, seconds, peak = run_child("train", args, plan, timeout, overrides)
    found, checks = train_metrics(run_dir, plan.train_steps, eta=2)
    checks = {"exit_code_0": result.get("exit_code") == 0, **checks}
    if (run_dir / "metrics.jsonl").exists():
        shutil.copyfile(run_dir / "metrics.jsonl", args.out / "train_metrics.jsonl")
    out = {
        **result, **found, "checks": checks, "seconds": seconds, "gpu_peak_gib": peak,
        "command": "python -m sdp_cli train " + " ".join(overrides),
    }  # fmt: skip
    if out["status"] not in ("timeout",):
        out["status"] = status_of(checks)
    tps, mismatch = found["tokens_per_second"], found["mismatch_lag0_abs_mean"]
    first, entropy = found["mismatch_lag0_first_abs_mean"], (found["entropy_first"], found["entropy_last"])
    memory = result.get("cuda_max_allocated_gib")
    out["summary"] = (
        f"{found['steps']} steps, {'n/a' if tps is None else f'{tps:.0f}'} generated tok/s, "
        + (
            "lag-0 engine/trainer mismatch: n/a, "
            if first is None
            else f"lag-0 engine/trainer mismatch at step {found['mismatch_lag0_first_step']}: mean abs {first:.2e} nats "
            f"(mean of all steps {mismatch:.2e}), "
        )
        + ("" if None in entropy else f"entropy {entropy[0]:.2f} → {entropy[1]:.2f} nats, ")
        + f"trainer's step {_fmt_s(found['train_s_mean'])}, its part of the push {_fmt_s(found['push_s_mean'])}, "
        f"waiting {_fmt_s(found['wait_s_mean'])}, "
        f"positions saved ≥ {found['positions_saved_min'] or 0:.0%}, π_prox_t of {found['recompute_tokens']['tokens']:.0f} "
        f"tokens recomputed and {found['recompute_tokens']['tokens_prefill']:.0f} re-prefilled, "
        + (f"CUDA peak {memory} GiB" if memory is not None else f"CUDA peak {NO_CUDA}")
    )
    return out


def part_gpu_tests(args: argparse.Namespace, plan: Plan, timeout: float) -> dict[str, Any]:
    xml_path = args.out / "gpu_tests.xml"
    xml_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider",
           "-o", "junit_family=legacy", f"--junitxml={xml_path}"]  # fmt: skip
    started = time.monotonic()
    with GpuMemoryPoll(plan.device == "cuda") as poll:
        code = run_process(cmd, timeout, child_env(plan))
    out: dict[str, Any] = {"seconds": time.monotonic() - started, "gpu_peak_gib": poll.result(), "device": plan.device}
    if code is None:
        return {**out, "status": "timeout", "reason": f"stopped after {timeout:.0f} s"}
    if not xml_path.exists():
        return {**out, "status": "failed", "reason": f"pytest exited with {code} and wrote no report"}
    tests = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        detail = next((c.get("message", "") for c in case if c.tag in ("failure", "error", "skipped")), "")
        props = {p.get("name"): _number(p.get("value")) for p in case.iter("property")}
        tests[case.get("name")] = {"outcome": outcome, "seconds": float(case.get("time", 0)), **props, **({"message": detail[:500]} if detail else {})}
    counts = {k: sum(t["outcome"] == k for t in tests.values()) for k in ("passed", "failure", "error", "skipped")}
    out.update(exit_code=code, counts=counts, tests=tests)
    if tests and counts["skipped"] == len(tests):
        out.update(status="skipped", reason=NO_CUDA)
    else:
        out["status"] = "ok" if code == 0 and counts["passed"] and not counts["failure"] + counts["error"] else "failed"
        out["summary"] = f"{counts['passed']} passed, {counts['failure'] + counts['error']} failed, {counts['skipped']} skipped on {plan.device}" + "".join(
            f"; {text}" for text in _test_highlights(tests)
        )
    return out


def _test_highlights(tests: dict[str, dict[str, Any]]) -> list[str]:
    """The numbers of the CUDA tests worth a look in the table (JUnit properties)."""
    found = []
    mismatch = tests.get("test_engine_agrees_with_itself_more_closely_than_with_the_trainer", {})
    if "engine_self_abs_mean" in mismatch:
        found.append(
            f"bf16 mismatch mean abs: trainer {mismatch['trainer_bf16_abs_mean']:.2e}, fp32 trainer "
            f"{mismatch['trainer_fp32_abs_mean']:.2e}, engine's own scores {mismatch['engine_self_abs_mean']:.2e} nats"
        )
    shared = tests.get("test_shared_forward_in_bfloat16_is_as_accurate_as_the_plain_one", {})
    if "shared_bf16_vs_fp32_abs_mean" in shared:
        found.append(
            f"bf16 error vs fp32: shared prefix {shared['shared_bf16_vs_fp32_abs_mean']:.2e}, "
            f"plain {shared['plain_bf16_vs_fp32_abs_mean']:.2e} nats"
        )
    fsdp = tests.get("test_a_sharded_step_on_one_gpu_equals_the_plain_step", {})
    if "weights_differing_fraction" in fsdp:
        found.append(f"FSDP step: {fsdp['weights_differing_fraction']:.1e} of weights differ from the plain step")
    return found


def _number(text: str | None) -> Any:
    try:
        return float(text)
    except (TypeError, ValueError):
        return text


def part_engine(args: argparse.Namespace, plan: Plan, timeout: float) -> dict[str, Any]:
    result, seconds, peak = run_child("engine", args, plan, timeout)
    result.update(seconds=seconds, gpu_peak_gib=peak)
    if result["status"] == "ok":
        result["summary"] = "; ".join(
            f"batch {r['batch']} × {r['new_tokens']} tokens: {r['tokens_per_second']:.0f} tok/s" for r in result["rows"]
        ) + f" ({result['dtype']}, {plan.device}{', CPU: not a benchmark' if plan.device == 'cpu' else ''})"
    return result


def part_fsdp(args: argparse.Namespace, plan: Plan, timeout: float) -> dict[str, Any]:
    run_dir = args.work / "run-fsdp"
    overrides = [*train_overrides(args, plan, run_dir, plan.fsdp_steps), "train.parallel=fsdp", "train.eval_samples=0"]
    # torchrun's logs in the work directory (by default a torchelastic_* directory left in /tmp)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--log-dir", str(args.work / "torchrun"),
           "-m", "sdp_cli", "train", *overrides]  # fmt: skip
    started = time.monotonic()
    with GpuMemoryPoll(plan.device == "cuda") as poll:
        code = run_process(cmd, timeout, child_env(plan))
    out: dict[str, Any] = {"seconds": time.monotonic() - started, "gpu_peak_gib": poll.result(), "exit_code": code,
                           "command": "torchrun --nproc_per_node 1 -m sdp_cli train " + " ".join(overrides)}  # fmt: skip
    if code is None:
        return {**out, "status": "timeout", "reason": f"stopped after {timeout:.0f} s"}
    found, checks = train_metrics(run_dir, plan.fsdp_steps, eta=2)
    checks = {"exit_code_0": code == 0, "all_steps_ran": checks["all_steps_ran"],
              "losses_and_weights_finite": checks["losses_and_weights_finite"]}  # fmt: skip
    backend = "NCCL" if plan.device == "cuda" else "gloo"
    return {
        **out, "steps": found["steps"], "checks": checks, "status": status_of(checks),
        "summary": f"{found['steps']} steps under torchrun, one process ({backend}; sdp trains it unsharded, "
        "its note says so; the sharding itself is gpu_tests' FSDP test)",
    }  # fmt: skip


def part_async(args: argparse.Namespace, plan: Plan, timeout: float) -> dict[str, Any]:
    """The train part's run at η = 0, against the train part's η = 2 (steps per second of the
    training loop, summary.json; the same config otherwise)."""
    run_dir = args.work / "run-eta0"
    overrides = train_overrides(args, plan, run_dir, plan.train_steps, eta=0)
    result, seconds, peak = run_child("train", args, plan, timeout, overrides)
    found, checks = train_metrics(run_dir, plan.train_steps, eta=0)
    checks = {"exit_code_0": result.get("exit_code") == 0, **{k: checks[k] for k in ASYNC_CHECKS}}
    out: dict[str, Any] = {
        **result, "seconds": seconds, "gpu_peak_gib": peak, "checks": checks,
        "command": "python -m sdp_cli train " + " ".join(overrides),
        "eta0": {k: found[k] for k in (
            "steps", "steps_per_second", "wall_seconds", "train_s_mean", "push_s_mean", "wait_s_mean",
            "step_s_second_half_median",
        )},
    }  # fmt: skip
    if out["status"] != "timeout":
        out["status"] = status_of(checks)
    eta2_path = args.work / TRAIN_RUN / "summary.json"
    eta2 = json.loads(eta2_path.read_text()).get("steps_per_second") if eta2_path.exists() else None
    eta0 = found["steps_per_second"]
    out["eta2_steps_per_second"] = eta2
    out["speedup"] = eta2 / eta0 if eta2 and eta0 else None
    step0, step2 = found["step_s_second_half_median"], second_half_step_s(_rows(args.work / TRAIN_RUN))
    out["eta2_step_s_second_half_median"] = step2
    out["second_half_speedup"] = step0 / step2 if step0 and step2 else None
    out["summary"] = (
        f"η = 0: {'n/a' if eta0 is None else f'{eta0:.3f}'} steps/s (per step: training "
        f"{_fmt_s(found['train_s_mean'])}, push {_fmt_s(found['push_s_mean'])}, waiting for generation "
        f"{_fmt_s(found['wait_s_mean'])}); η = 2 (train part): {'n/a' if eta2 is None else f'{eta2:.3f}'} steps/s"
        + ("" if out["speedup"] is None else f": {out['speedup']:.2f}× (one run each)")
        + (
            ""
            if out["second_half_speedup"] is None
            else f"; the second half's median step: η = 0 {_fmt_s(step0)}, η = 2 {_fmt_s(step2)}: "
            f"{out['second_half_speedup']:.2f}×"
        )
    )
    return out


#: the train part's checks that hold at η = 0 too (no stale token there, so no π_prox_t to fill)
ASYNC_CHECKS = ("all_steps_ran", "losses_and_weights_finite", "staleness_within_eta")


# --------------------------------------------------------------------------- child processes
def child_model(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    import torch

    from tests.gpu.qwen_shape import build_model, padded_tokenizer

    started = time.monotonic()
    model = build_model(plan.shape, seed=0, device=plan.device)
    built = time.monotonic() - started
    ids = torch.randint(3, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1)).to(plan.device)
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits.float().log_softmax(-1)
    model.save_pretrained(args.work / "model")
    padded_tokenizer(model.config.vocab_size).save_pretrained(args.work / "model")
    records = [{"prompt": f"{FEW_SHOT}{a}+{b}=", "answer": str(a + b)} for a in range(8) for b in range(8)]
    (args.work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return {
        "status": "ok",
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": model.config.vocab_size,
        "layers": model.config.num_hidden_layers,
        "hidden_size": model.config.hidden_size,
        "build_seconds": built,
        "save_seconds": time.monotonic() - started - built,
        "next_token_entropy": float(-(logprobs.exp() * logprobs).sum(-1).mean()),
        "max_p": float(logprobs.exp().max(-1).values.mean()),
    }


def child_train(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """`sdp train` in this process (the CLI's own entry point), then the CUDA allocator's peak."""
    import torch

    from sdp_cli.cli.main import main

    try:
        main(["train", *args.extra])
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    out: dict[str, Any] = {"status": "ok" if code == 0 else "failed", "exit_code": code}
    if torch.cuda.is_available():
        out["cuda_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["cuda_max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    return out


def child_engine(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """Tokens/s of the local engine in bf16: GRPO-shaped calls (8 prompts of 32 tokens, the rest
    of the batch their repeats), no end-of-sequence id so every sample runs to the budget; the
    median of ``engine_repeats`` calls after one warm-up."""
    import torch

    from sdp_cli.engine.base import SamplingParams
    from sdp_cli.engine.local import LocalEngine
    from sdp_cli.models.loader import load_policy
    from sdp_cli.rollout.records import RolloutSample

    policy = load_policy("hf", path=args.work / "model")
    engine = LocalEngine(
        policy.model, temperature=1.0, eos_token_id=(), pad_token_id=policy.pad_token_id, seed=0,
        device=plan.device, dtype=torch.bfloat16, max_batch_size=max(plan.engine_batches),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    prompts = [[1, *torch.randint(3, policy.model.config.vocab_size, (31,), generator=gen).tolist()] for _ in range(8)]
    cuda = torch.device(plan.device).type == "cuda"
    rows = []
    for batch in plan.engine_batches:
        times = []
        for i in range(plan.engine_repeats + 1):
            samples = [RolloutSample(prompt_ids=list(prompts[k % 8])) for k in range(batch)]
            started = time.perf_counter()
            engine.generate(samples, SamplingParams(max_new_tokens=plan.engine_new_tokens))
            if cuda:
                torch.cuda.synchronize()
            assert all(s.output_len == plan.engine_new_tokens for s in samples), "a sample stopped early"
            if i:
                times.append(time.perf_counter() - started)
        seconds = statistics.median(times)
        rows.append({"batch": batch, "new_tokens": plan.engine_new_tokens, "seconds_median": seconds,
                     "tokens_per_second": batch * plan.engine_new_tokens / seconds})  # fmt: skip
    out: dict[str, Any] = {"status": "ok", "dtype": "bfloat16", "rows": rows}
    if cuda:
        out["cuda_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


CHILDREN = {"model": child_model, "train": child_train, "engine": child_engine}


# ----------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="where gpu_check.json, gpu_check.md and the logs go")
    parser.add_argument("--work", type=Path, help="scratch directory (model, runs); default: a new one under $TMPDIR")
    parser.add_argument("--dry-run", action="store_true", help="the tiny shape on the CPU, CUDA-only parts skipped")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)} (model always runs)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all parts (default 450; dry run 600)")
    parser.add_argument("--wheels", type=Path, default=None, help="the wheels scripts/gpu_check.sh installed (recorded)")
    parser.add_argument("--site", type=Path, default=None, help="where it installed them (recorded)")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    if args.child:
        result = CHILDREN[args.child](args, plan)
        args.result.write_text(json.dumps(result, indent=2) + "\n")
        return
    parts = {"model", *(p for p in args.parts.split(",") if p)}  # every other part needs the model
    unknown = sorted(parts - set(PARTS))
    if unknown or args.out is None:
        parser.error(f"unknown part(s) {', '.join(unknown)}" if unknown else "--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    args.out = args.out.resolve()
    # never under --out: what is there comes back from a lent machine, and the model is GiBs
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="sdp_gpu_check."))).resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    env = environment(args)
    if not args.dry_run and not env.get("cuda_available"):
        sys.exit("gpu_check: torch sees no CUDA device; run with --dry-run on a machine without one")
    report = Report(args.out, {
        "check": "sdp gpu check", "dry_run": args.dry_run, "shape": plan.shape, "device": plan.device,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "environment": env,
    })  # fmt: skip
    report.set("install", installed(args))
    if plan.device == "cpu":
        report.set("gpu_memory", {"status": "skipped", "reason": NO_CUDA})
    budget = args.budget or (600.0 if args.dry_run else 450.0)
    deadline = time.monotonic() + budget
    run = {
        "model": part_model, "train": part_train, "gpu_tests": part_gpu_tests, "engine": part_engine,
        "fsdp": part_fsdp, "async": part_async,
    }  # fmt: skip
    for name in (p for p in PARTS if p in parts):
        left = deadline - time.monotonic()
        if left < 20:
            report.set(name, {"status": "skipped", "reason": f"time budget ({budget:.0f} s) spent"})
            continue
        if name != "model" and not (args.work / "model" / "config.json").exists():
            report.set(name, {"status": "skipped", "reason": "no model: the model part failed"})
            continue
        report.set(name, run[name](args, plan, min(plan.limits[name], left)))
    failed = [n for n, p in report.doc["parts"].items() if p["status"] in ("failed", "timeout")]
    print(report.table_path.read_text())
    print(f"wrote {report.json_path} and {report.table_path}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
