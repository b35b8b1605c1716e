"""The ``bench serve`` flags and what they describe: the workload and the client config.

``kvloom bench serve`` parses them from the command line and ``bench sweep`` from its
config's ``bench_args``; both build their requests and client config here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvloom.bench.datasets import BenchRequest
    from kvloom.bench.serve import ServeBenchConfig


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
    data.add_argument("--tokenizer", default=None,
                      help="model whose tokenizer measures prompt lengths (only the tokenizer loads; default: "
                           "the model the server at --base-url serves, its /v1/models 'root', else "
                           f"{DEFAULT_MODEL!r})")
    data.add_argument("--dataset", default="sharegpt",
                      choices=["sharegpt", "random", "prefix", "multiturn", "grounded"],
                      help="grounded: ShareGPT's quoted code blocks asked back reformatted (output copies "
                           "the prompt: the case for n-gram speculation)")
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
    data.add_argument("--prefix-interleave", action="store_true",
                      help="prefix: send the groups' requests in a seeded random order (tenants "
                           "interleaved, as many users of a few system prompts arrive) rather than "
                           "group by group")
    data.add_argument("--turns", type=int, default=3, help="multiturn: turns per conversation")
    data.add_argument("--history", choices=["dataset", "generated"], default="dataset",
                      help="multiturn: earlier turns' replies as the dataset has them (the same prompts "
                           "for every engine) or as the server generated them (what a chat client sends; "
                           "input tokens are then the server's count)")
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
            "prefix": ("prefix_groups", "prefix_len", "question_len", "reuse_ratio", "prefix_output_len",
                       "prefix_interleave"),
            "multiturn": ("turns", "max_context_len"),
            "grounded": ()}[args.dataset]
    return {"dataset": args.dataset, "num_prompts": args.num_prompts, "seed": args.seed,
            "tokenizer": args.tokenizer, "max_output_len": args.max_output_len,
            **{key: getattr(args, key) for key in keys}}


def resolve_tokenizer(args: argparse.Namespace, default: str | None = None) -> None:
    """Settle ``args.tokenizer``: as given; else ``default`` (a sweep's model); else what
    the server at ``--base-url`` says it serves (``root`` in ``/v1/models``: the model
    argument it was started with, loadable here when the server runs on this machine);
    else the default model."""
    from kvloom.config import DEFAULT_MODEL

    if args.tokenizer is None:
        args.tokenizer = default or served_model_root(args.base_url) or DEFAULT_MODEL


def served_model_root(base_url: str) -> str | None:
    """The ``root`` of the first model a server lists, or None when it cannot be asked."""
    import httpx

    try:
        response = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=10.0)
        response.raise_for_status()
        root = response.json()["data"][0].get("root")
    except (httpx.HTTPError, OSError, ValueError, KeyError, IndexError, AttributeError):
        return None
    return root if isinstance(root, str) and root else None


def sample_workload(args: argparse.Namespace) -> list[BenchRequest]:
    """The request list the ``bench serve`` flags describe (loads only the tokenizer)."""
    from kvloom.bench import datasets
    from kvloom.models.errors import ModelLoadError
    from kvloom.models.loader import load_checkpoint

    resolve_tokenizer(args)
    try:
        tokenizer = load_checkpoint(args.tokenizer, cache_gguf=False).tokenizer
    except ModelLoadError as error:
        raise ModelLoadError(f"the workload's tokenizer: {error} (pass --tokenizer)") from None
    if args.dataset == "sharegpt":
        if args.max_context_len is not None and args.sharegpt_filters != "sglang":
            raise ValueError("--max-context-len applies to sharegpt with --sharegpt-filters sglang")
        requests = datasets.sample_sharegpt(tokenizer, args.num_prompts, args.seed, args.sharegpt_filters,
                                            args.sharegpt_output_len, context_len=args.max_context_len)
    elif args.dataset == "grounded":
        requests = datasets.sample_grounded(tokenizer, args.num_prompts, args.seed)
    elif args.dataset == "random":
        requests = datasets.sample_random(tokenizer, args.num_prompts, args.random_input_len,
                                          args.random_output_len, args.random_range_ratio, args.seed)
    elif args.dataset == "prefix":
        per_group = max(1, args.num_prompts // args.prefix_groups)
        requests = datasets.sample_prefix(tokenizer, args.prefix_groups, per_group, args.prefix_len,
                                          args.question_len, args.prefix_output_len, args.reuse_ratio,
                                          args.seed)
        if args.prefix_interleave:
            random.Random(args.seed).shuffle(requests)
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
    if args.history != "dataset" and args.dataset != "multiturn":
        raise ValueError(f"--history {args.history} is for --dataset multiturn (its turns' replies)")
    if not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    return ServeBenchConfig(
        base_url=args.base_url, endpoint=endpoint, model=args.model, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed,
        ignore_eos=args.ignore_eos, temperature=args.temperature, num_warmups=args.num_warmups,
        slo=parse_slo(args.slo), extra_body=args.extra_body, request_timeout_s=args.request_timeout,
        label=args.label, workload=_workload_parameters(args), show_progress=args.show_progress,
        history=args.history)
