"""The paper's setting, value by value, and what a run cuts relative to it.

A run states its preset and every value that differs from the paper's in its first log line, its
``summary.md`` and its W&B config (:func:`setting_line`), so a cut run can never pass for a paper run.
Two kinds of reference values:

- **stated** by the paper (sec. 3.3-4.1, App. A-D, G): the target's full task set, the backbones, greedy
  decoding with seed 42 (or T=0.7 with 3 seeds), 50 steps, 32k context, the LLM analysis agent with 10
  labeling runs, delta 0.20 / rho 0.10, LLM-generated environments, GRPO lr 1e-5 up to 40 iterations at T=1.0
  with 5,120 rollouts over 4 capabilities (32 per iteration), LoRA at ~1.6 B parameters (rank 32 on
  Qwen3-30B-A3B), lambda_LB 0.05, top-1 routing.
- **full scale**: values the paper does not state, at tracekit's full-scale choice (``conf/scale/paper.yaml``);
  a cut of one is named as such ("the paper states none").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tracekit.pipeline import plain
from tracekit.targets.registry import target, target_of


PAPER_BACKBONES = ("qwen3_30b_a3b", "qwen3_6_27b")  # Qwen3-30B-A3B-Instruct-2507, Qwen3.6-27B (Table 1)

@dataclass(frozen=True)
class Reference:
    key: str  # a config key (or a derived quantity's name)
    paper: Any  # the paper's value (a tuple: any of these)
    stated: bool = True  # False: the paper states none; `paper` is tracekit's full-scale value
    source: str = ""
    get: Callable[[DictConfig], Any] | None = None  # how to read a derived quantity
    applies: Callable[[DictConfig], bool] | None = None  # only for some runs (tau^2's user simulator)

    def value(self, cfg: DictConfig) -> Any:
        if self.get is not None:
            return self.get(cfg)
        return plain(OmegaConf.select(cfg, self.key))

    def matches(self, value: Any) -> bool:
        return value in self.paper if isinstance(self.paper, tuple) else value == self.paper


def _eval_mode(cfg: DictConfig) -> str:
    """greedy (T=0, seed 42) and stochastic (T=0.7, 3 seeds) are the paper's two decodings (sec. 4.1, App. G)."""
    e = cfg.eval
    if e.temperature == 0:
        return "greedy, seed 42" if list(e.seeds) == [42] else f"greedy, seeds {list(e.seeds)}"
    if e.temperature == 0.7 and len(e.seeds) == 3:
        return "T=0.7, 3 seeds"
    return f"T={e.temperature:g}, {len(e.seeds)} seed(s)"


def _is_tau2(cfg: DictConfig) -> bool:
    """tau^2's LLM user simulator is the paper's for this run (the target says: tau^2 and its stand-ins)."""
    return target_of(cfg).paper_user_applies(cfg)


REFERENCES: tuple[Reference, ...] = (
    Reference("backbone.name", PAPER_BACKBONES, source="sec. 4.1, Table 1"),
    Reference("eval.decoding", ("greedy, seed 42", "T=0.7, 3 seeds"), source="sec. 4.1, App. G", get=_eval_mode),
    Reference("eval.max_steps", 50, source="sec. 4.1"),
    Reference("eval.context_budget", 32000, source="sec. 4.1"),
    Reference("user.kind", "llm", source="tau^2's LLM user simulator", applies=_is_tau2),
    Reference("agent.kind", "llm"),
    Reference("agent.constrained_tool_calls", False, source="free decoding"),
    Reference("agent.tool_choice", "auto", source="free decoding"),
    Reference("agent.copy_ids", False, source="free decoding"),
    Reference("analysis.discovery", "llm", source="sec. 3.3: the LLM analysis agent"),
    Reference("analysis.labeler", "llm", source="sec. 3.3"),
    Reference("thresholds.n", 10, source="sec. 4.3: 10 labeling runs"),
    Reference("thresholds.delta", 0.20, source="sec. 3.3"),
    Reference("thresholds.rho", 0.10, source="sec. 3.3"),
    Reference("thresholds.k", 8, source="sec. 4.3: tool-calling precision, kept, is selected in 8 of 10 runs"),
    Reference("synthesis.source", "generate", source="sec. 3.3: the LLM generation agent"),
    Reference("grpo.lr", 1e-5, source="sec. 4.1"),
    Reference("grpo.iterations", 40, source="sec. 4.1"),
    Reference("grpo.temperature", 1.0, source="sec. 4.1"),
    Reference("grpo.rollouts_per_iteration", 32, source="sec. 4.4: 5,120 rollouts / (4 capabilities x 40 iterations)",
              get=lambda c: c.grpo.groups * c.grpo.group_size),
    Reference("grpo.max_steps", 50, source="sec. 4.1"),
    Reference("grpo.max_prompt_tokens", 32000, source="sec. 4.1"),
    Reference("grpo.lora.rank", 32, source="App. D: ~1.6 B parameters per adapter on Qwen3-30B-A3B"),
    Reference("moe.lambda_lb", 0.05, source="sec. 4.1"),
    Reference("moe.top_k", 1, source="App. D: k=1"),
    # not stated by the paper: tracekit's full-scale values (conf/scale/paper.yaml)
    Reference("agent.max_new_tokens", 256, stated=False),
    Reference("grpo.max_new_tokens", 512, stated=False),
    Reference("grpo.num_minibatches", 4, stated=False),
    Reference("grpo.lora.alpha", 64, stated=False),
    Reference("synthesis.validation_seeds", 50, stated=False),
    Reference("moe.steps", 200, stated=False),
    Reference("moe.batch_size", 4, stated=False),
    Reference("moe.trajectories_per_capability", 32, stated=False),
    Reference("moe.gate_data", "successes", stated=False, source="the gate trains on successful rollouts"),
    Reference("consolidation.sft.epochs", 3, stated=False),
    Reference("consolidation.sft.data", "successes", stated=False, source="App. C: successful trajectories"),
    Reference("consolidation.distill.groups", 4, stated=False),
    Reference("consolidation.distill.samples_per_task", 8, stated=False),
)


@dataclass(frozen=True)
class Cut:
    key: str
    ours: Any
    paper: Any
    stated: bool

    def __str__(self) -> str:
        paper = " or ".join(map(_fmt, self.paper)) if isinstance(self.paper, tuple) else _fmt(self.paper)
        return (f"{self.key}={_fmt(self.ours)} (paper: {paper})" if self.stated
                else f"{self.key}={_fmt(self.ours)} (full scale: {paper}; the paper states none)")


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v).lower() if isinstance(v, bool) else "null"
    return f"{v:g}" if isinstance(v, float) else str(v)


def describe_target(b: DictConfig) -> str:
    """What the benchmark config runs: its name, and how many tasks of what (the target's
    :meth:`~tracekit.targets.base.Target.describe_tasks`)."""
    return target(b.kind).describe_tasks(b)


def target_cut(cfg: DictConfig) -> Cut | None:
    """The benchmark against the paper's task set of its target (``Target.paper_tasks_of``); None when it is the
    full set, or when the paper does not use the target (nothing to compare its tasks with)."""
    b = cfg.benchmark
    t = target(b.kind)
    full = t.paper_tasks_of(b)
    if full is None:
        return None
    if t.is_paper_tasks(b) and b.limit is None and not b.task_ids:
        return None
    return Cut("benchmark", t.describe_tasks(b), full, True)


def cuts(cfg: DictConfig) -> list[Cut]:
    """Every value of ``cfg`` that differs from the paper's (target first, then :data:`REFERENCES` in order)."""
    out = [c for c in [target_cut(cfg)] if c is not None]
    for ref in REFERENCES:
        if ref.applies is not None and not ref.applies(cfg):
            continue
        value = ref.value(cfg)
        if not ref.matches(value):
            out.append(Cut(ref.key, value, ref.paper, ref.stated))
    return out


def preset(cfg: DictConfig) -> dict[str, str]:
    """The experiment preset and scale profile of the running (or composed) config."""
    experiment = None
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            experiment = HydraConfig.get().runtime.choices.get("experiment")
    except Exception:  # noqa: BLE001 -- no Hydra runtime (compose API): fall back to the run name
        experiment = None
    return {"experiment": str(experiment or cfg.name), "scale": str(cfg.scale.name)}


def setting_line(cfg: DictConfig) -> str:
    """One line: the preset, then "the paper's setting (no cut)" or every cut, each with the paper's value."""
    p = preset(cfg)
    head = f"experiment={p['experiment']} scale={p['scale']}"
    found = cuts(cfg)
    if not found:
        return f"{head}: the paper's setting, no cut ({describe_target(cfg.benchmark)}, {cfg.backbone.name})"
    return f"{head}: CUT relative to the paper ({len(found)} values differ): " + "; ".join(map(str, found))


def setting_markdown(cfg: DictConfig) -> str:
    """The summary's section: the preset and a table of every cut."""
    p = preset(cfg)
    found = cuts(cfg)
    lines = [f"Preset: `experiment={p['experiment']}`, `scale={p['scale']}`.", ""]
    if not found:
        lines.append(f"**The paper's setting: no cut** ({describe_target(cfg.benchmark)}, {cfg.backbone.name}).")
        return "\n".join(lines)
    lines += [f"**Cut: {len(found)} values differ from the paper's.** A result of this run is not a paper number.",
              "", "| value | this run | paper |", "|---|---|---|"]
    for c in found:
        paper = " or ".join(map(_fmt, c.paper)) if isinstance(c.paper, tuple) else _fmt(c.paper)
        lines.append(f"| `{c.key}` | {_fmt(c.ours)} | {paper}{'' if c.stated else ' (full scale; not stated)'} |")
    return "\n".join(lines)


def cuts_dict(cfg: DictConfig) -> dict[str, Any]:
    """For W&B's run config: the preset, whether the run is cut, and each cut."""
    found = cuts(cfg)
    return {**preset(cfg), "cut": bool(found),
            "cuts": {c.key: {"ours": c.ours, "paper": list(c.paper) if isinstance(c.paper, tuple) else c.paper,
                             "stated": c.stated} for c in found}}
