"""`bench offline` on a token-id workload shared with other engines, and ``--lead``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvloom.bench.datasets import load_token_workload
from kvloom.bench.offline import run_offline
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine


def _write(path: Path, lines: list[object]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_token_workload_keeps_the_ids_and_checks_each_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "w.jsonl", [{"prompt": "a", "prompt_token_ids": [5, 6, 7], "max_tokens": 4},
                                         {"prompt_token_ids": [8], "max_tokens": 2}])
    requests = load_token_workload(path)
    assert [(r.prompt_token_ids, r.prompt_len, r.expected_output_len) for r in requests] == [
        ([5, 6, 7], 3, 4), ([8], 1, 2)]
    assert len(load_token_workload(path, num_prompts=1)) == 1
    for bad in ({"prompt_token_ids": [], "max_tokens": 2}, {"prompt_token_ids": [1, "x"], "max_tokens": 2},
                {"prompt_token_ids": [1], "max_tokens": 0}, {"prompt": "only text", "max_tokens": 3}):
        with pytest.raises(ValueError, match=r"w\.jsonl:2: .*prompt_token_ids"):
            load_token_workload(_write(tmp_path / "w.jsonl", [{"prompt_token_ids": [1], "max_tokens": 1}, bad]))


def test_lead_requests_go_first_and_the_rest_hit_their_prefix(tiny_llama: Path, tmp_path: Path) -> None:
    shared = list(range(10, 74))  # four blocks of 16
    path = _write(tmp_path / "p.jsonl", [{"prompt_token_ids": shared + [100 + i, 101 + i], "max_tokens": 3}
                                         for i in range(4)])
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), num_blocks=64, block_size=16))
    added_at: list[tuple[int, list[int]]] = []  # (steps taken when added, prompt)
    add_request = engine.add_request
    def recording_add(prompt, params=None, **kwargs):  # type: ignore[no-untyped-def]
        added_at.append((engine.scheduler.step_count, list(prompt)))
        return add_request(prompt, params, **kwargs)
    engine.add_request = recording_add  # type: ignore[method-assign]
    result = run_offline(engine, load_token_workload(path), "lead", show_progress=False, lead=1)
    assert (result.num_requests, result.output_tokens) == (4, 12)
    # The exact ids were submitted: the lead alone at first, the rest after its first step.
    assert [prompt for _, prompt in added_at] == [shared + [100 + i, 101 + i] for i in range(4)]
    assert added_at[0][0] == 0 and all(steps >= 1 for steps, _ in added_at[1:])
    # The three followers found the lead's four shared blocks in the prefix cache.
    assert engine.scheduler.num_cached_prompt_tokens == result.cached_prompt_tokens == 3 * 64
    assert result.prefix_hit_rate == 3 * 64 / result.prompt_tokens


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["--lead", "-1"], "--lead must be >= 0, got -1"),
    (["--dataset", "tokens"], "--dataset tokens needs --dataset-path FILE.jsonl"),
    (["--dataset-path", "/nonexistent.json"], "--dataset-path is read by --dataset tokens only, not sharegpt"),
    (["--dataset", "tokens", "--dataset-path", "/nonexistent.jsonl"], "/nonexistent.jsonl: no such file"),
    (["--output-json", "/nonexistent/dir/x.json"], "its directory does not exist"),
])
def test_bad_offline_flags_are_refused_before_a_model_loads(argv, message, capsys, monkeypatch) -> None:
    """Before, each of these loaded the model first (or silently used ShareGPT instead of the
    path given), then failed with a traceback, some only after the whole run."""
    import kvloom.engine.engine as engine_module
    from kvloom.cli import main

    def no_engine(*args, **kwargs):
        raise AssertionError("no model may load")
    monkeypatch.setattr(engine_module, "LLMEngine", no_engine)
    assert main(["bench", "offline", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["roofline", "--batches", "-1"], "argument --batches: must be >= 1, got -1"),  # numpy's error, before
    (["steps", "--batches", "abc"], "argument --batches: expected an integer, got 'abc'"),
    (["steps", "--batches", "0"], "argument --batches: must be >= 1, got 0"),
    (["steps", "--decode-steps", "0"], "argument --decode-steps: must be >= 1, got 0"),
    (["families", "--context", "-5"], "argument --context: must be >= 1, got -5"),
    # Each of these reached the run: a hang (placement), a traceback, or an empty table.
    (["placement", "--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),
    (["placement", "--prompt-len", "-1"], "argument --prompt-len: must be >= 1, got -1"),
    (["structured", "--num-prompts", "0"], "argument --num-prompts: must be >= 1, got 0"),
    (["tools", "--temperature", "nan"], "argument --temperature: must be a finite number >= 0, got nan"),
    (["soak", "--pool-factor", "nan"], "argument --pool-factor: must be a finite number > 0, got nan"),
    (["soak", "--soak-max-tokens", "0"], "argument --soak-max-tokens: must be >= 1, got 0"),
    (["steps", "--prefill", "2x"], "argument --prefill: expected COUNTxLENGTH of positive integers (8x256), got '2x'"),
    (["interference", "--request-rate", "0"], "argument --request-rate: must be a finite number > 0, got 0"),
    (["pd-sim", "--max-batch", "0"], "argument --max-batch: must be >= 1, got 0"),
])
def test_bench_sizes_are_usage_errors(argv, message, capsys) -> None:
    from kvloom.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bench_sizes_parse_into_lists() -> None:
    from kvloom.cli import build_parser

    assert build_parser().parse_args(["bench", "steps", "--batches", "1,16,64"]).batches == [1, 16, 64]
    assert build_parser().parse_args(["bench", "roofline"]).batches == [1, 16, 64]  # the default, parsed
    assert build_parser().parse_args(["bench", "steps", "--prefill", "8x256,1x2048"]).prefill == [(8, 256), (1, 2048)]


def test_bench_paths_and_names_are_one_line_errors(capsys) -> None:
    from kvloom.cli import main

    assert main(["bench", "sweep", "/nonexistent.json"]) == 1
    assert "kvloom: error: [Errno 2] No such file or directory: '/nonexistent.json'" in capsys.readouterr().err
    assert main(["bench", "families", "--families", ","]) == 2
    assert "--families names no family: give some of llama" in capsys.readouterr().err


def test_placement_ends_when_the_engine_loop_fails(tmp_path) -> None:
    """The consumer waited on the queue forever when the engine thread died."""
    from kvloom.bench.engine_placement import measure

    with pytest.raises(RuntimeError, match="the engine loop failed: .*no-such-model"):
        measure(str(tmp_path / "no-such-model"), {}, num_requests=1, prompt_len=4, max_tokens=1)


def test_bench_plot_names_a_missing_result_file(capsys) -> None:
    from kvloom.cli import main

    assert main(["bench", "plot", "/nonexistent.json", "--out", "/tmp/kvloom-plot-test"]) == 2
    assert "no such result file: /nonexistent.json" in capsys.readouterr().err


def test_offline_json_records_a_speculative_config(tiny_llama: Path, tmp_path: Path) -> None:
    """`--speculative-config` with `--output-json` ended the run with a TypeError (the
    parsed SpeculativeConfig went into the file's engine arguments as an object)."""
    from kvloom.cli import main

    workload = _write(tmp_path / "w.jsonl", [{"prompt_token_ids": [5, 6, 7, 5, 6, 7], "max_tokens": 6},
                                             {"prompt_token_ids": [9, 10], "max_tokens": 4}])
    out = tmp_path / "r.json"
    assert main(["bench", "offline", str(tiny_llama), "--dataset", "tokens", "--dataset-path", str(workload),
                 "--num-blocks", "64", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                 "--output-json", str(out)]) == 0
    saved = json.loads(out.read_text())
    spec = saved["meta"]["engine_args"]["speculative_config"]
    assert (spec["method"], spec["num_speculative_tokens"], spec["prompt_lookup_max"]) == ("ngram", 3, 4)
    assert [(r["num_requests"], r["output_tokens"]) for r in saved["results"]] == [(2, 10)]
