"""The scheduler's half of the two-phase commit: compressions between their plan and their report.

An action's life, and the method that moves it:

    plan  -> pending (its source block still owned by the request, its slot reserved)
    send  -> pending and sent (in a `ProximaPlan`; never sent again)
    commit                  the worker wrote it everywhere: it leaves, the manager frees the source
    fail                    the worker failed or the probe refused it: it leaves, and the next plan
                            revokes it (a tensor-parallel rank may have written it)
    drop                    its request was freed: its actions leave with it, and the next plan
                            tells the worker to forget the request

Invariant (`check`, which the accounting check calls every step under PROXIMA_CHECK_ACCOUNTING=1):
what is sent is pending, and so is every action planned during its request's prefill; the pending
actions are exactly the ledger's `RequestEntry.in_flight`, each under its own request and logical
block (so a block has at most one action in flight); a revoked action is no longer pending.

The ledger's per-request `in_flight` maps are written only here, so that the two views cannot
drift apart: the manager reads them (snapshot, targets, remap checks) and never writes them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from proxima.integration.vllm.plan import ActionId, CompressAction
from proxima.integration.vllm.scheduler.ledger import RequestEntry, RequestLedger


@dataclass(frozen=True)
class Outgoing:
    """What one plan tells the worker of the in-flight ledger (`InFlight.send`)."""

    actions: list[CompressAction]
    """Planned since the last plan, in planning order."""
    revoked: list[CompressAction]
    """Failed since the last plan (`InFlight.fail`'s order)."""
    dropped: list[str]
    """Requests freed since the last plan."""


@dataclass(frozen=True)
class Committed:
    """An action the worker reported written (`InFlight.commit`)."""

    action: CompressAction
    in_prefill: bool
    """Planned while its request's prompt was still being prefilled (counted by the stats)."""


class InFlight:
    """Every planned compression whose report has not arrived, and what the next plan owes the
    worker about them. Holds the ledger to keep each request's `in_flight` view in step."""

    def __init__(self, ledger: RequestLedger) -> None:
        self._ledger = ledger
        self._pending: dict[ActionId, CompressAction] = {}
        self._sent: set[ActionId] = set()
        self._in_prefill: set[ActionId] = set()
        self._revoked: list[CompressAction] = []
        self._dropped: list[str] = []
        self._ids = itertools.count()

    # --- reading ------------------------------------------------------------------------------

    def __bool__(self) -> bool:
        """Whether anything is in flight (the pressure plans only when nothing is)."""
        return bool(self._pending)

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[CompressAction]:
        """The pending actions, in planning order."""
        return iter(self._pending.values())

    def get(self, action_id: ActionId) -> CompressAction | None:
        return self._pending.get(action_id)

    # --- the life of an action ----------------------------------------------------------------

    def next_id(self) -> ActionId:
        """A fresh action id (ids are never reused in an engine: a late report cannot be mistaken)."""
        return ActionId(next(self._ids))

    def plan(self, action: CompressAction, *, in_prefill: bool) -> None:
        """`action` is reserved and goes out with the next plan. Its request must be in the ledger
        with no other action in flight for that block."""
        entry = self._ledger.get(action.req_id)
        if entry is None:
            raise ValueError(f"action {action.action_id}: request {action.req_id} is not in the ledger")
        if action.index in entry.in_flight:
            raise ValueError(f"action {action.action_id}: request {action.req_id} block {action.index} already "
                             f"has action {entry.in_flight[action.index].action_id} in flight (one at a time)")
        if action.action_id in self._pending:
            raise ValueError(f"action id {action.action_id} is already in flight (ids come from `next_id`)")
        entry.in_flight[action.index] = action
        self._pending[action.action_id] = action
        if in_prefill:
            self._in_prefill.add(action.action_id)

    def send(self) -> Outgoing:
        """This plan's message: the actions not sent yet (now sent), and the revocations and
        dropped requests gathered since the last plan (now cleared)."""
        out = Outgoing([a for aid, a in self._pending.items() if aid not in self._sent], self._revoked, self._dropped)
        self._sent.update(a.action_id for a in out.actions)
        self._revoked, self._dropped = [], []
        return out

    def _leave(self, action_id: ActionId) -> tuple[CompressAction, bool] | None:
        """Take an action out of every view; None if it is not in flight (its request was freed)."""
        action = self._pending.pop(action_id, None)
        self._sent.discard(action_id)
        in_prefill = action_id in self._in_prefill
        self._in_prefill.discard(action_id)
        if action is None:
            return None
        self._ledger[action.req_id].in_flight.pop(action.index, None)
        return action, in_prefill

    def commit(self, action_id: ActionId) -> Committed | None:
        """The worker wrote `action_id` on every rank; None if its request was freed meanwhile
        (its blocks went with it). The caller moves the block to its slot and frees the source."""
        left = self._leave(action_id)
        return None if left is None else Committed(*left)

    def fail(self, action_ids: Iterable[ActionId]) -> list[CompressAction]:
        """Actions that failed or that the probe refused: they leave, and the next plan revokes
        them. Returned (and revoked) latest slot first within each destination, the order in which
        the packer takes failed slots back (`SlotPacker.release(undo=True)`); ids no longer in
        flight are skipped."""
        failed = [left[0] for aid in action_ids if (left := self._leave(aid)) is not None]
        failed.sort(key=lambda a: (a.dst, -a.slot))
        self._revoked.extend(failed)
        return failed

    def drop(self, entry: RequestEntry) -> None:
        """`entry`'s request left the ledger (freed, finished or preempted): its actions leave
        with it (a report for one finds nothing), and the next plan drops the request."""
        for action in entry.in_flight.values():
            self._pending.pop(action.action_id, None)
            self._sent.discard(action.action_id)
            self._in_prefill.discard(action.action_id)
        self._dropped.append(entry.request.request_id)

    # --- the invariant ------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the invariant stated in the module docstring."""
        assert self._sent <= self._pending.keys(), f"sent but not pending: {sorted(self._sent - self._pending.keys())}"
        assert self._in_prefill <= self._pending.keys(), (
            f"planned in prefill but not pending: {sorted(self._in_prefill - self._pending.keys())}")
        views = {a.action_id: (rid, index, a) for rid, e in self._ledger.items() for index, a in e.in_flight.items()}
        assert views.keys() == self._pending.keys(), (
            f"in flight in the ledger but not pending: {sorted(views.keys() - self._pending.keys())}; "
            f"pending but not in the ledger: {sorted(self._pending.keys() - views.keys())}")
        for aid, (rid, index, action) in views.items():
            assert action is self._pending[aid] and (action.req_id, action.index) == (rid, index), (
                f"action {aid} is in flight under request {rid} block {index}, "
                f"but is for request {action.req_id} block {action.index}")
        assert not any(a.action_id in self._pending for a in self._revoked), "a revoked action is still pending"
