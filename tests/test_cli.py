"""The command line: flags map onto engine arguments; errors are one clear line."""

from __future__ import annotations

import builtins

from kvloom.cli import build_parser, main
from kvloom.engine_args import engine_kwargs


def test_engine_flags_share_names_with_llm_kwargs() -> None:
    args = build_parser().parse_args(
        ["generate", "m", "--prompt", "x", "--num-blocks", "7", "--block-size", "8", "--kv-cache-memory", "0.5",
         "--max-num-seqs", "3", "--max-num-batched-tokens", "99", "--dtype", "float32", "--no-prefix-cache",
         "--no-chunked-prefill", "--policy", "priority"])
    kwargs = engine_kwargs(args)
    assert {k: kwargs[k] for k in ("num_blocks", "block_size", "kv_cache_memory", "max_num_seqs",
                                   "max_num_batched_tokens", "dtype", "enable_prefix_caching",
                                   "enable_chunked_prefill", "policy")} == {
        "num_blocks": 7, "block_size": 8, "kv_cache_memory": 0.5, "max_num_seqs": 3,
        "max_num_batched_tokens": 99, "dtype": "float32", "enable_prefix_caching": False,
        "enable_chunked_prefill": False, "policy": "priority"}


def test_generate_prints_completions(tiny_llama, capsys, tmp_path) -> None:
    trace = tmp_path / "trace.json"
    code = main(["generate", str(tiny_llama), "--prompt", "Hello", "--prompt", "World", "--max-tokens", "4",
                 "--dtype", "float32", "--num-blocks", "32", "--trace-file", str(trace)])
    out = capsys.readouterr().out
    assert code == 0
    assert "--- 'Hello'" in out and "--- 'World'" in out and "[length]" in out
    assert trace.exists()
    assert main(["trace", "render", str(trace)]) == 0


def test_errors_are_one_line(capsys, tmp_path) -> None:
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"\x80\x04")
    assert main(["generate", str(tmp_path / "pickled"), "--prompt", "x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pickle" in err[0]


def test_bad_flag_value_is_one_line(tiny_llama, capsys) -> None:
    assert main(["generate", str(tiny_llama), "--prompt", "x", "--block-size", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvloom: error: block_size must be a positive integer, got 0"]


def test_chat_streams_and_keeps_history(tiny_llama, capsys, monkeypatch) -> None:
    lines = iter(["Hello", "again", ""])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    code = main(["chat", str(tiny_llama), "--max-tokens", "3", "--dtype", "float32", "--num-blocks", "64"])
    assert code == 0
    assert capsys.readouterr().out.count("\n") >= 2
