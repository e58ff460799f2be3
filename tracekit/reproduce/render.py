"""A reproduced table beside the paper's: ours, the paper's value and the difference per cell, 95% CIs where there
are seeds; written as Markdown, CSV and LaTeX, and drawn as PNG.

Our cells come from each row job's ``results.json`` (:func:`tracekit.evaluate.summarize` rows):

- pass-rate columns: the union of the row's domains in that column (Appendix F); ``airline``/``retail`` are the
  domains of that tau^2 family (on ``tau2_mini``: its library environments of that family);
- with two or more seed runs (``eval=stochastic``): the mean of the per-run rates +- the Student-t 95% half-width
  (:func:`tracekit.evaluate.mean_ci`, as the paper's Tables 6-7); the difference is of the means;
- ToolSandbox columns: a trajectory's reward is its similarity, success is similarity 1.0 (App. F), so
  ``mean_similarity`` is the mean reward and ``perfect`` the solved count.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracekit.evaluate import mean_ci
from tracekit.reproduce.spec import Column, Row, Spec
from tracekit.synthesis.library import LIBRARY_NAMES, library_env


@dataclass(frozen=True)
class Value:
    mean: float | None
    ci: float | None = None
    total: int | None = None  # counts: out of how many

    @property
    def missing(self) -> bool:
        return self.mean is None


NONE = Value(None)


@dataclass
class RowResult:
    row: Row
    status: str  # ok | not run | failed
    reason: str = ""
    values: dict[str, Value] = field(default_factory=dict)
    x: float | None = None  # figures: our x (the row's rollouts, or the spec's x)
    budget: dict[str, int] | None = None
    seconds: float | None = None
    cache: str = ""  # "all cached" | "computed: stage, ..."
    run_dir: str | None = None
    notes: list[str] = field(default_factory=list)
    job: int | None = None  # the job that produced it (rows with the same setting share one)
    extra: dict[str, Any] = field(default_factory=dict)  # figure 3: the selection


# --------------------------------------------------------------------------------------------
# measuring


def family(env: str) -> str:
    """The tau^2 family of a result column: ``tau2_airline`` for itself and for its library environments."""
    if env in ("tau2_airline", "tau2_retail"):
        return env

    return library_env(env).target if env in LIBRARY_NAMES else env


def _counts(domains: dict[str, Any], col: Column) -> tuple[int, int, float] | None:
    picked = [c for env, c in domains.items() if col.family is None or family(env) == col.family]
    if not picked:
        return None
    return (sum(c["solved"] for c in picked), sum(c["total"] for c in picked),
            sum(c["mean_reward"] * c["total"] for c in picked))


def measure(result: dict[str, Any], col: Column) -> Value:
    """Our value of one column from one results.json row (see the module docstring)."""
    runs = [r["domains"] for r in result.get("runs", {}).values()] or [result["domains"]]
    per_run = [c for c in (_counts(d, col) for d in runs) if c is not None]
    if not per_run:
        return NONE
    if col.unit == "percent":
        xs = [100.0 * s / n for s, n, _ in per_run]
    elif col.unit == "count":
        xs = [float(s) for s, _, _ in per_run]
    elif col.unit == "similarity":
        xs = [r / n for _, n, r in per_run]
    else:
        raise ValueError(f"column unit {col.unit!r} is not measured from results.json")
    mean, half = mean_ci(xs)
    return Value(mean, half, per_run[0][1] if col.unit == "count" else None)


def paper_value(v: Any) -> Value:
    if v is None:
        return NONE
    if isinstance(v, (list, tuple)):
        return Value(float(v[0]), float(v[1]) if len(v) > 1 else None)
    return Value(float(v))


# --------------------------------------------------------------------------------------------
# cells


def _num(x: float, unit: str) -> str:
    if unit == "percent":
        return f"{x:.1f}"
    if unit == "count":
        return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"
    if unit in ("similarity", "fraction"):
        return f"{x:.3f}"
    if unit == "parameters":
        return f"{x:,.0f}"
    return f"{x:g}"


def cell(v: Value, unit: str) -> str:
    if v.missing:
        return "–"
    s = _num(v.mean, unit)
    if v.total is not None:
        s += f"/{v.total}"
    return s if v.ci is None else f"{s} ± {_num(v.ci, unit)}"


def diff(ours: Value, paper: Value, unit: str) -> str:
    if ours.missing or paper.missing:
        return "–"
    d = ours.mean - paper.mean
    if unit == "parameters":
        return "0 (exact)" if d == 0 else f"{d:+,.0f} ({100 * d / paper.mean:+.1f}%)"
    return f"{'+' if d >= 0 else '−'}{_num(abs(d), unit)}"


def _status(r: RowResult) -> str:
    if r.status == "ok":
        return r.cache or "ok"
    return f"{r.status}: {r.reason}"


# --------------------------------------------------------------------------------------------
# tables


def header_and_rows(spec: Spec, results: list[RowResult]) -> tuple[list[str], list[list[str]]]:
    """The side-by-side grid shared by Markdown and LaTeX: per column ours | paper | diff."""
    blocks = len({r.row.block for r in results}) > 1
    figure = spec.kind == "figure"
    head = [*(["Model"] if blocks else []), "Approach"]
    if figure:
        xl = spec.figure.get("xlabel", "x")
        head += [f"{xl}: ours", "paper"]
    for c in spec.columns:
        t = spec.column(c).title
        head += [f"{t}: ours", "paper", "Δ"]
    budgets = any(r.budget for r in results)
    head += [*(["Train episodes"] if budgets else []), "Status"]
    rows = []
    for r in results:
        line = [*([r.row.block_label] if blocks else []), r.row.label]
        if figure:
            line += [_num(r.x, "x") if r.x is not None else "–", _num(r.row.x, "x") if r.row.x is not None else "–"]
        for c in spec.columns:
            col = spec.column(c)
            ours, paper = r.values.get(c, NONE), paper_value(r.row.paper.get(c))
            line += [cell(ours, col.unit), cell(paper, col.unit), diff(ours, paper, col.unit)]
        line += [*([f"{r.budget['episodes']:,}" if r.budget else "–"] if budgets else []), _status(r)]
        rows.append(line)
    return head, rows


def markdown(spec: Spec, results: list[RowResult]) -> str:
    head, rows = header_and_rows(spec, results)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(x.replace("|", "\\|") for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "±": r"$\pm$", "Δ": r"$\Delta$",
        "−": r"$-$", "–": "--", "τ": r"$\tau$"}


def tex_escape(s: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in s)


def latex(spec: Spec, results: list[RowResult]) -> str:
    head, rows = header_and_rows(spec, results)
    tail = 2 if "Train episodes" in head else 1
    lead = len(head) - 3 * len(spec.columns) - tail
    out = [f"% {spec.title} (tracekit.reproduce {spec.id}): ours beside the paper's", r"\begin{table}[t]",
           r"\centering", r"\small", r"\begin{tabular}{" + "l" * lead + "rrr" * len(spec.columns) + "r" * (tail - 1) + "l}",
           r"\toprule"]
    groups = [""] * lead + [rf"\multicolumn{{3}}{{c}}{{{tex_escape(spec.column(c).title)}}}"
                            for c in spec.columns] + [""] * tail
    out.append(" & ".join(groups) + r" \\")
    sub = [tex_escape(h) for h in head[:lead]] + ["ours", "paper", r"$\Delta$"] * len(spec.columns) + \
          ["Episodes", "Status"][2 - tail:]
    out += [" & ".join(sub) + r" \\", r"\midrule"]
    out += [" & ".join(tex_escape(x) for x in row) + r" \\" for row in rows]
    out += [r"\bottomrule", r"\end{tabular}", rf"\caption{{{tex_escape(spec.title)}: ours beside the paper's.}}",
            r"\end{table}"]
    return "\n".join(out) + "\n"


CSV_FIELDS = ["table", "block", "row", "label", "method", "column", "ours", "ours_ci95", "ours_total", "paper",
              "paper_ci95", "diff", "x_ours", "x_paper", "status", "reason", "episodes", "generated_tokens",
              "optimizer_steps", "seconds", "cache", "run_dir"]


def csv_text(spec: Spec, results: list[RowResult]) -> str:
    """One line per (row, column): the long form, for analysis."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    w.writeheader()
    if spec.metric == "selection":  # Figure 3: one line per (capability, column)
        _selection_csv(w, spec, results[0])
        return buf.getvalue()
    for r in results:
        for c in spec.columns:
            ours, paper = r.values.get(c, NONE), paper_value(r.row.paper.get(c))
            w.writerow({
                "table": spec.id, "block": r.row.block_label, "row": r.row.index, "label": r.row.label,
                "method": r.row.method or "", "column": c, "ours": ours.mean, "ours_ci95": ours.ci,
                "ours_total": ours.total, "paper": paper.mean, "paper_ci95": paper.ci,
                "diff": None if ours.missing or paper.missing else ours.mean - paper.mean,
                "x_ours": r.x, "x_paper": r.row.x, "status": r.status, "reason": r.reason,
                **{k: (r.budget or {}).get(k) for k in ("episodes", "generated_tokens", "optimizer_steps")},
                "seconds": None if r.seconds is None else round(r.seconds, 1), "cache": r.cache, "run_dir": r.run_dir})
    return buf.getvalue()


def _selection_csv(w: csv.DictWriter, spec: Spec, r: RowResult) -> None:
    sel = r.extra.get("selection") or {"candidates": [], "runs": []}
    paper = spec.paper.get("selected_in_runs", {})
    cands = {c["name"]: c for c in sel["candidates"]}
    for name in dict.fromkeys([*cands, *paper]):
        c = cands.get(name, {})
        for col, ours, pv in (("selected_in_runs", c.get("selection_count"), paper.get(name)),
                              ("median_coverage", c.get("median_cov"), None)):
            w.writerow({"table": spec.id, "block": r.row.block_label, "row": r.row.index, "label": name,
                        "column": col, "ours": ours, "ours_total": len(sel["runs"]) if col == "selected_in_runs" else None,
                        "paper": pv, "diff": None if ours is None or pv is None else ours - pv, "status": r.status,
                        "reason": r.reason, "cache": r.cache, "run_dir": r.run_dir})


def wandb_table(spec: Spec, results: list[RowResult]) -> tuple[list[str], list[list[Any]]]:
    rows = list(csv.DictReader(io.StringIO(csv_text(spec, results))))
    return CSV_FIELDS, [[row[k] for k in CSV_FIELDS] for row in rows]


# --------------------------------------------------------------------------------------------
# Figure 3: the selection beside the paper's


def selection_markdown(spec: Spec, result: RowResult) -> str:
    sel = result.extra.get("selection")
    paper = spec.paper.get("selected_in_runs", {})
    lines = ["| Capability | Selected: ours | paper | Δ | Median failure coverage [IQR]: ours | Kept |",
             "|---|---|---|---|---|---|"]
    if sel is None:
        return "\n".join(lines + [f"| – | – | – | – | – | {_status(result)} |"]) + "\n"
    n = len(sel["runs"])
    cands = {c["name"]: c for c in sel["candidates"]}
    for name in [*sorted(cands, key=lambda k: (-cands[k]["selection_count"], k)), *[p for p in paper if p not in cands]]:
        c = cands.get(name)
        ours = f"{c['selection_count']}/{n}" if c else "– (not a candidate)"
        pv = f"{paper[name]}/10" if name in paper else "–"
        d = f"{c['selection_count'] - paper[name]:+d}" if c and name in paper else "–"
        cov = ("–" if not c or c.get("median_cov") is None
               else f"{c['median_cov']:.2f} [{c['cov_iqr'][0]:.2f}, {c['cov_iqr'][1]:.2f}]")
        lines.append(f"| {name} | {ours} | {pv} | {d} | {cov} | {'yes' if c and c['selected'] else 'no'} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# PNG


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=150, bbox_inches="tight")
    _plt().close(fig)
    tmp.replace(path)
    return path


def _nonnegative_yerr(values: list[Value]) -> list[list[float]]:
    """Error bars (below, above) of mean +- CI drawn no lower than 0: every metric of the paper's tables is a
    rate, a similarity or a count, and a t interval over few seeds can reach below 0 (the tables print it whole)."""
    ci = [0.0 if v.missing or not v.ci else float(v.ci) for v in values]
    return [[min(c, max(v.mean, 0.0)) if not v.missing else 0.0 for v, c in zip(values, ci)], ci]


def table_png(spec: Spec, results: list[RowResult], path: Path) -> Path:
    """Grouped bars of the table's last column: ours (with CI) beside the paper's, one pair per row."""
    plt = _plt()
    c = spec.columns[-1]
    col = spec.column(c)
    labels = [f"{r.row.label}" + (f" [{r.row.block_label}]" if len({x.row.block for x in results}) > 1 else "")
              for r in results]
    ours = [r.values.get(c, NONE) for r in results]
    paper = [paper_value(r.row.paper.get(c)) for r in results]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.75 * len(results) + 2), 3.8))
    xs = range(len(results))
    ax.bar([x - 0.2 for x in xs], [v.mean if not v.missing else 0 for v in ours], 0.4, label="ours",
           yerr=_nonnegative_yerr(ours), capsize=3, color="#1565c0")
    ax.bar([x + 0.2 for x in xs], [v.mean if not v.missing else 0 for v in paper], 0.4, label="paper",
           yerr=_nonnegative_yerr(paper), capsize=3, color="#9e9e9e")
    for x, v, r in zip(xs, ours, results, strict=True):
        if v.missing:
            ax.text(x - 0.2, 0, "not run" if r.status == "not run" else r.status, rotation=90, fontsize=7,
                    ha="center", va="bottom")
    ax.set_xticks(list(xs), labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(col.title)
    ax.set_title(spec.title, fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def lines_png(spec: Spec, results: list[RowResult], path: Path) -> Path:
    """A line per series: ours (solid, at our x) and the paper's points (hollow, dashed), y the last column."""
    plt = _plt()
    c = spec.columns[-1]
    col = spec.column(c)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    series = list(dict.fromkeys(r.row.series or r.row.label for r in results))
    for i, s in enumerate(series):
        color = f"C{i}"
        pts = [r for r in results if (r.row.series or r.row.label) == s]
        ours = sorted((r.x, r.values[c].mean) for r in pts if r.x is not None and not r.values.get(c, NONE).missing)
        paper = sorted((r.row.x, paper_value(r.row.paper.get(c)).mean) for r in pts
                       if r.row.x is not None and not paper_value(r.row.paper.get(c)).missing)
        if ours:
            ax.plot(*zip(*ours, strict=True), "o-", color=color, label=f"{s} (ours)")
        if paper:
            ax.plot(*zip(*paper, strict=True), "o--", color=color, mfc="none", label=f"{s} (paper)")
    ax.set_xlabel(spec.figure.get("xlabel", "x"))
    ax.set_ylabel(col.title)
    ax.set_title(spec.title, fontsize=10)
    ax.legend(fontsize=7)
    return _save(fig, path)


def selection_png(spec: Spec, result: RowResult, path: Path) -> Path:
    plt = _plt()
    sel = result.extra.get("selection") or {"candidates": [], "runs": []}
    paper = spec.paper.get("selected_in_runs", {})
    names = list(dict.fromkeys([*(c["name"] for c in sel["candidates"]), *paper]))
    ours = {c["name"]: c["selection_count"] for c in sel["candidates"]}
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(names) + 1.5), 3.8))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [ours.get(n, 0) for n in names], 0.4, label=f"ours (of {len(sel['runs'])})",
           color="#2e7d32")
    ax.bar([x + 0.2 for x in xs], [paper.get(n, 0) for n in names], 0.4, label="paper (of 10)", color="#9e9e9e")
    ax.set_xticks(list(xs), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("runs selected")
    ax.set_title(spec.title, fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)

