"""What the KV manager keeps for the whole-model quality probes (canary and drift), in one type.

The canary runner's requests (`canary.py`) and the drift probe's holdout (`drift.py`) are resident
requests the pressure must not compress as it compresses the others; the controller's verdict
(`probe_status`) is what the policy engine is told each step. `ProximaState.probes` holds one.
Invariant: `canaries` counts the resident special requests (canaries and their references), and
`holdout` holds only resident requests: `admitted` and `released` keep both in step with the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxima.integration.vllm.scheduler.canary import is_canary, is_special
from proxima.policy.snapshot import ProbeStatus


@dataclass
class ProbeState:
    status: ProbeStatus = "ok"
    """What the quality probes say, for the policy engine (`Snapshot.probe_status`; set each step
    by `live.LiveControl` from the controller)."""
    canaries: int = 0
    """Resident canary and reference requests (`canary.py`; 0: planning skips looking for them)."""
    holdout: set[str] = field(default_factory=set)
    """Resident requests of the drift probe's holdout (`drift.is_holdout`): never compressed, the
    uncompressed population the compressed requests' tokens are compared with."""
    canary_prompt_tokens: int | None = None
    """Prompt tokens of the last live canary admitted (`canary.py`: informative only when vLLM
    prefills it in more than one step; `live.LiveControl` compares it with the chunk size)."""
    drift_observer: bool = True
    """The worker runs the drift probe's observer (`drift_observer.py`; the connector says, from
    vLLM's configuration). Without it nothing is held out or tagged for the drift probe."""

    def admitted(self, req_id: str, prompt_tokens: int, *, holdout: bool) -> None:
        """A request entered the ledger; `holdout`: the drift probe holds it out."""
        self.canaries += is_special(req_id)
        if is_canary(req_id):
            self.canary_prompt_tokens = prompt_tokens
        if holdout:
            self.holdout.add(req_id)

    def released(self, req_id: str) -> None:
        """A request left the ledger."""
        self.canaries -= is_special(req_id)
        self.holdout.discard(req_id)
