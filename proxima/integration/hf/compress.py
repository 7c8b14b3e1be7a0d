"""The transformers cache's compression: blocks into a format in every layer, from what each
holds now, behind the compression-time probe (the same decision as the vLLM worker's:
`proxima.policy.refusal.milder_formats` + `proxima.policy.probes.choose_within_bound`).

`CacheCompression` is a part of `ProximaCache` (`cache.py`), split out so each file has one job;
it encodes with `proxima.compression.compress_blocks` (the call the vLLM worker makes) and
commits through `ProximaLayer.store`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch

from proxima.compression.attention import attention_errors
from proxima.compression.blocks import Backend, CompressedBlocks, compress_blocks
from proxima.compression.spec import check_group_size
from proxima.formats import HOT, Format, recompressible
from proxima.integration.hf.layer import Decoded, ProximaLayer
from proxima.observation import observed_layer
from proxima.policy.probes import choose_within_bound
from proxima.policy.refusal import milder_formats

if TYPE_CHECKING:
    from proxima.policy.schema import Policy


@dataclass
class ProbeRecord:
    """One block compressed in one layer: the features and error the damage model learns from."""

    layer: int
    block: int
    fmt: str
    importance: float
    """Attention mass the observation window gives the block in this layer (max over heads)."""
    key_norm_spread: float
    """Std / mean of the block's key norms (mean over heads)."""
    error: float
    """Relative error of the observation window's attention output over the block."""


@dataclass
class CompressionReport:
    """What one `apply_policy` / `compress` call did."""

    actions: int = 0
    rejected: int = 0
    """Actions the compression-time probe refused (a milder format was tried, or the block stayed)."""
    formats: dict[str, int] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)


class CacheCompression:
    """Block compression for `ProximaCache` (see the module docstring)."""

    if TYPE_CHECKING:
        policy: Policy
        block_size: int
        layers: list
        chosen: list[Format]
        ineligible: set[int]
        record_probes: bool
        probe_log: list[ProbeRecord]
        kv_dtype: torch.dtype | None
        backend: Backend
        _group_size: int | None
        _obs: dict[int, torch.Tensor]

        @property
        def proxima_layers(self) -> list[ProximaLayer]: ...

        def group_for(self, fmt: Format) -> int: ...

        def token_importance(self, layer_idx: int) -> torch.Tensor | None: ...

    def compress_blocks(
        self,
        blocks: Sequence[int],
        fmt: Format,
        *,
        ladder: Sequence[Format] = (),
        probe: bool = False,
    ) -> CompressionReport:
        """Compress `blocks` (logical indices) into `fmt` in every layer (with the policy's layer
        overrides), from what each block holds now: hot blocks exactly, quantized ones from their
        dequantised data, token-reduced ones from their stored rows and counts (centroids merge
        further, counts add: `proxima.formats.recompressible` says which moves exist;
        a reduced block asked for a move it cannot make takes the mildest `ladder` format it can
        reach at that ratio or more).

        With `probe`, each block takes what the vLLM worker's probe would give it: its format, else
        the first of `milder_formats` (the policy's ladders, harshest first, equal ratios by damage
        then name) it can move into whose attention-output error in the observed layer
        (`proxima.observation`) is within the policy's bound (`choose_within_bound`); with none,
        it stays as it is and is marked ineligible. Errors are measured a format at a time over
        every block still undecided (one batched encode per format, not one per block: kernel
        launches bound a GPU run). `report.rejected` counts refusals, one per refused attempt."""
        report = CompressionReport()
        self._extend_chosen()
        groups: dict[tuple[tuple[Format, ...], Format], list[int]] = {}
        for raw in blocks:
            i = int(raw)
            if self.chosen[i].pack_ratio >= fmt.pack_ratio:
                continue
            target = self._reachable(i, fmt, ladder)
            if target is None:
                self.ineligible.add(i)
                continue
            src = tuple(layer.formats[i] for layer in self.proxima_layers)
            groups.setdefault((src, target), []).append(i)
        for (src, target), todo in groups.items():
            if not probe:
                encs, _ = self._encode_all_layers(todo, target, measure=False)
                self._commit(todo, target, encs)
                report.actions += len(todo)
                report.formats[target.name] = report.formats.get(target.name, 0) + len(todo)
                continue
            self._probe_and_commit(src, target, todo, report)
        return report

    def _probe_and_commit(
        self, src: tuple[Format, ...], target: Format, todo: list[int], report: CompressionReport
    ) -> None:
        """`compress_blocks` with the probe on, for blocks that all hold `src` and asked for `target`."""
        # The caller asked for the probe, so it decides even where the policy switched it off.
        cfg = self.policy.probes.compression.model_copy(update={"enabled": True})
        milder = [f for f in milder_formats(self.policy, target, src[0]) if self._reachable_from(src, f)]
        order = [target, *milder]
        errors: dict[Format, dict[int, float]] = {}
        encoded: dict[Format, tuple[list[int], list[tuple[Format, CompressedBlocks]]]] = {}

        def undecided_at(f: Format) -> list[int]:
            """The blocks every format before `f` refused (NaN counts as refused)."""
            earlier = order[: order.index(f)]
            return [b for b in todo if not any(errors[c][b] <= cfg.bound(c) for c in earlier)]

        def measure(b: int, f: Format) -> float:  # choose_within_bound's callback, per block
            if f not in errors:  # one batched encode per format, over the blocks that reach it
                batch = undecided_at(f)
                encs, errs = self._encode_all_layers(batch, f, measure=True)
                err = errs[observed_layer(len(errs))].tolist()  # the layer vLLM's worker probes
                errors[f] = dict(zip(batch, err, strict=True))
                encoded[f] = (batch, encs)
            return errors[f][b]

        chosen: dict[Format, list[int]] = {}
        for b in todo:
            verdict = choose_within_bound(order, partial(measure, b), cfg)
            report.rejected += sum(1 for f, err, bound in verdict.attempts if not err <= bound)
            if verdict.chosen is None:
                self.ineligible.add(b)
            else:
                chosen.setdefault(verdict.chosen, []).append(b)
        for f in order:  # commit in the order measured (harshest first), as before
            accepted = chosen.get(f, [])
            if not accepted:
                continue
            batch, encs = encoded[f]
            if accepted != batch:
                encs = self._reencode(accepted, f)  # the store holds no rejected rows
            self._commit(accepted, f, encs)
            report.actions += len(accepted)
            report.formats[f.name] = report.formats.get(f.name, 0) + len(accepted)

    def _reachable_from(self, src: tuple[Format, ...], fmt: Format) -> bool:
        """Every layer's stored format can be recompressed into its version of `fmt`."""
        return all(recompressible(s, self._layer_format(fmt, li)) for li, s in enumerate(src))

    def _reachable(self, i: int, fmt: Format, ladder: Sequence[Format]) -> Format | None:
        """`fmt` if block i can move there; else the mildest ladder format of at least that ratio it
        can reach (a merged block asked for a sparse format merges further instead); else None."""
        src = tuple(layer.formats[i] for layer in self.proxima_layers)
        if self._reachable_from(src, fmt):
            return fmt
        subs = sorted(
            (f for f in ladder if f.pack_ratio >= fmt.pack_ratio and self._reachable_from(src, f)),
            key=lambda f: f.pack_ratio,
        )
        return subs[0] if subs else None

    def _extend_chosen(self) -> None:
        n = self.proxima_layers[0].n_blocks if self.layers else 0
        self.chosen += [HOT] * (n - len(self.chosen))

    def _layer_format(self, fmt: Format, layer: int) -> Format:
        return self.policy.layer_format(fmt, layer)

    def _encode_all_layers(
        self, blocks: list[int], fmt: Format, *, measure: bool = True
    ) -> tuple[list[tuple[Format, CompressedBlocks]], list[torch.Tensor]]:
        """Compress `blocks` (each layer's stored format the same for all of them) into `fmt`.
        The probe error is measured in the observed layer when `measure`, in every layer when probes
        are recorded, else reported as 0 (nobody reads it: a third of an unprobed compression's
        time went to it)."""
        encs, errs = [], []
        for li, layer in enumerate(self.proxima_layers):
            lf = self._layer_format(fmt, li)
            kk, vv, lc, timp = self._block_rows(li, blocks)
            b = layer.tail_k.shape[0] if layer.tail_k is not None else 1
            # What vLLM holds hot is the 16-bit cache; compress exactly that, with the call its worker makes.
            kk, vv = kk.to(self.kv_dtype or kk.dtype), vv.to(self.kv_dtype or vv.dtype)
            group = self.group_for(lf)
            where = self.policy.storage.field_for(lf) if self._group_size is None else "ProximaCache(group_size=)"
            check_group_size(group, kk.shape[-1], (lf,), where)
            prot = self.policy.protect
            cb = compress_blocks(
                lf, kk, vv, token_importance=timp, group_size=group, log_count=lc,
                source_tokens=layer.block_size, backend=self.backend,
                pinned_tokens=prot.merged_tokens, pin_by=prot.merged_by,
            )
            measured = (measure and li == observed_layer(len(self.proxima_layers))) or self.record_probes
            err = self._probe(li, kk, vv, cb, b, lc) if measured else torch.zeros(len(blocks))  # [n]
            if self.record_probes:
                self._record(li, blocks, lf, kk, timp, err, b)
            encs.append((lf, cb))
            errs.append(err)
        return encs, errs

    def _block_rows(
        self, layer_idx: int, blocks: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """What `blocks` hold now in one layer, rows ordered (block, batch element):
        k, v `[N, C, H, D]`, their log-counts `[N, C, H]` (None unless token-reduced) and token
        importance `[N, C, H]` (None before any observation). Hot blocks read exactly, quantized
        ones dequantised (C = block size); token-reduced ones as their stored rows."""
        layer = self.proxima_layers[layer_idx]
        bsz = layer.block_size
        src = layer.formats[blocks[0]]
        lc: torch.Tensor | None = None
        if src.reduction is None:
            wk, wv, _ = layer.materialize()
            k = torch.stack([wk[..., i * bsz : (i + 1) * bsz, :] for i in blocks])  # [n, B, H, bs, D]
            v = torch.stack([wv[..., i * bsz : (i + 1) * bsz, :] for i in blocks])
            n, b, h, c, d = k.shape
            kk = k.reshape(n * b, h, c, d).transpose(1, 2)  # [N, bs, H, D]
            vv = v.reshape(n * b, h, c, d).transpose(1, 2)
        else:
            c = src.kept_tokens(bsz)
            decoded: dict[int, Decoded] = {}
            ks, vs, ls = [], [], []
            for i in blocks:
                slot = layer.slots[i]
                assert slot is not None and layer.formats[i] == src, f"block {i} is not stored as {src}"
                if id(slot.cb) not in decoded:
                    decoded[id(slot.cb)] = slot.decode()
                kh, vh, lh = decoded[id(slot.cb)]
                ks.append(kh[slot.rows])
                vs.append(vh[slot.rows])
                ls.append(lh[slot.rows])
            kk, vv, lc = torch.cat(ks), torch.cat(vs), torch.cat(ls)
            h = kk.shape[2]
        # Every layer's tokens are ranked by the observed layer's attention, as in the vLLM worker.
        imp = self.token_importance(observed_layer(len(self.layers)))
        timp = None
        if imp is not None:
            t = torch.stack([imp[..., i * bsz : i * bsz + c] for i in blocks])  # [n, B, H, C]
            timp = t.reshape(-1, h, c).transpose(1, 2).contiguous()
        return kk, vv, lc, timp

    def _probe(
        self,
        layer_idx: int,
        k: torch.Tensor,
        v: torch.Tensor,
        cb: CompressedBlocks,
        batch: int,
        log_count: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Relative error of the observation window's attention output over each block alone,
        before vs after compression (`proxima.compression.attention_errors`, the probe every
        integration uses), averaged over the batch. Returns `[n_blocks]`."""
        q = self._obs.get(layer_idx)
        n = k.shape[0] // batch
        if q is None:
            return torch.zeros(n)
        q_rows = q.transpose(1, 2).repeat(n, 1, 1, 1)  # [N, W, Hq, D], rows ordered (block, batch)
        return attention_errors(q_rows, k, v, cb, ref_log_count=log_count).view(n, batch).mean(1).cpu()

    def _record(
        self,
        layer_idx: int,
        blocks: list[int],
        fmt: Format,
        k: torch.Tensor,
        timp: torch.Tensor | None,
        err: torch.Tensor,
        batch: int,
    ) -> None:
        norms = k.float().norm(dim=-1)  # [N, bs, H]
        spread = (norms.std(1) / norms.mean(1).clamp_min(1e-12)).mean(1).view(-1, batch).mean(1)
        mass = timp.sum(1).amax(1).view(-1, batch).amax(1) if timp is not None else torch.zeros(len(blocks))
        # One device-to-host copy per tensor (a float() per element would synchronise a GPU each time).
        masses, spreads, errs = mass.tolist(), spread.tolist(), err.tolist()
        for j, blk in enumerate(blocks):
            self.probe_log.append(ProbeRecord(layer_idx, blk, fmt.name, masses[j], spreads[j], errs[j]))

    def _commit(self, blocks: list[int], fmt: Format, encs: list[tuple[Format, CompressedBlocks]]) -> None:
        for layer, (lf, enc) in zip(self.proxima_layers, encs, strict=True):
            assert layer.tail_k is not None
            layer.store(blocks, lf, enc, layer.tail_k.shape[0], self.backend)
        for i in blocks:
            self.chosen[i] = fmt

    def _reencode(self, blocks: list[int], fmt: Format) -> list[tuple[Format, CompressedBlocks]]:
        record, self.record_probes = self.record_probes, False
        try:
            encs, _ = self._encode_all_layers(blocks, fmt, measure=False)
        finally:
            self.record_probes = record
        return encs

    def compress_all(self, fmt: Format | str, *, protect_sinks: int = 0, protect_recent: int = 0) -> CompressionReport:
        """Compress every full block outside the protected windows into `fmt` (uniform methods)."""
        fmt = Format.parse(fmt) if isinstance(fmt, str) else fmt
        layer0 = self.proxima_layers[0]
        bs = self.block_size
        blocks = [
            i
            for i in range(layer0.n_blocks)
            if i * bs >= protect_sinks and (i + 1) * bs <= layer0.n_tokens - protect_recent
        ]
        return self.compress_blocks(blocks, fmt)

    def evict_tokens(self, keep: Sequence[torch.Tensor]) -> None:
        """Token eviction for the baselines: per layer a bool `[B, H_kv, T_full]` over full blocks."""
        for layer, kp in zip(self.proxima_layers, keep, strict=True):
            layer.evict(kp)
