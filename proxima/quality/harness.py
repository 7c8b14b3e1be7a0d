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

import copy
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from proxima.integration.hf import ProximaCache, enable
from proxima.quality.datasets import NeedleSample, TextSample
from proxima.quality.methods import Method

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
    ratio: list[float] = field(default_factory=list)
    nominal: list[float] = field(default_factory=list)
    formats: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def _mean(x: list[float]) -> float:
    return sum(x) / len(x) if x else float("nan")


@torch.no_grad()
def _prefill(model, ids: list[int], block_size: int) -> tuple[ProximaCache, torch.Tensor]:
    cache = ProximaCache(block_size=block_size, record_probes=True)
    out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache, out.logits[0, -1]


@torch.no_grad()
def _greedy(model, cache: ProximaCache, first: int, n: int) -> list[int]:
    toks = [first]
    nxt = torch.tensor([[first]])
    for _ in range(n - 1):
        logits = model(nxt, past_key_values=cache, use_cache=True).logits[0, -1]
        tok = int(logits.argmax())
        toks.append(tok)
        nxt = torch.tensor([[tok]])
    return toks


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
) -> list[Row]:
    """Run every method on every sample; the first method must be `baseline`. One row per
    (method, setting); `greedy_tokens=0` skips the free-running agreement (the costly part)."""
    if not methods or methods[0].name != "baseline":
        raise ValueError("the first method must be 'baseline' (metrics are relative to it)")
    unknown = set(settings) - set(SETTINGS)
    if unknown or not settings:
        raise ValueError(f"settings must be a non-empty subset of {SETTINGS}, got {settings}")
    enable(model)
    text_acc = {m.name: _TextAcc() for m in methods}
    accs = {(m.name, st): _Acc() for m in methods for st in settings}
    t_start = time.monotonic()
    total = len(text) + len(needles)

    for si, s in enumerate(text):
        t0 = time.monotonic()
        base_cache, last_logits = _prefill(model, s.context_ids, block_size)
        first = int(last_logits.argmax())
        cont = torch.tensor([s.continuation_ids])
        base_logp: torch.Tensor | None = None
        base_greedy: list[int] = []
        for m in methods:
            tm = time.monotonic()
            cache = copy.deepcopy(base_cache)
            m.apply(cache)
            ta = text_acc[m.name]
            _record_formats(ta, cache)
            if probe_sink is not None:
                probe_sink.extend(cache.probe_log)
            gen_cache = copy.deepcopy(cache) if greedy_tokens else None
            logits = model(cont, past_key_values=cache, use_cache=True).logits[0, :-1].float()
            logp = torch.log_softmax(logits, -1)
            target = cont[0, 1:]
            nll = -logp.gather(-1, target[:, None]).squeeze(-1)
            greedy = _greedy(model, gen_cache, first, greedy_tokens) if gen_cache is not None else []
            if base_logp is None:
                base_logp, base_greedy = logp, greedy
            ta.nll += nll.tolist()
            ta.top1 += (logp.argmax(-1) == base_logp.argmax(-1)).float().tolist()
            ta.kl += (base_logp.exp() * (base_logp - logp)).sum(-1).clamp_min(0).tolist()
            if greedy_tokens:
                same = 0
                for a, b in zip(greedy, base_greedy, strict=True):
                    if a != b:
                        break
                    same += 1
                ta.agree.append(same / greedy_tokens)
            ta.seconds += time.monotonic() - tm
        log(
            f"[{si + 1}/{total}] {s.name[:40]} ({len(s.context_ids)} tok): {len(methods)} methods "
            f"in {time.monotonic() - t0:.0f}s (elapsed {time.monotonic() - t_start:.0f}s)"
        )

    for ni, ns in enumerate(needles):
        t0 = time.monotonic()
        base_cache, _ = _prefill(model, ns.context_ids, block_size)
        q = ns.question_ids
        prompts: dict[str, tuple[ProximaCache, list[int]]] = {}
        if "after" in settings:
            prompts["after"] = (base_cache, q)  # compressed before the question arrives
        if "inside" in settings:
            inside = copy.deepcopy(base_cache)
            if len(q) > 1:
                model(torch.tensor([q[:-1]]), past_key_values=inside, use_cache=True)
            prompts["inside"] = (inside, q[-1:])  # the question is in the compressed prompt
        status = []
        for st, (prefilled, rest) in prompts.items():
            for m in methods:
                tm = time.monotonic()
                cache = copy.deepcopy(prefilled)
                m.apply(cache)
                acc = accs[(m.name, st)]
                _record_formats(acc, cache)
                logits = model(torch.tensor([rest]), past_key_values=cache, use_cache=True).logits[0, -1]
                toks = _greedy(model, cache, int(logits.argmax()), 6)
                acc.needle.append(float(ns.answer in tokenizer.decode(toks)))
                acc.seconds += time.monotonic() - tm
            status.append(f"{st}: baseline {'ok' if accs[('baseline', st)].needle[-1] else 'MISS'}")
        log(
            f"[{len(text) + ni + 1}/{total}] {ns.name} ({', '.join(status)}): {len(methods)} methods x "
            f"{len(prompts)} settings in {time.monotonic() - t0:.0f}s (elapsed {time.monotonic() - t_start:.0f}s)"
        )

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
                    ppl=math.exp(_mean(ta.nll)) if ta.nll else float("nan"),
                    tf_top1=_mean(ta.top1),
                    kl=_mean(ta.kl),
                    agreement=_mean(ta.agree),
                    formats=formats,
                    seconds=round(ta.seconds + res.seconds, 1),
                )
            )
    return rows
