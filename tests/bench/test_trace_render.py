"""The trace renderer: grid cells, text timeline, PNG and CLI, on hand-written and real traces."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from fake_runner import make_request, make_scheduler, run_to_completion

from kvloom.bench.trace_render import (
    add_trace_parser,
    build_timeline,
    load_trace,
    render_png,
    render_text,
    run_trace,
    timeline_grid,
    validate_trace,
)

NO_BLOCKS, POOL_FULL, ORDER = "no free blocks", "pool full (preempted this step)", "policy order"


def entry(request_id: str, kind: str, num_tokens: int = 1, num_blocks: int = 1) -> dict:
    return {"request_id": request_id, "kind": kind, "num_tokens": num_tokens, "num_blocks": num_blocks}


def step(n: int, scheduled=(), waiting=(), preempted=(), finished=(), free: int = 0) -> dict:
    return {"step": n, "scheduled": list(scheduled), "waiting": [list(p) for p in waiting],
            "preempted": [list(p) for p in preempted], "finished": [list(p) for p in finished],
            "num_free_blocks": free, "num_batched_tokens": sum(e["num_tokens"] for e in scheduled)}


def small_trace() -> dict:
    """a runs and finishes; b is preempted and recomputes; c waits, then stalls one step."""
    return {"version": 1, "steps": [
        step(1, [entry("a", "prefill", 4), entry("b", "prefill", 4)], [("c", NO_BLOCKS)], free=2),
        step(2, [entry("a", "decode"), entry("b", "decode")], [("c", NO_BLOCKS)], free=1),
        step(3, [entry("a", "decode")], [("b", POOL_FULL), ("c", POOL_FULL)],
             preempted=[("b", "no free blocks for a")], free=1),
        step(4, [entry("a", "decode")], [("b", NO_BLOCKS), ("c", ORDER)],
             finished=[("a", "length")], free=4),
        step(5, [entry("b", "prefill", 6), entry("c", "prefill", 3)], free=0),
        step(6, [entry("b", "decode")], finished=[("b", "length")], free=3),
        step(7, [entry("c", "decode")], finished=[("c", "stop")], free=6),
    ]}


def test_grid_cells_are_exact() -> None:
    ids, steps, cells = timeline_grid(small_trace())
    assert ids == ["a", "b", "c"]
    assert steps == [1, 2, 3, 4, 5, 6, 7]
    assert ["".join(row) for row in cells] == ["PDDD   ", "PDX.PD ", "....P-D"]


def test_summaries_and_wait_reasons() -> None:
    timeline = build_timeline(small_trace())
    a, b, c = timeline.summaries
    assert (a.first_scheduled_step, a.num_prefill_chunks, a.num_preemptions, a.finish_step) == (1, 1, 0, 4)
    assert (b.first_scheduled_step, b.num_prefill_chunks, b.num_preemptions, b.finish_step) == (1, 2, 1, 6)
    assert (c.first_scheduled_step, c.num_prefill_chunks, c.num_preemptions) == (5, 1, 0)
    assert (c.finish_step, c.finish_reason) == (7, "stop")
    # b's own wait in step 3 is drawn as X, so it is not counted.
    assert dict(timeline.wait_reasons) == {NO_BLOCKS: 3, POOL_FULL: 1, ORDER: 1}


def test_render_text_rows_legend_and_summary() -> None:
    text = render_text(small_trace(), width=80)
    lines = text.splitlines()
    assert lines[0] == "scheduler trace: steps 1..7 (7 steps), 3 requests"
    assert "step    |1      |" in lines
    assert "a       |PDDD   |" in lines
    assert "b       |PDX.PD |" in lines
    assert "c       |....P-D|" in lines
    assert any(line.startswith("legend: P prefill chunk  D decode  X preempted") for line in lines)
    assert max(len(line) for line in lines) <= 80
    assert "compressed" not in text
    assert "request  first step  prefill chunks  preemptions  finished" in lines
    assert "a                 1               1            0  step 4 (length)" in lines
    assert "b                 1               2            1  step 6 (length)" in lines
    assert "c                 5               1            0  step 7 (stop)" in lines
    assert "all requests: 1 preemptions; free KV blocks min 0; batched tokens per step max 9" in lines
    assert "  no free blocks: 3 request-steps" in lines
    assert f"  {POOL_FULL}: 1 request-steps" in lines
    assert "  policy order: 1 request-steps" in lines


def test_render_text_windows_requests_and_steps() -> None:
    text = render_text(small_trace(), max_steps=3, max_requests=2, width=80)
    assert "window: first 3 of 7 steps" in text
    assert "showing the first 2 of 3 requests" in text
    assert "b       |PDX|" in text
    assert "c       |" not in text


def test_render_text_compresses_wide_traces_without_losing_preemptions() -> None:
    # a runs throughout; b waits, is preempted at step 23 on its way in, is admitted at
    # step 24 and then stalls (running, not scheduled) to the end.
    steps = [step(1, [entry("a", "prefill", 8)])]
    steps += [step(n, [entry("a", "decode")], [("b", ORDER)]) for n in range(2, 23)]
    steps.append(step(23, [entry("a", "decode")], [("b", POOL_FULL)], preempted=[("b", "x")]))
    steps.append(step(24, [entry("a", "decode"), entry("b", "prefill", 2)]))
    steps += [step(n, [entry("a", "decode")]) for n in range(25, 51)]
    text = render_text({"version": 1, "steps": steps}, width=20)  # 20 - 7 - 3 -> 10 columns
    assert "compressed: each column is 5 steps" in text
    assert "a       |PDDDDDDDDD|" in text
    # Steps 21-25 hold the preemption (X beats P, D and .); b stalls from step 26 on.
    assert "b       |....X-----|" in text


def test_render_png_writes_a_sized_png(tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image")
    path = tmp_path / "small.png"
    render_png(small_trace(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = image.imread(str(path)).shape[:2]
    assert 500 <= width <= 3000 and 300 <= height <= 3000


def test_render_png_handles_a_hundred_requests_by_five_hundred_steps(tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image")
    records = []
    for n in range(1, 501):
        live = [f"req-{i}" for i in range(100) if i * 4 < n <= i * 4 + 30]
        records.append(step(n, [entry(r, "prefill" if n == int(r[4:]) * 4 + 1 else "decode")
                                for r in live[:8]], [(r, ORDER) for r in live[8:]]))
    path = tmp_path / "big.png"
    render_png({"version": 1, "steps": records}, str(path))
    height, width = image.imread(str(path)).shape[:2]
    assert 1500 <= width <= 2500 and 1200 <= height <= 2000


@pytest.mark.parametrize(("data", "message"), [
    ([], "must be a JSON object"),
    ({"steps": []}, "unsupported trace version None"),
    ({"version": 2, "steps": []}, "unsupported trace version 2"),
    ({"version": 1}, "'steps' must be a list"),
    ({"version": 1, "steps": [{"step": 1}]}, "steps[0].scheduled: expected a list"),
    ({"version": 1, "steps": [step(1, [entry("a", "verify")])]}, "steps[0].scheduled[0].kind"),
    ({"version": 1, "steps": [{**step(1), "waiting": [["a"]]}]}, "steps[0].waiting[0]"),
    ({"version": 1, "steps": [step(2), step(2)]}, "steps[1].step: step numbers must increase"),
])
def test_bad_traces_name_the_problem(data: object, message: str) -> None:
    with pytest.raises(ValueError) as error:
        validate_trace(data)
    assert message in str(error.value)


def test_load_trace_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_trace(str(bad))
    with pytest.raises(FileNotFoundError, match="trace file not found"):
        load_trace(str(tmp_path / "missing.json"))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(small_trace()))
    assert load_trace(str(good)) == validate_trace(small_trace())


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvloom")
    add_trace_parser(parser.add_subparsers(dest="command"))
    return run_trace(parser.parse_args(argv))


def test_cli_renders_and_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    trace_path, png = tmp_path / "t.json", tmp_path / "t.png"
    trace_path.write_text(json.dumps(small_trace()))
    assert _cli(["trace", "render", str(trace_path), "--png", str(png), "--width", "80"]) == 0
    out = capsys.readouterr().out
    assert "b       |PDX.PD |" in out and f"wrote {png}" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("content", [None, "{oops", '{"version": 9, "steps": []}'])
def test_cli_errors_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            content: str | None) -> None:
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    assert _cli(["trace", "render", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kvloom trace: error: ") and captured.err.count("\n") == 1


def test_real_trace_marks_preemptions_at_the_scheduler_steps() -> None:
    # 6 blocks of 4 tokens; each request grows to 4 blocks, so three cannot all fit.
    scheduler = make_scheduler(num_blocks=6, block_size=4, trace=True, max_num_batched_tokens=16)
    requests = [make_request(f"r{i}", 6, 10, first_token=i * 17) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    run_to_completion(scheduler)
    assert sum(r.num_preemptions for r in requests) > 0
    ids, steps, cells = timeline_grid(scheduler.trace.to_json())
    assert ids == [r.request_id for r in requests]
    for request, row in zip(requests, cells, strict=True):
        timeline = request.timeline
        steps_with = {state: [s for s, c in zip(steps, row, strict=True) if c == state] for state in "XP"}
        assert steps_with["X"] == timeline.preempted_steps
        assert steps_with["P"] == [s for s, _ in timeline.prefill_chunks]
        finish = steps.index(timeline.finished_step)
        assert row[finish] in ("P", "D") and set(row[finish + 1:]) <= {" "}
    text = render_text(scheduler.trace, width=200)  # a live SchedulerTrace works too
    assert f"all requests: {sum(r.num_preemptions for r in requests)} preemptions;" in text


def test_png_without_the_bench_extra_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    trace_path, png = tmp_path / "t.json", tmp_path / "t.png"
    trace_path.write_text(json.dumps(small_trace()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without [bench] looks like
    assert _cli(["trace", "render", str(trace_path), "--png", str(png)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'kvloom[bench]'" in err
    assert not png.exists()
