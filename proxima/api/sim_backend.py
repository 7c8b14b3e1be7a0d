"""The simulated engine behind `proxima api serve --simulate` and the API tests.

`SimulatedBackend` wraps the step-level `Simulator` with an endless synthetic workload (a new
batch of requests is offered whenever the queue runs low). `SimulatedQuality` produces canary
log-probs whose damage an operator (or a test) can inject. `SimDriver.tick()` is one engine step
done the way the live integration will do it: take the policy and fallback level from the
controller, step, report, and run the canary when it is due.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np

from proxima.api.backend import BackendStats, StepReport
from proxima.api.controller import Controller
from proxima.compression.spec import slot_spec
from proxima.formats import Format
from proxima.policy.probes import DriftSample, ProbeResult, drift_test, evaluate_canary
from proxima.policy.schema import CanaryProbe, DriftProbe, Policy, Storage
from proxima.simulator.sim import PoolConfig, Simulator
from proxima.simulator.workload import RequestSpec, WorkloadConfig, synthetic

# One uncompressed 16-token block of SmolLM2-135M (K and V, 30 layers, 3 KV heads, head_dim 64,
# bf16): 2 * 30 * 3 * 64 * 16 * 2 bytes. Only scales `saved_bytes`; nothing else depends on it.
SMOLLM2_BLOCK_BYTES = 2 * 30 * 3 * 64 * 16 * 2
SMOLLM2_GEOMETRY = {"layers": 30, "num_kv_heads": 3, "head_dim": 64}


def side_table_bytes(
    blocks_by_format: dict[str, int], block_size: int, geometry: dict[str, int], storage: Storage
) -> int:
    """Metadata bytes of compressed blocks held as `blocks_by_format` says (SmolLM2's geometry),
    each format at the quantization group the policy stores it with (`storage.group_for`)."""
    total = 0
    for name, n in blocks_by_format.items():
        fmt = Format.parse(name)
        if fmt.is_hot:
            continue
        spec = slot_spec(fmt, block_size=block_size, head_dim=geometry["head_dim"],
                         num_kv_heads=geometry["num_kv_heads"], group_size=storage.group_for(fmt))
        total += n * spec.meta_bytes_per_slot * geometry["layers"]
    return total


DRIFT_EVERY_STEPS = 20


class SimulatedBackend:
    """A simulator that never runs dry, safe to read from API threads while it steps."""

    def __init__(
        self,
        policy: Policy,
        pool: PoolConfig | None = None,
        workload: WorkloadConfig | None = None,
        seed: int = 0,
        block_bytes: int = SMOLLM2_BLOCK_BYTES,
    ) -> None:
        # The server runs until interrupted, so the simulator's runaway guard must never trip.
        self.pool_cfg = pool or PoolConfig(total_blocks=1024, block_size=16, max_running=128, max_steps=1 << 62)
        self.workload_cfg = workload or WorkloadConfig(num_requests=32, arrival_rate=2.0)
        self.seed = seed
        self.block_bytes = block_bytes
        self._lock = threading.Lock()
        self._batch = 0
        self._version = 0
        self.sim = Simulator(self.pool_cfg, policy, seed=seed, label="api")
        self.sim.start(self._next_batch(0))

    def _next_batch(self, at_step: int) -> list[RequestSpec]:
        specs = synthetic(self.workload_cfg, self.seed + self._batch)
        batch = self._batch
        self._batch += 1
        return [replace(s, request_id=f"b{batch}-{s.request_id}", arrival=s.arrival + at_step) for s in specs]

    def step(self, version: int, policy: Policy, fallback_level: int) -> StepReport:
        """One engine step under `policy` (swapped in if its version changed) at `fallback_level`."""
        with self._lock:
            sim = self.sim
            if version != self._version:
                sim.set_policy(policy)
                self._version = version
            if len(sim.waiting) + sim.pending_arrivals < self.workload_cfg.num_requests // 2:
                sim.add_requests(self._next_batch(sim.step_no))
            sim.state = replace(sim.state, fallback_level=fallback_level)
            before = dict(sim.result.decisions_by_format)
            skipped = sim.result.compressions_skipped
            sim.step()
            after = sim.result.decisions_by_format
        decided = {f: n - before.get(f, 0) for f, n in after.items() if n - before.get(f, 0) > 0}
        errors = {"pool_exhausted": sim.result.compressions_skipped - skipped}
        return StepReport(decided, {k: v for k, v in errors.items() if v})

    def stats(self) -> BackendStats:
        with self._lock:
            sim, pool = self.sim, self.sim.pool
            storage = sim.policy.storage if sim.policy is not None else Storage()  # off: nothing compressed
            decision = sim.last_decision
            free = pool.num_free()
            physical = 1.0 - free / self.pool_cfg.total_blocks
            return BackendStats(
                pressure=decision.pressure if decision is not None else physical,
                total_blocks=self.pool_cfg.total_blocks,
                free_blocks=free,
                owned_blocks=self.pool_cfg.total_blocks - free,  # free + owned == total (sim.check)
                blocks_by_format=(by_fmt := sim.blocks_by_format()),
                block_bytes=self.block_bytes,
                fragmentation_blocks=sim.packer.fragmentation_blocks(),
                step=sim.step_no,
                applied_policy_version=self._version or None,
                meta_bytes=side_table_bytes(by_fmt, self.pool_cfg.block_size, SMOLLM2_GEOMETRY, storage),
            )


class SimulatedQuality:
    """Canary log-probs for the simulator: the reference, and a live copy with injectable damage.

    `degradation` is the standard deviation of Gaussian noise added to the live logits; 0 gives a
    perfect canary. `inject()` is how tests and demos simulate a quality regression.
    """

    def __init__(self, prompts: int = 4, positions: int = 32, vocab: int = 256, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        # Peaked distributions, like a language model's: a clear top-1 most of the time.
        self.reference = [rng.standard_normal((positions, vocab)) * 3.0 for _ in range(prompts)]
        self.degradation = 0.0
        self._rng = np.random.default_rng(seed + 1)

    def inject(self, degradation: float) -> None:
        self.degradation = float(degradation)

    def drift(self, cfg: DriftProbe) -> ProbeResult:
        """A window of compressed-request tokens against the holdout's; damage lowers log-probs."""
        n = cfg.window
        hold = DriftSample(-self._rng.exponential(1.0, n), self._rng.gamma(2.0, 1.0, n))
        shift = self.degradation * 0.5
        comp = DriftSample(-self._rng.exponential(1.0, n) - shift, self._rng.gamma(2.0, 1.0, n) + shift)
        return drift_test(comp, hold, cfg)

    def canary(self, cfg: CanaryProbe) -> ProbeResult:
        live = [r + self._rng.standard_normal(r.shape) * self.degradation for r in self.reference]
        return evaluate_canary(self.reference, live, cfg)


class SimDriver:
    """Runs the simulated engine: `tick()` is one step; `start()` ticks on a background thread."""

    def __init__(
        self,
        controller: Controller,
        backend: SimulatedBackend,
        quality: SimulatedQuality | None = None,
        step_interval_s: float = 0.05,
    ) -> None:
        self.controller = controller
        self.backend = backend
        self.quality = quality or SimulatedQuality()
        self.step_interval_s = step_interval_s
        self._last_canary: float | None = None
        self._steps_since_drift = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> None:
        ctl = self.controller
        version, level = ctl.policy_for_step()
        ctl.on_step(self.backend.step(version.version, version.policy, level))
        canary = version.policy.probes.canary
        now = ctl.clock()
        if canary.enabled and (self._last_canary is None or now - self._last_canary >= canary.interval_s):
            self._last_canary = now
            ctl.on_probe(self.quality.canary(canary))
        # Drift compares windows of finished requests; in the simulator one window per
        # DRIFT_EVERY_STEPS steps stands in for "enough requests have finished".
        drift = version.policy.probes.drift
        self._steps_since_drift += 1
        if drift.enabled and self._steps_since_drift >= DRIFT_EVERY_STEPS:
            self._steps_since_drift = 0
            ctl.on_probe(self.quality.drift(drift))

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.step_interval_s):
                self.tick()

        self._thread = threading.Thread(target=loop, name="proxima-sim-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
