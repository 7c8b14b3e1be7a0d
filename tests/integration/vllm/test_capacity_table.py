"""The capacity benchmark's scoring and table (no engine: fast)."""

from __future__ import annotations

import math

import pytest
from vllm.logprobs import Logprob

from proxima.integration.vllm.capacity import common_prefix, prompt_scores, table_markdown, tabulate


def test_prompt_scores_cover_the_second_half_of_the_prompt() -> None:
    ids = [5, 6, 7, 8]
    # vLLM: no entry for the first token; each entry maps the actual token to its logprob and rank.
    lps = [None, {6: Logprob(-9.0, rank=7)}, {7: Logprob(-1.0, rank=1)}, {8: Logprob(-3.0, rank=2)}]
    nll, top1 = prompt_scores(ids, lps)
    assert nll == pytest.approx(2.0) and top1 == pytest.approx(0.5)  # tokens 2 and 3 only
    assert all(math.isnan(x) for x in prompt_scores(ids, None))


def test_table_compares_each_config_with_vanilla() -> None:
    base = {"wall_s": 10.0, "tokens_per_s": 2.0, "kv_blocks": 73}
    results = {
        "vanilla": base | {"outputs": [[1, 2, 3], [4, 5]], "prompt_nll": [2.0, 4.0], "prompt_top1": [0.5, 0.5],
                           "proxima": {"peak_resident": 2, "mean_resident": 1.5, "preemptions": 0}},
        "balanced": base | {"outputs": [[1, 2, 9], [7, 5]], "prompt_nll": [3.0, float("nan")], "prompt_top1": [0.25],
                            "proxima": {"peak_resident": 8, "mean_resident": 6.0, "preemptions": 1,
                                        "committed_by_format": {"int4": 3}}},
        "vanilla_fp8": {"error": "not measurable here"},
    }
    t = tabulate(results)
    assert t["vanilla"]["greedy_prefix_tokens"] == 2.5 and t["balanced"]["greedy_prefix_tokens"] == 1.0
    assert t["vanilla"]["prompt_nll"] == 3.0 and t["balanced"]["prompt_nll"] == 3.0  # NaN skipped
    assert t["balanced"]["peak_running"] == 8 and t["balanced"]["prompt_top1"] == 0.25
    md = table_markdown(t)
    assert "| balanced | 72 | 8 | 6.0 | 1 |" in md and "int4 3" in md and "not measurable here" in md
    assert common_prefix([1, 2], [1, 2, 3]) == 2
