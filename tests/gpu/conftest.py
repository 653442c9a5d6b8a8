"""Fixtures of the GPU check's tests (marker ``gpu``; docs/engines.md "Checking on a GPU").

They run on CUDA with a Qwen2.5-0.5B-shaped model (``qwen_shape.py``) and skip without CUDA.
Two variables change that, for the dry run of scripts/gpu_check.sh: ``SDP_GPU_TEST_DEVICE=cpu``
runs them on the CPU, and ``SDP_GPU_CHECK_SHAPE=tiny`` with the tiny shape, so their code is
known to work before a GPU is lent.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from .qwen_shape import SHAPES, build_model


@pytest.fixture(scope="session", autouse=True)
def device() -> torch.device:
    """The device of every test here; without CUDA each test is skipped (before any model is built)."""
    device = torch.device(os.environ.get("SDP_GPU_TEST_DEVICE", "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("skipped (no CUDA)")
    return device


@pytest.fixture(scope="session")
def shape() -> str:
    name = os.environ.get("SDP_GPU_CHECK_SHAPE", "qwen2.5-0.5b")
    assert name in SHAPES, f"SDP_GPU_CHECK_SHAPE={name}: choose one of {', '.join(SHAPES)}"
    return name


@pytest.fixture(scope="session")
def base_model(shape, device) -> torch.nn.Module:
    """The float32 model every test copies (never changed: tests work on ``model``)."""
    return build_model(shape, seed=0, device=device)


@pytest.fixture
def model(base_model) -> torch.nn.Module:
    return copy.deepcopy(base_model)


@pytest.fixture(autouse=True)
def _peak_memory(device, record_property):
    """Records each test's peak CUDA memory (GiB) in the JUnit XML bench/gpu.py reads."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    yield
    if device.type == "cuda":
        record_property("peak_gib", round(torch.cuda.max_memory_allocated(device) / 2**30, 3))
