"""ToolSandbox (``benchmark.kind=toolsandbox``, paper App. B, Tables 3, 7, 8): the real apple/ToolSandbox behind
its environment server (:mod:`tracekit.targets.toolsandbox.suite`), scored by its own evaluator. A trajectory's reward is
its similarity in [0, 1], success is similarity 1.0; the metrics are the mean similarity and the perfect rate
(App. F, eqs. 3-4) over the 129 base scenarios (``benchmark.domains: [base]``), the named variants as further
domains (columns), and a per-category breakdown (ToolSandbox's scenario categories).

Training split (``benchmark.toolsandbox.train_split``; ToolSandbox has none of its own, the target owns this one): the
baselines that learn from the target (GRPO on target, GEPA: Tables 3, 7, 8's bottom block, Figure 5) train on

- ``heldout`` (the default): a seeded split (``benchmark.toolsandbox.train_seed``) of the 129 base scenarios, stratified by
  ToolSandbox category (each stratum: the scenarios of one category set, split in half, the odd ones out
  rounded by the seed): the training half is never evaluated (every row's evaluation drops it, in every domain),
  so such a row measures generalization to unseen scenarios of the same kinds;
- ``eval``: the evaluated scenarios themselves (as the paper's in-domain rows appear to: they score out of 129),
  marked "trained on the evaluated scenarios" in the table.

Either is played in ``benchmark.toolsandbox.train_domains`` (default: the evaluated domains; e.g. ``[3_distraction_tools]``
trains on the same scenarios with three distraction tools added). The split is computed from a catalog of the
base scenarios (``data/toolsandbox_scenarios.json``, ``scripts/extract_toolsandbox_scenarios.py``), so it is
known at config time without ToolSandbox's environment; its name, seed and training scenarios are in the training
suite's spec (the cache key of what trains on it) and the split name and seed in the evaluation's (``benchmark``).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import DictConfig

from tracekit.config import ConfigError, _check
from tracekit.targets.toolsandbox.suite import DOMAINS, VARIANTS, ToolSandboxOracle, ToolSandboxSuite, base_name, missing_environment
from tracekit.evaluate import BUDGET_COLUMNS, mean_ci, split_runs, summarize
from tracekit.ranges import Choice
from tracekit.targets.base import ClientFor, Target
from tracekit.targets.toolsandbox.labels import ToolSandboxReferenceLabeler, reference_dictionary
from tracekit.types import stable_hash

CATALOG = Path(__file__).with_name("data") / "toolsandbox_scenarios.json"
BASE_CATEGORY = "NO_DISTRACTION_TOOLS"  # every base scenario's: no stratum of its own
TRAIN_SPLITS = {
    "heldout": "a seeded category-stratified half of the base scenarios, never evaluated",
    "eval": "the evaluated scenarios (trained on the evaluated scenarios)",
}
DEFAULT_TRAIN_SPLIT = "heldout"
HELDOUT_TRAIN_FRACTION = 0.5
EVAL_NOTE = "trained on the evaluated scenarios"


@cache
def catalog() -> tuple[dict[str, Any], ...]:
    """ToolSandbox's base scenarios: name, categories, the tools of it that call RapidAPI (the server's order)."""
    return tuple(json.loads(CATALOG.read_text())["scenarios"])


def stratum(row: dict[str, Any]) -> tuple[str, ...]:
    """A scenario's stratum: its ToolSandbox categories (the base scenarios' common one left out)."""
    return tuple(sorted(c for c in row["categories"] if c != BASE_CATEGORY))


def heldout_train_scenarios(seed: int, fraction: float = HELDOUT_TRAIN_FRACTION,
                            rows: tuple[dict[str, Any], ...] | None = None) -> list[str]:
    """The training scenarios of the ``heldout`` split (sorted names): in each stratum a seeded ``fraction``,
    rounded down, and the leftover scenarios (the total rounded to ``fraction`` of all) given to the strata with
    the largest remainders, ties broken by the seed. Deterministic in ``seed``; a stratum of one may go either way."""
    rows = catalog() if rows is None else rows
    strata: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for r in rows:
        strata[stratum(r)].append(r["name"])
    keys = sorted(strata)
    quota = {k: int(len(strata[k]) * fraction) for k in keys}
    extra = round(len(rows) * fraction) - sum(quota.values())
    tie = random.Random(int(stable_hash([seed, "toolsandbox-train-split", "strata"]), 16))
    order = sorted(keys, key=lambda k: (-(len(strata[k]) * fraction - quota[k]), tie.random()))
    for k in order[:max(0, extra)]:
        quota[k] += 1
    picked: list[str] = []
    for k in keys:
        names = sorted(strata[k])
        random.Random(int(stable_hash([seed, "toolsandbox-train-split", list(k)]), 16)).shuffle(names)
        picked += names[:quota[k]]
    return sorted(picked)


@dataclass
class ToolSandboxSettings:
    """``benchmark.toolsandbox``: the training split the target owns (ToolSandbox has none of its own)."""

    train_domains: list[str] = field(default_factory=list)  # the variants learned in ([]: the evaluated domains)
    train_split: str | None = None  # heldout | eval (None: heldout)
    train_seed: int | None = None  # the heldout split's seed (None: 0)

    RANGES: ClassVar[dict[str, str]] = {"train_seed": ">= 0"}
    CHOICES: ClassVar[dict[str, Choice]] = {"train_domains": VARIANTS, "train_split": tuple(TRAIN_SPLITS)}


def _own(b: DictConfig | dict[str, Any]) -> Any:
    """The ``toolsandbox`` settings of a benchmark node or of a training spec's benchmark."""
    return b["toolsandbox"]


def train_split_of(b: DictConfig | dict[str, Any]) -> str:
    return _own(b).get("train_split") or DEFAULT_TRAIN_SPLIT


def train_seed_of(b: DictConfig | dict[str, Any]) -> int:
    seed = _own(b).get("train_seed")
    return 0 if seed is None else int(seed)


def excluded_from_evaluation(b: DictConfig | dict[str, Any]) -> list[str]:
    """The base scenarios no row evaluates: the ``heldout`` split's training ones (none for ``eval``)."""
    return heldout_train_scenarios(train_seed_of(b)) if train_split_of(b) == "heldout" else []


class ToolSandboxTarget(Target):
    kind = "toolsandbox"
    summary = "apple/ToolSandbox 165848b (its scenarios, execution context, user simulator and evaluator)"
    metric = "similarity"
    columns = ("perfect", "mean_similarity")
    paper_tasks = "ToolSandbox: 129 base scenarios"
    settings = ToolSandboxSettings
    domains = DOMAINS

    def validate(self, cfg: DictConfig) -> None:
        b = cfg.benchmark
        _check(len(b.domains) > 0 and all(d in DOMAINS for d in b.domains), "benchmark.domains", list(b.domains),
               f"a non-empty list of ToolSandbox domains ({', '.join(DOMAINS)}) with benchmark.kind=toolsandbox")
        _check(b.split == "base", "benchmark.split", b.split, "base with benchmark.kind=toolsandbox (ToolSandbox has "
               "no train/test split; benchmark.toolsandbox.train_split picks the training scenarios)")
        _check(all(d in DOMAINS and d != "base" for d in _own(b).train_domains), "benchmark.toolsandbox.train_domains",
               list(_own(b).train_domains), f"ToolSandbox variant domains ({', '.join(DOMAINS[1:])}), or [] for the "
               "evaluated domains")
        split = train_split_of(b)
        _check(split in TRAIN_SPLITS, "benchmark.toolsandbox.train_split", _own(b).get("train_split"),
               f"one of {', '.join(TRAIN_SPLITS)} with benchmark.kind=toolsandbox")
        held = set(excluded_from_evaluation(b))
        chosen = [t for t in (b.task_ids or ()) if base_name(t) in held]
        _check(not chosen, "benchmark.task_ids", chosen, f"scenarios that are evaluated: these are training "
               f"scenarios of benchmark.toolsandbox.train_split=heldout (benchmark.toolsandbox.train_seed={train_seed_of(b)})")
        problem = self._no_scenarios(cfg)
        if problem:
            raise ConfigError(f"benchmark={b.name}: {problem}")
        if cfg.user.kind == "llm":
            ep = cfg.llm.endpoints.get(cfg.user.endpoint)
            _check(ep is None or ep.kind == "openai", f"llm.endpoints.{cfg.user.endpoint}.kind",
                   None if ep is None else ep.kind, "openai with benchmark.kind=toolsandbox and user=llm (ToolSandbox's "
                   "user simulator runs in its own environment and calls an OpenAI-compatible endpoint)")
        why = missing_environment()
        if why:
            raise ConfigError(f"benchmark={b.name}: {why}")

    def user_spec(self, cfg: DictConfig) -> dict[str, Any]:
        u = cfg.user
        if u.kind == "scripted":
            return {"kind": "scripted"}
        ep = cfg.llm.endpoints[u.endpoint]
        return {"kind": "llm", "base_url": ep.base_url, "model": ep.model, "api_key_env": ep.api_key_env,
                "temperature": u.temperature, "max_tokens": u.max_new_tokens, "timeout_s": ep.timeout_s,
                "max_retries": ep.max_retries}

    def build_suite(self, cfg: DictConfig, split: str | None, client_for: ClientFor) -> Any:
        if split not in (None, "base"):
            raise ValueError(f"ToolSandbox has no {split!r} split (its scenarios are one evaluation set)")
        b = cfg.benchmark
        return ToolSandboxSuite(name=b.name, domains=list(b.domains), task_ids=list(b.task_ids) if b.task_ids else None,
                                limit=b.limit, user=self.user_spec(cfg), exclude=excluded_from_evaluation(b) or None)

    def evaluated_scenarios(self, cfg: DictConfig) -> list[str]:
        """The base scenarios the evaluation plays (before RapidAPI skipping and ``limit``), from the catalog."""
        b = cfg.benchmark
        held = set(excluded_from_evaluation(b))
        chosen = {base_name(t) for t in b.task_ids} if b.task_ids else None
        return [r["name"] for r in catalog() if r["name"] not in held and (chosen is None or r["name"] in chosen)]

    def training_scenarios(self, cfg: DictConfig) -> list[str]:
        """The base scenarios the baselines that learn from the target train on (before RapidAPI skipping and
        ``limit``): the ``heldout`` split's training half, or, for ``eval``, the evaluated ones."""
        b = cfg.benchmark
        if train_split_of(b) == "heldout":
            return heldout_train_scenarios(train_seed_of(b))
        return self.evaluated_scenarios(cfg)

    def _no_scenarios(self, cfg: DictConfig) -> str | None:
        b = cfg.benchmark
        if not self.evaluated_scenarios(cfg):
            return "no scenario is left to evaluate (benchmark.task_ids, benchmark.toolsandbox.train_split)"
        if not self.training_scenarios(cfg):
            return f"benchmark.toolsandbox.train_split={train_split_of(b)} leaves no training scenario"
        return None

    def training_split_problem(self, cfg: DictConfig) -> str | None:
        b = cfg.benchmark
        if train_split_of(b) not in TRAIN_SPLITS:
            return f"benchmark.toolsandbox.train_split={_own(b).get('train_split')!r} is none of {', '.join(TRAIN_SPLITS)}"
        return self._no_scenarios(cfg)

    def train_spec(self, cfg: DictConfig, spec: dict[str, Any], n_per_env: int | None, limit: int | None) -> dict[str, Any]:
        """The split's name and seed (in ``spec['benchmark']``) and its training scenarios by name (``scenarios``);
        for ``eval`` also the evaluated selection (``task_ids``, the evaluation's ``limit``) it repeats."""
        b = cfg.benchmark
        own = {**spec["benchmark"]["toolsandbox"], "train_split": train_split_of(b), "train_seed": train_seed_of(b)}
        out = {**spec, "benchmark": {**spec["benchmark"], "toolsandbox": own}, "limit": limit,
               "scenarios": self.training_scenarios(cfg)}
        if own["train_split"] == "eval":
            out["evaluated"] = {"task_ids": list(b.task_ids) if b.task_ids else None, "limit": b.limit}
        return out

    def train_split_label(self, spec: dict[str, Any]) -> str:
        b = spec["benchmark"]
        n = len(spec.get("scenarios", ()))
        limit = min((x for x in (spec.get("limit"), (spec.get("evaluated") or {}).get("limit")) if x is not None),
                    default=None)
        where = ", ".join([*([f"first {limit} per domain"] if limit is not None else []),
                           *([f"in variants {', '.join(_own(b)['train_domains'])}"] if _own(b).get("train_domains") else [])])
        where = f"; {where}" if where else ""
        if _own(b).get("train_split") == "eval":
            return f"ToolSandbox's evaluated scenarios (train_split=eval: {n} base scenarios{where})"
        return (f"ToolSandbox heldout split (seed {_own(b).get('train_seed', 0)}: {n} base scenarios stratified by category, "
                f"never evaluated{where})")

    def train_split_notes(self, spec: dict[str, Any]) -> tuple[str, ...]:
        return (EVAL_NOTE,) if _own(spec["benchmark"]).get("train_split") == "eval" else ()

    def train_suite(self, cfg: DictConfig, spec: dict[str, Any], cache_dir: str | None, client_for: ClientFor,
                    seed_offset: int) -> Any:
        """The training scenarios in ``benchmark.toolsandbox.train_domains`` (default the evaluated domains). ``eval`` with the
        evaluated domains repeats the evaluation's selection exactly (task ids, its per-domain limit; then the
        training ``limit``)."""
        b = cfg.benchmark
        domains = list(_own(b).get("train_domains") or ()) or list(b.domains)
        limit = spec.get("limit")
        task_ids = None
        ev = spec.get("evaluated")
        if ev is not None:
            limit = min((n for n in (limit, ev["limit"]) if n is not None), default=None)
            if ev["task_ids"] and domains == list(b.domains):
                task_ids = ev["task_ids"]
        return ToolSandboxSuite(name=f"{b.name}-train", domains=domains, scenarios=list(spec["scenarios"]),
                                task_ids=task_ids, limit=limit, user=self.user_spec(cfg))

    def is_paper_tasks(self, b: DictConfig) -> bool:
        return list(b.domains) == ["base"] and train_split_of(b) == "eval"  # heldout keeps half of them out

    def describe_tasks(self, b: DictConfig) -> str:
        held = excluded_from_evaluation(b)
        split = (f"{len(held)} base scenarios held out for training (train_split=heldout, seed {train_seed_of(b)})"
                 if held else f"train_split={train_split_of(b)}")
        return f"{super().describe_tasks(b)[:-1]}, {split})"

    def synthesis_family(self, cfg: DictConfig) -> str:
        return "toolsandbox"

    def reference_dictionary(self) -> list[Any]:
        return reference_dictionary()

    def reference_labeler(self, noise: float) -> Any:
        return ToolSandboxReferenceLabeler(noise=noise)

    def gold_agent(self) -> Any:
        return ToolSandboxOracle()

    def summarize(self, trajectories: list[Any]) -> dict[str, Any]:
        """The standard summary (reward = similarity, solved = perfect) plus ``similarity``: mean similarity,
        perfect count and rate, per run and per ToolSandbox category (stochastic runs: mean +- Student-t CI)."""
        out = summarize(trajectories)
        runs = split_runs(trajectories)

        def block(ts: list[Any]) -> dict[str, Any]:
            n = len(ts)
            return {"scenarios": n, "mean_similarity": sum(t.reward for t in ts) / n, "perfect": sum(t.success for t in ts),
                    "perfect_rate": sum(t.success for t in ts) / n}

        per_run = {k: block(v) for k, v in runs.items()}
        cats: dict[str, list[Any]] = defaultdict(list)
        for t in trajectories:
            for c in t.info.get("categories", []):
                cats[c].append(t)
        sim = {**block(list(trajectories)), "runs": {str(k): v for k, v in per_run.items()},
               "categories": {c: block(ts) for c, ts in sorted(cats.items())}}
        if len(per_run) >= 2:
            for key in ("mean_similarity", "perfect_rate"):
                mean, half = mean_ci([r[key] for r in per_run.values()])
                sim[f"{key}_ci"] = {"mean": mean, "ci": half}
        out["similarity"] = sim
        return out

    def markdown_table(self, results: dict[str, Any]) -> str:
        budgets = any("budget" in r for r in results.values())
        header = ["Approach", "Scenarios", "Perfect", "Perfect (%)", "Mean Sim.", *(BUDGET_COLUMNS.values() if budgets else ())]
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        for name, r in results.items():
            s = r["similarity"]
            pr, ms = f"{100 * s['perfect_rate']:.1f}", f"{s['mean_similarity']:.3f}"
            if "perfect_rate_ci" in s and s["perfect_rate_ci"]["ci"] is not None:
                pr += f" ± {100 * s['perfect_rate_ci']['ci']:.1f}"
                ms += f" ± {s['mean_similarity_ci']['ci']:.3f}"
            row = [name, str(s["scenarios"]), str(s["perfect"]), pr, ms]
            if budgets:
                row += [f"{r['budget'][k]:,}" if "budget" in r else "–" for k in BUDGET_COLUMNS]
            lines.append("| " + " | ".join(row) + " |")
        cats = {c for r in results.values() for c in r["similarity"]["categories"]}
        if cats:
            lines += ["", "| Category | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
            for c in sorted(cats):
                cells = []
                for r in results.values():
                    b = r["similarity"]["categories"].get(c)
                    cells.append("–" if b is None else f"{b['mean_similarity']:.3f} ({b['perfect']}/{b['scenarios']})")
                lines.append(f"| {c} | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"
