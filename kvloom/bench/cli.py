"""`kvloom bench ...` argument parsing and dispatch.

``offline`` drives the engine in-process; ``serve`` load-tests an OpenAI-compatible
server over HTTP; ``sweep`` starts servers over a grid of engine options and
request rates and runs ``serve`` for each cell; ``plot`` draws the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvloom.bench.datasets import BenchRequest
    from kvloom.bench.serve import ServeBenchConfig


def add_bench_parser(sub: argparse._SubParsersAction,
                     add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    offline = bench_sub.add_parser("offline", help="in-process throughput through the engine")
    add_engine_args(offline)
    offline.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "random"])
    offline.add_argument("--num-prompts", type=int, default=100)
    offline.add_argument("--input-len", type=int, default=256, help="random dataset")
    offline.add_argument("--output-len", type=int, default=128,
                         help="random dataset; for sharegpt, caps each request's output length")
    offline.add_argument("--dataset-seed", type=int, default=0)
    offline.add_argument("--compare", action="store_true",
                         help="run continuous and static batching on the same requests")
    offline.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    offline.add_argument("--output-json", default=None)

    roofline = bench_sub.add_parser("roofline", help="matmul rate, memory bandwidth, decode-step bound")
    roofline.add_argument("model", nargs="?", default=None)
    roofline.add_argument("--batches", default="1,16,64", help="decode batch sizes")
    roofline.add_argument("--context", type=int, default=512, help="tokens of KV per sequence")

    steps = bench_sub.add_parser("steps", help="time engine steps: decode at given batch sizes, prefill")
    add_engine_args(steps)
    steps.add_argument("--batches", default="1,16,64,200", help="decode batch sizes")
    steps.add_argument("--context", type=int, default=300, help="prompt tokens of each decoding sequence")
    steps.add_argument("--decode-steps", type=int, default=20, help="timed decode steps per batch size")
    steps.add_argument("--prefill", default="8x256", help="COUNTxLENGTH[,...]: fresh prompts per prefill step")
    steps.add_argument("--repeats", type=int, default=5, help="timed prefill steps per shape")
    steps.add_argument("--output-json", default=None)

    soak = bench_sub.add_parser("soak", help="ordinary, disconnecting, aborting and hostile clients on a tiny pool")
    add_engine_args(soak)
    soak.add_argument("--num-requests", type=int, default=1000)
    soak.add_argument("--concurrency", type=int, default=64)
    soak.add_argument("--max-seconds", type=float, default=1800.0, help="stop sending new requests after this")
    soak.add_argument("--pool-factor", type=float, default=5.0, help="the KV pool is this many times too small")
    soak.add_argument("--soak-max-tokens", type=int, default=48, help="largest max_tokens of a request")
    soak.add_argument("--soak-seed", type=int, default=0, help="draws the requests")
    soak.add_argument("--output-json", default=None)

    placement = bench_sub.add_parser("placement", help="engine loop in a thread vs a process")
    add_engine_args(placement)
    placement.add_argument("--num-requests", type=int, default=32)
    placement.add_argument("--prompt-len", type=int, default=128)
    placement.add_argument("--max-tokens", type=int, default=128)

    structured = bench_sub.add_parser(
        "structured", help="JSON-schema workload vs unconstrained, jump-forward on/off",
        description="Arguments are passed to kvloom.structured.bench: MODEL --num-prompts N "
                    "--max-tokens N --temperature T --dtype D --output-json PATH")
    structured.add_argument("structured_args", nargs=argparse.REMAINDER)

    serve = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server over HTTP")
    add_serve_bench_args(serve)
    sweep = bench_sub.add_parser("sweep", help="bench serve over request rates x engine options")
    sweep.add_argument("config", help="sweep CONFIG.json (see kvloom.bench.sweep)")
    sweep.add_argument("--output-dir", default=None, help="overrides the config's output_dir")
    plot = bench_sub.add_parser("plot", help="latency-vs-throughput and throughput charts (PNG)")
    plot.add_argument("results", nargs="+", help="bench serve results JSON files")
    plot.add_argument("--out", required=True, help="directory for the PNG files")


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "offline":
        return _offline(args)
    if args.bench_command == "serve":
        return _serve(args)
    if args.bench_command == "sweep":
        from kvloom.bench.sweep import SweepConfig, run_sweep
        config = SweepConfig.from_file(args.config)
        if args.output_dir:
            config = dataclasses.replace(config, output_dir=args.output_dir)
        return run_sweep(config)
    if args.bench_command == "roofline":
        return _roofline(args)
    if args.bench_command == "steps":
        return _steps(args)
    if args.bench_command == "soak":
        return _soak(args)
    if args.bench_command == "placement":
        from kvloom.bench.engine_placement import measure
        from kvloom.cli import engine_kwargs
        results = measure(args.model, engine_kwargs(args), args.num_requests, args.prompt_len,
                          args.max_tokens)
        for name, rate in results.items():
            print(f"engine in a {name:<8} {rate:8.1f} output tok/s delivered to the consumer")
        return 0
    if args.bench_command == "structured":
        from kvloom.structured.bench import main as structured_main
        return structured_main(args.structured_args)
    if args.bench_command == "plot":
        from kvloom.bench.plot import plot_results
        for path in plot_results(args.results, args.out):
            print(path)
        return 0
    raise AssertionError(args.bench_command)


# ---------------------------------------------------------------- bench serve
def _rate(text: str) -> float:
    rate = float(text)  # "inf" parses to math.inf
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {text}")
    return rate


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    """The ``bench serve`` flags (also parsed by ``bench sweep`` for its bench_args)."""
    from kvloom.config import DEFAULT_MODEL

    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000")
    target.add_argument("--model", default=None, help="served model name (default: GET /v1/models)")
    target.add_argument("--endpoint", default=None, choices=["/v1/completions", "/v1/chat/completions"],
                        help="default: chat for multiturn, completions otherwise")
    target.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")
    data = parser.add_argument_group("workload")
    data.add_argument("--tokenizer", default=DEFAULT_MODEL,
                      help="model whose tokenizer measures prompt lengths (only the tokenizer loads)")
    data.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "random", "prefix", "multiturn"])
    data.add_argument("--num-prompts", type=int, default=100,
                      help="requests; conversations for multiturn; groups x per-group for prefix")
    data.add_argument("--max-output-len", type=int, default=None, help="cap every request's max_tokens")
    data.add_argument("--sharegpt-filters", default="vllm", choices=["vllm", "sglang"])
    data.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--prefix-groups", type=int, default=4)
    data.add_argument("--prefix-len", type=int, default=512, help="system prompt tokens per group")
    data.add_argument("--question-len", type=int, default=128)
    data.add_argument("--reuse-ratio", type=float, default=None,
                      help="shared tokens / prompt tokens (default: the whole system prompt)")
    data.add_argument("--prefix-output-len", type=int, default=128)
    data.add_argument("--turns", type=int, default=3, help="multiturn: turns per conversation")
    data.add_argument("--max-context-len", type=int, default=None,
                      help="multiturn: the whole replay must fit; sharegpt with sglang filters: "
                           "prompt + output must fit")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=_rate, default=math.inf, help="req/s, Poisson; inf: all at once")
    load.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; gamma shape otherwise")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--seed", type=int, default=0, help="dataset sampling and arrivals")
    load.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM's extension)")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--num-warmups", type=int, default=0)
    load.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into each request")
    out = parser.add_argument_group("results")
    out.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft:500,tpot:50")
    out.add_argument("--label", default=None, help="series name in plots and tables")
    out.add_argument("--output-json", default=None)
    out.add_argument("--no-progress", dest="show_progress", action="store_false")


def _workload_parameters(args: argparse.Namespace) -> dict[str, Any]:
    keys = {"sharegpt": ("sharegpt_filters", "sharegpt_output_len", "max_context_len"),
            "random": ("random_input_len", "random_output_len", "random_range_ratio"),
            "prefix": ("prefix_groups", "prefix_len", "question_len", "reuse_ratio", "prefix_output_len"),
            "multiturn": ("turns", "max_context_len")}[args.dataset]
    return {"dataset": args.dataset, "num_prompts": args.num_prompts, "seed": args.seed,
            "tokenizer": args.tokenizer, "max_output_len": args.max_output_len,
            **{key: getattr(args, key) for key in keys}}


def sample_workload(args: argparse.Namespace) -> list[BenchRequest]:
    """The request list the ``bench serve`` flags describe (loads only the tokenizer)."""
    from kvloom.bench import datasets
    from kvloom.models.loader import load_checkpoint

    tokenizer = load_checkpoint(args.tokenizer, cache_gguf=False).tokenizer
    if args.dataset == "sharegpt":
        if args.max_context_len is not None and args.sharegpt_filters != "sglang":
            raise ValueError("--max-context-len applies to sharegpt with --sharegpt-filters sglang")
        requests = datasets.sample_sharegpt(tokenizer, args.num_prompts, args.seed, args.sharegpt_filters,
                                            args.sharegpt_output_len, context_len=args.max_context_len)
    elif args.dataset == "random":
        requests = datasets.sample_random(tokenizer, args.num_prompts, args.random_input_len,
                                          args.random_output_len, args.random_range_ratio, args.seed)
    elif args.dataset == "prefix":
        per_group = max(1, args.num_prompts // args.prefix_groups)
        requests = datasets.sample_prefix(tokenizer, args.prefix_groups, per_group, args.prefix_len,
                                          args.question_len, args.prefix_output_len, args.reuse_ratio,
                                          args.seed)
    else:
        requests = datasets.sample_multiturn(tokenizer, args.num_prompts, args.turns, args.seed,
                                             max_context_len=args.max_context_len)
    if args.max_output_len:
        cap = args.max_output_len
        requests = [dataclasses.replace(r, expected_output_len=min(r.expected_output_len, cap))
                    for r in requests]
    return requests


def serve_config(args: argparse.Namespace) -> ServeBenchConfig:
    from kvloom.bench.metrics import parse_slo
    from kvloom.bench.serve import CHAT, COMPLETIONS, ServeBenchConfig

    endpoint = args.endpoint or (CHAT if args.dataset == "multiturn" else COMPLETIONS)
    if args.dataset == "multiturn" and endpoint != CHAT:
        raise ValueError("--dataset multiturn sends message lists: use --endpoint /v1/chat/completions")
    if not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    return ServeBenchConfig(
        base_url=args.base_url, endpoint=endpoint, model=args.model, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed,
        ignore_eos=args.ignore_eos, temperature=args.temperature, num_warmups=args.num_warmups,
        slo=parse_slo(args.slo), extra_body=args.extra_body, request_timeout_s=args.request_timeout,
        label=args.label, workload=_workload_parameters(args), show_progress=args.show_progress)


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import shlex
    import sys

    from kvloom.bench.serve import report, run_benchmark, save_result

    config = serve_config(args)
    command = shlex.join(["kvloom", *sys.argv[1:]])
    result = asyncio.run(run_benchmark(config, sample_workload(args), command))
    print(report(result))
    if args.output_json:
        save_result(args.output_json, result)
        print(f"results written to {args.output_json}")
    return 0


def _offline(args: argparse.Namespace) -> int:
    import dataclasses
    import platform

    import torch

    from kvloom.bench import datasets
    from kvloom.bench.offline import format_table, run_offline, save_results, warm_up
    from kvloom.cli import engine_kwargs, save_trace
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine

    base = engine_kwargs(args)
    modes = ["continuous", "static"] if args.compare else [args.scheduling]
    results = []
    requests = None
    for mode in modes:
        engine = LLMEngine(EngineConfig.from_kwargs(args.model, **{**base, "scheduling": mode}))
        if requests is None:
            if args.dataset == "sharegpt":
                requests = datasets.sample_sharegpt(engine.tokenizer, args.num_prompts, seed=args.dataset_seed)
                if args.output_len:
                    requests = [dataclasses.replace(r, expected_output_len=min(r.expected_output_len, args.output_len))
                                for r in requests]
            else:
                requests = datasets.sample_random(engine.tokenizer, args.num_prompts, args.input_len,
                                                  args.output_len, 0.0, args.dataset_seed)
        warm_up(engine)
        results.append(run_offline(engine, requests, mode, ignore_eos=args.ignore_eos))
        if args.trace_file:
            save_trace(engine, args)
        del engine
    print(format_table(results))
    if args.output_json:
        save_results(args.output_json, results, {
            "command": "kvloom bench offline", "engine_args": base, "dataset": args.dataset,
            "num_prompts": args.num_prompts, "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads()})
    return 0


def _engine_flags(args: argparse.Namespace, extra: tuple[str, ...]) -> dict[str, Any]:
    """The compute-path engine flags (and ``extra`` ones) of a benchmark that sizes the
    pool and the batch limits itself."""
    from kvloom.cli import engine_kwargs

    keep = {"dtype", "device", "seed", "attention_backend", "num_threads", "matmul", *extra}
    return {key: value for key, value in engine_kwargs(args).items() if key in keep}


def _steps(args: argparse.Namespace) -> int:
    from kvloom.bench.steps import as_json, run_steps

    prefills = [tuple(int(n) for n in shape.split("x")) for shape in args.prefill.split(",") if shape]
    batches = [int(b) for b in args.batches.split(",") if b]
    # The pool, the batch limits and the prefix cache are the benchmark's to size.
    engine = _engine_flags(args, ())
    results = run_steps(args.model, engine, batches, args.context, args.decode_steps,
                        prefills, args.repeats)  # type: ignore[arg-type]
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "engine": engine, "steps": as_json(results)}, f, indent=1)
    return 0


def _soak(args: argparse.Namespace) -> int:
    from kvloom.bench.soak import SoakConfig, format_soak, run_soak

    # The pool is the soak's to size (pool_factor); the scheduler's flags pass through.
    engine = _engine_flags(args, ("block_size", "max_num_seqs", "max_num_batched_tokens", "policy",
                                  "enable_prefix_caching"))
    config = SoakConfig(args.model, engine, args.num_requests, args.concurrency, args.max_seconds,
                        args.soak_seed, args.pool_factor, args.soak_max_tokens)
    result = run_soak(config)
    print(format_soak(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    clean = (result["lost"] == 0 and result["kv_blocks_leaked"] == 0 and result["engine_faults"] == 0
             and result["greedy_equal_alone"] == result["greedy_compared"])
    return 0 if clean else 1


def _roofline(args: argparse.Namespace) -> int:
    from kvloom.bench.roofline import run_roofline
    from kvloom.config import DEFAULT_MODEL, ModelConfig
    from kvloom.models.loader import load_checkpoint

    checkpoint = load_checkpoint(args.model or DEFAULT_MODEL)
    config = ModelConfig.from_hf(checkpoint.hf_config)
    num_params = sum(t.numel() for _, t in checkpoint.weights())
    print(f"{checkpoint.name}: {num_params / 1e6:.1f}M parameters")
    print(run_roofline(config, num_params, [int(b) for b in args.batches.split(",")], args.context))
    return 0
