"""The package exports every public name, lazily: importing records must not import torch."""

import subprocess
import sys

import sdp_cli.rollout as rollout


def test_every_export_resolves():
    for name in rollout.__all__:
        assert getattr(rollout, name).__name__ == name
    assert "SavedBatch" in dir(rollout)


def test_records_import_does_not_pull_torch():
    code = "import sys, sdp_cli.rollout.records, sdp_cli.rollout.staleness; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
