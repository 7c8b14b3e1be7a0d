"""What a block the compression-time probe refuses tries next: one decision for every integration.

The vLLM worker (`integration/vllm/worker/probe.py`) and the transformers cache
(`integration/hf/cache.py`) both order the milder formats with `milder_formats` and walk them
with `probes.choose_within_bound`, so a policy refuses and substitutes the same way in the
quality harness as in serving (equal-ratio candidates are ordered by damage, then name, in both).
"""

from __future__ import annotations

from proxima.formats import Format
from proxima.policy.schema import Policy


def milder_formats(policy: Policy | None, fmt: Format, from_fmt: Format) -> list[Format]:
    """The formats of the policy's ladders that hold more than `fmt` keeps (lower pack ratio) and
    still shrink the block (above `from_fmt`'s ratio), harshest first; equal ratios by the
    policy's damage table (least damage first), then by name so the order never depends on set
    iteration. What a refused block tries, in this order; callers drop the formats the block
    cannot move into (`formats.recompressible`)."""
    if policy is None:
        return []
    seen = {f for band in policy.bands for f in band.ladder}
    out = [f for f in seen if from_fmt.pack_ratio < f.pack_ratio < fmt.pack_ratio]
    return sorted(out, key=lambda f: (-f.pack_ratio, policy.damage.of(f), f.name))


__all__ = ["milder_formats"]
