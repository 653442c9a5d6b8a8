"""Two training processes (torchrun, gloo on CPU): rank 0 runs the loop and the engine, both
ranks train on their half of every batch, and they end with identical weights."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import FAST


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None, reason="torchrun not installed")
def test_two_processes_train_the_same_model(tmp_path):
    torchrun = str(Path(sys.executable).parent / "torchrun")
    run_dir = tmp_path / "run"
    env = dict(os.environ, SDP_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    cmd = [torchrun, "--nproc_per_node", "2", "--log-dir", str(tmp_path / "torchrun"), "-m", "sdp_cli", "train",
           *FAST, "+preset=segment_wise",
           "train.steps=3", "train.threads=1", f"run.dir={run_dir}"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "started" and events[0]["processes"] == 2
    assert events[-1]["event"] == "finished"  # reached only if both ranks ended with equal weights
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # each process trains on half of the 16 sequences of a batch
    assert all(r["batch/sequences"] == 16 for r in rows)


# The environment `accelerate launch --cpu --num_processes 2` gives its one child (accelerate
# 1.15, utils/launch.py prepare_simple_launcher_cmd_env): CPU flag and a rendezvous address,
# but no WORLD_SIZE/RANK — torch.distributed is never set up, so only one process trains.
ACCELERATE_CPU_CHILD = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "env",
    [
        {},  # plain `sdp train`
        {"ACCELERATE_USE_CPU": "True"},  # `accelerate launch --cpu` with one process
        {**ACCELERATE_CPU_CHILD, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},  # torchrun
        {**ACCELERATE_CPU_CHILD, "PMI_SIZE": "2"},  # accelerate's mpirun path (--mpirun_hostfile)
        {**ACCELERATE_CPU_CHILD, "OMPI_COMM_WORLD_SIZE": "2"},
    ],
)
def test_launches_that_start_every_process_are_accepted(env):
    from sdp_cli.train.asyncloop.distributed import check_launch

    check_launch(env)


def test_accelerate_cpu_multi_process_is_refused_in_one_line():
    from sdp_cli.errors import UserError
    from sdp_cli.train.asyncloop.distributed import check_launch

    with pytest.raises(UserError) as err:
        check_launch(ACCELERATE_CPU_CHILD)
    message = str(err.value)
    assert "\n" not in message and "torchrun --nproc_per_node" in message and "accelerate launch --cpu" in message


@pytest.mark.skipif(shutil.which("accelerate", path=str(Path(sys.executable).parent)) is None, reason="accelerate CLI not installed")
def test_accelerate_launch_cpu_two_processes_exits_pointing_to_torchrun(tmp_path):
    accelerate = str(Path(sys.executable).parent / "accelerate")
    run_dir = tmp_path / "run"
    env = dict(os.environ, SDP_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    cmd = [accelerate, "launch", "--cpu", "--num_processes", "2", "-m", "sdp_cli", "train", *FAST,
           "train.steps=1", f"run.dir={run_dir}"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    lines = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "torchrun --nproc_per_node N" in lines[0], done.stderr[-2000:]
    assert not run_dir.exists()  # refused before anything is written


@pytest.mark.parametrize("name", ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"])
def test_sharded_accelerate_launches_are_refused_in_one_line(name):
    # accelerate launch --use_fsdp / --use_deepspeed set these for every process (torchrun
    # underneath); accelerate.Accelerator() would then wrap the trainer's model in FSDP/DeepSpeed,
    # while sdp shards it itself (train.parallel=fsdp): the line says how to launch that instead
    from sdp_cli.errors import UserError
    from sdp_cli.train.asyncloop.distributed import check_launch

    with pytest.raises(UserError) as err:
        check_launch({name: "true", "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    message = str(err.value)
    assert "\n" not in message and "torchrun --nproc_per_node N" in message and "train.parallel=fsdp" in message
    check_launch({name: "false", "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"})


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None, reason="torchrun not installed")
def test_a_mode_of_yours_failing_in_a_two_process_run_stops_both_ranks_at_the_step_in_one_line(tmp_path):
    # every rank weighs the whole batch and meets the failure alike; rank 0 stops the run (its
    # event, its line), the other follows it to the end. Before, the other rank exited on its own
    # error and rank 0's stop met a dead peer: a gloo traceback, no stopped event.
    mode_file = tmp_path / "my_mode.py"
    mode_file.write_text(
        "from sdp_cli.modes import mode\nSEEN = set()\n\n@mode(needs=('proximal_logprobs',))\n"
        "def weight(old, proximal, proximal_t, mask):\n    SEEN.add(round(float(old.sum()), 4))\n"
        "    return (proximal - old) * (float('nan') if len(SEEN) > 3 else 1.0)\n"
    )
    torchrun = str(Path(sys.executable).parent / "torchrun")
    run_dir = tmp_path / "run"
    env = dict(os.environ, SDP_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    cmd = [torchrun, "--nproc_per_node", "2", "--log-dir", str(tmp_path / "torchrun"), "-m", "sdp_cli", "train",
           *FAST, "train.steps=4", "train.threads=1", "train.checkpoint_every=1", f"run.dir={run_dir}",
           f"loss.mode={mode_file}:weight"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: training stopped at step 2: loss.mode="), done.stderr[-3000:]
    assert "returned nan at a valid token" in lines[0] and lines[0].endswith("(from step 2, the last complete checkpoint)")
    assert "[rank0]: Traceback" not in done.stderr and "[rank1]: Traceback" not in done.stderr, done.stderr[-3000:]
    # torchrun reports each rank's exit: both 2, neither killed. When rank 1 leaves first,
    # torchrun logs "closing signal SIGTERM" to rank 0, which ignores it once the run is over
    # (Coordinator.end) and exits 2 on its own; torchrun waits for it and reports that exit.
    codes = re.findall(r"^\s*exitcode\s*:\s*(-?\d+) \(pid", done.stderr, flags=re.MULTILINE)
    assert codes == ["2", "2"] and "forcefully exiting" not in done.stderr, done.stderr[-3000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "stopped" and events[-1]["checkpoint"] is None and events[-1]["resume_step"] == 2
