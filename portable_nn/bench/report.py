"""The benchmark report: a text table (:func:`format_report`), JSON (:func:`report_json`), a plot.

The text starts with what the numbers mean: the mode (user / tuned / quick), the machine
(CPU model, vector ISA and its bf16/AMX extensions, CPU count, OpenBLAS's core type), the
library versions and every variable that changes how a contender runs, as the workers saw
them.  Then one row per (workload, contender, phase): the median, the spread over the
user mode's rounds, the ratio to PyTorch (the user mode's is the verdict), the ratio to the
reference when it ran, GB/s and its fraction of the copy bandwidth for memory-bound
workloads, and the user mode's memory figures.  Then the mixed section and first calls.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .environment import ISA_SETTINGS, REPORTED_PREFIXES, TUNED_SETTINGS

if TYPE_CHECKING:
    from . import Report, Row

__all__ = ["format_report", "plot_report", "report_json"]


def _count(n: int, noun: str, plural: str = "s") -> str:
    return f"{n} {noun}" + ("" if n == 1 else plural)


def _mode_line(report: Report) -> str:
    s = report.settings
    if report.mode == "user":
        rounds = _count(s.get("rounds", 0), "round")
        line = (f"MODE user (what users get): each contender in its own fresh process per workload, the user's "
                f"environment, alternated over {rounds}; per process a warm-up (compilation excluded), then "
                f"{s.get('repeats')} bursts of ~{1e3 * s.get('burst_s', 0):.0f} ms per phase; medians of the "
                f"per-process medians")
        return line + (" — QUICK SHAPES" if report.quick else "")
    if report.mode == "quick":
        return ("QUICK RUN: small shapes, few short repeats, one process, contenders interleaved "
                "(a smoke test, not a measurement)")
    tuned = ", ".join(f"{k}={v}" for k, v in TUNED_SETTINGS.items())
    return (f"MODE tuned (NOT what users get): one process configured with {tuned}, contenders interleaved, "
            f"{s.get('repeats')} repeats of ~{1e3 * s.get('burst_s', 0):.0f} ms bursts after a settle pause")


def _header(report: Report) -> list[str]:
    """Mode, machine, versions, environment variables and copy bandwidth, per ISA."""
    env = report.environment
    extras = env.get("isa_extensions") or []
    lines = [
        _mode_line(report),
        f"cpu: {env.get('cpu', '?')}, {env.get('isa', '?')}" + (f" (+ {', '.join(extras)})" if extras else "")
        + f", {env.get('cpus', '?')} CPUs",
        f"python {env.get('python')}, numpy {env.get('numpy')}, numba {env.get('numba')}, torch {env.get('torch')}, "
        f"portable_nn {env.get('portable_nn')}; {report.settings.get('threads', 2)} threads for every contender",
    ]
    for isa, machine in (report.environments or {"native": env}).items():
        added = ISA_SETTINGS.get(isa) or {}
        variables = machine.get("env") or {}
        seen = ", ".join(f"{k}={v}" for k, v in variables.items()) or (
            "none of " + ", ".join(p + ("*" if p.endswith("_") else "") for p in REPORTED_PREFIXES) + " set")
        lines.append(f"[{isa}] OpenBLAS core type (NumPy's): {machine.get('openblas_coretype', '?')}; "
                     f"copy bandwidth (read+write): {machine.get('copy_gbps', report.copy_gbps):.1f} GB/s")
        if added:
            lines.append(f"[{isa}] --isa {isa} adds only: " + ", ".join(f"{k}={v}" for k, v in added.items()))
        lines.append(f"[{isa}] environment as the {'workers' if report.mode == 'user' else 'process'} saw it: "
                     + seen)
    removed = report.settings.get("removed") or {}
    if removed:
        lines.append("removed from this shell's environment for the workers: "
                     + ", ".join(f"{k}={v}" for k, v in removed.items()))
    return lines


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def _spread(row: Row) -> str:
    """(max - min) / median over the user mode's rounds, in percent."""
    if len(row.per_round_ms) < 2 or not row.median_ms:
        return "-"
    return f"{100 * (max(row.per_round_ms) - min(row.per_round_ms)) / row.median_ms:.0f}%"


def _table(report: Report) -> list[str]:
    """One line per row; memory on the first row of each contender."""
    rows = report.rows
    several_isas = len({r.isa for r in rows}) > 1
    with_ref = any(r.ratio_vs_reference is not None for r in rows)
    user = report.mode == "user"
    width = max([38, *(len(r.workload) for r in rows)])
    cols = [f"{'workload':{width}s}", *(["isa   "] if several_isas else []), f"{'contender':10s}", f"{'phase':8s}",
            f"{'median ms':>10s}", *([f"{'spread':>6s}"] if user else []),
            f"{'verdict' if user else 'vs torch':>8s}", *([f"{'vs ref':>7s}"] if with_ref else []),
            f"{'GB/s':>7s}", f"{'% copy':>7s}", *([f"{'footprint MiB':>13s}", f"{'+peak MiB':>9s}"] if user else [])]
    lines = [" ".join(cols)]
    if user:
        lines.insert(0, "% copy: of a copy moving the bytes the workload's forward moves, timed in the same processes")
    shown: set[tuple[str, str, str]] = set()
    for r in rows:
        first = (r.workload, r.isa, r.contender) not in shown
        shown.add((r.workload, r.isa, r.contender))
        cells = [f"{r.workload:{width}s}", *([f"{r.isa:6s}"] if several_isas else []), f"{r.contender:10s}",
                 f"{r.phase:8s}", f"{r.median_ms:10.3f}", *([f"{_spread(r):>6s}"] if user else []),
                 f"{_fmt(r.ratio_vs_torch, '.2f', 'x'):>8s}",
                 *([f"{_fmt(r.ratio_vs_reference, '.1f', 'x'):>7s}"] if with_ref else []),
                 f"{_fmt(r.gbps, '.1f'):>7s}", f"{_percent(r.fraction_of_copy):>7s}"]
        if user:
            cells += [f"{_fmt(r.footprint_mib if first else None, '.1f'):>13s}",
                      f"{_fmt(r.peak_growth_mib if first else None, '.1f'):>9s}"]
        lines.append(" ".join(cells))
    return lines


def _mixed(report: Report) -> list[str]:
    """The mixed section: each case's median step times and ratios."""
    if not report.mixed:
        return []
    processes = _count(report.settings.get("rounds", 0), "fresh process", "es")
    lines = ["", f"mixed section: PyTorch and portable_nn in one process (user environment), each case in "
             f"{processes}; ms per step (fwd+bwd or training step)"]
    for m in report.mixed:
        times = ", ".join(f"{k} {v:.3f}" for k, v in m.times_ms.items())
        ratios = ", ".join(f"{k} = {v:.2f}" + ("" if m.kind == "alternating" else "x") for k, v in m.ratios.items())
        goal = f" (goal {m.goal}: {'met' if m.goal_met else 'NOT met'})" if m.goal else ""
        lines.append(f"  {m.case}: {times} -> {ratios}{goal}")
    return lines


def _first_calls(report: Report) -> list[str]:
    if not report.first_call:
        return []
    lines = ["", "first fwd+bwd call in a new process (numba, seconds): warm_cache = the process's first call "
             "(with numba's one-off startup); op_after_startup = the op's own first call once numba is up"]
    for op, entry in report.first_call.items():
        lines.append(f"  {op:14s} " + ", ".join(f"{k}={v:.2f}" for k, v in entry.items()))
    return lines


def _wrap(text: str, width: int = 118) -> list[str]:
    """``text`` in lines of at most ``width`` characters, at its semicolons."""
    lines, current = [], ""
    for part in text.split("; "):
        candidate = f"{current}; {part}" if current else part
        if current and len(candidate) > width:
            lines.append(current + ";")
            current = part
        else:
            current = candidate
    return [*lines, current]


def format_report(report: Report) -> str:
    """The report as text: header, table, legend, mixed section, first calls, notes."""
    if report.mode == "user":
        legend = ("verdict = PyTorch's time / the contender's in the user mode (> 1: faster than PyTorch); spread = "
                  "(max - min) / median over rounds; footprint = RSS after warm-up minus RSS after `import numpy`; "
                  "+peak = peak RSS while timing over the RSS before")
    else:
        legend = "vs torch = PyTorch's time / the contender's (> 1: faster); not a verdict: see the user mode"
    table = [*_table(report), *_wrap(legend)] if report.rows else []
    lines = [*_header(report), "", *table, *_mixed(report), *_first_calls(report)]
    if report.notes:
        lines += ["", "not measured:"] + [f"  {n}" for n in report.notes]
    return "\n".join(lines)


def report_json(report: Report) -> dict[str, Any]:
    """Everything in the report as JSON-ready data (rows, mixed rows, memory per contender)."""
    memory: dict[str, dict[str, dict[str, Any]]] = {}
    for r in report.rows:
        if r.footprint_mib is not None or r.peak_growth_mib is not None:
            memory.setdefault(r.isa, {}).setdefault(r.workload, {})[r.contender] = {
                "footprint_mib": r.footprint_mib, "peak_growth_mib": r.peak_growth_mib}
    return {
        "mode": report.mode,
        "quick": report.quick,
        "settings": report.settings,
        "environment": report.environment,
        "environments": report.environments,
        "copy_gbps": report.copy_gbps,
        "rows": [asdict(r) for r in report.rows],
        "mixed": [asdict(m) for m in report.mixed],
        "memory": memory,
        "first_call": report.first_call,
        "notes": report.notes,
    }


def plot_report(report: Report, path: str) -> None:
    """Horizontal bars: each workload's fwd+bwd speed vs PyTorch, one bar per backend (and ISA), log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.contender != "torch" and r.ratio_vs_torch and r.phase == "fwd+bwd"]
    several = len({r.isa for r in rows}) > 1
    key = (lambda r: f"{r.contender} [{r.isa}]") if several else (lambda r: r.contender)
    workloads = list(dict.fromkeys(r.workload for r in rows))
    series = list(dict.fromkeys(key(r) for r in rows))
    height = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(workloads) + 1.2))
    for k, name in enumerate(series):
        ratio = {r.workload: r.ratio_vs_torch for r in rows if key(r) == name}
        ys = [i + k * height for i, w in enumerate(workloads) if w in ratio]
        ax.barh(ys, [ratio[w] for w in workloads if w in ratio], height=height, label=name)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(workloads))], workloads, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(f"fwd+bwd speed vs PyTorch ({report.mode} mode; x, > 1 is faster)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
