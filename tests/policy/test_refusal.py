"""`milder_formats`: what a block the compression-time probe refuses tries next, in both integrations."""

from __future__ import annotations

from proxima.formats import HOT, Format
from proxima.policy.loader import parse_policy
from proxima.policy.refusal import milder_formats

POLICY = """
schema_version: 1
name: t
bands:
  - {name: low, enter: 0.5, exit: 0.4, target_free: 0.6, ladder: [int4, int8]}
  - {name: high, enter: 0.8, exit: 0.7, target_free: 0.5, ladder: [int2, "cluster(4)", "sparse(4)"]}
damage:
  table: {"cluster(4)": 0.01, "sparse(4)": 0.01, int4: 0.5}
"""


def test_harshest_first_then_least_damage_then_name() -> None:
    policy = parse_policy(POLICY)
    names = [f.name for f in milder_formats(policy, Format.parse("int2"), HOT)]
    # Every ladder's formats milder than int2 (8x) and above hot; the three at 4x by damage, the two
    # of equal damage by name; int8 (2x) last.
    assert names == ["cluster(4)", "sparse(4)", "int4", "int8"]


def test_only_formats_that_still_shrink_the_block() -> None:
    policy = parse_policy(POLICY)
    assert [f.name for f in milder_formats(policy, Format.parse("int2"), Format.parse("int8"))] == [
        "cluster(4)", "sparse(4)", "int4"]
    assert milder_formats(policy, Format.parse("int8"), HOT) == []
    assert milder_formats(None, Format.parse("int2"), HOT) == []
