"""Usage: PYTHONPATH=$PWD .venv/bin/python bench/results/experiments/admission-growth/admission_check_time.py

Time one admission check (compressed_footprint + resident_growth) with 11 residents of 96
blocks, 91 of them committed (about 1,000 slots: the 8B throughput workload's balanced peak)."""
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT / "tests" / "integration" / "vllm" / "scheduler"), str(ROOT)]
import test_admission as T  # noqa: E402  (its small-pool manager over a real vLLM KVCacheManager)

from proxima.formats import Format  # noqa: E402
from proxima.integration.vllm.scheduler.ledger import CompressedSlot  # noqa: E402
from proxima.placement import BlockId, SlotIndex  # noqa: E402

B = T.B
policy = T.load_policy(T.ROOT / "proxima" / "policies" / "balanced.yaml")
m = T._manager(policy, blocks=2000)
fmts = [Format.parse("int4"), Format.parse("cluster(2)+int4")]
for r in range(11):
    req = T._request(f"r{r}", 64 * B, max_tokens=32 * B)
    assert m.allocate_slots(req, 64 * B) is not None
    e = m.px.ledger[f"r{r}"]
    for i in range(60):
        slot = CompressedSlot(fmts[i % 2], BlockId(1), SlotIndex(i))
        if hasattr(e, "commit"):  # (this commit and later; before it, the dict was written directly)
            e.commit(i, slot)
        else:
            e.compressed[i] = slot
n = 200
t0 = time.perf_counter()
for _ in range(n):
    m.compressed_footprint(3072)
    if hasattr(m, "resident_growth"):  # (69dd485 and later)
        m.resident_growth()
    m.side_table_bytes()
dt = (time.perf_counter() - t0) / n
slots = sum(len(e.compressed) for e in m.px.ledger.values())
print(f"slots {slots}: {dt * 1e3:.3f} ms per admission check (+ side-table bytes)")
