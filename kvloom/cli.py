"""`kvloom serve | generate | chat | fetch-model | bench | trace` (argparse -> config; no logic).

Engine flags share their names with ``LLM(...)`` keyword arguments:
``--num-blocks`` <-> ``num_blocks``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvloom.config import DEFAULT_MODEL, MATMULS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                       help=f"HF directory, .gguf file, or {DEFAULT_MODEL!r} (default)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--num-blocks", type=int, default=None, help="KV blocks (wins over --kv-cache-memory)")
    group.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB for the KV pool")
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--scheduling", default="continuous", choices=["continuous", "static"])
    group.add_argument("--policy", default="fcfs")
    group.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    group.add_argument("--long-prefill-threshold", type=int, default=0)
    group.add_argument("--no-prefix-cache", dest="enable_prefix_caching", action="store_false")
    group.add_argument("--max-wait-steps", type=int, default=0,
                       help="starvation bound: admit a request first after this many steps waiting")
    group.add_argument("--max-wait-seconds", type=float, default=0.0)
    group.add_argument("--low-watermark", type=float, default=0.0)
    group.add_argument("--high-watermark", type=float, default=1.0)
    group.add_argument("--trace", action="store_true", help="record the scheduler's decisions")
    group.add_argument("--trace-file", default=None, help="write the decision record here at exit")
    group.add_argument("--attention-backend", default="auto")
    group.add_argument("--num-threads", type=int, default=None)
    group.add_argument("--matmul", choices=MATMULS, default="invariant",
                       help="kernel for CPU bf16 matmuls: 'invariant' (kvloom's GEMM: a request's tokens "
                            "never depend on the batch), 'onednn' (prepacked oneDNN: rounding changes with "
                            "the batch size), 'torch' (F.linear, for comparison)")


ENGINE_KEYS = ("dtype", "device", "seed", "max_model_len", "block_size", "num_blocks",
               "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "scheduling",
               "policy", "enable_chunked_prefill", "long_prefill_threshold",
               "attention_backend", "num_threads", "enable_prefix_caching", "max_wait_steps",
               "max_wait_seconds", "low_watermark", "high_watermark", "trace", "matmul")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {key: getattr(args, key) for key in ENGINE_KEYS if hasattr(args, key)}
    if getattr(args, "trace_file", None):
        kwargs["trace"] = True
    return kwargs


def save_trace(engine: Any, args: argparse.Namespace) -> None:
    """Write the scheduler's decision record where --trace-file asks."""
    if getattr(args, "trace_file", None):
        engine.scheduler.trace.save(args.trace_file)
        print(f"trace written to {args.trace_file}", file=sys.stderr)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--sample-seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[])


def sampling_params(args: argparse.Namespace):
    from kvloom.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sample_seed,
                          stop=args.stop)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvloom", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    generate = sub.add_parser("generate", help="generate completions for prompts")
    add_engine_args(generate)
    add_sampling_args(generate)
    generate.add_argument("--prompt", action="append", required=True, help="repeatable")
    generate.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user message")

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None)

    fetch = sub.add_parser("fetch-model", help=f"download and extract {DEFAULT_MODEL} into the model cache")
    fetch.set_defaults(model=DEFAULT_MODEL)

    from kvloom.bench.cli import add_bench_parser
    add_bench_parser(sub, add_engine_args)
    from kvloom.engine.trace_render import add_trace_parser
    add_trace_parser(sub)
    from kvloom.server.cli import add_serve_parser
    add_serve_parser(sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvloom.models.errors import ModelLoadError
    try:
        return _dispatch(args)
    except ModelLoadError as error:
        print(f"kvloom: error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"kvloom: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "fetch-model":
        from kvloom.models.default_model import resolve_default_model
        print(resolve_default_model())
        return 0
    if args.command == "generate":
        from kvloom.engine.llm import LLM
        llm = LLM(args.model, **engine_kwargs(args))
        prompts: list[str | list[int]] = list(args.prompt)
        if args.chat_template:
            prompts = [llm.encode_chat([{"role": "user", "content": p}]) for p in args.prompt]
        for prompt, output in zip(args.prompt, llm.generate(prompts, sampling_params(args)), strict=True):
            print(f"--- {prompt!r}\n{output.outputs[0].text}\n[{output.outputs[0].finish_reason}]")
        save_trace(llm.engine, args)
        return 0
    if args.command == "chat":
        from kvloom.chat import run_chat
        return run_chat(args.model, engine_kwargs(args), sampling_params(args), args.system)
    if args.command == "bench":
        from kvloom.bench.cli import run_bench
        return run_bench(args)
    if args.command == "serve":
        from kvloom.server.cli import run_serve
        return run_serve(args)
    if args.command == "trace":
        from kvloom.engine.trace_render import run_trace
        return run_trace(args)
    raise AssertionError(args.command)
