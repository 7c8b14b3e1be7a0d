"""What the tests that start real vLLM engines or servers share: a free port and the model."""

from __future__ import annotations

import os
import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def test_model() -> str:
    """`PX_MODEL` (the GPU kit sets it), else the prepared SmolLM2."""
    env = os.environ.get("PX_MODEL")
    if env:
        return env
    from proxima.models import prepare

    return str(prepare("smollm2", progress=lambda *_: None))


test_model.__test__ = False  # type: ignore[attr-defined]  # a helper, not a pytest test
