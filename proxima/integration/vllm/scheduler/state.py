"""Everything the Proxima KV manager adds to vLLM's: one typed object (`manager.px`).

`install()` switches vLLM's manager instance to Proxima's class (patch 2 of `_patches`)
and attaches one `ProximaState`, so all of vLLM's own state stays where vLLM put it and all of
Proxima's sits in one place with its types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import KVCacheConfig

from proxima.formats import Format
from proxima.integration.vllm.scheduler.admission import OutputLengths
from proxima.integration.vllm.scheduler.block_source import VllmBlockSource
from proxima.integration.vllm.scheduler.in_flight import InFlight
from proxima.integration.vllm.scheduler.ledger import RequestLedger
from proxima.integration.vllm.scheduler.probe_state import ProbeState
from proxima.integration.vllm.scheduler.queue_demand import QueueDemand
from proxima.integration.vllm.scheduler.side_tables import SideTableCharge
from proxima.integration.vllm.scheduler.stats import MetaSizes, ProximaStats
from proxima.placement import BlockId, SlotPacker
from proxima.policy.backoff import FormatBackoff
from proxima.policy.engine import EngineState
from proxima.policy.schema import Policy


@dataclass
class ProximaState:
    policy: Policy
    """The live policy (blocks already compressed keep their format when it changes)."""
    formats: set[Format]
    """Every format of the live policy's ladders (the vLLM data path stores them all)."""
    blocks: VllmBlockSource
    packer: SlotPacker
    """Destination blocks of every request (the placement model)."""
    meta: MetaSizes
    charge: SideTableCharge
    """Pool blocks held back for the side tables' bytes (`side_tables.py`)."""
    check: bool
    """Assert the placement invariants at every step (tests: PROXIMA_CHECK_ACCOUNTING=1)."""
    engine: EngineState = field(default_factory=EngineState)
    ledger: RequestLedger = field(default_factory=RequestLedger)
    stats: ProximaStats = field(default_factory=ProximaStats)
    in_flight: InFlight = field(init=False)
    """Compressions between plan and report, and what the next plan owes the worker of them
    (`in_flight.py`). It holds `ledger` itself: the ledger is never rebound, only mutated."""
    probes: ProbeState = field(default_factory=ProbeState)
    """The canary and drift probes' requests and the controller's verdict (`probe_state.py`)."""
    on_change: Callable[[], None] | None = None
    """Called after a request's blocks were freed (the connector dumps its counters)."""
    emergency: bool = False
    """An emergency compression is in flight: admit no new request until it commits."""
    waiting_need: int = 0
    """Blocks the largest waiting request needed this step (counted as pressure)."""
    queue: QueueDemand | None = None
    """vLLM's waiting queue, read for the blocks it will ask for (`queue_demand.py`; None: unknown)."""
    backoff: FormatBackoff = field(default_factory=FormatBackoff)
    """Formats whose batches failed are left out of planning for a growing number of steps."""
    policy_version: int = 0
    """Version of `policy` (0: the startup policy; the runtime API's store numbers the changes)."""
    worker_version: int = 0
    """The policy version last sent to the worker (`ProximaPlan.policy`)."""
    targets: set[str] = field(default_factory=set)
    """Resident requests with a compression target still to plan (`targets.py`)."""
    disabled: str | None = None
    """Why compression stopped for good in this engine (the worker cannot read compressed blocks)."""
    outputs: OutputLengths = field(default_factory=OutputLengths)
    """How many tokens a request will output, learned from finished ones (admission)."""

    def __post_init__(self) -> None:
        self.in_flight = InFlight(self.ledger)

    @classmethod
    def create(cls, policy: Policy, pool: BlockPool, config: KVCacheConfig, check: bool, ranks: int = 1
               ) -> ProximaState:
        blocks = VllmBlockSource(pool)
        meta = MetaSizes(config, ranks, policy.storage)
        st = cls(policy=policy, formats=set(), blocks=blocks, packer=SlotPacker(blocks),
                 meta=meta, charge=SideTableCharge(pool, meta.block_bytes), check=check)
        st.adopt(policy, version=0)  # the worker loaded the same startup policy: nothing to send
        return st

    def adopt(self, policy: Policy, version: int | None = None) -> None:
        """Adopt a (validated) policy; takes effect at the next planning step, in this process and
        (sent with that step's plan) in the worker. Blocks already compressed keep their format,
        in-flight actions still commit. `version`: the store's (else the next number)."""
        self.policy = policy
        self.policy_version = self.policy_version + 1 if version is None else version
        self.formats = {f for band in policy.bands for f in band.ladder}

    def release(self, req_id: str, *, free_now: bool = True) -> list[BlockId]:
        """A request's entry and destinations go (its in-flight actions with them); returns its
        destinations (with `free_now=False` the caller frees them: vLLM's deferred-free path)."""
        entry = self.ledger.pop(req_id, None)
        if entry is None:
            return []
        self.probes.released(req_id)
        self.targets.discard(req_id)
        self.in_flight.drop(entry)
        return self.packer.release_request(req_id, free_now=free_now)
