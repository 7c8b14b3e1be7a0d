"""The quality suite through vLLM: the transformers harness's tasks, on the engine Proxima serves.

`harness.py` prefills a context, compresses a copy of the cache (`apply_policy(target_ratio=r)`)
and scores what the model still does. Here every (method, setting, sample) is one vLLM request:

* the method is a policy (the engine's `PROXIMA_POLICY`) and a ratio: the request's
  `extra_args["proxima_target_ratio"]` makes the KV manager store its prompt r times smaller, in
  bytes, after the prefill and before the first decode step's forward (`integration/vllm/
  targets.py`, the same engine trials as the HF cache). `baseline` sets no target;
* teacher forcing: `ForcedTokens`, a vLLM logits processor, makes a request whose
  `extra_args["proxima_forced"]` lists tokens sample exactly those first (greedy after them).
  vLLM's log-probs are the raw model's (`logprobs_mode="raw_logprobs"`, taken before any logits
  processor), so a forced token's log-prob and the top-1 token are the model's own.

The protocols match the harness's (`harness.SETTINGS`):

* text window: prompt = the context, forced = the 64-token continuation, `logprobs=1`. The first
  continuation token comes from the uncompressed prefill and is not scored (as there); tokens
  1..63 are predicted from the compressed context;
* passkey `after`: prompt = the context, forced = the question, then 6 greedy tokens: the context
  is compressed before the question is read;
* passkey `inside`: prompt = context + question but its last token, forced = that last token,
  then 6 greedy tokens: the question is in the compressed prompt, and the last token's forward
  reads the compressed cache.

The difference that remains, on purpose: vLLM runs bf16 activations (the harness float32, with
bf16 KV blocks). So every metric is compared relative to the same engine's own uncompressed
requests, which run in every engine. (Both observe importance and probe in the same layer:
`proxima.observation`.) KL is not computed (vLLM returns top-k log-probs only). Each policy runs
in its own engine, in a child process (`run_child`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from proxima.integration.vllm.scheduler.targets import TARGET_ARG
from proxima.integration.vllm.serve.child import run_logged
from proxima.quality.datasets import NeedleSample, TextSample

FORCED_ARG = "proxima_forced"
"""`SamplingParams.extra_args` key: token ids the request must sample first (teacher forcing)."""
ANSWER_TOKENS = 6
"""Greedy tokens after a passkey question (the 5 digits appear in 6 tokens; as `harness.py`)."""


def _forced(sampling_params: Any) -> list[int] | None:
    return (sampling_params.extra_args or {}).get(FORCED_ARG) if sampling_params is not None else None


def _validate(sampling_params: Any) -> None:
    forced = _forced(sampling_params)
    if forced is not None and (not isinstance(forced, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in forced)):
        raise ValueError(f"extra_args[{FORCED_ARG!r}] must be a list of token ids, got {forced!r}")


def _force(logits: torch.Tensor, row: int, token: int) -> None:
    logits[row].fill_(float("-inf"))
    logits[row, token] = 0.0


class ForcedTokens(LogitsProcessor):
    """Teacher forcing through vLLM: a request with `extra_args["proxima_forced"] = [t0, t1, ...]`
    samples t0, t1, ... as its first output tokens (every other logit set to -inf), then decodes
    as its sampling parameters say. A request without it is untouched. The V1 model runner's
    interface, as Proxima's own drift observer: `run_engine` runs the V1 runner on CUDA too.

    The position of a row is the length of its output so far (vLLM passes each added request's
    running output list by reference). Needs synchronous scheduling: under async scheduling that
    list lags a step behind the sampler."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[list[int], list[int]]] = {}
        """Batch row -> (tokens to force, the request's output tokens so far)."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        _validate(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        # vLLM's own bookkeeping of sparse per-row state (as the drift observer's)
        def new_state(params: Any, _prompt: list[int] | None, output: list[int]) -> tuple[list[int], list[int]] | None:
            forced = _forced(params)
            return (list(forced), output) if forced else None

        process_dict_updates(self.rows, batch_update, new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, (forced, output) in self.rows.items():
            pos = len(output)
            if pos < len(forced) and i < logits.shape[0]:
                _force(logits, i, forced[pos])
        return logits


@dataclass(frozen=True)
class VllmMethod:
    """A policy at a target ratio (None: the uncompressed baseline)."""

    name: str
    policy: str
    ratio: float | None


def parse_method(name: str) -> VllmMethod:
    """`proxima:<policy>@<r>x` (a policy in configs/ or bench/policies/) or `baseline`."""
    if name == "baseline":
        return VllmMethod(name, "off", None)
    if not name.startswith("proxima:") or "@" not in name or not name.endswith("x"):
        raise ValueError(f"method {name!r}: the vLLM harness runs 'baseline' and 'proxima:<policy>@<r>x' methods")
    policy, ratio = name.removeprefix("proxima:").rsplit("@", 1)
    return VllmMethod(name, policy, float(ratio[:-1]))


@dataclass
class Job:
    """One engine's work: requests for its methods (and the baseline), as plain token ids."""

    model: str
    policy: str
    """A policy file (the engine's `PROXIMA_POLICY`)."""
    methods: list[dict[str, Any]]
    text: list[dict[str, Any]]
    needles: list[dict[str, Any]]
    settings: list[str]
    block_size: int = 64
    engine_args: dict[str, Any] = field(default_factory=dict)


def _requests(job: Job) -> list[tuple[str, list[int], dict[str, Any]]]:
    """(request id, prompt ids, SamplingParams kwargs) for every (method, sample, setting)."""
    out = []
    for m in job.methods:
        target = {} if m["ratio"] is None else {TARGET_ARG: m["ratio"]}
        for s in job.text:
            out.append((f"{m['name']}|text|{s['name']}", s["context_ids"],
                        {"max_tokens": len(s["continuation_ids"]), "logprobs": 1,
                         "extra_args": {**target, FORCED_ARG: s["continuation_ids"]}}))
        for s in job.needles:
            q = s["question_ids"]
            for st in job.settings:
                prompt, forced = (s["context_ids"], q) if st == "after" else (s["context_ids"] + q[:-1], q[-1:])
                out.append((f"{m['name']}|{st}|{s['name']}", prompt,
                            {"max_tokens": len(forced) + ANSWER_TOKENS, "extra_args": {**target, FORCED_ARG: forced}}))
    return out


def run_child(job: Job) -> dict[str, Any]:
    """Run `job` in this process's vLLM engine (`PROXIMA_POLICY` names the job's policy): the raw
    per-request results, and what the KV manager reached (`targets` of its stats)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # By its module's own name: run as `python -m` this file is __main__, which the engine's
    # processes cannot import the classes from.
    from proxima.quality import vllm_harness as here

    tok = AutoTokenizer.from_pretrained(job.model)
    reqs = _requests(job)
    longest = max(len(p) + sp["max_tokens"] for _, p, sp in reqs)
    args = {
        "model": job.model, "dtype": "bfloat16", "block_size": job.block_size, "enforce_eager": True,
        "max_model_len": longest + job.block_size, "seed": 0, "async_scheduling": False,
        # Every method's requests repeat the baseline's prompts: with prefix caching they would share
        # blocks, which Proxima never compresses (another request reads them).
        "enable_prefix_caching": False, "max_num_seqs": min(256, len(reqs)), **job.engine_args,
    }
    llm = LLM(**args, logits_processors=[here.ForcedTokens])
    prompts = [TokensPrompt(prompt_token_ids=p) for _, p, _ in reqs]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, **sp) for _, _, sp in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    results: dict[str, Any] = {}
    by_name = {s["name"]: s for s in job.needles}
    stats_file = os.environ.get("PROXIMA_STATS_FILE")
    llm.llm_engine.engine_core.shutdown()  # (the connector writes its last stats on shutdown)
    stats = json.loads(Path(stats_file).read_text()) if stats_file and Path(stats_file).exists() else {}
    # The manager's stats are keyed by the engine's request ids: the output's id plus a suffix.
    reached = {k.rsplit("-", 1)[0]: v for k, v in stats.get("targets", {}).items()}
    for (rid, _, sp), o in zip(reqs, outs, strict=True):
        c = o.outputs[0]
        forced = sp["extra_args"][FORCED_ARG]
        toks = list(c.token_ids)
        rec: dict[str, Any] = {"forced_ok": toks[: len(forced)] == forced}
        if "|text|" in rid:
            lps = c.logprobs or []
            rec["nll"] = [-lps[i][t].logprob for i, t in enumerate(forced) if i < len(lps) and t in lps[i]]
            rec["top1"] = [next((k for k, lp in lps[i].items() if lp.rank == 1), -1) for i in range(len(lps))]
        else:
            answer = tok.decode(toks[len(forced):])
            rec["answer"] = answer
            rec["correct"] = by_name[rid.rsplit("|", 1)[1]]["answer"] in answer
        if o.request_id in reached:
            rec["reached"] = reached[o.request_id]["reached"]
        results[rid] = rec
    return {"results": results, "stats": stats, "wall_s": wall, "requests": len(reqs)}


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def run_engine(job: Job, timeout_s: float = 900.0, log=print,  # type: ignore[no-untyped-def]
               keep_log: Path | None = None) -> dict[str, Any]:
    """`run_child(job)` in a fresh process (one vLLM engine per policy); a one-line summary goes
    to `log`, the engine's whole output to `keep_log` if given, written while it runs (so a
    timed-out or killed engine leaves its log too); without it only a failure's tail is shown."""
    tmp = Path(tempfile.mkdtemp(prefix="proxima-qv-"))
    (tmp / "job.json").write_text(json.dumps(asdict(job)))
    env = dict(os.environ)
    env["PROXIMA_POLICY"] = job.policy
    env["PROXIMA_STATS_FILE"] = str(tmp / "stats.json")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    # vLLM 0.32 runs Model Runner V2 on CUDA, which refuses V1-interface logits processors: this
    # harness's and Proxima's drift observer (`drift_observer.DriftObserver`) are both V1.
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    cmd = [sys.executable, "-m", "proxima.quality.vllm_harness", str(tmp / "job.json"), str(tmp / "out.json")]
    log_path = keep_log if keep_log is not None else tmp / "engine.log"
    t0 = time.monotonic()
    try:
        rc = run_logged(cmd, env, timeout_s, log_path)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"vLLM engine for {job.policy} ran past {timeout_s:.0f}s and was killed "
                           f"(log: {log_path}):\n{_tail(log_path)}") from None
    if rc != 0 or not (tmp / "out.json").exists():
        raise RuntimeError(f"vLLM engine for {job.policy} failed (rc {rc}; log: {log_path}):\n{_tail(log_path)}")
    out = json.loads((tmp / "out.json").read_text())
    log(f"[quality-vllm] {Path(job.policy).stem}: {out['requests']} requests in {out['wall_s']:.1f}s "
        f"(engine {time.monotonic() - t0:.0f}s)")
    return dict(out)


def job_for(policy: str, methods: Sequence[VllmMethod], text: Sequence[TextSample], needles: Sequence[NeedleSample],
            settings: Sequence[str], model: str, engine_args: dict[str, Any] | None = None) -> Job:
    """An engine's job: `methods` of one policy, and the baseline (every engine scores its own)."""
    ms = [VllmMethod("baseline", "off", None), *[m for m in methods if m.ratio is not None]]
    return Job(model=model, policy=policy, methods=[asdict(m) for m in ms],
               text=[asdict(s) for s in text], needles=[asdict(s) for s in needles], settings=list(settings),
               engine_args=dict(engine_args or {}))


def rows(out: dict[str, Any], methods: Sequence[VllmMethod], settings: Sequence[str]) -> list[dict[str, Any]]:
    """Per (method, setting): the harness's row fields, from one engine's results. tf_top1 and the
    relative perplexity (`ppl_vs_baseline_pct`) compare with this engine's own baseline requests."""
    res = out["results"]
    base_top1 = {rid.split("|", 2)[2]: r["top1"] for rid, r in res.items() if rid.startswith("baseline|text|")}
    base_nll = [x for rid, r in res.items() if rid.startswith("baseline|text|") for x in r["nll"][1:]]
    base_ppl = math.exp(sum(base_nll) / len(base_nll)) if base_nll else math.nan
    table = []
    for m in [VllmMethod("baseline", "off", None), *methods]:
        text = {rid.split("|", 2)[2]: r for rid, r in res.items() if rid.startswith(f"{m.name}|text|")}
        nll = [x for r in text.values() for x in r["nll"][1:]]  # position 0: the uncompressed prefill's
        agree = [float(a == b) for w, r in text.items() for a, b in zip(r["top1"][1:], base_top1[w][1:], strict=False)]
        for st in settings:
            keys = [rid for rid in res if rid.startswith(f"{m.name}|{st}|")]
            needle = [float(res[k]["correct"]) for k in keys]
            ratios = [res[k]["reached"] for k in [*[f"{m.name}|text|{w}" for w in text], *keys] if "reached" in res[k]]
            table.append({
                "method": m.name, "setting": st, "target_ratio": m.ratio,
                "achieved_ratio": round(sum(ratios) / len(ratios), 3) if ratios else 1.0,
                "targets_reached_n": len(ratios),
                "needle_acc": sum(needle) / len(needle) if needle else math.nan, "needle_n": len(needle),
                "ppl": math.exp(sum(nll) / len(nll)) if nll else math.nan, "text_n": len(text),
                "ppl_vs_baseline_pct": 100.0 * (math.exp(sum(nll) / len(nll)) / base_ppl - 1) if nll else math.nan,
                "tf_top1": sum(agree) / len(agree) if agree else math.nan,
                "forced_ok": all(r["forced_ok"] for k, r in res.items() if k.startswith(f"{m.name}|")),
            })
    return table


NOISE = {"achieved_ratio": 0.02, "ppl_pp": 1.0, "tf_top1": 0.02}
"""Agreement bounds between the two harnesses (besides the needle's): achieved bytes ratio within
2% (relative), perplexity relative to each harness's own baseline within 1 percentage point,
top-1 agreement with the own baseline within 0.02. The needle: within two standard errors of the
difference of two proportions over n samples each (`needle_bound`)."""


def needle_bound(p_a: float, p_b: float, n: int) -> float:
    """Two standard errors of the difference of two accuracies over `n` samples each; at least one
    sample's worth (1/n), so identical extremes (0 or 1) still leave a sample of slack."""
    p = (p_a + p_b) / 2
    return max(1.0 / max(1, n), 2.0 * math.sqrt(max(0.0, p * (1 - p)) * 2.0 / max(1, n)))


def compare(vllm_rows: Sequence[dict[str, Any]], hf_rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (method, setting) present in both: each harness's numbers relative to its own baseline,
    their differences, and whether each is within noise (`NOISE`, `needle_bound`)."""
    def base_ppl(rows: Sequence[dict[str, Any]], st: str) -> float:
        return next((float(r["ppl"]) for r in rows if r["method"] == "baseline" and r["setting"] == st), math.nan)

    hf = {(r["method"], r["setting"]): r for r in hf_rows}
    out = []
    for v in vllm_rows:
        h = hf.get((v["method"], v["setting"]))
        if h is None:
            continue
        st = v["setting"]
        # vLLM's rows carry their own engine's baseline (engines differ a little: batches, bf16)
        dv = v.get("ppl_vs_baseline_pct", 100.0 * (v["ppl"] / base_ppl(vllm_rows, st) - 1))
        dh = 100.0 * (float(h["ppl"]) / base_ppl(hf_rows, st) - 1)
        n = min(int(v["needle_n"]), int(h["needle_n"]))
        bound = needle_bound(float(v["needle_acc"]), float(h["needle_acc"]), n)
        checks = {
            "achieved_ratio": abs(v["achieved_ratio"] / float(h["achieved_ratio"]) - 1) <= NOISE["achieved_ratio"],
            "needle_acc": abs(v["needle_acc"] - float(h["needle_acc"])) <= bound + 1e-9,
            "ppl": abs(dv - dh) <= NOISE["ppl_pp"],
            "tf_top1": abs(v["tf_top1"] - float(h["tf_top1"])) <= NOISE["tf_top1"],
        }
        out.append({
            "method": v["method"], "setting": st,
            "achieved_ratio": {"vllm": v["achieved_ratio"], "hf": float(h["achieved_ratio"])},
            "needle_acc": {"vllm": v["needle_acc"], "hf": float(h["needle_acc"]), "bound": round(bound, 3), "n": n},
            "ppl_vs_baseline_pct": {"vllm": round(dv, 2), "hf": round(dh, 2)},
            "tf_top1": {"vllm": v["tf_top1"], "hf": float(h["tf_top1"])},
            "within_noise": checks, "agrees": all(checks.values()),
        })
    return out


def main(argv: list[str]) -> int:
    """Child entry point: `python -m proxima.quality.vllm_harness JOB.json OUT.json`."""
    job = Job(**json.loads(Path(argv[0]).read_text()))
    Path(argv[1]).write_text(json.dumps(run_child(job)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
