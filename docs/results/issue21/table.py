"""The benchmarks.md tables of issue 21 from run.sh's JSON lines (PASS=N files):
python docs/results/issue21/table.py 2"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
suffix = f"_{sys.argv[1]}" if len(sys.argv) > 1 else ""
rows = [json.loads(line) for name in ("cache_on", "cache_off", "server")
        for line in (HERE / f"{name}{suffix}.jsonl").read_text().splitlines() if line.strip()]


def find(workload: str, style: str, backend: str, cache: bool) -> dict:
    return next(r for r in rows if (r["workload"], r["style"], r["backend"], r["prefix_cache"])
                == (workload, style, backend, cache))


def cell(r: dict) -> str:
    return f"{r['seconds']:.2f} s, {r['output_tok_per_s']:.0f} tok/s, hit {r['cache_hit_rate']:.3f}"


print("| workload | program, in-process: on / off | program, server: on / off | OpenAI calls, server: on / off |")
print("|---|---|---|---|")
for workload in ("few_shot", "tree_of_thought", "multi_turn", "json_extraction"):
    cells = []
    for style, backend in (("program", "local"), ("program", "endpoint"), ("openai", "endpoint")):
        on, off = find(workload, style, backend, True), find(workload, style, backend, False)
        cells.append(f"{cell(on)} / {off['seconds']:.2f} s ({off['seconds'] / on['seconds']:.1f}x)")
    print(f"| {workload} | " + " | ".join(cells) + " |")
print()
print("| multi-turn TTFT by turn, ms (median of 16) | cache on | cache off |")
print("|---|---|---|")
for style, backend in (("program", "local"), ("program", "endpoint"), ("openai", "endpoint")):
    on, off = find("multi_turn", style, backend, True), find("multi_turn", style, backend, False)
    print(f"| {style}, {backend} | {' / '.join(f'{t:.0f}' for t in on['ttft_ms_by_turn'])} | "
          f"{' / '.join(f'{t:.0f}' for t in off['ttft_ms_by_turn'])} |")
