"""Fixtures of the engine tests."""

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Two OpenMP threads competing with other processes on a 2-core machine make tiny forwards
    many times slower (measured in tests/models/conftest.py); one thread avoids that. The
    caller's thread count is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
