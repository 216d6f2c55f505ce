"""The `quill` command: generate, chat, serve, tp-node, cost (and calibrate), simulate, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from quill.engine_args import add_engine_arguments, engine_options


def _sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)


def _sampling_params(args):
    from quill.contract.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def _stream(engine, prompt, params) -> str:
    """Run one request, printing its text as it arrives."""
    request_id = engine.add_request(prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            delta = out.outputs[0].delta_text
            text += delta
            sys.stdout.write(delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from quill.llm import LLM

    llm = LLM(args.model, **engine_options(args))
    _stream(llm.engine, args.prompt, _sampling_params(args))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from quill.llm import LLM

    llm = LLM(args.model, **engine_options(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("quill chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        prompt = llm.tokenizer.apply_chat_template(messages)
        reply = _stream(llm.engine, prompt, _sampling_params(args))
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_tp_node(args: argparse.Namespace) -> int:
    from quill.config import EngineConfig
    from quill.distributed.executor import run_node

    return run_node(EngineConfig(args.model, **engine_options(args)))


SERVE_HELP = "OpenAI-compatible HTTP server"
ROUTER_HELP = (
    "one OpenAI endpoint for prefill and decode instances (disaggregation), or for "
    "whole-request instances, picked by load"
)
OFFLINE_COMMANDS = {"generate", "chat", "tp-node", "cost", "simulate", "bench"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt, streaming to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    add_engine_arguments(gen)
    _sampling_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="talk to the model through its chat template")
    chat.add_argument("--model", default=None)
    chat.add_argument("--system", default=None, help="system message")
    add_engine_arguments(chat)
    _sampling_arguments(chat)
    chat.set_defaults(func=cmd_chat)

    node = sub.add_parser(
        "tp-node",
        help="run this host's tensor-parallel ranks for a `quill serve` on node 0 (same flags, "
        "and --node-rank)",
    )
    node.add_argument("model", nargs="?", default=None)
    add_engine_arguments(node)
    node.set_defaults(func=cmd_tp_node)

    serve = sub.add_parser("serve", help=SERVE_HELP)
    words = sys.argv[1:] if argv is None else argv
    # The server's modules (FastAPI, pydantic) take about half a second to import: only a
    # command that may be one of theirs, or a request for help, pays for them.
    add_serve_arguments = run_serve = None
    if not (words and words[0] in OFFLINE_COMMANDS):
        try:
            from quill.server.serve import add_serve_arguments, run_serve
        except ImportError:  # the server's dependencies are optional for offline use
            pass
    if add_serve_arguments is None:
        sub.add_parser("router", help=ROUTER_HELP)
    else:
        add_serve_arguments(serve)
        serve.set_defaults(func=run_serve)
        from quill.router.app import add_router_arguments, run_router

        router = sub.add_parser("router", help=ROUTER_HELP)
        add_router_arguments(router)
        router.set_defaults(func=run_router)

    from quill.cost.cli import add_cost_parser

    add_cost_parser(sub)

    from quill.sim.cli import add_simulate_parser

    add_simulate_parser(sub)

    from quill.bench.cli import add_bench_parser

    add_bench_parser(sub)

    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request a client sends
    if getattr(args, "func", None) is None:
        parser.error("the server is not available")
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
