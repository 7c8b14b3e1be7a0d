"""What the tests that start real vLLM engines or servers share: a free port and the model (whole, or
cut to a few layers for the tensor-parallel engines)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path


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


def shallow_model(dest: Path, layers: int, kv_heads: int | None = None, q_heads: int | None = None) -> str:
    """SmolLM2 cut to its first `layers` decoder layers, in `dest` (made once; tensor-parallel
    engines of 2-3 CPU ranks run the full 30 layers too slowly for CI on 2 cores).

    Same tokenizer, hidden size and head size. With `kv_heads`/`q_heads` (e.g. 4/8, so that 2 ranks
    divide them) the head counts change and no weights are written: load it with vLLM's
    `load_format="dummy"`. Otherwise the real weights of the kept layers are written (9 query /
    3 KV heads: 3 ranks divide them)."""
    src = Path(test_model())
    if (dest / "config.json").exists():
        return str(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dest / name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    if kv_heads is not None or q_heads is not None:
        cfg["num_key_value_heads"] = kv_heads or cfg["num_key_value_heads"]
        cfg["num_attention_heads"] = q_heads or cfg["num_attention_heads"]
    else:
        from safetensors.torch import load_file, save_file

        keep = re.compile(r"model\.layers\.(\d+)\.")
        tensors = {k: v for k, v in load_file(str(src / "model.safetensors")).items()
                   if not (m := keep.match(k)) or int(m[1]) < layers}
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(dest)


def run_engine(tmp: Path, name: str, env_extra: dict[str, str], churn: int = 0, model: str | None = None) -> dict:
    """`engine_runner.py` in a fresh process (vLLM reads the plugin environment when its processes
    start) with `env_extra` on top of this environment less its PROXIMA_ variables; its JSON summary."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
    env.update(env_extra)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the pool is num_gpu_blocks_override; cap the RAM reserve
    if "PROXIMA_POLICY" in env_extra:
        env["PROXIMA_STATS_FILE"] = str(tmp / f"{name}-stats.json")
    runner = Path(__file__).with_name("engine_runner.py")
    proc = subprocess.run([sys.executable, str(runner), model or test_model(), str(churn)],
                          env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"{name} engine failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return dict(json.loads(lines[-1]))


def compression_probe_off(store: object) -> None:
    """Switch the compression-time probe off in a worker store (`WorkerStore`) whose test feeds it
    actions directly: no step observed their requests, so the probe would defer every block."""
    policy = store.policy  # type: ignore[attr-defined]
    assert policy is not None
    probe = policy.probes.compression.model_copy(update={"enabled": False})
    store.adopt(policy.model_copy(update={"probes": policy.probes.model_copy(update={"compression": probe})}),  # type: ignore[attr-defined]
                store.policy_version)  # type: ignore[attr-defined]
