#!/bin/bash
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q tests/compression/test_attention.py tests/compression/test_group_sizes.py -k "ptx or small_heads or refuses or group" -rA 2>&1 | tee $OUT/pytest5.log | grep -E "PASS|FAIL|passed|failed|Error" | tail -30
