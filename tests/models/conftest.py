"""Model tests run torch on one thread.

On the shared 2-core machine, two OpenMP threads competing with other processes made a forward
pass of the small test model ~50x slower (116 ms instead of 2 ms, measured); one thread avoids the
oversubscription. The setting is restored after each test.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
