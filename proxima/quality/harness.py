"""The quality harness: prefill each context once, then for every method compress a copy of the
cache and measure what the model still does.

Metrics (per method, averaged over samples):
- `needle_acc`: passkey retrieval accuracy (the 5 digits appear in 6 greedy tokens).
- `ppl`: perplexity of the 64-token continuation of a Wikipedia context, teacher-forced.
- `tf_top1`: on the same scored positions, top-1 agreement with the uncompressed model.
- `kl`: mean KL(uncompressed || compressed) of the next-token distributions there.
  (teacher-forced metrics do not cascade the way free-running agreement does.)
- `agreement`: greedy agreement over the first 64 generated tokens: the fraction generated
  identically before the first divergence from the uncompressed model's tokens.
The first continuation token is predicted from the context's own (uncompressed) prefill logits,
so it is excluded from scoring: every scored position reads the compressed cache.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from proxima.compression.blocks import Backend
from proxima.integration.hf import ProximaCache, enable
from proxima.quality.datasets import NeedleSample, TextSample
from proxima.quality.h2o import AttentionSums
from proxima.quality.methods import Method
from proxima.quality.probe_records import ProbeLog, probe_records
from proxima.quality.stacking import stacked

Log = Callable[[str], None]


SETTINGS = ("after", "inside")
"""Passkey settings. `after`: the context is compressed before the question arrives (the harness
protocol of FACTS.md). `inside`: the question is part of the compressed prompt, as in vLLM, where
the whole prompt is cached (and compressed) before the answer: context + question but its last
token is prefilled, compressed, and the last token's forward reads the compressed cache. The
teacher-forced text metrics are the same in both (the continuation is scored from a cache
compressed without it either way; vLLM's prompt log-probs come from chunks that see the earlier
ones compressed), so each setting's row carries the same ppl / tf_top1 / kl."""


@dataclass
class Row:
    method: str
    family: str
    ratio: float
    """The ratio the method was asked for."""
    setting: str = "after"
    achieved_ratio: float = 0.0
    """16-bit KV bytes over bytes held, metadata included (`ProximaCache.achieved_ratio`)."""
    nominal_ratio: float = 0.0
    """The same counting each format at its pack ratio, metadata excluded (labelled nominal)."""
    needle_acc: float = float("nan")
    needle_n: int = 0
    """Passkey samples behind `needle_acc`."""
    text_n: int = 0
    """Text windows behind `ppl`, `tf_top1`, `kl`."""
    ppl: float = float("nan")
    tf_top1: float = float("nan")
    kl: float = float("nan")
    agreement: float = float("nan")
    formats: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


@dataclass
class _Acc:
    needle: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)
    nominal: list[float] = field(default_factory=list)
    formats: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class _TextAcc:
    nll: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    agree: list[float] = field(default_factory=list)
    windows: int = 0
    ratio: list[float] = field(default_factory=list)
    nominal: list[float] = field(default_factory=list)
    formats: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def _mean(x: list[float]) -> float:
    return sum(x) / len(x) if x else float("nan")


@torch.no_grad()
def _prefill(
    model, ids: list[int], block_size: int, record_probes: bool, backend: Backend, accumulate_attention: bool = False
) -> tuple[ProximaCache, torch.Tensor]:
    cache = ProximaCache(
        block_size=block_size, probe_hook=ProbeLog() if record_probes else None, backend=backend,
        query_hooks=(AttentionSums(),) if accumulate_attention else (),
    )
    out = model(torch.tensor([ids], device=model.device), past_key_values=cache, use_cache=True)
    return cache, out.logits[0, -1]


@torch.no_grad()
def _generate(model, cache: ProximaCache, prompt: list[int], rows: int, n: int) -> list[list[int]]:
    """Greedy: feed `prompt` to every row of `cache`, then take `n` tokens (n forward passes).
    Returns the tokens per row."""
    out: list[list[int]] = [[] for _ in range(rows)]
    nxt = torch.tensor([prompt], device=model.device).expand(rows, -1)
    for _ in range(n):
        logits = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1]
        tok = logits.argmax(-1)
        for r, t in enumerate(tok.tolist()):
            out[r].append(int(t))
        nxt = tok[:, None]
    return out


def _chunks(methods: list[Method], size: int) -> list[list[Method]]:
    size = max(1, size)
    return [methods[i : i + size] for i in range(0, len(methods), size)]


def _record_formats(acc: _Acc | _TextAcc, cache: ProximaCache) -> None:
    for f in cache.block_formats():
        acc.formats[f.name] = acc.formats.get(f.name, 0) + 1
    acc.ratio.append(cache.achieved_ratio())
    acc.nominal.append(cache.nominal_ratio())


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    methods: list[Method],
    text: list[TextSample],
    needles: list[NeedleSample],
    *,
    block_size: int = 64,
    greedy_tokens: int = 64,
    settings: tuple[str, ...] = SETTINGS,
    log: Log = print,
    probe_sink: list | None = None,
    method_batch: int = 1,
    deadline: float | None = None,
    checkpoint: Callable[[list[Row]], None] | None = None,
    backend: Backend = "auto",
) -> list[Row]:
    """Run every method on every sample; the first method must be `baseline`. One row per
    (method, setting); `greedy_tokens=0` skips the free-running agreement (the costly part).

    Runs wherever `model` is (CPU or CUDA: every tensor is made on `model.device`, and the
    compression calls pick their Triton kernels for CUDA tensors). `method_batch` methods are
    compressed one by one, each on its own copy of the sample's prefill, then decoded together as
    the rows of one batch (`proxima.quality.stacking.stacked`): the same tokens as one forward per method,
    far fewer kernel launches. `deadline` (a `time.monotonic()` value): a sample whose expected
    duration would end past it is not started (the rows say how many samples each metric saw:
    `needle_n`, `text_n`). `checkpoint` receives the rows so far after every sample. `backend`:
    the caches' compression kernels ("triton" tests the GPU's kernels on CPU, interpreted)."""
    if not methods or methods[0].name != "baseline":
        raise ValueError("the first method must be 'baseline' (metrics are relative to it)")
    unknown = set(settings) - set(SETTINGS)
    if unknown or not settings:
        raise ValueError(f"settings must be a non-empty subset of {SETTINGS}, got {settings}")
    enable(model)
    dev = model.device
    # H2O's scores sum every prefill query's attention: a second attention pass in every layer,
    # paid only when a selected method reads it.
    accumulate = any(m.needs_accumulated_attention for m in methods)
    text_acc = {m.name: _TextAcc() for m in methods}
    accs = {(m.name, st): _Acc() for m in methods for st in settings}
    t_start = time.monotonic()
    total = len(text) + len(needles)
    # Seconds per context token of the last finished sample of each kind: the last, not the
    # worst, because the first samples also pay for compiling the Triton kernels on a GPU.
    per_token: dict[str, float] = {}

    def out_of_time(n_tokens: int, what: str, kind: str) -> bool:
        if deadline is None:
            return False
        expected = per_token.get(kind, 0.0) * n_tokens
        if time.monotonic() + expected <= deadline:
            return False
        log(f"[budget] {what} not started: expected {expected:.0f}s, {deadline - time.monotonic():.0f}s left")
        return True

    def progress(i: int, name: str, t0: float, detail: str, n_tokens: int, kind: str) -> None:
        now = time.monotonic()
        per_token[kind] = (now - t0) / max(1, n_tokens)
        left = "" if deadline is None else f", budget left {deadline - now:.0f}s"
        log(
            f"[{i}/{total}] {name} ({n_tokens} tok): {detail} in {now - t0:.1f}s "
            f"(elapsed {now - t_start:.0f}s{left})"
        )
        if checkpoint is not None:
            checkpoint(_rows(methods, settings, text_acc, accs))

    def compressed(prefilled: ProximaCache, chunk: list[Method], acc_of) -> list[ProximaCache]:
        caches = []
        for m in chunk:
            tm = time.monotonic()
            cache = prefilled.fork()
            m.apply(cache)
            acc = acc_of(m)
            _record_formats(acc, cache)
            if probe_sink is not None:
                probe_sink.extend(probe_records(cache))
            acc.seconds += time.monotonic() - tm
            caches.append(cache)
        return caches

    for si, s in enumerate(text):
        if out_of_time(len(s.context_ids), f"text window {si + 1}/{len(text)}", "text"):
            break
        t0 = time.monotonic()
        base_cache, last_logits = _prefill(
            model, s.context_ids, block_size, probe_sink is not None, backend, accumulate
        )
        first = int(last_logits.argmax())
        cont = torch.tensor([s.continuation_ids], device=dev)
        target = cont[0, 1:]
        base_logp: torch.Tensor | None = None
        base_greedy: list[int] = []
        for chunk in _chunks(methods, method_batch):
            caches = compressed(base_cache, chunk, lambda m: text_acc[m.name])
            tm = time.monotonic()
            batch = stacked(caches)
            gen = stacked(caches) if greedy_tokens else None
            del caches
            logits = model(cont.expand(len(chunk), -1), past_key_values=batch, use_cache=True).logits[:, :-1].float()
            logps = torch.log_softmax(logits, -1)
            del batch, logits
            greedy = (
                [[first, *g] for g in _generate(model, gen, [first], len(chunk), greedy_tokens - 1)]
                if gen is not None
                else [[] for _ in chunk]
            )
            for m, logp, toks in zip(chunk, logps, greedy, strict=True):
                if base_logp is None:
                    base_logp, base_greedy = logp, toks
                ta = text_acc[m.name]
                ta.nll += (-logp.gather(-1, target[:, None]).squeeze(-1)).tolist()
                ta.top1 += (logp.argmax(-1) == base_logp.argmax(-1)).float().tolist()
                ta.kl += (base_logp.exp() * (base_logp - logp)).sum(-1).clamp_min(0).tolist()
                if greedy_tokens:
                    same = 0
                    for a, b in zip(toks, base_greedy, strict=True):
                        if a != b:
                            break
                        same += 1
                    ta.agree.append(same / greedy_tokens)
                ta.windows += 1
            shared = (time.monotonic() - tm) / len(chunk)  # the batched decode, split evenly
            for m in chunk:
                text_acc[m.name].seconds += shared
        progress(si + 1, s.name[:40], t0, f"{len(methods)} methods", len(s.context_ids), "text")

    for ni, ns in enumerate(needles):
        if out_of_time(len(ns.context_ids), f"passkey {ns.name}", "needle"):
            break
        t0 = time.monotonic()
        base_cache, _ = _prefill(model, ns.context_ids, block_size, probe_sink is not None, backend, accumulate)
        q = ns.question_ids
        prompts: dict[str, tuple[ProximaCache, list[int]]] = {}
        if "after" in settings:
            prompts["after"] = (base_cache, q)  # compressed before the question arrives
        if "inside" in settings:
            inside = base_cache.fork()
            if len(q) > 1:
                model(torch.tensor([q[:-1]], device=dev), past_key_values=inside, use_cache=True)
            prompts["inside"] = (inside, q[-1:])  # the question is in the compressed prompt
        status = []
        for st, (prefilled, rest) in prompts.items():
            for chunk in _chunks(methods, method_batch):
                caches = compressed(prefilled, chunk, lambda m, st=st: accs[(m.name, st)])
                tm = time.monotonic()
                batch = stacked(caches)
                del caches
                answers = _generate(model, batch, rest, len(chunk), 6)
                del batch
                shared = (time.monotonic() - tm) / len(chunk)
                for m, toks in zip(chunk, answers, strict=True):
                    acc = accs[(m.name, st)]
                    acc.needle.append(float(ns.answer in tokenizer.decode(toks)))
                    acc.seconds += shared
            status.append(f"{st}: baseline {'ok' if accs[('baseline', st)].needle[-1] else 'MISS'}")
        progress(
            len(text) + ni + 1, ns.name, t0, f"{', '.join(status)}; {len(methods)} methods x {len(prompts)} settings",
            len(ns.context_ids), "needle",
        )
    return _rows(methods, settings, text_acc, accs)


def _rows(
    methods: list[Method], settings: tuple[str, ...], text_acc: dict[str, _TextAcc], accs: dict[tuple[str, str], _Acc]
) -> list[Row]:
    rows = []
    for m in methods:
        ta = text_acc[m.name]
        for st in settings:
            res = accs[(m.name, st)]
            ratios, nominal = ta.ratio + res.ratio, ta.nominal + res.nominal
            formats = dict(ta.formats)
            for k, v in res.formats.items():
                formats[k] = formats.get(k, 0) + v
            rows.append(
                Row(
                    method=m.name,
                    family=m.family,
                    ratio=float(m.ratio),
                    setting=st,
                    achieved_ratio=round(_mean(ratios), 3),
                    nominal_ratio=round(_mean(nominal), 3),
                    needle_acc=_mean(res.needle),
                    needle_n=len(res.needle),
                    text_n=ta.windows,
                    ppl=math.exp(_mean(ta.nll)) if ta.nll else float("nan"),
                    tf_top1=_mean(ta.top1),
                    kl=_mean(ta.kl),
                    agreement=_mean(ta.agree),
                    formats=formats,
                    seconds=round(ta.seconds + res.seconds, 1),
                )
            )
    return rows
