"""The soak's reading of the server log (`bench/soak.py`): which tracebacks count as failures."""

from __future__ import annotations

from bench.soak import proxima_log_lines, tracebacks

PROBE = (
    "(EngineCore pid=1) WARNING 12-06 22:18:06 [import_utils.py:417] Traceback (most recent call last):\n"
    "(EngineCore pid=1) WARNING 12-06 22:18:06 [import_utils.py:417]   File \"x.py\", line 1, in <module>\n"
    "(EngineCore pid=1) WARNING 12-06 22:18:06 [import_utils.py:417] AssertionError: no _C_extension\n"
)
FAILURE = (
    "(EngineCore pid=1) ERROR 12-06 22:19:00 [core.py:900] Traceback (most recent call last):\n"
    "(EngineCore pid=1) ERROR 12-06 22:19:00 [core.py:900] RuntimeError: boom\n"
)


def test_vllms_optional_import_warning_is_not_a_failure_but_an_error_is() -> None:
    assert tracebacks(PROBE) == []
    found = tracebacks(PROBE + FAILURE + "Traceback (most recent call last):\n  ValueError\n")
    assert len(found) == 2 and "RuntimeError: boom" in found[0] and "ValueError" in found[1]


def test_the_results_keep_the_lines_that_name_proxima() -> None:
    line = "WARNING proxima worker: compression of 2 blocks failed: int4: non-finite k_scale"
    assert proxima_log_lines(f"INFO start\n{line}\nINFO x\n") == [line]
