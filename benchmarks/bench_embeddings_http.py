"""Embeddings over HTTP: `quill serve` against `llama-server --embedding`, 16 clients.

Why: a RAG application's indexer sends texts to a server as fast as it answers. Target (issue
47): at 16 concurrent clients, texts/s through quill's `/v1/embeddings` at least 1.2x
llama-server's on the same model converted by llama.cpp's converter (all-MiniLM-L6-v2).

Each client sends one text a request, in a closed loop, over the same 1,000 texts as
bench_embeddings.py (20-200 tokens). One server runs at a time, started afresh, warmed up on
32 texts; the sides alternate round by round and each keeps its best round. quill: `quill
serve all-minilm-l6-v2` with its defaults (and `--dtype float32`); llama-server: the f32 and
f16 GGUF files llama.cpp's converter makes (`--embedding --pooling mean`, 16 slots, a batch of
4096 tokens, the machine's threads); its vectors are compared with quill's (cosine).

    .venv/bin/python benchmarks/bench_embeddings_http.py [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_embeddings import texts  # noqa: E402
from benchmarks.bench_server import start_server  # noqa: E402
from benchmarks.engine.machine import machine_info  # noqa: E402
from benchmarks.peers import llama_cpp  # noqa: E402
from quill.model.named_models import named_model_path  # noqa: E402


def gguf(outtype: str) -> Path:
    """all-MiniLM-L6-v2 through llama.cpp's own converter (made once)."""
    out = llama_cpp.peers_dir() / "models" / "minilm" / f"all-MiniLM-L6-v2-{outtype}.gguf"
    if not out.is_file():
        peers = llama_cpp.peers_dir()
        converter = sorted(peers.glob("src/llama_cpp_python-*/vendor/llama.cpp/"
                                      "convert_hf_to_gguf.py"))  # fmt: skip
        if not converter:
            raise SystemExit("llama.cpp is not built: bash benchmarks/peers/build_llama_cpp.sh")
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(peers / "venv" / "bin" / "python"), str(converter[-1]),
                        str(named_model_path("all-minilm-l6-v2")), "--outtype", outtype,
                        "--outfile", str(out)], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return out


async def run_clients(url: str, data: list[str], clients: int, model: str) -> tuple[float, list]:
    vectors: list = [None] * len(data)
    queue = list(range(len(data)))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop()
            r = await http.post("/v1/embeddings", json={"model": model, "input": data[i]})
            r.raise_for_status()
            vectors[i] = r.json()["data"][0]["embedding"]

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        seconds = time.perf_counter() - start
    return len(data) / seconds, vectors


def run_side(side: str, data: list[str], clients: int) -> tuple[float, list]:
    if side.startswith("llama"):
        model = gguf(side.removeprefix("llama-"))
        threads = os.cpu_count() or 1
        server = llama_cpp.LlamaServer(model, threads=threads, ctx=4096, parallel=clients,
                                       extra=("--embedding", "--pooling", "mean", "-b", "4096",
                                              "-ub", "4096")).start()  # fmt: skip
        try:
            asyncio.run(run_clients(server.url, data[:32], clients, "minilm"))
            return asyncio.run(run_clients(server.url, data, clients, "minilm"))
        finally:
            server.stop()
    extra = ["--dtype", "float32"] if side == "quill-fp32" else []
    proc, url = start_server("auto", ["all-minilm-l6-v2", *extra])
    try:
        asyncio.run(run_clients(url, data[:32], clients, "all-minilm-l6-v2"))
        return asyncio.run(run_clients(url, data, clients, "all-minilm-l6-v2"))
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", default="quill,llama-f16,quill-fp32,llama-f32")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    data = texts(args.texts, args.seed)
    sides = args.sides.split(",")
    rounds: dict[str, list[float]] = {s: [] for s in sides}
    vectors = {}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else list(reversed(sides)):
            rate, vectors[side] = run_side(side, data, args.clients)
            rounds[side].append(rate)
            print(f"round {r} {side}: {rate:.1f} texts/s", flush=True)
    best = {s: max(v) for s, v in rounds.items()}
    summary = {"machine": machine_info(os.cpu_count() or 1), "date": time.strftime("%Y-%m-%d"),
               "command": " ".join(sys.argv), "clients": args.clients, "texts": args.texts,
               "rounds": rounds, "best_texts_per_s": best}  # fmt: skip
    for quill_side, llama_side in (("quill", "llama-f16"), ("quill-fp32", "llama-f32")):
        if quill_side in best and llama_side in best:
            ratio = best[quill_side] / best[llama_side]
            a, b = np.asarray(vectors[quill_side]), np.asarray(vectors[llama_side])
            cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
            summary[f"{quill_side}_vs_{llama_side}"] = ratio
            summary[f"{quill_side}_vs_{llama_side}_min_cosine"] = float(cos.min())
            print(f"{quill_side} / {llama_side}: {ratio:.2f}x, min cosine {cos.min():.6f}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
