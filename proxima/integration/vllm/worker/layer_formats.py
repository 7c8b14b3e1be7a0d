"""Which format each layer stores, across live changes of the policy's `layer_overrides`.

The scheduler chooses one format per block; the policy's `layer_overrides` substitute another
format of the same pack ratio in some layers (same slot, another encoding and side table). A
block is read back with the substitution that was in force when it was *written*: when an
operator changes or removes an override live, the blocks already compressed keep their
encoding, only new compressions use the new table.

So every table the worker has used is kept (`LayerFormats.tables`, epoch = its index), and a
block compressed under epoch e > 0 is remembered as a `StoredFormat` (the scheduler's format plus
e). `StoredFormat` is a `Format` (name, pack ratio, reduction are the scheduler's), but it is not
equal to the plain format, so the readers, which group blocks by format, never mix two epochs in
one batched read. Epoch 0 (the startup table) uses plain formats: without a live change nothing
differs from a worker that never heard of epochs.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxima.formats import Format
from proxima.policy.schema import Policy


@dataclass(frozen=True, order=True)
class StoredFormat(Format):
    """The scheduler's format of a block compressed under override table `epoch` (> 0)."""

    epoch: int = 0


def plain(fmt: Format) -> Format:
    """The format without its epoch (what the scheduler and the pools know)."""
    return Format(fmt.reduction, fmt.reduction_ratio, fmt.quant) if isinstance(fmt, StoredFormat) else fmt


class LayerFormats:
    """Every override table this worker used; the last one applies to new compressions."""

    def __init__(self, policy: Policy | None = None) -> None:
        self.tables: list[Policy] = [policy if policy is not None else Policy(enabled=False)]
        """The policy whose `layer_overrides` each epoch used (only that field is read); no two
        epochs hold the same overrides."""
        self.epoch = 0
        """The epoch new compressions are tagged with."""

    def adopt(self, policy: Policy) -> bool:
        """Use `policy`'s overrides for new compressions; True when they differ from the current
        table. Overrides an earlier epoch used bring that epoch back rather than a new one: a
        policy switched back and forth (a canary, a rollback) makes no new formats, and every
        (format, epoch) pair takes one of the one-pass decode's few format codes."""
        same = [e for e, t in enumerate(self.tables) if t.layer_overrides == policy.layer_overrides]
        changed = self.epoch not in same
        if same:
            self.epoch = same[0]
            self.tables[self.epoch] = policy
        else:
            self.tables.append(policy)
            self.epoch = len(self.tables) - 1
        return changed

    def stored(self, fmt: Format) -> Format:
        """How a block compressed now into `fmt` is remembered (tagged with the current epoch)."""
        if fmt.is_hot or self.epoch == 0:
            return plain(fmt)
        return StoredFormat(fmt.reduction, fmt.reduction_ratio, fmt.quant, self.epoch)

    def current(self, fmt: Format) -> Format:
        """`fmt` as a block written now would be tagged: `of` then reads it with the latest table."""
        return self.stored(plain(fmt))

    def of(self, fmt: Format, layer: int) -> Format:
        """The (plain) format stored in `layer` for a block remembered as `fmt`.

        A substitution that changes the number of stored tokens between a sparse format and any
        other would change the scratch layout per layer; the vLLM path keeps the chosen format.
        """
        base = plain(fmt)
        if base.is_hot:
            return base
        epoch = fmt.epoch if isinstance(fmt, StoredFormat) else 0
        sub = self.tables[epoch].layer_format(base, layer)
        if (sub.reduction == "sparse") != (base.reduction == "sparse"):
            return base
        return sub


__all__ = ["LayerFormats", "StoredFormat", "plain"]
