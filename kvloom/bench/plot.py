"""`kvloom bench plot RESULTS.json... --out DIR`: PNG charts of ``bench serve`` results.

- ``latency_vs_throughput.png``: output token throughput (x) against mean and p99
  TTFT and TPOT (four panels), one line per label (an engine or option set), points
  in load order (request rate, then the cap on requests in flight) and annotated
  with it: ``c16`` for 16 in flight, ``4/s`` for 4 requests a second. A sweep over
  concurrencies draws each engine's throughput-vs-latency curve on the same axes.
- ``throughput.png``: output token throughput as grouped bars, one group per
  request rate and one bar per label.

Figures are built on ``matplotlib.figure.Figure`` with the Agg canvas: no pyplot
state, no display needed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvloom.bench.extras import require_bench_package

__all__ = ["load_results", "plot_latency_vs_throughput", "plot_results", "plot_throughput_bars",
           "series_by_label"]

_LATENCY_PANELS = (("ttft_ms", "mean", "mean TTFT (ms)"), ("ttft_ms", "p99", "p99 TTFT (ms)"),
                   ("tpot_ms", "mean", "mean TPOT (ms)"), ("tpot_ms", "p99", "p99 TPOT (ms)"))


def load_results(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Read results documents; each remembers its file as ``_path`` for labelling."""
    results = []
    for path in paths:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if "metrics" not in data:
            raise ValueError(f"{path} is not a bench serve results file (no 'metrics')")
        data["_path"] = str(path)
        results.append(data)
    return results


def _rate(result: Mapping[str, Any]) -> float:
    rate = result.get("parameters", {}).get("request_rate", "inf")
    return math.inf if rate == "inf" else float(rate)


def _label(result: Mapping[str, Any]) -> str:
    return str(result.get("label") or result.get("model") or Path(result.get("_path", "run")).stem)


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _cap(result: Mapping[str, Any]) -> float:
    """The cap on requests in flight (inf: none)."""
    cap = result.get("parameters", {}).get("max_concurrency")
    return math.inf if cap is None else float(cap)


def _load(result: Mapping[str, Any]) -> tuple[float, float]:
    return _rate(result), _cap(result)


def _load_text(result: Mapping[str, Any]) -> str:
    rate, cap = _load(result)
    if math.isinf(cap):
        return _rate_text(rate) if math.isinf(rate) else f"{rate:g}/s"
    return f"c{cap:g}" if math.isinf(rate) else f"{rate:g}/s c{cap:g}"


def series_by_label(results: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Results grouped by label (first-seen order), each group in load order (request
    rate, then concurrency cap)."""
    series: dict[str, list[Mapping[str, Any]]] = {}
    for result in results:
        series.setdefault(_label(result), []).append(result)
    return {label: sorted(group, key=_load) for label, group in series.items()}


def _figure(width: float, height: float) -> Any:
    require_bench_package("matplotlib", "kvloom bench plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_latency_vs_throughput(results: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Four panels of latency against output throughput; returns the PNG's path."""
    figure = _figure(11, 8)
    axes = figure.subplots(2, 2)
    series = series_by_label(results)
    for axis, (metric, stat, title) in zip(axes.flat, _LATENCY_PANELS, strict=True):
        for label, group in series.items():
            xs = [r["metrics"]["output_throughput"] for r in group]
            ys = [r["metrics"][metric][stat] for r in group]
            axis.plot(xs, ys, marker="o", label=label)
            for x, y, result in zip(xs, ys, group, strict=True):
                axis.annotate(_load_text(result), (x, y), textcoords="offset points",
                              xytext=(3, 3), fontsize=7)
        axis.set_title(title)
        axis.set_xlabel("output throughput (tok/s)")
        axis.set_ylabel(title)
        axis.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    figure.suptitle("Latency vs throughput (points annotated with the load: "
                    "cN = N requests in flight, R/s = a request rate)")
    path = Path(path)
    figure.savefig(path, dpi=120)
    return path


def plot_throughput_bars(results: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Output throughput per label, grouped by load (request rate and concurrency cap);
    returns the PNG's path."""
    series = series_by_label(results)
    loads = sorted({_load(r) for r in results})
    names = {_load(r): _load_text(r) for r in results}
    figure = _figure(max(6.0, 1.2 * len(loads) * max(1, len(series)) ** 0.5 + 3), 5)
    axis = figure.subplots()
    width = 0.8 / max(1, len(series))
    for position, (label, group) in enumerate(series.items()):
        by_load = {_load(r): r["metrics"]["output_throughput"] for r in group}
        xs = [index + (position - (len(series) - 1) / 2) * width
              for index, load in enumerate(loads) if load in by_load]
        heights = [by_load[load] for load in loads if load in by_load]
        bars = axis.bar(xs, heights, width=width, label=label)
        axis.bar_label(bars, fmt="%.0f", fontsize=7)
    axis.set_xticks(range(len(loads)), [names[load] for load in loads])
    axis.set_xlabel("load (request rate, or cN: N requests in flight)")
    axis.set_ylabel("output throughput (tok/s)")
    axis.set_title("Output token throughput")
    axis.legend(fontsize=8)
    axis.grid(True, axis="y", alpha=0.3)
    path = Path(path)
    figure.savefig(path, dpi=120)
    return path


def plot_results(paths: Iterable[str | Path], out_dir: str | Path) -> list[Path]:
    """Both charts for the results files in ``paths``, written under ``out_dir``."""
    results = load_results(paths)
    if not results:
        raise ValueError("no results files given")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [plot_latency_vs_throughput(results, out / "latency_vs_throughput.png"),
            plot_throughput_bars(results, out / "throughput.png")]
