"""Embedding throughput offline: quill's `LLM.embed` against sentence-transformers' `encode`.

Why: a RAG application embeds its documents in bulk; quill should do it faster than the
library people reach for. Target (issue 47): 1,000 texts of 20-200 tokens at least 1.5x
sentence-transformers' `encode` (batch 32, the same threads) on all-MiniLM-L6-v2.

Each side runs in its own subprocess with torch's threads set to the machine's cores, the
same 1,000 texts (random words, lengths drawn uniformly from 20-200 tokens, seeded), warmed
up on 64 texts first; the sides alternate round by round and each keeps its best round. quill
runs with its defaults (`LLM(model)`: the dtype `auto` picks, its token budget) and in fp32;
the vectors of every side are compared with fp32 sentence-transformers' (cosine). Usage:

    .venv/bin/python benchmarks/bench_embeddings.py [--texts 1000] [--rounds 3] [--json out]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine.machine import machine_info  # noqa: E402

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea"
).split()


def texts(count: int, seed: int) -> list[str]:
    """Texts of 20-200 tokens (MiniLM's tokenizer: one token per word here, plus CLS/SEP)."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(18, 198))) for _ in range(count)]


def run_side(side: str, model: str, count: int, seed: int, out: Path) -> None:
    """One side's round, in this (child) process: texts/s, and the vectors to compare."""
    import numpy as np
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    data = texts(count, seed)
    if side == "st":
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(model, device="cpu")
        st.encode(data[:64], batch_size=32)
        start = time.perf_counter()
        vectors = st.encode(data, batch_size=32, convert_to_numpy=True)
    else:
        from quill import LLM

        options = {"dtype": "float32"} if side == "quill-fp32" else {}
        llm = LLM(model, **options)
        llm.embed(data[:64], use_tqdm=False)
        start = time.perf_counter()
        vectors = np.asarray(llm.embed(data, use_tqdm=False), dtype=np.float32)
    seconds = time.perf_counter() - start
    np.save(out.with_suffix(".npy"), vectors)
    out.write_text(json.dumps({"seconds": seconds, "texts_per_s": count / seconds}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: all-minilm-l6-v2's directory")
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", default="st,quill,quill-fp32")
    parser.add_argument("--json", default=None)
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from quill.model.named_models import named_model_path

        args.model = str(named_model_path("all-minilm-l6-v2"))
    if args.side:
        run_side(args.side, args.model, args.texts, args.seed, Path(args.out))
        return 0
    import numpy as np

    sides = args.sides.split(",")
    rounds: dict[str, list[float]] = {s: [] for s in sides}
    vectors = {}
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-embeddings-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else reversed(sides):
            out = tmp / f"{side}.json"
            subprocess.run([sys.executable, __file__, "--side", side, "--out", str(out),
                            "--model", args.model, "--texts", str(args.texts),
                            "--seed", str(args.seed)], check=True)  # fmt: skip
            result = json.loads(out.read_text())
            rounds[side].append(result["texts_per_s"])
            vectors[side] = np.load(out.with_suffix(".npy"))
            print(f"round {r} {side}: {result['texts_per_s']:.1f} texts/s", flush=True)
    best = {s: max(v) for s, v in rounds.items()}
    summary = {"machine": machine_info(os.cpu_count() or 1), "date": time.strftime("%Y-%m-%d"),
               "command": " ".join(sys.argv), "model": args.model, "texts": args.texts,
               "rounds": rounds, "best_texts_per_s": best}  # fmt: skip
    if "st" in vectors:
        ref = vectors["st"] / np.linalg.norm(vectors["st"], axis=1, keepdims=True)
        for side in sides:
            if side == "st":
                continue
            v = vectors[side] / np.linalg.norm(vectors[side], axis=1, keepdims=True)
            cos = (ref * v).sum(1)
            summary[f"{side}_vs_st"] = best[side] / best["st"]
            summary[f"{side}_min_cosine"] = float(cos.min())
            print(f"{side}: {best[side] / best['st']:.2f}x sentence-transformers, min cosine "
                  f"{cos.min():.6f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
