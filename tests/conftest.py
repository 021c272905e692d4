import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the scripts are modules at the repo root


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Every test model is tiny: with two intra-op threads the hand-offs cost more than the matmuls
    (20-50x slower on a shared 2-core machine), so the suite runs on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
