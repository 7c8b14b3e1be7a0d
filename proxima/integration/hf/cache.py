"""`ProximaCache`: a transformers `Cache` that stores KV in Proxima's block formats.

    model = proxima.integration.hf.enable(model)          # attention that reads compressed blocks
    cache = ProximaCache(policy="proxima/policies/balanced.yaml", capacity_blocks=24)
    model.generate(**inputs, past_key_values=cache)

Layout per layer (why: the same logical blocks as vLLM, so the policy engine sees the same thing):
full blocks of `block_size` tokens, each hot (exact tensors) or compressed (a `CompressedBlocks`
payload from `proxima.compression.compress_blocks`, the very call the vLLM worker makes, on the
block cast to the 16-bit KV dtype vLLM caches: the payload is byte for byte what vLLM stores),
then a hot tail of fewer than `block_size` tokens. A block's format
is the same in every layer, except where the policy's `layer_overrides` substitute a format of
equal pack ratio (DESIGN.md). The batch is treated as one request: every row shares the block
formats (the quality harness runs batch 1).

Reads return keys/values at the *logical* length (one slot per token) plus a per-slot additive
bias handed to Proxima's attention function (`attention.py`): 0 for exact and quantized slots,
`log(count)` for centroids, `-inf` for slots a reduced block no longer uses. With policy `off`
nothing is ever compressed and `update` returns exactly what `DynamicCache` returns.

Policy application: `apply_policy(target_ratio=r)` (quality runs: compress until the context is
stored r times smaller) or automatically at the start of each forward when `capacity_blocks` is
set (a virtual pool of that many physical blocks; pressure = used / capacity). Both build a
`Snapshot` of the cache's blocks and call the real engine `proxima.policy.engine.decide`.
Block and token importance come from the observation window: the last W queries of each layer,
recorded by the attention function, scored in one layer (`proxima.observation.observed_layer`, the
middle one, as the vLLM worker observes it) for every layer's blocks and tokens.
Callers may attach hooks (`hooks.py`) that see every layer's queries and every probe measurement:
the quality harness's H2O sums and probe records (`proxima.quality`) are such hooks.

Files: this one holds the Cache API, the constructor's settings, byte accounting and the policy
driver; `layer.py` the per-layer storage, `importance.py` the observation window and importance,
`compress.py` compression behind the probe, `hooks.py` what callers may attach. Batch stacking
(the quality harness's) is `proxima.quality.stacking`.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache

from proxima.compression.blocks import Backend
from proxima.compression.spec import bytes_ratio
from proxima.formats import HOT, Format
from proxima.integration.hf import attention
from proxima.integration.hf.compress import CacheCompression, CompressionReport
from proxima.integration.hf.hooks import ProbeHook, QueryHook
from proxima.integration.hf.importance import CacheImportance
from proxima.integration.hf.layer import ProximaLayer
from proxima.policy import target
from proxima.policy.engine import Action, EngineState, decide
from proxima.policy.schema import OFF, Policy
from proxima.policy.snapshot import RequestBlocks, Snapshot


class ProximaCache(CacheImportance, CacheCompression, Cache):
    """A transformers cache applying Proxima's block formats and policy engine (see module doc).

    Args:
        policy: a `Policy`, a path to a policy YAML, or None (off: a pass-through).
        block_size: tokens per logical block (vLLM's CPU default is 128; 64 gives the quality
            harness finer blocks on short contexts).
        capacity_blocks: size of a virtual KV pool in physical blocks; when set, the engine runs
            at the start of every forward pass, as vLLM's scheduler would.
        keep_working_copy: keep the decompressed view cached between steps (fast; memory = store
            + working copy). False re-materialises compressed blocks on every read, so only the
            compressed store stays resident.
        observation_window: queries per layer kept to score tokens (default: the policy's).
        probe_hook: called with every layer's probe measurements of every compression
            (`hooks.ProbeHook`; every layer is then measured): the damage model's records,
            `proxima.quality.probe_records.ProbeLog`.
        group_size: the quantization group (`proxima.compression.spec.SlotSpec.group_size`);
            None (default): the policy's `storage` (`group_size`, per-format `group_sizes`), as
            the vLLM worker reads it.
        kv_dtype: the dtype a serving KV cache holds (vLLM: bf16). Blocks are cast to it before
            `compress_blocks`, so payloads equal vLLM's even when the model runs in float32 (the
            CPU harness), and hot blocks are counted at its size in `held_nbytes`. None: the
            model's dtype.
        backend: the compression kernels (`proxima.compression.blocks.Backend`): "auto" runs
            Triton on CUDA tensors and the torch reference on CPU tensors, as the vLLM worker
            does; "triton" forces the kernels (on CPU under TRITON_INTERPRET=1, to test the
            path a GPU run takes).
        query_hooks: called with every layer's queries of every forward (`hooks.QueryHook`):
            the H2O baseline's attention sums, `proxima.quality.h2o.AttentionSums`. Attach them
            before the prefill (here or on `query_hooks`), or they miss its queries.
    """

    def __init__(
        self,
        policy: Policy | str | Path | None = None,
        *,
        block_size: int = 64,
        capacity_blocks: int | None = None,
        keep_working_copy: bool = True,
        observation_window: int | None = None,
        probe_hook: ProbeHook | None = None,
        group_size: int | None = None,
        kv_dtype: torch.dtype | None = torch.bfloat16,
        backend: Backend = "auto",
        query_hooks: tuple[QueryHook, ...] = (),
    ) -> None:
        super().__init__(layers=[])
        if isinstance(policy, (str, Path)):
            from proxima.policy.loader import load_policy

            policy = load_policy(policy)
        self.policy: Policy = policy if policy is not None else OFF
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.keep_working_copy = keep_working_copy
        self.window = observation_window or self.policy.importance.observation_window
        self.probe_hook = probe_hook
        self._group_size = group_size
        self.kv_dtype = kv_dtype
        self.backend: Backend = backend
        self.engine_state = EngineState()
        self.block_importance: torch.Tensor | None = None  # EMA per logical block
        self.ineligible: set[int] = set()  # blocks the probe refused for every ladder format
        self._obs: dict[int, torch.Tensor] = {}
        self.query_hooks: list[QueryHook] = list(query_hooks)
        self._pending_bias: int | None = None
        self.chosen: list[Format] = []
        self._stacked = False  # set by `stacked()`: its hot blocks are views of the working copies
        """Per logical block, the format the engine (or a caller) chose; layers may store a substitute."""

    def fork(self) -> ProximaCache:
        """An independent copy of this cache, for compressing the same prefill several ways (the
        quality harness, one copy per method; `apply_policy`'s byte passes): what `copy.deepcopy`
        gives, without copying tensors nothing writes in place. Hot blocks, tails, compressed
        payloads and observation queries are shared (every change replaces them); block lists,
        the engine's bookkeeping and each layer's working copy (patched in place) are copied.
        A deepcopy of a 4k-token SmolLM2 cache is about 27k tensor operations (kernel launches
        on a GPU); a fork is two or three clones per layer. Relies on hot blocks not aliasing the
        working copy, which holds for every cache but a `stacked()` one (its hot blocks are views
        of its working copy, so a fork's would still view the original's): those refuse."""
        if self._stacked:
            raise ValueError("a stacked() cache cannot be forked: its hot blocks are views of its working copies")
        out = copy.copy(self)
        out.layers = [layer.fork() for layer in self.proxima_layers]
        out.engine_state = copy.copy(self.engine_state)
        out.probe_hook = self.probe_hook.fork() if self.probe_hook is not None else None
        out.ineligible = set(self.ineligible)
        out._obs = dict(self._obs)
        out.query_hooks = [h.fork() for h in self.query_hooks]
        out.chosen = list(self.chosen)
        return out

    @property
    def group_size(self) -> int | None:
        """The quantization group forced for every format (the constructor's), or None: the
        policy's `storage` decides per format (`group_for`)."""
        return self._group_size

    @group_size.setter
    def group_size(self, value: int | None) -> None:
        self._group_size = value

    def group_for(self, fmt: Format) -> int:
        """The quantization group of new `fmt` compressions: `group_size` if set, else the policy's
        `storage.group_for(fmt)` (what the vLLM worker uses). Each stored block keeps the group it
        was written with (`CompressedBlocks.group_size`), so reads never depend on this."""
        return self._group_size if self._group_size is not None else self.policy.storage.group_for(fmt)

    # -- transformers interface ----------------------------------------------------------------

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.layers) <= layer_idx:
            self.layers.append(ProximaLayer(self.block_size, self.keep_working_copy))
        if self._pending_bias is not None:
            raise RuntimeError(
                f"layer {self._pending_bias} had compressed blocks that need a per-key bias, but the model's "
                "attention never read it: call proxima.integration.hf.enable(model) (attn_implementation="
                f"{attention.ATTN_NAME!r}) before using sparse or cluster formats"
            )
        if layer_idx == 0 and self.capacity_blocks is not None and not self.policy.is_off:
            self.apply_policy()
        layer = self.proxima_layers[layer_idx]
        keys, values = layer.update(key_states, value_states)
        if layer.last_bias is not None:
            self._pending_bias = layer_idx
        attention.set_active(self)
        return keys, values

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int) -> tuple[int, int]:  # type: ignore[override]
        if layer_idx >= len(self.layers):
            q = int(query_length.shape[0]) if isinstance(query_length, torch.Tensor) else int(query_length)
            return q, 0
        return self.proxima_layers[layer_idx].get_mask_sizes(query_length)

    def _take_attention_bias(self, layer_idx: int, kv_len: int) -> torch.Tensor | None:
        if layer_idx >= len(self.layers):
            return None
        layer = self.proxima_layers[layer_idx]
        bias = layer.last_bias
        layer.last_bias = None
        if self._pending_bias == layer_idx:
            self._pending_bias = None
        if bias is not None and bias.shape[-1] != kv_len:
            raise RuntimeError(f"layer {layer_idx}: bias covers {bias.shape[-1]} keys, attention got {kv_len}")
        return bias

    # -- accounting ----------------------------------------------------------------------------

    @property
    def proxima_layers(self) -> list[ProximaLayer]:
        return self.layers  # type: ignore[return-value]

    def stored_nbytes(self) -> int:
        """Bytes of the store across layers (what a real deployment keeps resident)."""
        return sum(layer.stored_nbytes() for layer in self.proxima_layers)

    def resident_nbytes(self) -> int:
        """Store plus working copies: what this process holds right now."""
        return sum(layer.stored_nbytes() + layer.working_nbytes() for layer in self.proxima_layers)

    def held_nbytes(self) -> int:
        """Bytes a serving deployment holds for this cache: compressed payloads with their
        metadata, hot blocks and the tail at `kv_dtype` (vLLM's 16-bit cache), evicted tokens free."""
        if not self.layers:
            return 0
        itemsize = self.kv_dtype.itemsize if self.kv_dtype is not None else self.proxima_layers[0].dtype.itemsize
        return sum(layer.held_nbytes(itemsize) for layer in self.proxima_layers)

    def kv16_nbytes(self) -> int:
        """The same tokens' keys and values in 16 bits, uncompressed."""
        return sum(layer.kv16_nbytes() for layer in self.proxima_layers)

    def achieved_ratio(self) -> float:
        """The ratio Proxima reports: 16-bit KV bytes over bytes held, metadata included
        (`proxima.compression.spec.bytes_ratio`)."""
        return bytes_ratio(self.kv16_nbytes(), self.held_nbytes())

    def block_formats(self) -> list[Format]:
        return list(self.proxima_layers[0].formats) if self.layers else []

    def nominal_ratio(self) -> float:
        """The *nominal* ratio, shown next to `achieved_ratio` and labelled so: 16-bit KV bits over
        stored bits counting each format at its pack ratio (metadata excluded) and evicted tokens
        as free; averaged over layers."""
        ratios = []
        for layer in self.proxima_layers:
            bs = layer.block_size
            stored = float(layer.tail_k.shape[-2]) if layer.tail_k is not None else 0.0
            for i, fmt in enumerate(layer.formats):
                keep = layer.keep[i]
                frac = 1.0 if keep is None else float(keep.float().mean())
                stored += bs * frac / fmt.pack_ratio
            ratios.append(layer.n_tokens / stored if stored > 0 else 1.0)
        return sum(ratios) / len(ratios) if ratios else 1.0

    # -- the policy engine ---------------------------------------------------------------------

    def snapshot(self, total_blocks: int | target.VirtualPool) -> Snapshot:
        """The cache's blocks as the engine sees them (one request; the tail block included)."""
        layer0 = self.proxima_layers[0]
        n = layer0.n_blocks
        imp = self.block_importance
        if imp is None or len(imp) < n:
            imp = self.refresh_importance()
        self._extend_chosen()
        formats = list(self.chosen[:n])
        tokens = [self.block_size] * n
        importance = [float(x) for x in imp[:n]]
        tail = layer0.tail_k.shape[-2] if layer0.tail_k is not None else 0
        if tail:
            formats.append(HOT)
            tokens.append(tail)
            importance.append(max(importance, default=1.0))
        shared = [i in self.ineligible for i in range(len(formats))]
        return target.virtual_snapshot(RequestBlocks("seq", importance, formats, tokens, shared=shared),
                                       total_blocks, self.block_size)

    def used_blocks(self) -> float:
        """Physical blocks used, amortised over packing (`target.used_blocks`; the tail: one block)."""
        layer0 = self.proxima_layers[0]
        self._extend_chosen()
        tail = [HOT] if layer0.tail_k is not None and layer0.tail_k.shape[-2] else []
        return target.used_blocks([*self.chosen, *tail])

    def apply_policy(self, *, target_ratio: float | None = None, max_steps: int = 32) -> CompressionReport:
        """Run the engine until it has nothing left to do (or `max_steps`). With `target_ratio`,
        the pool is sized so that reaching the top band's target means a `target_ratio`x smaller
        store *in bytes* (`achieved_ratio`, metadata and hot blocks included). The engine counts
        blocks at their pack ratios, which overstate bytes by the metadata (int4: 4x packed, 3.2x
        in bytes), so a pass that ends short is redone from the same starting state with the ask
        raised by the shortfall, at most `target.BYTE_PASSES` passes; the first pass that reaches the
        target (else the last) is kept. Each pass is the policy as written on a fresh pool: a
        second engine round on the compressed state would start below the top band's `enter`
        and, in a policy whose lower band cannot upgrade, change nothing."""
        report = CompressionReport()
        if self.policy.is_off or not self.layers or self.proxima_layers[0].n_blocks == 0:
            return report
        if target_ratio is None:
            if self.capacity_blocks is None:
                raise ValueError("apply_policy needs target_ratio, or capacity_blocks set on the cache")
            self.refresh_importance()
            self._run_engine(self.capacity_blocks, max_steps, report)
            return report
        layer0 = self.proxima_layers[0]
        logical = layer0.n_blocks + (1 if layer0.tail_k is not None and layer0.tail_k.shape[-2] else 0)

        def trial(ask: float) -> tuple[ProximaCache, CompressionReport]:
            fork, rep = self.fork(), CompressionReport()
            fork.refresh_importance()
            fork._run_engine(target.pool_for_ratio(logical, self.policy, ask), max_steps, rep)
            return fork, rep

        band_before = self.engine_state.active_band
        kept, report = target.reach_ratio(target_ratio, trial, achieved=lambda t: t[0].achieved_ratio(),
                                          acted=lambda t: t[1].actions > 0)
        self.__dict__.update(kept.__dict__)  # the kept trial's state becomes this cache's
        # ... but not the band: on the virtual pool every band is entered at any pressure
        # (`target.engine_policy`), so the trial ends in the top band; carried into a later real
        # pool (`capacity_blocks`), hysteresis would hold the top band where a fresh state does not
        self.engine_state = replace(self.engine_state, active_band=band_before)
        return report

    def _run_engine(self, total: int | target.VirtualPool, max_steps: int, report: CompressionReport) -> None:
        probe = self.policy.probes.compression
        policy = target.engine_policy(self.policy, total)
        for _ in range(max_steps):
            snap = self.snapshot(total)
            dec = decide(snap, policy, self.engine_state)
            self.engine_state = dec.state
            report.reasons.append(dec.reason)
            if len(dec) == 0:
                break
            by_fmt: dict[Format, list[Action]] = {}
            for a in dec.actions:
                by_fmt.setdefault(a.to_format, []).append(a)
            band = next((b for b in self.policy.bands if b.name == dec.band), None)
            ladder = band.ladder if band is not None else []
            done_before = report.actions + report.rejected
            for fmt, acts in by_fmt.items():
                r = self.compress_blocks([a.block_index for a in acts], fmt, ladder=ladder, probe=probe.enabled)
                report.actions += r.actions
                report.rejected += r.rejected
                for k, v in r.formats.items():
                    report.formats[k] = report.formats.get(k, 0) + v
            if report.actions + report.rejected == done_before:
                break  # the engine only proposed blocks we cannot touch: no progress possible
