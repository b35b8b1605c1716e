"""Engine flags are generated from the config dataclasses: one flag per field, each with
help, and flags -> engine kwargs -> EngineConfig gives back exactly the values given."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from kvloom.cli import build_parser
from kvloom.config import (
    ATTENTION_BACKENDS,
    DECODER_STACKS,
    DEFAULT_MODEL,
    DISTRIBUTED_BACKENDS,
    KV_ROLES,
    KV_TRANSPORTS,
    MATMULS,
    OVERLAP_MODES,
    POLICY_NAMES,
    SCHEDULING_MODES,
    SUPPORTED_DTYPES,
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvloom.engine_args import add_engine_args, engine_kwargs

# Every config field, its flag and a value other than its default: (argv, section, field, value).
# The flag names are the public CLI (docs, Makefile, benchmark scripts): they never change.
NON_DEFAULTS = [
    (["some/model"], None, "model", "some/model"),
    (["--revision", "v2"], None, "revision", "v2"),
    (["--tokenizer", "some/tokenizer"], None, "tokenizer", "some/tokenizer"),
    (["--dtype", "float32"], None, "dtype", "float32"),
    (["--device", "cpu"], None, "device", "cpu"),
    (["--seed", "7"], None, "seed", 7),
    (["--max-model-len", "512"], None, "max_model_len", 512),
    (["--max-logprobs", "-1"], None, "max_logprobs", -1),
    (["--override-generation-config", '{"temperature": 0.5}'], None, "override_generation_config",
     {"temperature": 0.5}),
    (["--hf-overrides", '{"is_matryoshka": true}'], None, "hf_overrides", {"is_matryoshka": True}),
    (["--pooler-config", '{"pooling_type": "MEAN"}'], None, "pooler_config", {"pooling_type": "MEAN"}),
    (["--attention-backend", "torch_ref"], None, "attention_backend", "torch_ref"),
    (["--num-threads", "2"], None, "num_threads", 2),
    (["--matmul", "onednn"], None, "matmul", "onednn"),
    (["--decoder-stack", "modules"], None, "decoder_stack", "modules"),
    (["--enforce-eager"], None, "enforce_eager", True),
    (["--overlap-scheduling", "off"], None, "overlap_scheduling", "off"),
    (["--chat-template", "{{ messages[0]['content'] }}"], None, "chat_template",
     "{{ messages[0]['content'] }}"),
    (["--generation-config", "none"], None, "generation_config", "none"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'], None,
     "speculative_config", SpeculativeConfig("ngram", num_speculative_tokens=3)),
    (["--block-size", "8"], "cache", "block_size", 8),
    (["--num-blocks", "7"], "cache", "num_blocks", 7),
    (["--num-state-slots", "3"], "cache", "num_state_slots", 3),
    (["--num-state-checkpoints", "0"], "cache", "num_state_checkpoints", 0),
    (["--kv-cache-memory", "0.5"], "cache", "kv_cache_memory", 0.5),
    (["--no-prefix-cache"], "cache", "enable_prefix_caching", False),
    (["--gpu-memory-utilization", "0.5"], "cache", "gpu_memory_utilization", 0.5),
    (["--max-num-seqs", "3"], "scheduler", "max_num_seqs", 3),
    (["--max-num-batched-tokens", "99"], "scheduler", "max_num_batched_tokens", 99),
    (["--scheduling", "static"], "scheduler", "scheduling", "static"),
    (["--policy", "priority"], "scheduler", "policy", "priority"),
    (["--no-chunked-prefill"], "scheduler", "enable_chunked_prefill", False),
    (["--long-prefill-threshold", "64"], "scheduler", "long_prefill_threshold", 64),
    (["--max-wait-steps", "5"], "scheduler", "max_wait_steps", 5),
    (["--max-wait-seconds", "2.5"], "scheduler", "max_wait_seconds", 2.5),
    (["--low-watermark", "0.25"], "scheduler", "low_watermark", 0.25),
    (["--high-watermark", "0.75"], "scheduler", "high_watermark", 0.75),
    (["--trace"], "scheduler", "trace", True),
    (["--trace-capacity", "50"], "scheduler", "trace_capacity", 50),
    (["--tensor-parallel-size", "2"], "parallel", "tensor_parallel_size", 2),
    (["--distributed-backend", "gloo"], "parallel", "distributed_backend", "gloo"),
    (["--no-shared-memory"], "parallel", "shared_memory", False),
    (["--distributed-timeout", "30"], "parallel", "distributed_timeout", 30.0),
    (["--enable-expert-parallel"], "parallel", "enable_expert_parallel", True),
    (["--role", "decode"], "kv_transfer", "role", "decode"),
    (["--kv-transport", "torch"], "kv_transfer", "kv_transport", "torch"),
    (["--kv-host", "10.0.0.1"], "kv_transfer", "kv_host", "10.0.0.1"),
    (["--kv-port", "29600"], "kv_transfer", "kv_port", 29600),
    (["--kv-buffer-gib", "0.5"], "kv_transfer", "kv_buffer_gib", 0.5),
    (["--kv-transfer-timeout", "30"], "kv_transfer", "kv_transfer_timeout", 30.0),
    (["--kv-shm-dir", "/tmp/kv"], "kv_transfer", "kv_shm_dir", "/tmp/kv"),
    (["--enable-lora"], "lora", "enable_lora", True),
    (["--max-loras", "2"], "lora", "max_loras", 2),
    (["--max-cpu-loras", "6"], "lora", "max_cpu_loras", 6),
    (["--max-lora-rank", "64"], "lora", "max_lora_rank", 64),
]


def _config_fields() -> set[tuple[str | None, str]]:
    sections = (("cache", CacheConfig), ("scheduler", SchedulerConfig), ("parallel", ParallelConfig),
                ("kv_transfer", KVTransferConfig), ("lora", LoRAConfig))
    own = {(None, f.name) for f in dataclasses.fields(EngineConfig) if f.name not in dict(sections)}
    return own | {(section, f.name) for section, cls in sections for f in dataclasses.fields(cls)}


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def _engine_actions() -> list[argparse.Action]:
    return [action for action in _engine_parser()._actions if action.dest != "help"]


def _config(argv: list[str]) -> EngineConfig:
    args = _engine_parser().parse_args(argv)
    return EngineConfig.from_kwargs(args.model, **engine_kwargs(args))


def _value(config: EngineConfig, section: str | None, name: str) -> object:
    return getattr(config if section is None else getattr(config, section), name)


# Further spellings (vLLM's, or kvloom's older ones) of a flag in NON_DEFAULTS.
ALIASES = [
    (["--model", "some/model"], None, "model", "some/model"),
    (["--no-enable-prefix-caching"], "cache", "enable_prefix_caching", False),
    (["--no-enable-chunked-prefill"], "scheduler", "enable_chunked_prefill", False),
    (["-tp", "2"], "parallel", "tensor_parallel_size", 2),
    (["--scheduling-policy", "priority"], "scheduler", "policy", "priority"),
    (["--long-prefill-token-threshold", "64"], "scheduler", "long_prefill_threshold", 64),
    (["--num-gpu-blocks-override", "99"], "cache", "num_blocks", 99),
]
# Two flags that size the KV pool and exclude each other: the all-at-once test drops one.
# And a role other than both is refused with the tensor-parallel size set above.
EXCLUSIVE = {"gpu_memory_utilization", "role"}


def test_the_table_covers_every_config_field() -> None:
    assert {(section, name) for _, section, name, _ in NON_DEFAULTS} == _config_fields()
    assert len(NON_DEFAULTS) == len(_config_fields())


def test_every_engine_flag_has_help() -> None:
    for action in _engine_actions():
        assert action.help and action.help.strip(), action.dest


def test_each_config_field_is_exactly_one_flag() -> None:
    dests = [action.dest for action in _engine_actions()]
    # --trace-file is the one CLI-only flag (it implies --trace); the model is both the
    # positional MODEL and --model.
    assert sorted(dests) == sorted([name for _, name in _config_fields()] + ["trace_file", "model"])


@pytest.mark.parametrize("argv, section, name, value", ALIASES, ids=[row[0][0] for row in ALIASES])
def test_an_alias_round_trips_like_its_flag(argv: list[str], section: str | None, name: str,
                                            value: object) -> None:
    assert _value(_config(argv), section, name) == value
    assert _value(EngineConfig(), section, name) != value


def test_a_bool_switch_turns_on_again_and_the_last_spelling_wins() -> None:
    assert _config(["--no-prefix-cache", "--enable-prefix-caching"]).cache.enable_prefix_caching
    assert not _config(["--enable-prefix-caching", "--no-prefix-cache"]).cache.enable_prefix_caching
    assert _config(["--no-chunked-prefill", "--enable-chunked-prefill"]).scheduler.enable_chunked_prefill


def test_the_model_positional_or_flag_not_both(capsys) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve", "--model", "a/b"]).model == "a/b"
    assert parser.parse_args(["serve", "a/b"]).model == "a/b"
    assert parser.parse_args(["serve"]).model == DEFAULT_MODEL
    assert parser.parse_args(["serve", "a/b", "--model", "a/b"]).model == "a/b"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["serve", "a/b", "--model", "c/d"])
    assert exit_info.value.code == 2
    assert "the model is given twice ('a/b' and 'c/d')" in capsys.readouterr().err


def test_every_flag_and_alias_of_every_command_has_help() -> None:
    """The engine flags and the server's, every spelling shows in --help with text."""
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for command in ("serve", "generate", "chat"):
        for action in commands[command]._actions:
            if action.dest != "help":
                assert action.help and action.help.strip(), (command, action.option_strings or action.dest)
        text = commands[command].format_help()
        for flag in ("--model", "--enable-prefix-caching", "--no-enable-prefix-caching",
                     "--no-prefix-cache", "--gpu-memory-utilization", "--chat-template",
                     "--generation-config", "--seed"):
            assert flag in text, (command, flag)
    serve_help = commands["serve"].format_help()
    for flag in ("--served-model-name", "--disable-log-stats", "--host", "--port", "--version"):
        assert flag in serve_help
    assert "--version" in parser.format_help()


def test_no_flags_give_the_dataclass_defaults() -> None:
    assert _config([]) == EngineConfig()
    args = _engine_parser().parse_args([])
    for section, name in _config_fields():
        default = _value(EngineConfig(), section, name)
        assert getattr(args, name) == default, name


@pytest.mark.parametrize("argv, section, name, value", NON_DEFAULTS, ids=[row[2] for row in NON_DEFAULTS])
def test_one_flag_round_trips_into_its_field(argv: list[str], section: str | None, name: str,
                                             value: object) -> None:
    config = _config(argv)
    assert _value(config, section, name) == value
    assert value != _value(EngineConfig(), section, name)
    # Every other field keeps its default.
    for other_section, other in _config_fields() - {(section, name)}:
        assert _value(config, other_section, other) == _value(EngineConfig(), other_section, other)


def test_all_flags_at_once_round_trip() -> None:
    rows = [row for row in NON_DEFAULTS if row[2] not in EXCLUSIVE]
    config = _config([token for argv, *_ in rows for token in argv])
    assert {(section, name): _value(config, section, name) for _, section, name, _ in rows} == {
        (section, name): value for _, section, name, value in rows}


def test_trace_file_implies_trace(tmp_path) -> None:
    args = _engine_parser().parse_args(["--trace-file", str(tmp_path / "t.json")])
    assert engine_kwargs(args)["trace"] is True
    assert EngineConfig.from_kwargs(args.model, **engine_kwargs(args)).scheduler.trace


def test_choices_come_from_the_config_constants(capsys) -> None:
    choices = {action.dest: action.choices for action in _engine_actions() if action.choices}
    assert choices == {"dtype": list(SUPPORTED_DTYPES), "matmul": list(MATMULS),
                       "decoder_stack": list(DECODER_STACKS), "overlap_scheduling": list(OVERLAP_MODES),
                       "scheduling": list(SCHEDULING_MODES), "policy": list(POLICY_NAMES),
                       "attention_backend": list(ATTENTION_BACKENDS),
                       "distributed_backend": list(DISTRIBUTED_BACKENDS), "role": list(KV_ROLES),
                       "kv_transport": list(KV_TRANSPORTS)}
    with pytest.raises(SystemExit):
        _engine_parser().parse_args(["--matmul", "blas"])
    assert "invalid choice: 'blas'" in capsys.readouterr().err


def test_the_choices_are_the_registries_names() -> None:
    from kvloom.attention.registry import BACKENDS, MLA_BACKENDS
    from kvloom.engine.policy import POLICIES
    assert set(POLICY_NAMES) == set(POLICIES)
    assert set(ATTENTION_BACKENDS) == {"auto", *BACKENDS, *MLA_BACKENDS}
    from kvloom.config import SPECULATIVE_METHODS
    from kvloom.speculative.proposer import PROPOSERS
    assert set(SPECULATIVE_METHODS) == set(PROPOSERS)


BAD_VALUES = [  # (argv, what the one-line error must say)
    (["--policy", "bogus"], "argument --policy/--scheduling-policy: invalid choice: 'bogus' (choose from 'fcfs', "
                            "'priority', 'fcfs-cheapest-victim', 'watermark', 'lpm')"),
    (["--attention-backend", "flash"], "argument --attention-backend: invalid choice: 'flash' "
                                       "(choose from 'auto', 'cpu_paged', 'triton', 'flashinfer', 'flash_attn', "
                                       "'torch_ref', 'mla_cpu', 'mla_batched', 'mla_ref')"),
    (["--overlap-scheduling", "yes"], "argument --overlap-scheduling: invalid choice: 'yes' "
                                      "(choose from 'auto', 'on', 'off')"),
    (["--scheduling", "batch"], "argument --scheduling: invalid choice: 'batch'"),
    (["--matmul", "blas"], "argument --matmul: invalid choice: 'blas'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--device", "gpu"], "argument --device: device must be auto, cpu, cuda, cuda:N or mps, got 'gpu'"),
    (["--device", "cuda:x"], "argument --device: device must be auto, cpu, cuda, cuda:N or mps"),
    (["--speculative-config", "ngram"], "argument --speculative-config: speculative_config must be a "
                                        "JSON object: Expecting value"),
    (["--speculative-config", '{"method": "eagle"}'], "speculative_config.method must be one of "
                                                      "('ngram', 'draft', 'layer_skip'), got 'eagle'"),
    (["--speculative-config", '{"method": "draft"}'], "speculative_config.model (the draft model's "
                                                      "path) is required for method 'draft'"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_token": 4}'],
     "speculative_config has unknown keys ['num_speculative_token']"),
]


@pytest.mark.parametrize("argv, message", BAD_VALUES, ids=[row[0][0] for row in BAD_VALUES])
def test_a_bad_choice_is_a_usage_error_before_any_model_loads(argv: list[str], message: str,
                                                              capsys, monkeypatch) -> None:
    import kvloom.server.main as server_main

    def no_serving(*args: object, **kwargs: object) -> None:
        raise AssertionError("the server (and its model) must not start")
    monkeypatch.setattr(server_main, "run_server", no_serving)
    from kvloom.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and message in error_lines[0]


def test_speculative_config_checks_name_the_key() -> None:
    for bad, message in [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive"),
        ({"method": "ngram", "prompt_lookup_min": 5}, "prompt_lookup_min must be <= prompt_lookup_max"),
        ({"method": "layer_skip"}, "num_layers (how many of the target's layers"),
        ({"method": "ngram", "num_layers": 2}, "num_layers is only for method 'layer_skip'"),
        ({"method": "ngram", "model": "x"}, "model is only for method 'draft'"),
        ({"num_speculative_tokens": 2}, "speculative_config.method is required"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            EngineConfig(speculative_config=bad)
    assert EngineConfig(speculative_config={"method": "layer_skip", "num_layers": 4}).speculative_config \
        == SpeculativeConfig("layer_skip", num_layers=4)


def test_config_refuses_bad_names_too() -> None:
    with pytest.raises(ValueError, match="policy must be one of"):
        SchedulerConfig(policy="bogus")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda, cuda:N or mps, got 'gpu'"):
        EngineConfig(device="gpu")
    assert EngineConfig(device="cuda:3").device == "cuda:3"


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["chat"], ["serve"],
                                     ["bench", "offline"], ["bench", "steps"], ["bench", "soak"],
                                     ["bench", "placement"], ["bench", "structured"]])
def test_every_command_with_engine_flags_parses_them_alike(command: list[str]) -> None:
    rows = [row for row in NON_DEFAULTS if row[2] not in EXCLUSIVE]
    argv = [token for argv, *_ in rows for token in argv if argv != ["some/model"]]
    args = build_parser().parse_args([*command, "some/model", *argv])
    expected = {name: value for _, _, name, value in rows if name != "model"}
    defaults = {"gpu_memory_utilization": None, "role": "both", "enable_lora": False}  # left at their defaults
    expected.update({name: defaults[name] for name in EXCLUSIVE})
    assert args.model == "some/model" and engine_kwargs(args) == expected


def test_unknown_engine_keyword_is_refused() -> None:
    with pytest.raises(TypeError, match="unknown engine argument 'num_block'"):
        EngineConfig.from_kwargs("m", num_block=8)
    with pytest.raises(TypeError, match="unknown engine argument 'cache'"):
        EngineConfig.from_kwargs("m", cache=CacheConfig())


def test_devices_and_backends_this_machine_cannot_run_are_refused_up_front(monkeypatch) -> None:
    import torch

    from kvloom.attention.registry import make_backend
    from kvloom.runner.device import resolve_device, resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda': this torch .* sees no CUDA device"):
        resolve_device("cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend 'triton' runs on CUDA"):
        make_backend("triton", torch.device("cpu"), 4, 2, 16)
    # Tensor parallel over nccl on a CPU: torch's "NCCL built in" traceback, before, from every rank.
    from kvloom.config import ModelConfig
    from kvloom.runner.tensor_parallel import load_first_rank
    config = EngineConfig.from_kwargs(DEFAULT_MODEL, tensor_parallel_size=2, distributed_backend="nccl")
    model = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=128,
                        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="distributed_backend nccl runs on CUDA devices only, not cpu"):
        load_first_rank(config, model, None, torch.device("cpu"), torch.bfloat16, 64)
    # float16 on a CPU is bf16, as vLLM's CPU backend has it (the kernels take f32 and bf16).
    assert resolve_dtype("float16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cuda")) == torch.float16


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_cache_memory": float("nan")}, "kv_cache_memory must be a finite number > 0 (GiB), got nan"),
    ({"kv_cache_memory": float("inf")}, "kv_cache_memory must be a finite number > 0 (GiB), got inf"),
    ({"num_threads": -3}, "num_threads must be a positive integer, got -3"),
    ({"seed": 2**70}, "seed must be an integer in [-2**63, 2**64)"),
    ({"seed": "x"}, "seed must be an integer"),
    ({"max_logprobs": -2}, "max_logprobs must be an integer >= 0, or -1 for the whole vocabulary, got -2"),
    # An OverflowError in timedelta and "cannot convert float NaN to integer", before.
    ({"distributed_timeout": 1e300}, "distributed_timeout must be > 0 and at most a year (seconds), got 1e+300"),
    ({"distributed_timeout": float("nan")}, "distributed_timeout must be > 0 and at most a year (seconds), got nan"),
])
def test_numbers_that_would_fail_deep_in_loading_are_refused_by_the_config(kwargs, message) -> None:
    """Before, each failed after the model loaded, in torch or in int(), without naming the option."""
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig.from_kwargs(DEFAULT_MODEL, **kwargs)


@pytest.mark.parametrize("command", [["serve"], ["router", "--worker-url", "http://127.0.0.1:1"]])
@pytest.mark.parametrize("port, message", [("99999", "port must be in 0..65535, got 99999"),
                                           ("x", "port must be an integer, got 'x'")])
def test_a_bad_port_is_a_usage_error_before_any_model_loads(command, port, message, capsys) -> None:
    """Before, `serve --port 99999` loaded the model and then failed in bind() with 80 lines."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, "--port", port])
    assert exit_info.value.code == 2
    assert f"argument --port: {message}" in capsys.readouterr().err
