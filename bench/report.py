"""The load generator's report: throughput and latency statistics of a run, the A/B comparison of two
runs, and their plots."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from servelm.bench.client import BenchmarkRun

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = (  # (key, title, abbreviation)
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "std": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64) * scale
    out: dict[str, float | None] = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(a, p))
    return out


def summarize(run: BenchmarkRun) -> dict[str, Any]:
    """Throughput and latency statistics (latencies in ms) of a run, flat like vLLM's result JSON."""
    ok = [r for r in run.results if r.success]
    failed = [r for r in run.results if not r.success]
    dur = run.duration if run.duration > 0 else float("nan")
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    s: dict[str, Any] = {
        "base_url": run.base_url,
        "model": run.model,
        "completed": len(ok),
        "failed": len(failed),
        "duration": run.duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "errors": sorted({r.error for r in failed})[:10],
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for key, values in series.items():
        for stat, v in _stats(values).items():
            s[f"{stat}_{key}_ms"] = v
    return s


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def format_summary(s: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    width = 52
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<38}{_fmt(value):>14}")

    row("Base URL:", s["base_url"])
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for key, name, abbr in LATENCY_METRICS:
        lines.append(f" {name} ".center(width, "-"))
        row(f"Mean {abbr} (ms):", s[f"mean_{key}_ms"])
        row(f"Median {abbr} (ms):", s[f"median_{key}_ms"])
        for p in PERCENTILES[1:]:
            row(f"P{p} {abbr} (ms):", s[f"p{p}_{key}_ms"])
    lines.append("=" * width)
    for e in s.get("errors") or []:
        lines.append(f"error: {e}")
    return "\n".join(lines)


COMPARED = (
    ("completed", "Successful requests"),
    ("duration", "Duration (s)"),
    ("request_throughput", "Request throughput (req/s)"),
    ("output_throughput", "Output throughput (tok/s)"),
    ("total_token_throughput", "Total throughput (tok/s)"),
) + tuple(
    (f"{stat}_{key}_ms", f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {abbr} (ms)")
    for key, _, abbr in LATENCY_METRICS
    for stat in ("mean", "median", "p99")
)


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """B / A for every compared figure (None where A is 0 or missing)."""
    out: dict[str, float | None] = {}
    for key, _ in COMPARED:
        va, vb = a.get(key), b.get(key)
        out[key] = vb / va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else None
    return out


def format_comparison(a: dict[str, Any], b: dict[str, Any]) -> str:
    ratio = compare(a, b)
    lines = [
        " Comparison ".center(72, "="),
        f"A = {a['base_url']}",
        f"B = {b['base_url']}",
        f"{'':<32}{'A':>12}{'B':>12}{'B/A':>12}",
    ]
    for key, label in COMPARED:
        r = ratio[key]
        lines.append(f"{label:<32}{_fmt(a.get(key)):>12}{_fmt(b.get(key)):>12}{(f'{r:.3f}x' if r else 'n/a'):>12}")
    lines.append("=" * 72)
    return "\n".join(lines)


def tokens_per_second(run: BenchmarkRun, bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens/s over time: each request's tokens spread evenly over its content chunks."""
    nbins = max(1, math.ceil(run.duration / bin_s))
    counts = np.zeros(nbins)
    for r in run.results:
        if not r.success or not r.chunk_times:
            continue
        per_chunk = r.output_len / len(r.chunk_times)
        for t in r.chunk_times:
            counts[min(nbins - 1, int(t / bin_s))] += per_chunk
    return np.arange(nbins) * bin_s, counts / bin_s


def plot(runs: list[BenchmarkRun], path: str | Path) -> None:
    """Latency distributions (TTFT, TPOT, ITL, E2E) and output tokens/s over time, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [
        ("TTFT (ms)", lambda rs: [r.ttft * 1e3 for r in rs]),
        ("TPOT (ms)", lambda rs: [r.tpot * 1e3 for r in rs if r.tpot is not None]),
        ("ITL (ms)", lambda rs: [g * 1e3 for r in rs for g in r.itl]),
        ("End-to-end latency (s)", lambda rs: [r.latency for r in rs]),
    ]
    for ax, (label, values) in zip(axes.flat, panels):
        per_run = [values([r for r in run.results if r.success]) for run in runs]
        everything = [x for v in per_run for x in v]
        if not everything:
            continue
        bins = np.histogram_bin_edges(everything, bins=40)  # shared, so the runs compare bar for bar
        for run, v in zip(runs, per_run):
            if v:
                ax.hist(v, bins=bins, alpha=0.6, label=run.base_url)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    ax = axes.flat[4]
    longest = max(run.duration for run in runs)
    bin_s = max(0.05, longest / 60)  # about 60 points whatever the run's length
    for run in runs:
        t, tps = tokens_per_second(run, bin_s)
        ax.step(t, tps, where="post", label=run.base_url)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("output tokens/s")
    ax = axes.flat[5]
    for run in runs:  # requests in flight over time
        events = sorted(
            [(r.start, 1) for r in run.results] + [(r.start + r.latency, -1) for r in run.results if r.success]
        )
        if events:
            xs, ys, n = [], [], 0
            for at, d in events:
                n += d
                xs.append(at)
                ys.append(n)
            ax.step(xs, ys, where="post", label=run.base_url)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests in flight")
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
