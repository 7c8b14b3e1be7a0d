"""The KV connector: vLLM's supported per-step channel between scheduler and worker.

Proxima loads no external KV (it reports zero external tokens), so vLLM's prefix caching and
scheduling are unchanged. It uses the connector's *channel*:

* scheduler: `bind_kv_cache_manager` (install the manager subclass), `build_connector_meta`
  (end of schedule: plan), `update_connector_output` (commit), `has_pending_block_frees`
  (wait instead of preempting while a commit is in flight);
* worker: `register_kv_caches`, `bind_connector_metadata` (before the forward: execute the
  plan), `build_connector_worker_meta` (report).

The worker role owns the process's `WorkerStore` (the compressed blocks' maps and slot pools).
vLLM keeps the worker's connector as the process's KV transfer group, so the attention backends
find the store through vLLM's accessor (`worker_store()`), with no global of Proxima's own.

With tensor parallelism there is one scheduler-side connector and one worker-side connector per
rank: every rank gets the same plan, and vLLM merges the ranks' reports into one before
`update_connector_output` (`ranks.py`).

With the runtime API enabled, the scheduler side also drives `live.LiveControl` (policy swaps,
fallback level, stats, step reports); without it `self.live` stays None and nothing changes.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

from proxima.integration.vllm.plan import ProximaPlan, ProximaReport, settle

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from proxima.integration.vllm.scheduler.live import LiveControl
    from proxima.integration.vllm.scheduler.manager import ProximaKVCacheManager
    from proxima.integration.vllm.worker.block_table import DeviceBlockTable
    from proxima.integration.vllm.worker.store import WorkerStore

logger = logging.getLogger("proxima.vllm")
STATS_ENV = "PROXIMA_STATS_FILE"
"""If set, the scheduler side writes its counters there (JSON) at every step and after every
request's blocks are freed."""


def _no_table(fmt: Any) -> str:
    """`WorkerStore.format_gate` once the device block table stopped following the steps under
    CUDA graphs (`ProximaConnector._retire_block_table`)."""
    return ("the device block table stopped following the steps (see the worker's log) and decode batches "
            "replay CUDA graphs that read it: nothing more is compressed in this engine")


class ProximaConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        from proxima.integration.vllm import POLICY_ENV
        from proxima.policy.loader import load_policy
        from proxima.policy.schema import Policy

        path = os.environ.get(POLICY_ENV)
        self.policy_source = path or "initial"
        self.policy = load_policy(path) if path else Policy(enabled=False)
        self.manager: ProximaKVCacheManager | None = None  # scheduler role, set in bind_kv_cache_manager
        self.live: LiveControl | None = None  # scheduler role, only when the runtime API is enabled
        self.store: WorkerStore | None = None  # worker role
        self.block_table: DeviceBlockTable | None = None
        """Worker role: the compressed blocks' map on the device (`block_table.py`), kept in step
        with `store.remap` after each plan; None without the one-pass decode (`PROXIMA_ONE_PASS_DECODE`,
        read when the caches are registered: nothing else reads the table), before the caches are
        registered, or after an update failed (the attention then plans from the host maps)."""
        self._retired_tables: list[DeviceBlockTable] = []
        """Tables that stopped following the steps, kept alive: a CUDA graph captured with the
        one-pass decode holds their tensors' addresses and replays whatever Python decides."""
        self.ranks = int(vllm_config.parallel_config.tensor_parallel_size)
        """Worker ranks of this engine, each with its shard's KV heads (`ranks.py`)."""
        self._importance_readback: Any = None
        """Worker role: `device_importance.ImportanceReadback` (the device-observed importance's
        way into the next step's report)."""
        if role == KVConnectorRole.WORKER:
            from proxima.integration.vllm.worker.device_importance import ImportanceReadback
            from proxima.integration.vllm.worker.store import WorkerStore

            self.store = WorkerStore(rank=_tensor_parallel_rank())
            self._importance_readback = ImportanceReadback()

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.33 asks; 0.32 never calls it): sleep mode frees and remaps the KV tensors,
        and the worker's compressed slots are views into them and its side tables index them, so
        what they held would be lost or read from freed memory after a wake-up."""
        return False

    # --- scheduler role ---------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        from proxima.integration.vllm.scheduler.manager import install

        pp = int(self._vllm_config.parallel_config.pipeline_parallel_size)
        if pp > 1:  # each stage would report only its layers' writes: untested, so not offered
            logger.warning("proxima: pipeline_parallel_size %d is not supported; Proxima stays inactive", pp)
            return
        self.manager = install(kv_cache_manager, self.policy, ranks=self.ranks)
        if self.manager is not None:
            from proxima.integration.vllm.scheduler.queue_demand import QueueDemand, binding_scheduler

            scheduler = binding_scheduler()  # patch 4: the queue the engine prices in
            self.manager.px.queue = QueueDemand(scheduler) if scheduler is not None else None
        if self.manager is not None and os.environ.get(STATS_ENV):
            self.manager.px.on_change = self.dump_stats
        if self.manager is not None:
            from proxima.integration.vllm.scheduler.canary import prefill_chunk_tokens
            from proxima.integration.vllm.scheduler.live import LiveControl
            from proxima.integration.vllm.worker.drift_observer import configured

            observer = configured(self._vllm_config)
            self.manager.px.probes.drift_observer = observer
            self.live = LiveControl.from_env(self.manager, self.policy, self.policy_source, drift_observer=observer,
                                             canary_chunk_tokens=prefill_chunk_tokens(self._vllm_config))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.manager is None:
            return ProximaPlan()
        if self.live is not None:
            self.live.before_plan()  # a policy changed through the API is planned with from this step on
        plan = self.manager.build_plan(scheduler_output.num_scheduled_tokens.keys())
        if self.live is not None:
            self.live.after_plan()
        if os.environ.get(STATS_ENV):
            self.dump_stats()
        return plan

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        rep = connector_output.kv_connector_worker_meta
        if self.manager is not None and isinstance(rep, ProximaReport):
            rep = settle(rep, self.ranks)  # every rank's report merged by vLLM (ProximaReport.aggregate)
            if self.live is not None:
                self.live.commit(rep)  # applies the report, then tells the controller about the step
            else:
                self.manager.apply_report(rep)

    def has_pending_block_frees(self) -> bool:
        return self.manager is not None and self.manager.has_pending()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def dump_stats(self) -> None:
        import json

        path = os.environ.get(STATS_ENV)
        if path and self.manager is not None:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.manager.summary(), f)
            os.replace(tmp, path)

    def shutdown(self) -> None:
        self.dump_stats()
        if self.live is not None:
            self.live.stop()

    # --- worker role ------------------------------------------------------------------------

    def _worker_store(self) -> WorkerStore:
        if self.store is None:
            raise RuntimeError(f"proxima: a worker-side connector hook ran on the {self.role.name} role's connector")
        return self.store

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from proxima.integration.vllm.worker.store import SlotReader

        store = self._worker_store()
        store.register(kv_caches)
        self._check_side_table_budget(store, kv_caches)
        from proxima.integration.vllm.worker.block_table import one_pass_decode

        device = next(iter(kv_caches.values())).device if kv_caches else None
        if one_pass_decode(device):  # only the one-pass decode reads it: without it, no table to keep current
            from proxima.compression.mixed_decode import READS_QUANTS
            from proxima.compression.spec import LEAN_BITS

            self._make_block_table(kv_caches)
            if self.block_table is not None:
                store.format_gate = self.block_table.refusal  # never a format the kernel has no code for
            # The lean reader costs every other format of the kernel (H100, 8 x 32k: bf16 pages
            # 0.38 -> 0.44 ms a layer, int4 3.02 -> 3.18): compiled in only when the start-up
            # policy stores a lean format. A lean format a live policy brings later is refused
            # (`WorkerStore._readable`: the block stays hot, the report says why).
            store.one_pass_lean = any(f.quant in LEAN_BITS for f in store.stored_formats())
            store.readable_quants = READS_QUANTS if store.one_pass_lean else READS_QUANTS - set(LEAN_BITS)
        store.require_reader = True  # a real worker: compress only if a Proxima backend reads it
        # The model (and with it every layer's attention implementation) is built before vLLM
        # creates this connector, so the readers are found on the layers, not announced by them.
        layers = self._vllm_config.compilation_config.static_forward_context
        readers = [impl for name in kv_caches
                   if isinstance(impl := getattr(layers.get(name), "impl", None), SlotReader)]
        store.readers = {type(impl).__name__ for impl in readers}
        if readers and kv_caches and store.compressible:  # the reader's kernel says how pages are ordered
            store.use_layout(readers[0].page_layout(next(iter(kv_caches.values()))))
            readers[0].warm_up(store)
            from proxima.integration.vllm.worker.step_warm_up import warm_up_step_groups

            warm_up_step_groups(store)  # the executor's own groups: no compile inside a step

    def _check_side_table_budget(self, store: WorkerStore, kv_caches: dict[str, Any]) -> None:
        """On CUDA, with a pool vLLM sized from `gpu_memory_utilization` (no override): warn at
        start-up when the side tables can outgrow the memory vLLM leaves outside its budget
        (`worker/side_table_budget.py`). CPU pages commit where written: nothing to say there."""
        import torch

        from proxima.integration.vllm.worker.side_table_budget import check_at_startup

        first = next(iter(kv_caches.values()), None)
        cache = self._vllm_config.cache_config
        if first is None or first.device.type != "cuda" or cache.num_gpu_blocks_override:
            return
        try:  # a word of advice: it never stops the engine from starting
            _free, total = torch.cuda.mem_get_info(first.device)
            pool = sum(t.numel() * t.element_size() for t in kv_caches.values())
            check_at_startup(store.policy, len(kv_caches), tuple(first.shape), pool, total,
                             float(cache.gpu_memory_utilization))
        except Exception as exc:
            logger.info("proxima: side-table budget not checked: %s", exc)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # vLLM calls start_load_kv *after* the forward when no sync load is pending, but binds
        # the metadata before it: this is the last point before attention reads the blocks.
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, ProximaPlan):
            store = self._worker_store()
            # A sampled step counts what this step sends to the device (`step_counter.py`): the
            # compression and the block table's update here, the row planning in the attention.
            store.counter.start_step(bool(connector_metadata.actions))
            with store.counter.region(store.device):
                with store.times.span("compress_s", store.device):
                    store.apply(connector_metadata)
                self._update_block_table(connector_metadata)
            store.times.begin("forward_s", store.device)  # ends in build_connector_worker_meta

    def _make_block_table(self, kv_caches: dict[str, Any]) -> None:
        from proxima.integration.vllm.worker.block_table import table_for

        model = self._vllm_config.model_config
        self.block_table = table_for(kv_caches, int(self._vllm_config.scheduler_config.max_num_seqs),
                                     int(model.max_model_len) if model is not None else None)
        self._refresh_descriptors()  # allocated now, before any CUDA graph captures their addresses

    def _update_block_table(self, plan: ProximaPlan) -> None:
        """The step's changes of `store.remap` into the device table (separate from `apply`, which
        stays the host map's only writer). A failure here never fails a request: the table is
        dropped and attention keeps planning from the host maps."""
        from proxima.integration.vllm.worker.block_table import step_placements

        table, store = self.block_table, self._worker_store()
        # A probed action is installed when its verdict is read, often after its own plan: its
        # placement enters the table with the plan after that (until then it reads the source).
        settled, store.settled = store.settled, []
        if table is None:
            return
        try:
            table.update(step_placements([*plan.revoked, *plan.actions, *settled], store.remap), plan.dropped,
                         plan.key_blocks)
            # Codes no entry holds go back, except those of blocks the probe is still judging and
            # those a revocation may restore (`store.replaced`: the entry a recompression replaced).
            keep = {b.stored for b in store.probing if b.stored is not None}
            keep.update(old[0] for blocks in store.replaced.values() for _, old in blocks.values())
            table.release_unused(keep)
        except Exception:
            logger.exception("proxima: the device block table could not follow this step; attention plans "
                             "from the host maps from now on")
            self._retire_block_table()
        self._refresh_descriptors()

    def _refresh_descriptors(self) -> None:
        """The one-pass decode's pool descriptors, current with the table's formats, here (every
        step, outside any CUDA graph) rather than in the forward, which a graph replay skips."""
        from proxima.integration.vllm.worker.decode_descriptors import refresh_descriptors

        if self.block_table is None or self.store is None:
            return
        try:
            refresh_descriptors(self.store, self.block_table)
        except Exception:
            logger.exception("proxima: the one-pass decode's pool descriptors could not be built; attention "
                             "plans from the host maps from now on")
            # A code may already name a new format in the entries while its row still describes the
            # old pool: zeroed, a replayed graph skips those blocks rather than read out of bounds.
            for _, desc in self.block_table.descriptors.values():
                desc.zero_()
            self._retire_block_table()

    def _retire_block_table(self) -> None:
        """Stop using the device table, without freeing it (`_retired_tables`): a decode graph
        captured with the one-pass kernel replays it whatever the host decides; freed, its memory
        would be reused and the replay would read pointers out of other data. Eager batches plan
        from the host maps; but a replayed decode graph reads this table, which no longer follows
        the steps (on the H100 soak that ran out of format codes, 2026-12-06: NaN logprobs), so
        with full CUDA graphs nothing more is compressed. That limits the harm, it does not undo it:
        the replays keep reading the stale table for the blocks already compressed. Retiring is
        therefore logged as an error path; the format codes (`DeviceBlockTable.refusal`, codes
        kept for in-flight and revocable blocks) keep the known cause from reaching it."""
        if self.block_table is not None:
            self._retired_tables.append(self.block_table)
            self.block_table = None
            if self.store is not None:
                self.store.format_gate = None if not self._graphs_replay_decode() else _no_table

    def _graphs_replay_decode(self) -> bool:
        """Whether decode batches replay full CUDA graphs (vLLM's `cudagraph_mode` FULL, FULL_DECODE_ONLY
        or FULL_AND_PIECEWISE): there attention is inside the graph; piecewise graphs run it eagerly."""
        mode = getattr(self._vllm_config.compilation_config, "cudagraph_mode", None)
        return mode is not None and "FULL" in getattr(mode, "name", str(mode))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        store = self._worker_store()
        store.times.end("forward_s", store.device)
        self._report_device_importance(store)
        return store.take_report()

    def _report_device_importance(self, store: WorkerStore) -> None:
        """The previous step's device-observed importance into this step's report; this step's
        (if its observed layer ran on the device, `DeviceBlockTable.observed`) queued for the next."""
        from proxima.integration.vllm.worker.device_importance import seed_from_host

        readback, table = self._importance_readback, self.block_table
        if readback is None:
            return
        try:
            # Observed on the host this step: the device average goes on from there (only read on the
            # one-pass path, so nothing to seed without it).
            if table is not None:  # (a table is kept only with the one-pass decode on)
                b = next(iter(store.kv_caches.values())).shape[2] if store.kv_caches else 1
                for rid in store.report.importance:
                    if (imp := store.token_importance.get(rid)) is not None:
                        seed_from_host(table, rid, imp, b)
            readback.finish(store.report)
            if table is not None and table.observed is not None:
                width, table.observed = table.observed, None
                readback.start(table, sorted(set(store.key_blocks.values())), width, store.aggregate)
                readback.finish(store.report, wait=False)
        except Exception as e:  # importance is advisory: never fail the step
            store.report.errors.append(f"importance: {type(e).__name__}: {e}")


def _tensor_parallel_rank() -> int:
    """This worker's rank in its tensor-parallel group (0 outside vLLM's distributed setup: tests)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return int(parallel_state.get_tensor_model_parallel_rank())


def worker_block_table() -> DeviceBlockTable | None:
    """The device block table of this worker process's connector (None: none, or Proxima not
    configured in it)."""
    if not has_kv_transfer_group():
        return None
    conn = get_kv_transfer_group()
    return conn.block_table if isinstance(conn, ProximaConnector) else None


def worker_store() -> WorkerStore | None:
    """This worker process's store: the one of the KV connector vLLM runs here, if it is Proxima's.

    None when vLLM runs without a connector or with another one: the attention backends then
    behave exactly as their vLLM parents."""
    if not has_kv_transfer_group():
        return None
    connector = get_kv_transfer_group()
    return connector.store if isinstance(connector, ProximaConnector) else None
