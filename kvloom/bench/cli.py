"""`kvloom bench ...` argument parsing and dispatch."""

from __future__ import annotations

import argparse
from collections.abc import Callable


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


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "offline":
        return _offline(args)
    raise AssertionError(args.bench_command)


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
