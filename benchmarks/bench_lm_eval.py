"""lm-evaluation-harness against `quill serve`, checked against its own run on transformers.

Why: people evaluate a model with EleutherAI's lm-evaluation-harness before they serve it,
and its `local-completions` model scores multiple-choice answers through an OpenAI-compatible
server: /v1/completions with the context and a choice as token ids, `echo: true`,
`logprobs: 1`, `max_tokens: 1`, and it sums the choice tokens' `token_logprobs`. The same task
run by its `hf` model (transformers in its own process, on the same weights) is the
reference: every question must get the same choice, and every choice's loglikelihood must
agree within 1e-3 (fp32 on both sides).

The task is ours (no dataset can be downloaded here): benchmarks/lm_eval/quill_mc50.jsonl,
50 multiple-choice questions written for it, four choices each, read as a local JSON dataset by
a YAML task this script writes (`Question: ...\\nAnswer:` then " <choice>", accuracy and
length-normalised accuracy). lm-eval runs in its own virtual environment
(benchmarks/peers/lm_eval.sh), with its tokenizer read from the default model's local
directory, offline.

With `--kv-cache-dtypes A,B` the task runs twice through `quill serve` instead, the weights
fp32 and the KV cache of each type (issue 44: int8 against 16-bit): the questions answered
right by each and those whose choice differs.

Usage:
    bash benchmarks/peers/lm_eval.sh      # once: installs lm-eval, prints its path
    .venv/bin/python benchmarks/bench_lm_eval.py [--batch-size 8]
        [--json docs/results/bench_lm_eval.json]
    .venv/bin/python benchmarks/bench_lm_eval.py --kv-cache-dtypes bfloat16,int8
        [--json docs/results/bench_lm_eval_kv_int8.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# benchmarks/ is not installed: the repo root on the path makes it importable from this script.
sys.path.insert(0, str(REPO))

from benchmarks.bench_server import finish_results  # noqa: E402
from benchmarks.engine.http_servers import QuillServe, free_port  # noqa: E402
from quill.model.default_model import default_model_dir  # noqa: E402

INSTALLER = REPO / "benchmarks" / "peers" / "lm_eval.sh"
DATA = REPO / "benchmarks" / "lm_eval" / "quill_mc50.jsonl"
TASK = "quill_mc50"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# The exact path on both sides: fp32 weights, activations and KV cache, no quantization.
QUILL_FLAGS = ["--dtype", "float32", "--kv-cache-dtype", "float32", "--quantization", "none"]
TOLERANCE = 1e-3

TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def lm_eval_exe(given: str | None) -> str:
    if given:
        return given
    out = subprocess.run(["bash", str(INSTALLER)], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def run_lm_eval(
    exe: str, model: str, model_args: str, tasks_dir: Path, out_dir: Path, batch_size: int
) -> tuple[dict, list[dict], float]:
    """One lm_eval run: its results, its per-question samples, and its wall time."""
    cmd = [
        exe, "--model", model, "--model_args", model_args, "--tasks", TASK,
        "--include_path", str(tasks_dir), "--batch_size", str(batch_size),
        "--output_path", str(out_dir), "--log_samples", "--seed", "1234", "--device", "cpu",
    ]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, **OFFLINE})
    wall = time.perf_counter() - start
    results = json.loads(next(out_dir.rglob("results_*.json")).read_text())
    samples_file = next(out_dir.rglob(f"samples_{TASK}_*.jsonl"))
    samples = [json.loads(line) for line in samples_file.read_text().splitlines() if line]
    return results, sorted(samples, key=lambda s: s["doc_id"]), wall


def choice_loglikelihoods(sample: dict) -> list[float]:
    """Each choice's summed loglikelihood, as lm-eval recorded it (resps: [[ll, greedy]])."""
    return [float(r[0][0]) for r in sample["resps"]]


def compare(quill: list[dict], hf: list[dict]) -> dict:
    same_choice, diffs, rows = 0, [], []
    for q, h in zip(quill, hf, strict=True):
        assert q["doc_id"] == h["doc_id"]
        lq, lh = choice_loglikelihoods(q), choice_loglikelihoods(h)
        pick_q = max(range(len(lq)), key=lq.__getitem__)
        pick_h = max(range(len(lh)), key=lh.__getitem__)
        same_choice += pick_q == pick_h
        worst = max(abs(a - b) for a, b in zip(lq, lh, strict=True))
        diffs.append(worst)
        rows.append(
            {
                "doc_id": q["doc_id"],
                "quill": lq,
                "hf": lh,
                "max_abs_diff": worst,
                "choice_quill": pick_q,
                "choice_hf": pick_h,
            }
        )
    return {
        "num_questions": len(rows),
        "same_choice": same_choice,
        "max_abs_loglikelihood_diff": max(diffs),
        "mean_abs_loglikelihood_diff": sum(diffs) / len(diffs),
        "within_tolerance": all(d <= TOLERANCE for d in diffs),
        "tolerance": TOLERANCE,
        "questions": rows,
    }


def compare_kv_caches(args, run_quill) -> None:
    """The task through quill with two KV caches: right answers each, and choices that differ."""
    runs = {}
    for kv in args.kv_cache_dtypes.split(","):
        flags = ["--dtype", "float32", "--kv-cache-dtype", kv, "--quantization", "none"]
        res, samples, wall, cmd = run_quill(flags, f"quill-{kv}")
        right = sum(int(s["acc"]) for s in samples)
        runs[kv] = {"cmd": cmd, "results": res["results"][TASK], "right": right, "wall_s": wall}
        runs[kv]["samples"] = samples
    (a, ra), (b, rb) = runs.items()
    comparison = compare(ra.pop("samples"), rb.pop("samples"))
    results = {"task": TASK, "kv_cache_dtypes": [a, b], "runs": runs, **comparison}
    print(
        f"\n{TASK}: {comparison['num_questions']} questions; right: {a} {ra['right']}, "
        f"{b} {rb['right']} (difference {abs(ra['right'] - rb['right'])}); the same choice on "
        f"{comparison['same_choice']}; loglikelihoods max |diff| "
        f"{comparison['max_abs_loglikelihood_diff']:.2e} (mean "
        f"{comparison['mean_abs_loglikelihood_diff']:.2e})"
    )
    finish_results(results, args)


def served_model_name(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lm-eval", help="the lm_eval executable (default: install it)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--kv-cache-dtypes", help="A,B: quill with each KV cache, not transformers")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    exe = lm_eval_exe(args.lm_eval)
    model_dir = default_model_dir()
    work = Path(tempfile.mkdtemp(prefix="quill-lm-eval-"))
    tasks_dir = work / "tasks"
    tasks_dir.mkdir()
    (tasks_dir / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=DATA))

    def run_quill(flags: list[str], out: str):
        server = QuillServe(free_port())
        server.cmd += flags
        server.start()
        try:
            name = served_model_name(server.url)
            quill_args = (
                f"model={name},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={model_dir},num_concurrent=1,max_retries=1,tokenized_requests=True"
            )
            ran = run_lm_eval(
                exe, "local-completions", quill_args, tasks_dir, work / out, args.batch_size
            )
        finally:
            server.stop()
        return (*ran, " ".join(server.cmd))

    if args.kv_cache_dtypes:
        compare_kv_caches(args, run_quill)
        return
    quill_res, quill_samples, quill_s, quill_cmd = run_quill(QUILL_FLAGS, "quill")
    hf_args = f"pretrained={model_dir},dtype=float32"
    hf_res, hf_samples, hf_s = run_lm_eval(
        exe, "hf", hf_args, tasks_dir, work / "hf", args.batch_size
    )
    comparison = compare(quill_samples, hf_samples)
    results = {
        "task": TASK,
        "quill_cmd": quill_cmd,
        "lm_eval_version": quill_res.get("lm_eval_version") or quill_res.get("git_hash"),
        "quill": {"results": quill_res["results"][TASK], "wall_s": quill_s},
        "hf": {"results": hf_res["results"][TASK], "wall_s": hf_s},
        **comparison,
    }
    q, h = results["quill"]["results"], results["hf"]["results"]
    print(
        f"\n{TASK}: {comparison['num_questions']} questions; same choice on "
        f"{comparison['same_choice']}; loglikelihoods max |diff| "
        f"{comparison['max_abs_loglikelihood_diff']:.2e} (mean "
        f"{comparison['mean_abs_loglikelihood_diff']:.2e}; within {TOLERANCE}: "
        f"{comparison['within_tolerance']})\n"
        f"acc quill {q.get('acc,none')} hf {h.get('acc,none')}; acc_norm quill "
        f"{q.get('acc_norm,none')} hf {h.get('acc_norm,none')}; wall quill {quill_s:.1f} s "
        f"(HTTP, batch {args.batch_size}), hf {hf_s:.1f} s"
    )
    finish_results(results, args)


if __name__ == "__main__":
    main()
