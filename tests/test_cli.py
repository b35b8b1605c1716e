"""The command line: flags map onto engine arguments; errors are one clear line."""

from __future__ import annotations

import builtins

import pytest

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


def test_version_prints_the_packages_version_and_exits(capsys) -> None:
    import re
    from pathlib import Path

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    for argv in (["--version"], ["serve", "--version"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        assert capsys.readouterr().out.strip() == f"kvloom {version}"


def _serve_call(monkeypatch, argv: list[str]) -> dict:
    import kvloom.server.main as server_main
    calls: list[dict] = []
    monkeypatch.setattr(server_main, "run_server",
                        lambda model, kwargs, settings, **rest: calls.append(
                            {"model": model, "settings": settings, **rest}) or 0)
    assert main(["serve", *argv]) == 0
    return calls[0]


def test_serve_takes_the_model_either_way_and_several_served_names(monkeypatch) -> None:
    call = _serve_call(monkeypatch, ["--model", "some/dir", "--served-model-name", "a", "b", "c"])
    assert call["model"] == "some/dir"
    settings = call["settings"]
    assert (settings.served_model_name, settings.model_aliases) == ("a", ("b", "c"))
    assert call["log_stats"] is True
    # The first name is the one reported; every name (and the model path) is accepted.
    assert settings.model_ids("some/dir") == ("a", "some/dir", "b", "c")
    call = _serve_call(monkeypatch, ["some/dir", "--disable-log-stats"])
    assert (call["model"], call["settings"].served_model_name, call["log_stats"]) == ("some/dir", None, False)


def test_gpu_memory_utilization_and_kv_cache_memory_conflict_in_one_line(capsys) -> None:
    assert main(["serve", "--kv-cache-memory", "2", "--gpu-memory-utilization", "0.9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvloom: error: kv_cache_memory and gpu_memory_utilization both size the KV pool: "
                   "give one (got kv_cache_memory=2.0, gpu_memory_utilization=0.9)"]


def test_a_missing_chat_template_file_fails_before_loading(capsys, tmp_path) -> None:
    assert main(["generate", "--prompt", "x", "--chat-template", str(tmp_path / "nope.jinja")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "neither an existing file nor a Jinja template" in err[0]


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|im_end|>{% endfor %}>>"


@pytest.mark.parametrize("as_file", [False, True], ids=["inline", "file"])
def test_chat_template_overrides_the_tokenizers(tiny_llama, tmp_path, as_file: bool) -> None:
    from kvloom.engine.llm import LLM
    value = TEMPLATE
    if as_file:
        value = str(tmp_path / "template.jinja")
        (tmp_path / "template.jinja").write_text(TEMPLATE)
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=16, chat_template=value)
    ids = llm.encode_chat([{"role": "user", "content": "hi"}])
    assert ids == llm.tokenizer.encode("[user] hi<|im_end|>>>", add_special_tokens=False)
    # Without it, the model's own (ChatML) template.
    plain = LLM(str(tiny_llama), dtype="float32", num_blocks=16)
    assert plain.encode_chat([{"role": "user", "content": "hi"}]) == plain.tokenizer.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def test_a_broken_chat_template_names_the_field(tiny_llama) -> None:
    from kvloom.engine.llm import LLM
    with pytest.raises(ValueError, match="chat_template is not a valid Jinja template"):
        LLM(str(tiny_llama), dtype="float32", num_blocks=16, chat_template="{% for %}")


def test_generate_chat_wraps_prompts_in_the_given_template(tiny_llama, capsys) -> None:
    code = main(["generate", str(tiny_llama), "--prompt", "Hello", "--chat", "--chat-template", TEMPLATE,
                 "--max-tokens", "2", "--dtype", "float32", "--num-blocks", "16"])
    assert code == 0 and "--- 'Hello'" in capsys.readouterr().out
