"""`sdp recompute` through the command line, on the batches of a real `sdp train` run:
reports, dry runs, outputs, and one-line errors (exit 2) that leave every file untouched."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time

import pytest
import torch

from sdp_cli.analysis.noise import Verdict
from sdp_cli.cli import recompute as recompute_cli
from sdp_cli.rollout.batch_file import read_batch, write_batch

from ..fast_run import FAST, train_run
from .run_main import run_main

# The fast settings of tests/fast_run.py (FAST) with batches and version checkpoints
# kept; temperature 1 (the default) so that the server path gets past its temperature check.
OVERRIDES = [
    *FAST,
    "train.checkpoint_every=0",
    "train.steps=4",
    "train.save_batches=true",
    "train.keep_version_checkpoints=true",
    "+preset=segment_wise",
    "rollout.max_head_offpolicyness=3",
    "optim.weight_decay=1.0",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("cli-recompute"), OVERRIDES)


@pytest.fixture
def batches(run_dir, tmp_path):
    """A private copy of the run's batches and their bytes."""
    target = tmp_path / "batches"
    shutil.copytree(run_dir / "batches", target)
    files = sorted(target.iterdir())
    return files, {p: p.read_bytes() for p in files}


def assert_one_line_error(code, err, *fragments):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def unchanged(files, before) -> bool:
    return all(p.read_bytes() == before[p] for p in files) and sorted(files[0].parent.iterdir()) == sorted(files)


def test_help_lists_the_command_with_an_example(capsys):
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0 and "recompute" in out
    code, out, _ = run_main(["recompute", "--help"], capsys)
    assert code == 0 and "sdp recompute runs/my-run/batches --checkpoints runs/my-run" in out


def test_the_command_module_does_not_import_torch():
    code = (
        "import sys; from sdp_cli.cli import recompute; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dry_run_reports_and_writes_nothing(run_dir, batches, capsys):
    files, before = batches
    code, out, err = run_main(["recompute", files[0].parent, "-c", run_dir, "--dry-run", "--json", "--exact"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["dry_run"] and report["written"] == [] and report["tokens_scored"] > 0
    assert [b["trainer_version"] for b in report["batches"]] == [0, 1, 2, 3]
    # nothing was wrong, so nothing moves (within fp32 noise) and nothing is retagged
    for b in report["batches"]:
        assert b["retagged"] == 0 and (b["proximal_t"]["max_abs"] or 0.0) <= 1e-5
        assert b["proximal"]["max_abs"] <= 1e-5
    assert report["lags"] and report["lags"][0]["lag"] == 1
    assert unchanged(files, before)


def test_the_readable_exact_report_is_the_json_one(run_dir, batches, capsys):
    """The human tables of --exact show the numbers of the JSON report: per lag, mean ± std of
    each log weight, and the mean log ratio of every step j < lag (blank past the lag);
    --drift-clip 1 (segment-wise itself) is a κ like any other."""
    files, _ = batches
    argv = ["recompute", files[0].parent, "-c", run_dir, "--exact", "--dry-run", "--drift-clip", "1", "--drift-clip", "2"]
    code, out, err = run_main([*argv, "--json"], capsys)
    assert code == 0, err
    lags = json.loads(out)["lags"]
    # the fixture's run: stale tokens at lags 1 and 2 at least (more where its engine ran ahead)
    longest = max(lag["lag"] for lag in lags)
    assert [lag["lag"] for lag in lags] == list(range(1, longest + 1)) and longest >= 2
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()]
    assert ["lag", *(f"j={j}" for j in range(longest))] in rows and "κ=1 kept" in out and "κ=2 kept" in out
    for lag in lags:

        def pm(part):
            return f"{lag[part]['mean']:+.1e}±{lag[part]['std']:.1e}"

        assert [str(lag["lag"]), str(lag["tokens"]), pm("segment_wise"), pm("decoupled"), pm("dropped")] in [
            r[:5] for r in rows
        ], out
        assert [str(lag["lag"]), *(f"{x:+.1e}" for x in lag["step_means"])] in rows, out


def test_repairs_in_place_with_a_readable_report(run_dir, batches, capsys):
    files, _ = batches
    originals = {p: read_batch(p) for p in files}
    for p in files:  # tags of every lagged token set back to "not recomputed", values off
        b = originals[p]
        lagged = (b.versions >= 0) & (b.versions < b.trainer_version)
        write_batch(
            p,
            dataclasses.replace(
                b,
                proximal_t_versions=torch.where(lagged, b.versions, b.proximal_t_versions),
                proximal_logprobs_t=torch.where(lagged, b.old_logprobs, b.proximal_logprobs_t),
            ),
        )
    code, out, err = run_main(["recompute", *files, "--checkpoints", run_dir / "versions"], capsys)
    assert code == 0, err
    assert "wrote 4 batch file(s) in place" in out and "v000001" in out
    # the verdicts: a batch without lagged tokens (the first, at least) is unchanged; one with
    # them had them retagged and their values moved beyond the noise floor
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0].startswith("step-")]
    assert [r[0] for r in rows] == [p.name for p in files] and rows[0][5:] == ["0", "unchanged"]
    damaged = [r for r in rows if r[5] != "0"]
    assert damaged and all(r[6:] == ["unchanged"] for r in rows if r[5] == "0")
    for row in damaged:
        retagged = int(row[5])
        verdict = " ".join(row[6:])
        found = re.fullmatch(r"DAMAGED \((\d+) beyond the floor, (\d+) retagged\)", verdict)
        assert found and 0 < int(found[1]) <= retagged == int(found[2]) == int(row[2]), verdict
    for p in files:
        fixed, original = read_batch(p), originals[p]
        assert torch.equal(fixed.proximal_t_versions, original.proximal_t_versions)
        assert float((fixed.proximal_logprobs_t - original.proximal_logprobs_t).abs().max()) <= 1e-5


def test_output_file_and_directory(run_dir, batches, tmp_path, capsys):
    files, before = batches
    code, _, err = run_main(["recompute", files[2], "-c", run_dir, "-o", tmp_path / "one.safetensors"], capsys)
    assert code == 0, err
    assert read_batch(tmp_path / "one.safetensors").trainer_version == 2
    code, out, err = run_main(["recompute", *files, "-c", run_dir, "--output", tmp_path / "out", "--proximal", "1"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [p.name for p in files]
    assert f"to {tmp_path / 'out'}" in out
    assert unchanged(files, before)


@pytest.mark.parametrize(
    "content",
    [b"\x80\x04\x95 a pickle", b"not a safetensors file at all", "truncated"],
    ids=["pickle", "garbage", "truncated"],
)
def test_a_bad_file_is_one_line_and_nothing_is_written(run_dir, batches, content, capsys):
    files, before = batches
    bad = files[0].parent / "step-000099.safetensors"
    bad.write_bytes(files[1].read_bytes()[:-40] if content == "truncated" else content)
    before[bad] = bad.read_bytes()
    code, _, err = run_main(["recompute", files[0].parent, "-c", run_dir], capsys)
    assert_one_line_error(code, err, "step-000099.safetensors")
    assert unchanged([*files, bad], before)


def test_a_run_directory_alone_is_its_batches_and_its_checkpoints(run_dir, batches, capsys):
    code, out, err = run_main(["recompute", str(run_dir), "--dry-run", "--json"], capsys)
    assert code == 0, err
    code, expected, _ = run_main(
        ["recompute", str(run_dir / "batches"), "--checkpoints", str(run_dir), "--dry-run", "--json"], capsys
    )
    doc, want = json.loads(out), json.loads(expected)
    assert code == 0 and doc["batches"] == want["batches"] and len(doc["batches"]) == 4
    assert doc["checkpoints"] == want["checkpoints"] == str(run_dir / "versions")
    # batches outside a run's batches/ have no run to default to: one line naming the option
    files, before = batches
    code, _, err = run_main(["recompute", str(files[0].parent)], capsys)
    assert_one_line_error(code, err, "pass --checkpoints")
    assert unchanged(files, before)


def test_missing_checkpoints_are_one_line_and_nothing_is_written(run_dir, batches, tmp_path, capsys):
    files, before = batches
    # π_prox_t of the lagged tokens needs v000001 (batches c = 1…3 hold version-0 tokens);
    # --exact needs v000001…v000003 as well
    shutil.copytree(run_dir / "versions", tmp_path / "v", ignore=shutil.ignore_patterns("v000001", "v000003"))
    code, _, err = run_main(["recompute", *files, "-c", tmp_path / "v"], capsys)
    assert_one_line_error(code, err, "version(s) 1 are missing", "train.keep_version_checkpoints=true")
    code, _, err = run_main(["recompute", *files, "-c", tmp_path / "v", "--exact"], capsys)
    assert_one_line_error(code, err, "version(s) 1, 3 are missing", "(it has 0, 2, 4)")
    assert unchanged(files, before)


def test_unreachable_server_is_one_line_and_nothing_is_written(run_dir, batches, capsys):
    files, before = batches
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    code, _, err = run_main(["recompute", *files, "-c", run_dir, "--engine", "sglang", "--server", url], capsys)
    assert_one_line_error(code, err, f"127.0.0.1:{port}", "--server")
    assert unchanged(files, before)


def test_server_engines_refuse_other_temperatures(run_dir, batches, tmp_path, capsys):
    files, _ = batches
    warm = tmp_path / "warm.safetensors"
    write_batch(warm, dataclasses.replace(read_batch(files[1]), temperature=0.7))
    code, _, err = run_main(["recompute", warm, "-c", run_dir, "--engine", "vllm", "--server", "http://127.0.0.1:1"], capsys)
    assert_one_line_error(code, err, "temperature 0.7", "--engine local")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--engine", "vllm"], "needs the URL of a running server"),
        (["--server", "http://127.0.0.1:1"], "--server needs --engine vllm or --engine sglang"),
        (["--engine", "tgi"], "--engine 'tgi' is unknown"),
        (["--proximal", "soon"], "--proximal 'soon' is not a version"),
        (["--exact", "--proximal", "1"], "--exact computes π_prox under each batch's trainer version"),
        (["--drift-clip", "2"], "--drift-clip reports on the exact decomposition; add --exact"),
        (["--exact", "--drift-clip", "0.5"], "--drift-clip 0.5 must be >= 1"),
    ],
)
def test_bad_options_are_one_line(run_dir, batches, args, fragment, capsys):
    files, before = batches
    code, _, err = run_main(["recompute", files[1], "-c", run_dir, *args], capsys)
    assert_one_line_error(code, err, fragment)
    assert unchanged(files, before)


def test_json_is_valid_even_when_a_statistic_is_not_finite(run_dir, batches, monkeypatch, capsys):
    """E[π_c/π_{v+1}] = mean(exp(dropped)) overflows when two checkpoints disagree by more than
    ~88 nats on a token; the report then prints null there, never Infinity (not JSON)."""
    import sdp_cli.analysis.recompute as recompute_module

    real = recompute_module.exact_decomposition

    def overflowing(*args, **kwargs):
        lags = real(*args, **kwargs)
        for lag in lags:
            lag.dropped_ratio_mean = float("inf")
        return lags

    monkeypatch.setattr(recompute_module, "exact_decomposition", overflowing)
    files, _ = batches
    code, out, err = run_main(["recompute", files[3], "-c", run_dir, "--exact", "--dry-run", "--json"], capsys)
    assert code == 0, err

    def refuse(name):
        raise AssertionError(f"{name} is not JSON")

    doc = json.loads(out, parse_constant=refuse)
    assert doc["lags"] and all(lag["dropped_ratio_mean"] is None for lag in doc["lags"])


# ------------------------------------------------------------------ outputs never clobber
def test_an_existing_output_is_replaced_only_with_force(run_dir, batches, tmp_path, capsys):
    files, before = batches
    target = tmp_path / "keep.safetensors"
    target.write_bytes(files[0].read_bytes())  # another batch the user keeps there
    kept = target.read_bytes()
    code, _, err = run_main(["recompute", files[2], "-c", run_dir, "-o", target], capsys)
    assert_one_line_error(code, err, f"{target}: already exists; pass --force to replace it")
    assert target.read_bytes() == kept and unchanged(files, before)
    code, _, err = run_main(["recompute", files[2], "-c", run_dir, "-o", target, "--force"], capsys)
    assert code == 0, err
    assert read_batch(target).trainer_version == 2


def test_an_output_directory_holding_a_batch_of_that_name_needs_force(run_dir, batches, tmp_path, capsys):
    files, before = batches
    out = tmp_path / "out"
    out.mkdir()
    (out / files[1].name).write_bytes(b"someone else's file")
    code, _, err = run_main(["recompute", *files, "-c", run_dir, "-o", out], capsys)
    assert_one_line_error(code, err, f"{out / files[1].name}: already exists; pass --force")
    assert [p.name for p in out.iterdir()] == [files[1].name] and unchanged(files, before)


def test_an_output_that_is_not_a_regular_file_is_refused(run_dir, batches, tmp_path, capsys):
    files, before = batches
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    code, _, err = run_main(["recompute", files[2], "-c", run_dir, "-o", fifo, "--force"], capsys)
    assert_one_line_error(code, err, f"{fifo}: is a FIFO, not a regular file")
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and unchanged(files, before)


def test_a_failing_rename_leaves_every_output_as_it_was(run_dir, batches, tmp_path, monkeypatch, capsys):
    """Four batches in place: the third rename fails, so the first two are put back (in place,
    the old batches are the backups) and nothing changed. Before, the first two stayed new."""
    files, _ = batches
    originals = {p: read_batch(p) for p in files}
    for p in files:  # make the recompute change every file
        b = originals[p]
        lagged = (b.versions >= 0) & (b.versions < b.trainer_version)
        write_batch(p, dataclasses.replace(b, proximal_logprobs_t=torch.where(lagged, b.old_logprobs, b.proximal_logprobs_t)))
    before = {p: p.read_bytes() for p in files}
    real_replace = os.replace
    renames = []

    def third_batch_fails(src, dst, **kwargs):
        if str(dst).endswith(".safetensors") and not os.path.basename(str(dst)).startswith("."):
            renames.append(dst)
            if len(renames) == 3:
                raise OSError(5, "Input/output error")
        return real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", third_batch_fails)
    code, _, err = run_main(["recompute", *files, "-c", run_dir], capsys)
    assert_one_line_error(code, err, "Input/output error", "nothing was written")
    assert unchanged(files, before)


def test_a_too_long_output_name_is_one_line(run_dir, batches, tmp_path, capsys):
    files, before = batches
    target = tmp_path / ("b" * 300 + ".safetensors")
    code, _, err = run_main(["recompute", files[2], "-c", run_dir, "-o", target], capsys)
    assert_one_line_error(code, err, "longer than the 255 this file system allows")
    assert list(tmp_path.iterdir()) == [files[0].parent] and unchanged(files, before)


def test_paths_with_rich_markup_are_printed_as_they_are(run_dir, batches, tmp_path, capsys):
    """Paths holding "[/]" with no tag open (a MarkupError traceback; here across two path
    components), "[bold]" (a style rich would apply and hide) and an emoji code are printed as
    they are."""
    files, _ = batches
    out_dir = tmp_path / "o [" / "] :thumbs_up:"
    source = files[0].parent / "[bold] [x] :thumbs_up:.safetensors"
    files[2].rename(source)
    code, out, err = run_main(["recompute", source, "-c", run_dir, "-o", f"{out_dir}/"], capsys)
    assert code == 0, err
    assert source.name in out and f"wrote 1 batch file(s) to {out_dir}" in out
    assert "👍" not in out


def test_a_trailing_slash_makes_the_output_a_directory_even_for_one_batch(run_dir, batches, tmp_path, capsys):
    """Before, typer turned "-o new/" into Path("new"), so one batch was written to a file
    named "new" (docs/recompute.md: a trailing slash means a directory)."""
    files, _ = batches
    code, _, err = run_main(["recompute", files[2], "-c", run_dir, "-o", f"{tmp_path / 'new'}/"], capsys)
    assert code == 0, err
    assert (tmp_path / "new").is_dir() and read_batch(tmp_path / "new" / files[2].name).trainer_version == 2


@pytest.mark.parametrize(
    "device, fragment",
    [
        ("bogus", "--device 'bogus' is not a device; use auto, cpu, cuda or cuda:N"),
        ("meta", "--device 'meta' is not supported; use auto, cpu, cuda or cuda:N"),
        ("cuda:x", "--device 'cuda:x' is not a device"),
    ],
)
def test_a_bad_device_is_one_line(run_dir, batches, device, fragment, capsys):
    files, before = batches
    code, _, err = run_main(["recompute", files[2], "-c", run_dir, "--device", device], capsys)
    assert_one_line_error(code, err, fragment)
    assert unchanged(files, before)


@pytest.mark.parametrize("device", ["cuda", "cuda:99"])
def test_a_missing_cuda_device_is_one_line(run_dir, batches, device, monkeypatch, capsys):
    """Without CUDA (this machine's torch is CPU-only) and, simulated, with one GPU."""
    import torch

    files, before = batches
    code, _, err = run_main(["recompute", files[2], "-c", run_dir, "--device", device], capsys)
    if torch.cuda.is_available():
        assert code == 0 or "CUDA device" in err
    else:
        assert_one_line_error(code, err, f"--device {device}: CUDA is not available", "use --device cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, _, err = run_main(["recompute", files[2], "-c", run_dir, "--device", "cuda:99"], capsys)
    assert_one_line_error(code, err, "--device cuda:99: this machine has 1 CUDA device(s) (cuda:0 to cuda:0)")
    assert unchanged(files, before)


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("localhost:8000", "no http:// or https:// scheme"),
        ("ftp://host:8000", "no http:// or https:// scheme"),
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://host:99999", "Port out of range 0-65535"),
        ("http://host:0", "port 0"),
        ("http://host:port", "Port could not be cast to integer value"),
        ("http://", "no host"),
        ("http://a b:8000", "spaces or control characters"),
        ("http://host:8000/?x=1", "a query or fragment"),
    ],
)
def test_a_malformed_server_url_is_one_line_and_immediate(run_dir, batches, url, fragment, capsys):
    files, before = batches
    started = time.perf_counter()
    code, _, err = run_main(["recompute", files[1], "-c", run_dir, "--engine", "vllm", "--server", url], capsys)
    assert_one_line_error(code, err, f"--server {url!r} is not a server URL", fragment)
    assert time.perf_counter() - started < 5, "refused before any connection attempt (and its retries)"
    assert unchanged(files, before)


@pytest.mark.parametrize(
    ("verdict", "words"),
    [
        (None, "–"),
        (Verdict("unchanged"), "unchanged"),
        (Verdict("dtype noise"), "dtype noise"),
        (Verdict("unverified", beyond=3), "unverified (3 > 1e-5, no floor)"),
        (Verdict("damaged", beyond=2), "DAMAGED (2 beyond the floor)"),
        (Verdict("damaged", beyond=0, retagged=4), "DAMAGED (0 beyond the floor, 4 retagged)"),
    ],
)
def test_each_verdict_reads_as_its_words_in_the_report(verdict, words):
    # "unverified" needs a run with no noise floor, which the fixture's run always measures
    assert recompute_cli._verdict(verdict) == words
