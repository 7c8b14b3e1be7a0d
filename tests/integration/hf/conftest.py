from __future__ import annotations

import pytest
import torch
from hf_helpers import tiny_llama


@pytest.fixture
def model():
    return tiny_llama()


@pytest.fixture
def ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (1, 300), generator=g)
