"""Draw a scheduler trace (``SchedulerTrace.to_json()``) as a request x step timeline.

``kvloom trace render TRACE.json`` prints one row per request and one column per
step, then a summary (when each request started, its prefill chunks, preemptions and
finish, and why waiting requests waited); ``--png OUT.png`` also draws the grid as an
image. Everything here reads the JSON form only, so a trace saved on a server can be
drawn anywhere; matplotlib (the bench extra) is imported only when a PNG is asked for.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvloom.bench.extras import require_bench_package
from kvloom.engine_args import positive_int

TRACE_VERSION = 1

# One character per (request, step). A compressed column stands for several steps and
# shows the first of these it contains, so a one-step preemption never disappears.
PREEMPTED, PREFILL, DECODE, WAITING, STALLED, ABSENT = "X", "P", "D", ".", "-", " "
PRIORITY = (PREEMPTED, PREFILL, DECODE, WAITING, STALLED, ABSENT)
LEGEND = {
    PREFILL: "prefill chunk", DECODE: "decode", PREEMPTED: "preempted (KV freed)",
    WAITING: "waiting", STALLED: "running, not scheduled", ABSENT: "not arrived / finished",
}
_RANK = {state: rank for rank, state in enumerate(PRIORITY)}
_PAIR_KEYS = ("waiting", "preempted", "finished")


# ---- loading and validation ----------------------------------------------------------
def load_trace(path: str) -> dict:
    """Read and validate a trace file. Bad JSON or shape -> ValueError naming the problem."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"trace file not found: {path}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    try:
        return validate_trace(data)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def validate_trace(data: Any) -> dict:
    """Check a trace's version and shape; returns a copy with optional fields filled in."""
    if hasattr(data, "to_json"):  # a live SchedulerTrace
        data = data.to_json()
    if not isinstance(data, dict):
        raise ValueError(f"a trace must be a JSON object, got {type(data).__name__}")
    if data.get("version") != TRACE_VERSION:
        raise ValueError(f"unsupported trace version {data.get('version')!r} "
                         f"(this kvloom reads version {TRACE_VERSION})")
    if not isinstance(data.get("steps"), list):
        raise ValueError(f"'steps' must be a list of step records, got {data.get('steps')!r}")
    steps: list[dict] = []
    for index, record in enumerate(data["steps"]):
        steps.append(_check_step(record, f"steps[{index}]"))
        if len(steps) > 1 and steps[-1]["step"] <= steps[-2]["step"]:
            raise ValueError(f"steps[{index}].step: step numbers must increase, got "
                             f"{steps[-1]['step']} after {steps[-2]['step']}")
    return {"version": TRACE_VERSION, "steps": steps}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(where: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"{where}: expected {expected}, got {value!r}")


def _check_step(record: Any, where: str) -> dict:
    if not isinstance(record, dict):
        raise _fail(where, "a step record (object)", record)
    if not _is_int(record.get("step")):
        raise _fail(f"{where}.step", "an integer", record.get("step"))
    scheduled = record.get("scheduled")
    if not isinstance(scheduled, list):
        raise _fail(f"{where}.scheduled", "a list", scheduled)
    for index, entry in enumerate(scheduled):
        at = f"{where}.scheduled[{index}]"
        if not isinstance(entry, dict):
            raise _fail(at, "an object", entry)
        if not isinstance(entry.get("request_id"), str):
            raise _fail(f"{at}.request_id", "a string", entry.get("request_id"))
        if entry.get("kind") not in ("prefill", "decode"):
            raise _fail(f"{at}.kind", "'prefill' or 'decode'", entry.get("kind"))
        for key in ("num_tokens", "num_blocks"):
            if not _is_int(entry.get(key)):
                raise _fail(f"{at}.{key}", "an integer", entry.get(key))
    checked = {"step": record["step"], "scheduled": [dict(e) for e in scheduled]}
    for key in _PAIR_KEYS:
        # "finished" is filled in after the step is recorded, so old traces may lack it.
        pairs = record.get(key, [] if key == "finished" else None)
        if not isinstance(pairs, list):
            raise _fail(f"{where}.{key}", "a list of [request_id, reason]", pairs)
        for index, pair in enumerate(pairs):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                    and all(isinstance(item, str) for item in pair)):
                raise _fail(f"{where}.{key}[{index}]", "[request_id, reason] (two strings)", pair)
        checked[key] = [tuple(pair) for pair in pairs]
    for key in ("num_free_blocks", "num_batched_tokens"):
        if not _is_int(record.get(key, 0)):
            raise _fail(f"{where}.{key}", "an integer", record.get(key))
        checked[key] = record.get(key, 0)
    return checked


# ---- the grid ------------------------------------------------------------------------
@dataclass(slots=True)
class RequestSummary:
    """One request's life as the trace window saw it."""

    request_id: str
    first_scheduled_step: int | None = None
    num_prefill_chunks: int = 0  # includes recompute after a preemption
    num_preemptions: int = 0
    finish_step: int | None = None
    finish_reason: str | None = None


@dataclass(slots=True)
class Timeline:
    """A replayed trace: the grid the renderers draw, plus what the summary reports."""

    request_ids: list[str]  # first-seen order
    steps: list[int]
    cells: list[list[str]]  # [request][step index] -> one of PRIORITY
    summaries: list[RequestSummary]
    wait_reasons: Counter[str] = field(default_factory=Counter)  # reason -> waiting cells
    num_free_blocks: list[int] = field(default_factory=list)
    num_batched_tokens: list[int] = field(default_factory=list)


def build_timeline(trace: Any) -> Timeline:
    """Replay a trace into per-request cells and summaries.

    A request absent from a step's record is "running, not scheduled" when it was
    scheduled earlier and has not been preempted or finished since (the trace lists
    only who ran and who waited); otherwise it is blank. A preempted request is also
    on that step's waiting list; the cell says X and its wait is not counted.
    """
    records = validate_trace(trace)["steps"]
    index: dict[str, int] = {}
    for record in records:  # scheduled before waiting keeps arrival order within a step
        for request_id in ([e["request_id"] for e in record["scheduled"]]
                           + [pair[0] for key in _PAIR_KEYS for pair in record[key]]):
            index.setdefault(request_id, len(index))
    summaries = [RequestSummary(request_id) for request_id in index]
    cells = [[ABSENT] * len(records) for _ in index]
    waits: Counter[str] = Counter()
    running: set[str] = set()
    for col, record in enumerate(records):
        scheduled = {e["request_id"]: e["kind"] for e in record["scheduled"]}
        preempted = {request_id for request_id, _ in record["preempted"]}
        waiting = {request_id for request_id, _ in record["waiting"]}
        running -= waiting
        # Later writes win: stalled < waiting < scheduled < preempted.
        for request_id in running:
            cells[index[request_id]][col] = STALLED
        for request_id, reason in record["waiting"]:
            cells[index[request_id]][col] = WAITING
            if request_id not in preempted:
                waits[reason] += 1
        for request_id, kind in scheduled.items():
            summary = summaries[index[request_id]]
            if summary.first_scheduled_step is None:
                summary.first_scheduled_step = record["step"]
            summary.num_prefill_chunks += int(kind == "prefill")
            cells[index[request_id]][col] = PREFILL if kind == "prefill" else DECODE
        for request_id in preempted:
            summaries[index[request_id]].num_preemptions += 1
            cells[index[request_id]][col] = PREEMPTED
        running = (running | scheduled.keys()) - preempted
        for request_id, reason in record["finished"]:
            summary = summaries[index[request_id]]
            summary.finish_step, summary.finish_reason = record["step"], reason
            running.discard(request_id)
    return Timeline(list(index), [r["step"] for r in records], cells, summaries, waits,
                    [r["num_free_blocks"] for r in records], [r["num_batched_tokens"] for r in records])


def timeline_grid(trace: Any) -> tuple[list[str], list[int], list[list[str]]]:
    """(request ids in first-seen order, step numbers, cells[request][step index])."""
    timeline = build_timeline(trace)
    return timeline.request_ids, timeline.steps, timeline.cells


def _window(trace: Any, max_steps: int | None) -> tuple[dict, int]:
    data = validate_trace(trace)
    total = len(data["steps"])
    if max_steps is not None:
        data = {"version": TRACE_VERSION, "steps": data["steps"][:max_steps]}
    return data, total


# ---- text ----------------------------------------------------------------------------
def render_text(trace: Any, max_steps: int | None = None, max_requests: int | None = None,
                width: int = 120) -> str:
    """The timeline as text: header, step ruler, one row per request, legend, summary.

    Only the first ``max_steps`` steps and ``max_requests`` requests are drawn. When the
    steps do not fit in ``width`` columns, each column stands for k steps (said in the
    header) and shows its most telling state, in the order X P D . -.
    """
    data, total_steps = _window(trace, max_steps)
    timeline = build_timeline(data)
    if not timeline.steps:
        return "scheduler trace: no steps recorded\n"
    steps, shown = timeline.steps, timeline.request_ids[:max_requests]
    label_width = min(16, max(len("request"), *(len(r) for r in shown)) if shown else 7)
    per_column = max(1, math.ceil(len(steps) / max(10, width - label_width - 3)))
    num_columns = math.ceil(len(steps) / per_column)
    lines = [f"scheduler trace: steps {steps[0]}..{steps[-1]} ({len(steps)} steps), "
             f"{len(timeline.request_ids)} requests"]
    if len(steps) < total_steps:
        lines.append(f"window: first {len(steps)} of {total_steps} steps")
    if len(shown) < len(timeline.request_ids):
        lines.append(f"showing the first {len(shown)} of {len(timeline.request_ids)} requests")
    if per_column > 1:
        lines.append(f"compressed: each column is {per_column} steps "
                     "and shows its most telling state (X > P > D > . > -)")
    ruler = [" "] * num_columns
    for col in range(0, num_columns, 10):
        label = str(steps[col * per_column])
        if col + len(label) <= num_columns:
            ruler[col:col + len(label)] = label
    lines.append(f"{'step':<{label_width}} |{''.join(ruler)}|")
    for row, request_id in zip(timeline.cells[:len(shown)], shown, strict=True):
        columns = (min(row[c:c + per_column], key=_RANK.__getitem__)
                   for c in range(0, len(row), per_column))
        label = request_id if len(request_id) <= label_width else request_id[:label_width - 1] + "~"
        lines.append(f"{label:<{label_width}} |{''.join(columns)}|")
    lines += _legend_lines(width)
    lines += ["", _summary_table(timeline.summaries[:len(shown)], label_width), ""]
    # These totals cover every request in the window, not only the rows shown.
    lines.append(f"all requests: {sum(s.num_preemptions for s in timeline.summaries)} preemptions; "
                 f"free KV blocks min {min(timeline.num_free_blocks)}; "
                 f"batched tokens per step max {max(timeline.num_batched_tokens)}")
    lines.append("waiting request-steps by reason (all requests):"
                 + ("" if timeline.wait_reasons else " none"))
    lines += [f"  {reason}: {count} request-steps"
              for reason, count in timeline.wait_reasons.most_common()]
    return "\n".join(lines) + "\n"


def _legend_lines(width: int) -> list[str]:
    """The legend, wrapped between items so it stays within ``width`` where it can."""
    lines: list[str] = []
    for state, text in LEGEND.items():
        item = f"{'(blank)' if state == ABSENT else state} {text}"
        if lines and len(lines[-1]) + 2 + len(item) <= width:
            lines[-1] += "  " + item
        else:
            lines.append(("legend: " if not lines else " " * 8) + item)
    return lines


def _summary_table(summaries: list[RequestSummary], label_width: int) -> str:
    header = f"{'request':<{label_width}}  first step  prefill chunks  preemptions  finished"
    rows = [header]
    for s in summaries:
        first = "-" if s.first_scheduled_step is None else str(s.first_scheduled_step)
        finish = "-" if s.finish_step is None else f"step {s.finish_step} ({s.finish_reason})"
        rows.append(f"{s.request_id[:label_width]:<{label_width}}  {first:>10}  "
                    f"{s.num_prefill_chunks:>14}  {s.num_preemptions:>11}  {finish}")
    return "\n".join(rows)


# ---- image ---------------------------------------------------------------------------
# Colours per state, in code order (absent, stalled, waiting, decode, prefill, preempted).
_COLOURS = {ABSENT: "#ffffff", STALLED: "#d0d0d0", WAITING: "#f2c45a",
            DECODE: "#59a14f", PREFILL: "#4e79a7", PREEMPTED: "#e15759"}


def render_png(trace: Any, path: str, max_steps: int | None = None,
               max_requests: int | None = None, dpi: int = 100, title: str | None = None) -> None:
    """Write the timeline as a PNG: requests down, steps across, KV counters below.

    Uses matplotlib's Agg renderer through ``Figure`` directly, so no display or global
    backend switch is involved. Sized to stay readable for ~100 requests x ~500 steps.
    """
    require_bench_package("matplotlib", "a PNG trace timeline")
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    data, _ = _window(trace, max_steps)
    timeline = build_timeline(data)
    ids, cells = timeline.request_ids[:max_requests], timeline.cells[:max_requests]
    if not ids:
        raise ValueError("nothing to draw: the trace has no requests")
    codes = {state: code for code, state in enumerate(_COLOURS)}
    grid = np.array([[codes[c] for c in row] for row in cells])  # [requests, steps]
    num_requests, num_steps = grid.shape
    grid_height = min(16.0, max(2.5, 0.14 * num_requests))
    fig_width = min(24.0, max(8.0, 4 + 0.025 * num_steps))
    fig = Figure(figsize=(fig_width, grid_height + 2.8),
                 dpi=dpi, layout="constrained")
    ax, counters = fig.subplots(2, 1, sharex=True, height_ratios=[grid_height, 1.4])
    ax.imshow(grid, cmap=ListedColormap(list(_COLOURS.values())), vmin=-0.5,
              vmax=len(_COLOURS) - 0.5, aspect="auto", interpolation="nearest")
    every = math.ceil(num_requests / 60)  # at most ~60 labels keeps them legible
    ax.set_yticks(range(0, num_requests, every), labels=ids[::every],
                  fontsize=8 if num_requests <= 30 else 6)
    ax.set_ylabel("request (first-seen order)")
    steps = timeline.steps
    counters.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=12))
    counters.xaxis.set_major_formatter(FuncFormatter(
        lambda x, _: str(steps[int(round(x))]) if 0 <= round(x) < len(steps) else ""))
    counters.plot(range(num_steps), timeline.num_free_blocks, color="#4e79a7", lw=1)
    counters.set_ylabel("free blocks", color="#4e79a7", fontsize=8)
    tokens = counters.twinx()
    tokens.plot(range(num_steps), timeline.num_batched_tokens, color="#f28e2b", lw=1)
    tokens.set_ylabel("batched tokens", color="#f28e2b", fontsize=8)
    for axis in (counters, tokens):
        axis.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
    counters.set_xlim(-0.5, num_steps - 0.5)  # line plots would otherwise pad the shared axis
    counters.set_xlabel("scheduler step")
    handles = [Patch(facecolor=colour, edgecolor="#888888", label=LEGEND[state])
               for state, colour in _COLOURS.items()]
    fig.legend(handles=handles, loc="outside lower center",
               ncols=len(handles) if fig_width >= 12 else 3,  # one row needs ~12 inches fontsize=8,
               frameon=False)
    preemptions = sum(s.num_preemptions for s in timeline.summaries)
    fig.suptitle(title or f"kvloom scheduler trace: {num_requests} requests x {num_steps} steps, "
                          f"{preemptions} preemption{'' if preemptions == 1 else 's'}")
    fig.savefig(path, format="png")


# ---- command line --------------------------------------------------------------------
def add_trace_parser(subparsers: Any) -> None:
    """Register ``kvloom trace render TRACE.json [--png OUT.png] [--max-steps N] ...``."""
    trace = subparsers.add_parser("trace", allow_abbrev=False, help="inspect a scheduler trace saved with --trace")
    actions = trace.add_subparsers(dest="trace_command", required=True)
    render = actions.add_parser("render", allow_abbrev=False, help="draw a trace as a request x step timeline")
    render.add_argument("trace_path", metavar="TRACE.json")
    render.add_argument("--png", metavar="OUT.png", default=None, help="also write an image")
    render.add_argument("--max-steps", type=positive_int, default=None, help="first N steps only")
    render.add_argument("--max-requests", type=positive_int, default=None,
                        help="first N requests only")
    render.add_argument("--width", type=positive_int, default=None,
                        help="text columns (default: the terminal's)")
    render.set_defaults(run=run_trace)


def run_trace(args: argparse.Namespace) -> int:
    """Run a ``kvloom trace`` command; any failure is one line on stderr and exit code 2."""
    try:
        data = load_trace(args.trace_path)
        width = args.width or shutil.get_terminal_size((120, 24)).columns
        print(render_text(data, args.max_steps, args.max_requests, width), end="")
        if args.png:
            render_png(data, args.png, args.max_steps, args.max_requests)
            print(f"wrote {args.png}")
    except (OSError, ValueError, ImportError) as error:
        print(f"kvloom trace: error: {error}", file=sys.stderr)
        return 2
    return 0
