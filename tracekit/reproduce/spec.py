"""Paper table specs (``experiments/<id>_*.yaml``): loading, the row plan, and the check before any work.

A spec names the preset its rows start from (``experiment``), the target (``target``: a ``conf/benchmark``
name), the metric and its columns, and blocks of rows (a block: one backbone). A row names a method of the
registry (:data:`tracekit.methods.METHODS`), its own Hydra overrides and the paper's numbers::

    id: table4
    title: "Table 4: consolidation approaches on tau^2-Bench"
    experiment: paper
    target: tau2
    metric: pass_rate
    columns: [airline, retail, overall]
    blocks:
      - backbone: qwen3_30b_a3b
        rows:
          - {label: CORE-TSV, method: trace, overrides: [consolidation=merge_core_tsv],
             paper: {airline: 36.0, retail: 41.2, overall: 39.6}}

Each row becomes one ``python -m tracekit`` job with the overrides
``experiment=<experiment> benchmark=<target> backbone=<block> <spec, block, row overrides> eval.methods=[<method>]``
followed by the user's overrides (which win). The scale profile maps the target and the backbone
(``scale.targets``, ``scale.backbone``: ``scale=embedded`` runs tau^2 tables on ``tau2_mini`` with the bundled
model). :func:`plan` composes every row and checks it against the registries before any work: a row whose
method, target, strategy or config key is not built, or whose values the config refuses (a baseline that needs
its data), cannot run, and :func:`blocked_line` names each in one line; a spec with an unknown column, metric or
field is refused by :func:`load_spec` (:class:`SpecError`, one line).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tracekit.config import ConfigError
from tracekit.schema import register_configs
from tracekit.methods import METHODS
from tracekit.methods.consolidate import STRATEGIES
from tracekit.validate import validate

ROOT = Path(__file__).resolve().parent.parent.parent
EXPERIMENTS = ROOT / "experiments"
CONF = ROOT / "conf"

KINDS = ("table", "figure", "parameters")


@dataclass(frozen=True)
class Column:
    title: str
    unit: str  # percent | count | similarity | parameters | runs | fraction
    family: str | None = None  # pass-rate columns over the domains of one tau^2 family (airline, retail)


# metric -> its columns (what a spec's `columns` may name) and how each reads a results.json row
COLUMNS: dict[str, dict[str, Column]] = {
    "pass_rate": {"airline": Column("Airline (%)", "percent", "tau2_airline"),
                  "retail": Column("Retail (%)", "percent", "tau2_retail"),
                  "overall": Column("Overall (%)", "percent")},
    "pass_at_1": {"pass_at_1": Column("Pass@1 (%)", "percent")},
    # ToolSandbox: a trajectory's reward is its similarity in [0, 1], success is similarity 1.0 (App. F)
    "similarity": {"perfect": Column("Perfect", "count"), "mean_similarity": Column("Mean Sim.", "similarity"),
                   "pass_rate": Column("Pass Rate (%)", "percent")},
    "parameters": {"parameters": Column("Parameters", "parameters")},
    "selection": {"selected_in_runs": Column("Selected in runs", "runs"),
                  "median_coverage": Column("Median failure coverage", "fraction")},
}

SPEC_KEYS = {"id", "title", "kind", "experiment", "target", "metric", "columns", "overrides", "stages", "blocks",
             "paper", "capabilities", "figure", "note"}
BLOCK_KEYS = {"backbone", "label", "overrides", "rows"}
ROW_KEYS = {"label", "method", "overrides", "paper", "series", "x", "count", "note"}


class SpecError(ValueError):
    """A spec that cannot be run as written (message: one line naming the spec and what is wrong)."""


@dataclass(frozen=True)
class Row:
    index: int
    block: int
    block_label: str
    backbone: str | None
    label: str
    method: str | None  # None: a row that runs stages only (Figure 3: up to `select`)
    overrides: tuple[str, ...]  # the spec's, the block's and the row's own
    paper: dict[str, Any]
    series: str | None = None  # figures: the line this point belongs to
    x: float | None = None  # figures: the point's x in the paper
    count: str | None = None  # parameter tables: which count (backbone | adapter_each | gates_total)
    note: str = ""


@dataclass
class Spec:
    id: str
    title: str
    path: Path
    kind: str
    experiment: str
    target: str | None
    metric: str
    columns: list[str]
    stages: list[str]
    rows: list[Row]
    paper: dict[str, Any] = field(default_factory=dict)
    capabilities: int | None = None
    figure: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def column(self, name: str) -> Column:
        return COLUMNS[self.metric][name]


def spec_paths() -> list[Path]:
    return sorted(EXPERIMENTS.glob("*.yaml"))


def find_spec(name: str) -> Path:
    """``table1`` -> ``experiments/table1_*.yaml`` (or a path to a spec file)."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    hits = [q for q in spec_paths() if q.stem == name or q.stem.split("_", 1)[0] == name]
    if len(hits) != 1:
        known = ", ".join(q.stem.split("_", 1)[0] for q in spec_paths())
        raise SpecError(f"no spec named {name!r} in {EXPERIMENTS} (known: {known}, or a path to a .yaml spec)")
    return hits[0]


def _list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecError(f"{where}: must be a list of strings, got {value!r}")
    return list(value)


def _unknown(keys: Iterable[str], allowed: set[str], where: str) -> None:
    extra = sorted(set(keys) - allowed)
    if extra:
        raise SpecError(f"{where}: unknown field(s) {', '.join(extra)} (allowed: {', '.join(sorted(allowed))})")


def load_spec(path: str | Path) -> Spec:
    """Read and structurally check one spec; SpecError (one line) on the first problem."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SpecError(f"{path}: cannot read the spec ({' '.join(str(e).split())})") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: a spec is a mapping")
    where = path.name
    _unknown(raw, SPEC_KEYS, where)
    for key in ("id", "title", "metric"):
        if not isinstance(raw.get(key), str):
            raise SpecError(f"{where}: field {key!r} (a string) is required")
    kind = raw.get("kind", "table")
    if kind not in KINDS:
        raise SpecError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    metric = raw["metric"]
    if metric not in COLUMNS:
        raise SpecError(f"{where}: unknown metric {metric!r} (known: {', '.join(COLUMNS)})")
    columns = _list(raw.get("columns"), f"{where}: columns") or list(COLUMNS[metric])[:1]
    bad = [c for c in columns if c not in COLUMNS[metric]]
    if bad:
        raise SpecError(f"{where}: unknown column(s) {', '.join(bad)} for metric {metric} "
                        f"(known: {', '.join(COLUMNS[metric])})")
    spec_overrides = _list(raw.get("overrides"), f"{where}: overrides")
    rows: list[Row] = []
    for b, block in enumerate(raw.get("blocks") or []):
        bwhere = f"{where}: block {b + 1}"
        if not isinstance(block, dict):
            raise SpecError(f"{bwhere}: a block is a mapping")
        _unknown(block, BLOCK_KEYS, bwhere)
        block_overrides = _list(block.get("overrides"), f"{bwhere}: overrides")
        backbone = block.get("backbone")
        for r, row in enumerate(block.get("rows") or []):
            rwhere = f"{bwhere}, row {r + 1}"
            if not isinstance(row, dict):
                raise SpecError(f"{rwhere}: a row is a mapping")
            _unknown(row, ROW_KEYS, rwhere)
            if not isinstance(row.get("label"), str):
                raise SpecError(f"{rwhere}: field 'label' (a string) is required")
            paper = row.get("paper") or {}
            if not isinstance(paper, dict):
                raise SpecError(f"{rwhere}: paper must map columns to the paper's numbers")
            bad = [c for c in paper if c not in COLUMNS[metric]]
            if bad:
                raise SpecError(f"{rwhere} ({row['label']}): paper names unknown column(s) {', '.join(bad)} "
                                f"(metric {metric}: {', '.join(COLUMNS[metric])})")
            rows.append(Row(index=len(rows), block=b, block_label=str(block.get("label") or backbone or ""),
                            backbone=backbone, label=row["label"], method=row.get("method"),
                            overrides=(*spec_overrides, *block_overrides, *_list(row.get("overrides"), rwhere)),
                            paper=paper, series=row.get("series"), x=row.get("x"), count=row.get("count"),
                            note=row.get("note", "")))
    if kind != "parameters" and not rows:
        raise SpecError(f"{where}: no rows (blocks[].rows[])")
    return Spec(id=raw["id"], title=raw["title"], path=path, kind=kind, experiment=raw.get("experiment", "paper"),
                target=raw.get("target"), metric=metric, columns=columns,
                stages=_list(raw.get("stages"), f"{where}: stages") or ["evaluate"], rows=rows,
                paper=raw.get("paper") or {}, capabilities=raw.get("capabilities"), figure=raw.get("figure") or {},
                note=raw.get("note", ""))


# --------------------------------------------------------------------------------------------
# overrides


def override_key(override: str) -> str:
    """The key an override sets: ``benchmark=tau2`` -> benchmark, ``+a.b=1`` -> a.b, ``~x`` -> x."""
    return override.lstrip("+~").split("=", 1)[0].split("@", 1)[0]


def merge_overrides(*groups: Sequence[str]) -> list[str]:
    """Concatenate override lists; a later override of the same key replaces an earlier one (the user's win)."""
    out: dict[str, str] = {}
    for group in groups:
        for o in group:
            k = override_key(o)
            out.pop(k, None)
            out[k] = o
    return list(out.values())


def is_hydra_override(override: str) -> bool:
    """Overrides of Hydra itself (``hydra/launcher=joblib``, ``hydra.launcher.n_jobs=2``): the launch, not a row."""
    return override_key(override).startswith(("hydra/", "hydra."))


def choice(overrides: Sequence[str], group: str) -> str | None:
    """The option chosen for ``group`` by the last override of it (None when none chooses it)."""
    found = None
    for o in overrides:
        if "=" in o and override_key(o) == group and not o.startswith("~"):
            found = o.split("=", 1)[1]
    return found


# --------------------------------------------------------------------------------------------
# the plan and the check


@dataclass
class PlannedRow:
    row: Row
    overrides: list[str]  # the job's Hydra overrides (empty when not runnable)
    problem: str | None = None  # why the row cannot run: a piece not built yet, or a value it must be given
    cfg: Any = None  # the row's composed config (runnable rows)


@dataclass
class Plan:
    spec: Spec
    scale: str
    base_overrides: list[str]  # experiment + scale + the user's overrides (without Hydra's own)
    hydra_overrides: list[str]  # the user's overrides of Hydra (launcher, sweep dir)
    rows: list[PlannedRow]
    base_cfg: Any = None  # the spec's preset at the chosen scale with the user's overrides (the table's logger)

    @property
    def runnable(self) -> list[PlannedRow]:
        return [p for p in self.rows if p.problem is None]

    @property
    def blocked(self) -> list[PlannedRow]:
        return [p for p in self.rows if p.problem is not None]


def _registry_problems(method: str | None, target: str | None, backbone: str | None,
                       overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(not built, invalid) pieces a row names, from the registries and conf/ at run time."""
    missing, invalid = [], []
    if method is not None and method not in METHODS:
        missing.append(f"method {method!r} is not in the methods registry (built: {', '.join(METHODS)})")
    if target is not None and not (CONF / "benchmark" / f"{target}.yaml").is_file():
        missing.append(f"target {target!r} is not built (no conf/benchmark/{target}.yaml)")
    if backbone is not None and not (CONF / "backbone" / f"{backbone}.yaml").is_file():
        invalid.append(f"backbone {backbone!r} has no conf/backbone/{backbone}.yaml")
    strategy = choice(overrides, "consolidation")
    if strategy is not None and strategy not in STRATEGIES:
        missing.append(f"consolidation strategy {strategy!r} is not in the registry (built: {', '.join(STRATEGIES)})")
    return missing, invalid


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    m = re.match(r"Could not override '([^']+)'\. To append to your config use \+\S+", text)
    if m:  # Hydra's wording for a key the schema does not have
        return f"no config key {m.group(1)}"
    for cut in (" Config search path:", " Available options in"):  # Hydra's long tails
        text = text.split(cut, 1)[0]
    return text


def plan(spec: Spec, user_overrides: Sequence[str] = (), log_rows: bool = False) -> Plan:
    """Every row's job overrides, composed and checked (registries, composition, :func:`validate`) before any
    work. Rows that compose alike are composed once (a table's rows mostly differ in ``eval.methods`` only)."""
    from omegaconf import open_dict


    hydra_ov = [o for o in user_overrides if is_hydra_override(o)]
    user = [o for o in user_overrides if not is_hydra_override(o)]
    base = merge_overrides([f"experiment={spec.experiment}"], user)
    with Composer() as composer:
        base_cfg = composer.compose(base)  # the spec's preset at the chosen scale: how targets and backbones map
        scale = str(base_cfg.scale.name)
        targets = dict(base_cfg.scale.targets)
        rows: list[PlannedRow] = []
        composed_by: dict[tuple[str, ...], Any] = {}
        # a user's own experiment preset (experiment=micro) is a world of its own: its target and backbone are the
        # rows', not the spec's (which would override the preset's)
        own_world = choice(user, "experiment") not in (None, spec.experiment)
        for row in spec.rows:
            target = targets.get(spec.target, spec.target) if spec.target and not own_world else None
            backbone = None if own_world else base_cfg.scale.backbone or row.backbone
            own = [*([f"benchmark={target}"] if target else []), *([f"backbone={backbone}"] if backbone else []),
                   *row.overrides, f"stages=[{','.join(spec.stages)}]"]
            if not log_rows:
                own.append("logger=none")  # the table has one W&B run; --log-rows keeps each row's own
            overrides = merge_overrides(base, own, user)  # the user's overrides win over the spec's
            # what the row will actually run (the user's target or backbone win too)
            missing, invalid = _registry_problems(row.method, choice(overrides, "benchmark"),
                                                  choice(overrides, "backbone"), overrides)
            if missing or invalid:
                rows.append(PlannedRow(row, [], "; ".join(invalid + missing)))
                continue
            key = tuple(overrides)
            if key not in composed_by:
                try:
                    composed_by[key] = composer.compose(overrides)
                except Exception as e:  # noqa: BLE001 -- Hydra's composition errors: an override not built
                    composed_by[key] = e
            composed = composed_by[key]
            if isinstance(composed, Exception):
                rows.append(PlannedRow(row, [], f"not composable: {_one_line(composed)}"))
                continue
            method_ov = [f"eval.methods=[{row.method}]"] if row.method else []
            job = merge_overrides(base, own, method_ov, user)
            cfg = composed.copy()
            if method_ov and choice(user, "eval.methods") is None:
                with open_dict(cfg):
                    cfg.eval.methods = [row.method]
            try:
                validate(cfg)
            except ConfigError as e:
                rows.append(PlannedRow(row, [], f"config refused: {_one_line(e)}"))
                continue
            rows.append(PlannedRow(row, job, cfg=cfg))
    return Plan(spec, scale, base, hydra_ov, rows, base_cfg)


class Composer:
    """Hydra's compose API over ``conf/`` (the config the app composes), initialized once for many rows; inside a
    running Hydra app or an initialized context it uses that one."""

    def __enter__(self) -> Composer:
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra


        register_configs()
        self._context = None
        if not GlobalHydra.instance().is_initialized():
            self._context = initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="tracekit")
            self._context.__enter__()
        return self

    _composed: dict[tuple[str, ...], Any] = {}  # per process: specs share most rows' settings

    def compose(self, overrides: Sequence[str]) -> Any:
        from hydra import compose

        key = tuple(overrides)
        if key not in self._composed:
            self._composed[key] = compose(config_name="config", overrides=list(overrides))
        return self._composed[key].copy()

    def __exit__(self, *exc: Any) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)


def row_name(plan_: Plan, row: Row) -> str:
    """A row's label, with its block when the table has several."""
    blocks = len({p.row.block for p in plan_.rows}) > 1
    return f"{row.block_label}/{row.label}" if blocks and row.block_label else row.label


def blocked_line(plan_: Plan) -> str:
    """One line naming every row that cannot run, grouped by why."""
    by_reason: dict[str, list[str]] = {}
    for p in plan_.blocked:
        by_reason.setdefault(p.problem or "", []).append(repr(row_name(plan_, p.row)))
    parts = [f"{reason}: {', '.join(rows)}" for reason, rows in by_reason.items()]
    n, total = len(plan_.blocked), len(plan_.rows)
    return (f"{plan_.spec.id}: {n} of {total} rows cannot run: " + "; ".join(parts)
            + (f" (add --partial to run the other {len(plan_.runnable)} and show these as not run)"
               if plan_.runnable else ""))
