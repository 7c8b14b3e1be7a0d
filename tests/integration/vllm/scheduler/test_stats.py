"""The scheduler's stats count first compressions apart from recompressions (issue 37 item 4)."""

from proxima.formats import Format
from proxima.integration.vllm.scheduler.stats import ProximaStats


def test_commits_count_first_compressions_and_recompressions_apart() -> None:
    s = ProximaStats()
    s.record_commit(Format.parse("int4"), in_prefill=False, first=True)
    s.record_commit(Format.parse("cluster(2)+int4"), in_prefill=False, first=False)  # the same block, one rung on
    s.record_commit(Format.parse("int4"), in_prefill=True, first=True)
    assert (s.committed, s.blocks_compressed, s.committed_in_prefill) == (3, 2, 1)
    assert s.committed_by_format == {"int4": 2, "cluster(2)+int4": 1}
