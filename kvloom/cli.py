"""`kvloom serve | router | generate | chat | fetch-model | bench | trace` (argparse -> config; no logic).

Engine flags share their names with ``LLM(...)`` keyword arguments:
``--num-blocks`` <-> ``num_blocks``; they are generated from the config dataclasses
(kvloom/engine_args.py). Each command's parser sets ``run``, the function it calls.
"""

from __future__ import annotations

import argparse
import sys

from kvloom.bench.cli import add_bench_parser
from kvloom.bench.extras import MissingExtra
from kvloom.bench.trace_render import add_trace_parser
from kvloom.config import DEFAULT_MODEL
from kvloom.engine_args import add_engine_args, add_version_flag, engine_kwargs, save_trace
from kvloom.router.cli import add_data_parallel_args, add_router_parser
from kvloom.server.cli import add_serve_parser


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    group.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    group.add_argument("--sample-seed", type=int, default=None,
                       help="this command's sampling seed (default: the engine's --seed)")
    group.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def sampling_params(args: argparse.Namespace):
    from kvloom.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sample_seed,
                          stop=args.stop)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvloom", allow_abbrev=False, description=__doc__.splitlines()[0])
    add_version_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    generate = sub.add_parser("generate", allow_abbrev=False, help="generate completions for prompts")
    add_engine_args(generate)
    add_sampling_args(generate)
    generate.add_argument("--prompt", action="append", required=True, help="repeatable")
    generate.add_argument("--chat", action="store_true",
                          help="wrap each prompt as a user message in the chat template")
    generate.set_defaults(run=_generate)

    chat = sub.add_parser("chat", allow_abbrev=False, help="interactive chat, streaming tokens")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="a system message opening the conversation")
    chat.set_defaults(run=_chat)

    fetch = sub.add_parser("fetch-model", allow_abbrev=False,
                           help=f"download and extract {DEFAULT_MODEL} into the model cache")
    fetch.set_defaults(model=DEFAULT_MODEL, run=_fetch_model)

    add_bench_parser(sub)
    add_trace_parser(sub)
    add_data_parallel_args(add_serve_parser(sub))
    add_router_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvloom.distributed.errors import RankFailed
    from kvloom.models.errors import ModelLoadError
    try:
        if hasattr(args, "tensor_parallel_size"):
            rank = _torchrun_worker_rank(args)
            if rank is not None:
                return rank
        return args.run(args)
    except (ModelLoadError, MissingExtra, RankFailed) as error:
        print(f"kvloom: error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"kvloom: error: {error}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as error:
        # A path the command was given (a config, a profile, a work directory): named, no traceback.
        print(f"kvloom: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _torchrun_worker_rank(args: argparse.Namespace) -> int | None:
    """Under torchrun every rank runs the same command: rank 0 runs it, the others
    serve their tensor-parallel shard until rank 0 stops (their exit status), here."""
    from kvloom.distributed.launch import torchrun_placement
    placement = torchrun_placement()
    if placement is None or placement.rank == 0:
        return None
    import logging

    from kvloom.config import EngineConfig
    from kvloom.runner.tensor_parallel import worker_main
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s rank{placement.rank} %(name)s: %(message)s")
    return worker_main(EngineConfig.from_kwargs(args.model, **engine_kwargs(args)), placement)


def _fetch_model(args: argparse.Namespace) -> int:
    from kvloom.models.default_model import resolve_default_model
    print(resolve_default_model())
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kvloom.engine.llm import LLM
    llm = LLM(args.model, **engine_kwargs(args))
    prompts: list[str | list[int]] = list(args.prompt)
    if args.chat:
        prompts = [llm.encode_chat([{"role": "user", "content": p}]) for p in args.prompt]
    with llm:
        for prompt, output in zip(args.prompt, llm.generate(prompts, sampling_params(args)), strict=True):
            print(f"--- {prompt!r}\n{output.outputs[0].text}\n[{output.outputs[0].finish_reason}]")
        save_trace(llm.engine, args)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from kvloom.chat import run_chat
    return run_chat(args.model, engine_kwargs(args), sampling_params(args), args.system)
