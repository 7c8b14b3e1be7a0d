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


def compression_probe_off(store: object) -> None:
    """Switch the compression-time probe off in a worker store (`WorkerStore`) whose test feeds it
    actions directly: no step observed their requests, so the probe would defer every block."""
    policy = store.policy  # type: ignore[attr-defined]
    assert policy is not None
    probe = policy.probes.compression.model_copy(update={"enabled": False})
    store.adopt(policy.model_copy(update={"probes": policy.probes.model_copy(update={"compression": probe})}),  # type: ignore[attr-defined]
                store.policy_version)  # type: ignore[attr-defined]
