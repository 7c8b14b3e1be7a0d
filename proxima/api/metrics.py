"""Prometheus metrics of one Proxima engine, on an injectable registry.

Naming follows Prometheus conventions: `proxima_<subsystem>_<name>_<unit>`, base units, `_total`
for counters, `_ratio` for values in [0, 1]. Labels are bounded: `format` takes the formats of
the live policy's ladders (a handful), `probe` three values, `kind`/`reason`/`result` a few each.
Tests pass their own `CollectorRegistry` so that instances never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxima.api.backend import BackendStats

COMPRESSION_ERROR_REASONS = ("kernel", "revoke_mismatch", "pool_exhausted")
"""The `reason` labels of `proxima_engine_compression_errors_total`: the vLLM engine's (`live.py`:
a failed kernel, a revoke the worker did not match) and the simulator's (no destination slot)."""


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        # Pool: what the memory looks like now.
        self.pressure = Gauge(
            "proxima_pool_pressure_ratio",
            "Used fraction of physical KV blocks (pending allocations included).",
            registry=r,
        )
        self.blocks = Gauge(
            "proxima_pool_blocks",
            "Resident logical KV blocks, by storage format.",
            ["format"],
            registry=r,
        )
        self.physical_blocks = Gauge(
            "proxima_pool_physical_blocks",
            "Physical KV blocks, by state (free or owned).",
            ["state"],
            registry=r,
        )
        self.saved_bytes = Gauge(
            "proxima_pool_saved_bytes",
            "KV bytes the resident requests would need more without compression.",
            registry=r,
        )
        # Not a 0-1 value, hence no `_ratio` suffix; 1 when nothing is compressed.
        self.compression_factor = Gauge(
            "proxima_pool_effective_compression_factor",
            "16-bit KV bytes of the resident blocks over bytes held for them (owned blocks plus "
            "side-table metadata).",
            registry=r,
        )
        self.nominal_compression_factor = Gauge(
            "proxima_pool_nominal_compression_factor",
            "Nominal compression: resident logical blocks per owned physical block (metadata not counted).",
            registry=r,
        )
        self.meta_bytes = Gauge(
            "proxima_pool_metadata_bytes",
            "Side-table bytes (scales, zero points, log-counts) of the resident compressed slots.",
            registry=r,
        )
        self.fragmentation = Gauge(
            "proxima_pool_fragmentation_blocks",
            "Allocated but unused capacity, in physical blocks.",
            registry=r,
        )

        # Engine: what it decided and how the compressions went.
        self.steps = Counter("proxima_engine_steps_total", "Engine steps observed.", registry=r)
        self.decisions = Counter(
            "proxima_engine_decisions_total",
            "Compression actions decided, by action and target format.",
            ["action", "format"],
            registry=r,
        )
        self.compression_errors = Counter(
            "proxima_engine_compression_errors_total",
            "Compressions not applied because of an error (the block stays uncompressed).",
            ["reason"],
            registry=r,
        )
        # Every reason an engine reports, at 0 from the start: rate() over a series that appears
        # only with its first error has no data before it (the dashboard panel reads "No data"
        # instead of 0, and a first error is invisible to rate() until its second sample).
        for reason in COMPRESSION_ERROR_REASONS:
            self.compression_errors.labels(reason=reason)
        self.compression_backoffs = Counter(
            "proxima_engine_compression_backoffs_total",
            "Pauses of a format after a failed compression batch (each failure pauses it longer).",
            ["format"],
            registry=r,
        )
        self.compression_backoff_formats = Gauge(
            "proxima_engine_compression_backoff_formats",
            "Formats backing off after failures, not yet committed again (0 = every format healthy).",
            registry=r,
        )
        self.kernel_seconds = Histogram(
            "proxima_engine_compression_kernel_seconds",
            "Wall time of one step's compression kernels.",
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5),
            registry=r,
        )

        # Probes and the fallback ladder.
        self.probe_runs = Counter(
            "proxima_probe_runs_total",
            "Probe verdicts, by probe and result.",
            ["probe", "result"],
            registry=r,
        )
        self.probe_value = Gauge(
            "proxima_probe_value",
            "Last measured value of each probe statistic (KL in nats, top-1 and p as 0-1).",
            ["probe", "stat"],
            registry=r,
        )
        self.compression_rejected = Counter(
            "proxima_probe_compression_rejected_total",
            "Compressions refused by the compression-time probe (error over the policy bound).",
            registry=r,
        )
        self.probe_error = Histogram(
            "proxima_probe_compression_error",
            "Relative attention-output error the compression-time probe measured, by format tried.",
            ["format"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
            registry=r,
        )
        self.probe_seconds = Histogram(
            "proxima_probe_compression_seconds",
            "Wall time of one step's compression-time probe measurements (the probe's cost).",
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5),
            registry=r,
        )
        self.fallback_level = Gauge(
            "proxima_fallback_level",
            "Effective fallback ladder level (0 = the policy as written).",
            registry=r,
        )
        self.fallback_transitions = Counter(
            "proxima_fallback_transitions_total",
            "Fallback ladder level changes, by kind.",
            ["kind"],
            registry=r,
        )

        # Alerts and policy changes.
        self.alerts = Counter(
            "proxima_alerts_fired_total",
            "Alerts raised, by kind and severity.",
            ["kind", "severity"],
            registry=r,
        )
        self.webhook_failures = Counter(
            "proxima_alerts_webhook_failures_total",
            "Alert deliveries to the webhook that failed after all retries.",
            registry=r,
        )
        self.webhook_dropped = Counter(
            "proxima_alerts_webhook_dropped_total",
            "Alerts dropped because the webhook queue was full.",
            registry=r,
        )
        self.policy_version = Gauge("proxima_policy_version", "Version number of the live policy.", registry=r)
        self.policy_changes = Counter(
            "proxima_policy_changes_total",
            "Policy versions installed, by origin.",
            ["origin"],
            registry=r,
        )
        self._known_formats: set[str] = set()

    def set_stats(self, stats: BackendStats) -> None:
        self.pressure.set(stats.pressure)
        # A format that left the pool must read 0, not its last value.
        for name in self._known_formats - set(stats.blocks_by_format):
            self.blocks.labels(format=name).set(0)
        for name, n in stats.blocks_by_format.items():
            self.blocks.labels(format=name).set(n)
        self._known_formats |= set(stats.blocks_by_format)
        self.physical_blocks.labels(state="free").set(stats.free_blocks)
        self.physical_blocks.labels(state="owned").set(stats.owned_blocks)
        self.saved_bytes.set(stats.saved_bytes)
        self.compression_factor.set(stats.effective_compression)
        self.nominal_compression_factor.set(stats.nominal_compression)
        self.meta_bytes.set(stats.meta_bytes)
        self.fragmentation.set(stats.fragmentation_blocks)
