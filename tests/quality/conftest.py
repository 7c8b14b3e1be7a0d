from __future__ import annotations

import sys
from pathlib import Path

import transformers  # noqa: F401  (the [quality] extra: a missing one fails the run, never skips it)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration" / "hf"))
