"""ToolSandbox (``benchmark.kind=toolsandbox``, paper App. B, Tables 3, 7, 8): the real apple/ToolSandbox behind
its environment server (:mod:`tracekit.envs.toolsandbox`), scored by its own evaluator. A trajectory's reward is
its similarity in [0, 1], success is similarity 1.0; the metrics are the mean similarity and the perfect rate
(App. F, eqs. 3-4) over the 129 base scenarios (``benchmark.domains: [base]``), the named variants as further
domains (columns), and a per-category breakdown (ToolSandbox's scenario categories).

Training split: ToolSandbox has none, and the paper's in-domain rows (Table 8's bottom block, Figure 5) name
none. The baselines that learn from the target train on ``benchmark.train_domains``: named variants of the
scenarios (default ``3_distraction_tools``: each scenario with three distraction tools added), never an evaluated
domain. They are the evaluated tasks with another tool set, so such a row measures in-domain training, as the
paper's does, not generalization to unseen tasks."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from omegaconf import DictConfig

from tracekit.config import ConfigError, _check
from tracekit.envs.toolsandbox import DOMAINS, ToolSandboxOracle, ToolSandboxSuite, missing_environment
from tracekit.evaluate import BUDGET_COLUMNS, mean_ci, split_runs, summarize
from tracekit.targets.base import ClientFor, Target
from tracekit.targets.toolsandbox_labels import ToolSandboxReferenceLabeler, reference_dictionary


class ToolSandboxTarget(Target):
    kind = "toolsandbox"
    summary = "apple/ToolSandbox 165848b (its scenarios, execution context, user simulator and evaluator)"
    metric = "similarity"
    columns = ("perfect", "mean_similarity")

    def validate(self, cfg: DictConfig) -> None:
        b = cfg.benchmark
        _check(len(b.domains) > 0 and all(d in DOMAINS for d in b.domains), "benchmark.domains", list(b.domains),
               f"a non-empty list of ToolSandbox domains ({', '.join(DOMAINS)}) with benchmark.kind=toolsandbox")
        _check(b.split == "base", "benchmark.split", b.split, "base with benchmark.kind=toolsandbox (ToolSandbox has "
               "no train/test split)")
        _check(all(d in DOMAINS and d != "base" for d in b.train_domains), "benchmark.train_domains",
               list(b.train_domains), f"ToolSandbox variant domains ({', '.join(DOMAINS[1:])})")
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
                                limit=b.limit, user=self.user_spec(cfg))

    def training_split_problem(self, cfg: DictConfig) -> str | None:
        b = cfg.benchmark
        if not b.train_domains:
            return ("ToolSandbox has no train/test split: name the scenario variants to train on, e.g. "
                    "benchmark.train_domains=[3_distraction_tools]")
        evaluated = sorted(set(b.train_domains) & set(b.domains))
        return f"benchmark.train_domains {evaluated} are evaluated (benchmark.domains)" if evaluated else None

    def train_split_label(self, spec: dict[str, Any]) -> str:
        return f"ToolSandbox variants {', '.join(spec['benchmark']['train_domains'])} (the evaluated scenarios, other tools)"

    def train_suite(self, cfg: DictConfig, spec: dict[str, Any], cache_dir: str | None, client_for: ClientFor,
                    seed_offset: int) -> Any:
        b = cfg.benchmark
        return ToolSandboxSuite(name=f"{b.name}-train", domains=list(b.train_domains), limit=spec.get("limit"),
                                user=self.user_spec(cfg))

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
