from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# Before anything imports triton: Proxima's Triton kernels run under the interpreter on CPU
# (test_methods.py runs the harness through them, the path a CUDA run takes).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: F401  (the [quality] extra: a missing one fails the run, never skips it)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration" / "hf"))
