"""The routing table at outcome-deciding tokens (issue 53's pre-registration, ``PREREG_issue53.md`` "Metrics"): for a
finished run whose consolidation is a LoRA-MoE (``consolidation=moe`` at any granularity and soft top-k, or
``consolidation=route``), which expert each block's gate picks where a micro-world episode's outcome is decided.

Post hoc, over the run's artifacts (``artifacts.json``): the compose stage's saved LoRA-MoE (gates, adapters and,
for ``route``, the task router) and the evaluation episodes of that row (the ``episodes`` artifact whose policy is
the composed model). Nothing is generated: each decision turn's prompt (the episode's messages before it, rendered
with the micro tools, checked against the token ids the rollout recorded for that turn) runs through the composed
model, and the routing is read as generation applied it.

Decision points, from the micro world's tool results in the transcript (the first of each kind per episode; the
decision turn is the first assistant turn after the tool result, none when the episode ended there):

- ``locked``: after a ``read`` that returned ``"locked": true`` (refuse, or write anyway);
- ``first_write_ok``: after the first ``write`` that returned ``ok``, in a request of several writes (go on, or stop);
- ``asked_read``: after the ``read`` of the item the user asked about (say the value, or not).

What is recorded at the decision turn, by the row's routing (:class:`tracekit.moe.model.MoEConfig`):

- ``token`` granularity: each block's gate probabilities at the turn prompt's last token, the position whose output
  is the turn's first generated token, and the weights the inference routing gives them (hard top-k: the kept
  probabilities; soft top-k: the kept ones renormalized, at the saved temperature);
- ``turn`` granularity: the turn's decision (:class:`tracekit.moe.routed.GateDecider`, as the routed client made it),
  pinned for every token and block of the turn, beside each block's own probabilities averaged over the turn's new
  prompt tokens (what the decision averaged);
- ``trajectory`` granularity: the episode's decision from its opening, the same for every turn;
- ``decider="task"`` (``route``): the task router's weights for the episode (no gate decides; one row per decision,
  block ``all``), and per episode in ``episode_weights.csv``.

Outputs (atomic): ``decisions.csv`` (one row per episode x decision point x block), ``episode_weights.csv``
(trajectory granularity and ``route``: one row per episode) and ``routing.md`` (per kind: the share per expert of the
(decision, block) pairs by decision point, all and split by whether the episode passed, and the mean weights).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tracekit.artifacts import Artifact, StageCache, atomic_write_text, read_json
from tracekit.llm.backbones import get_spec, load_backbone
from tracekit.llm.hf import padding_id
from tracekit.llm.tools import encode_prompt
from tracekit.methods.consolidate.base import read_consolidated
from tracekit.moe.gate import prompt_decisions
from tracekit.moe.layer import masked_topk_probs
from tracekit.moe.model import LoRAMoEModel
from tracekit.moe.routed import opening, turn_start
from tracekit.moe.task_router import load_task_router
from tracekit.rollout import read_trajectories
from tracekit.targets.micro.library import REPORT
from tracekit.targets.micro.target import MicroTarget
from tracekit.types import Message, Trajectory

DECISIONS = ("locked", "first_write_ok", "asked_read")
DECISIONS_CSV, EPISODES_CSV, ROUTING_MD = "decisions.csv", "episode_weights.csv", "routing.md"
ALL_BLOCKS = "all"  # the block column of a decision no gate made (the task router's)

# (saved backbone reference, device) -> (backbone, tokenizer): how the composed model's backbone is loaded
BackboneLoader = Callable[[dict[str, Any], str], tuple[Any, Any]]


class RoutingTableError(ValueError):
    """Bad input to the routing table (one line)."""


@dataclass(frozen=True)
class DecisionPoint:
    """Where an episode's outcome is decided: ``kind`` (one of :data:`DECISIONS`), the tool result's message index
    and the decision turn (its assistant message index and its ordinal among the episode's assistant turns)."""

    kind: str
    result_index: int
    message_index: int
    turn: int


@dataclass
class RoutedRow:
    """One composed row of a run: its label, saved LoRA-MoE directory and evaluation episodes."""

    label: str
    compose: Artifact
    moe_dir: Path
    episodes: list[Artifact] = field(default_factory=list)


# --------------------------------------------------------------------------------------------- decision points


def asked_items(params: dict[str, Any]) -> list[str]:
    """The items a micro instance's user asks the value of: ``asked`` of a write kind that also asks, the target of a
    pure question (a report kind without writes: no ``values``)."""
    if "asked" in params:
        return list(params["asked"])
    return list(params["targets"]) if REPORT in params["kinds"] and "values" not in params else []


def decision_points(messages: Sequence[Message], params: dict[str, Any]) -> list[DecisionPoint]:
    """The episode's decision points (module docstring) from its messages and its micro instance's ``params``: the
    first of each kind, in :data:`DECISIONS` order, each with the first assistant turn after its tool result."""
    calls = {c.id: c for m in messages if m.role == "assistant" for c in m.tool_calls}
    several_writes = len(params.get("values", [])) >= 2
    asked = set(asked_items(params))
    found: dict[str, int] = {}
    for i, m in enumerate(messages):
        if m.role != "tool" or m.error:
            continue
        call = calls.get(m.tool_call_id or "")
        name = call.name if call is not None else m.name
        result = _json(m.content)
        if name == "read" and isinstance(result, dict) and result.get("locked") is True:
            found.setdefault("locked", i)
        if name == "write" and several_writes and (m.content or "").strip().strip('"') == "ok":
            found.setdefault("first_write_ok", i)
        if name == "read" and call is not None and call.arguments.get("id") in asked and isinstance(result, dict):
            found.setdefault("asked_read", i)
    turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
    out = []
    for kind in DECISIONS:
        if kind not in found:
            continue
        after = [j for j in turns if j > found[kind]]
        if after:  # an episode that ended at the tool result decided nothing there
            out.append(DecisionPoint(kind, found[kind], after[0], turns.index(after[0])))
    return out


def _json(text: str | None) -> Any:
    try:
        return json.loads(text or "")
    except ValueError:
        return None


MicroEpisode = tuple[Trajectory, Any, list[dict[str, Any]]]  # (episode, its micro instance, its environment's tools)


def micro_episodes(trajectories: Sequence[Trajectory]) -> list[MicroEpisode]:
    """Each episode with its micro instance (regenerated from its environment, difficulty and seed) and its
    environment's tools, or one line naming the first episode that is not a micro-world one."""
    target, out = MicroTarget(), []
    for traj in trajectories:
        try:
            env = target.env_class(traj.env)(int(traj.info["difficulty"]))
            out.append((traj, env.generate(int(traj.info["seed"])), env.tools()))
        except (KeyError, ValueError, TypeError):
            raise RoutingTableError(f"episode {traj.uid} (environment {traj.env}) is not a micro-world episode: the "
                                    "routing table reads the micro world's tool results (micro_* environments, their "
                                    "difficulty and seed)") from None
    return out


# --------------------------------------------------------------------------------------------- routing at a decision


class DecisionRouter:
    """The routing of a composed model at decision turns, as its evaluation applied it (module docstring)."""

    def __init__(self, model: LoRAMoEModel, tokenizer: Any, moe_dir: Path | None = None):
        if model.router != "gate":
            raise RoutingTableError(f"the composed model routes by {model.router!r} (each projection by its adapters' "
                                    "prototypes): it has no block gate to tabulate")
        self.model, self.tokenizer = model, tokenizer
        self.pad_id = padding_id(tokenizer)
        self.config = model.moe_config
        self.slots = list(model.slot_names)
        self.router = (load_task_router(moe_dir, model, self.encode, tokenizer, self.pad_id)
                       if self.config.decider == "task" else None)

    def encode(self, messages: list[Any], tools: Any) -> list[int]:
        return encode_prompt(self.tokenizer, messages, tools)

    @property
    def describe(self) -> str:
        c = self.config
        if self.router is not None:
            return (f"the task router (one decision per episode, top-p {self.router.top_p:g} of its probabilities), "
                    f"slots {', '.join(self.slots)}")
        soft = f"soft top-{c.soft_top_k} (T={c.soft_temperature:g})" if c.soft_top_k else f"hard top-{c.top_k}"
        return f"granularity {c.granularity}, {soft}, slots {', '.join(self.slots)}"

    def episode_weights(self, messages: Sequence[Message], tools: Any) -> torch.Tensor:
        """The slot weights [S] of the episode's one decision (trajectory granularity or the task router)."""
        prompt = (opening(messages), tools)
        if self.router is not None:
            return self.router.decide([prompt])[0]
        return self._decide(self.encode(*prompt), 0)[0]

    def _decide(self, ids: list[int], start: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(the decision's slot weights [S], each block's probabilities averaged over ``ids[start:]``): the routed
        client's decision from one prompt (batch of one: no padding), and the per-block means it averaged."""
        weights = self.model.decide(prompt_decisions(self.model, [ids], [start], self.pad_id))[0]
        per_block = {b: p[start:].mean(0).cpu() for b, p in self.model.gate_probs().items()}  # that forward's gates
        return weights, per_block

    @torch.no_grad()
    def token_routing(self, ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{block: (gate probabilities [S], applied weights [S])} at the last token of ``ids`` under the inference
        routing (the position whose output is the next generated token)."""
        spec = self.model.inference_spec
        device = self.model.model.get_output_embeddings().weight.device
        with self.model.routing(spec):
            self.model.model.model(input_ids=torch.tensor([ids], device=device), use_cache=False)
        out = {}
        for b, p in self.model.gate_probs().items():
            probs = p[-1:].float().cpu()
            weights = probs if spec.top_k is None else masked_topk_probs(probs, spec.top_k, spec.renormalize)
            out[b] = (probs[0], weights[0])
        return out

    def at(self, messages: Sequence[Message], tools: Any, point: DecisionPoint,
           episode: torch.Tensor | None) -> list[tuple[str, torch.Tensor | None, torch.Tensor]]:
        """[(block, probabilities [S] or None, weights [S])] at the decision turn ``point``; ``episode``: the
        episode's decision where the granularity is ``trajectory`` (the same for every turn)."""
        before = list(messages[: point.message_index])
        if episode is not None:
            if self.router is not None:
                return [(ALL_BLOCKS, None, episode)]
            _, per_block = self._decide(self.encode(opening(messages), tools), 0)
            return [(str(b), p, episode) for b, p in sorted(per_block.items())]
        ids = self.encode(before, tools)
        if self.config.granularity == "turn":
            weights, per_block = self._decide(ids, turn_start(self.encode, before, tools, ids))
            return [(str(b), p, weights) for b, p in sorted(per_block.items())]
        return [(str(b), p, w) for b, (p, w) in sorted(self.token_routing(ids).items())]


def check_recorded_prompt(traj: Trajectory, point: DecisionPoint, ids: list[int]) -> None:
    """The decision turn's rendered prompt must be the one the rollout recorded (``info["turns"]``, one per assistant
    turn), else the tools, tokenizer or messages are not those of the evaluation: one line."""
    turns = traj.info.get("turns") or []
    if point.turn < len(turns) and list(turns[point.turn]["prompt_ids"]) != ids:
        raise RoutingTableError(f"episode {traj.uid}: turn {point.turn}'s prompt rendered with the micro tools "
                                f"({len(ids)} tokens) differs from the {len(turns[point.turn]['prompt_ids'])} tokens its "
                                "rollout recorded: the backbone's tokenizer or the tools are not the evaluation's")


# --------------------------------------------------------------------------------------------- rows and tables


def routing_rows(router: DecisionRouter, micro: Sequence[MicroEpisode], row: str = ""
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(decision rows: one per episode x decision point x block; episode rows: one per episode with its weights,
    trajectory granularity and the task router only) for the episodes ``micro`` (:func:`micro_episodes`) under
    ``router``."""
    decisions, episodes = [], []
    per_episode = router.config.granularity == "trajectory"
    for traj, instance, tools in micro:
        common = {"row": row, "kind": traj.env, "task_id": traj.task_id, "sample": traj.sample,
                  "passed": int(bool(traj.success))}
        episode = router.episode_weights(traj.messages, tools) if per_episode else None
        if episode is not None:
            episodes.append({**common, "expert": router.slots[int(episode.argmax())],
                             **{f"weight_{s}": round(float(w), 6) for s, w in zip(router.slots, episode)}})
        for point in decision_points(traj.messages, instance.params):
            check_recorded_prompt(traj, point, router.encode(list(traj.messages[: point.message_index]), tools))
            for block, probs, weights in router.at(traj.messages, tools, point, episode):
                decisions.append({
                    **common, "decision": point.kind, "turn": point.turn, "message_index": point.message_index,
                    "granularity": router.config.granularity, "block": block,
                    "expert": router.slots[int(weights.argmax())],
                    **{f"weight_{s}": round(float(w), 6) for s, w in zip(router.slots, weights)},
                    **{f"prob_{s}": "" if probs is None else round(float(p), 6)
                       for s, p in zip(router.slots, probs if probs is not None else weights)}})
    return decisions, episodes


def csv_text(rows: Sequence[dict[str, Any]]) -> str:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def _shares(rows: Sequence[dict[str, Any]], slots: Sequence[str]) -> str:
    if not rows:
        return "-"
    return " / ".join(f"{s} {100 * sum(r['expert'] == s for r in rows) / len(rows):.0f}%" for s in slots)


def _mean_weights(rows: Sequence[dict[str, Any]], slots: Sequence[str]) -> str:
    if not rows:
        return "-"
    return " / ".join(f"{s} {sum(float(r[f'weight_{s}']) for r in rows) / len(rows):.2f}" for s in slots)


def _episodes(rows: Sequence[dict[str, Any]]) -> set[tuple[str, str, int]]:
    return {(r["kind"], r["task_id"], r["sample"]) for r in rows}


def markdown(title: str, describe: str, slots: Sequence[str], decisions: Sequence[dict[str, Any]],
             episodes: Sequence[dict[str, Any]], n_episodes: int, source: str) -> str:
    """The routing table (module docstring) as markdown."""
    lines = [f"# Routing at outcome-deciding tokens: {title}", "",
             f"Routing: {describe}. Episodes: {n_episodes} ({source}); with a decision point: "
             f"{len(_episodes(decisions))}.", "",
             "Decision points: `locked` = the turn after a read that returned \"locked\": true (refuse or write); "
             "`first_write_ok` = the turn after the first write's ok in a several-write request (go on or stop); "
             "`asked_read` = the turn after the read of the item the user asked about (say the value or not). "
             "Expert shares are over (decision, block) pairs, each pair's expert being its largest weight.", ""]
    if decisions:
        lines += ["| kind | decision | episodes | passed | expert share | share, passed | share, failed | "
                  "mean weights |", "|---|---|---|---|---|---|---|---|"]
        for kind in sorted({r["kind"] for r in decisions}):
            for d in DECISIONS:
                rows = [r for r in decisions if r["kind"] == kind and r["decision"] == d]
                if not rows:
                    continue
                passed = [r for r in rows if r["passed"]]
                failed = [r for r in rows if not r["passed"]]
                lines.append(f"| {kind} | {d} | {len(_episodes(rows))} | {len(_episodes(passed))} | "
                             f"{_shares(rows, slots)} | {_shares(passed, slots)} | {_shares(failed, slots)} | "
                             f"{_mean_weights(rows, slots)} |")
    else:
        lines.append("No episode reached a decision point.")
    if episodes:
        lines += ["", "## The episode's weights (one decision per episode)", "",
                  "| kind | episodes | passed | mean weights | mean weights, passed | mean weights, failed |",
                  "|---|---|---|---|---|---|"]
        for kind in sorted({r["kind"] for r in episodes}):
            rows = [r for r in episodes if r["kind"] == kind]
            passed = [r for r in rows if r["passed"]]
            failed = [r for r in rows if not r["passed"]]
            lines.append(f"| {kind} | {len(rows)} | {len(passed)} | {_mean_weights(rows, slots)} | "
                         f"{_mean_weights(passed, slots)} | {_mean_weights(failed, slots)} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- a run's artifacts


def _lookup(run_dir: Path, entry: dict[str, Any]) -> Artifact:
    path = Path(entry["path"])
    found = StageCache(path.parents[1]).lookup(entry["stage"], entry["key"])
    if found is None:
        raise RoutingTableError(f"{run_dir}: its {entry['stage']} artifact {path} is missing or incomplete")
    return found


def routed_rows(run_dir: Path) -> list[RoutedRow]:
    """The run's composed LoRA-MoE rows and the evaluation episodes of each, or one line saying why there is none."""
    record = run_dir / "artifacts.json"
    if not record.is_file():
        raise RoutingTableError(f"{run_dir}: not a finished run directory (no artifacts.json)")
    entries = list(read_json(record).values())
    composes = [e for e in entries if e["stage"] == "compose"]
    if not composes:
        raise RoutingTableError(f"{run_dir}: the run has no compose artifact (the routing table reads the LoRA-MoE "
                                "that consolidation=moe or route composes; run the trace method first)")
    out = []
    for entry in composes:
        compose = _lookup(run_dir, entry)
        policy = read_consolidated(compose)
        if policy.policy.kind != "moe":
            raise RoutingTableError(f"{run_dir}: its consolidation row {policy.label!r} is a policy of kind "
                                    f"{policy.policy.kind!r}, not a LoRA-MoE: it has no routing to tabulate")
        identity = policy.policy.identity()
        row = RoutedRow(policy.label, compose, policy.policy.weights.path / policy.policy.subdir)
        for e in entries:
            if e["stage"] == "episodes":
                art = _lookup(run_dir, e)
                if read_json(art.path / "summary.json").get("policy") == identity:
                    row.episodes.append(art)
        if not row.episodes:
            raise RoutingTableError(f"{run_dir}: no evaluation episodes of the composed row {policy.label!r} (its "
                                    "evaluate stage has not run)")
        out.append(row)
    return out


def load_run_backbone(reference: dict[str, Any], device: str) -> tuple[Any, Any]:
    """The backbone a compose stage saved its reference of (``{"tracekit_backbone": ...}``), with its tokenizer."""
    if "tracekit_backbone" not in reference:
        raise RoutingTableError(f"the composed model's backbone reference {sorted(reference)} is not a tracekit "
                                "backbone (tracekit_backbone)")
    return load_backbone(get_spec(reference["tracekit_backbone"]), device)


def routing_table(run_dir: str | Path, out: str | Path | None = None, device: str = "cpu",
                  load: BackboneLoader = load_run_backbone) -> list[Path]:
    """Write the routing table of every composed row of the finished run ``run_dir`` into ``out`` (default
    ``<run_dir>/routing``; one sub-directory per row when the run has several); the markdown files written."""
    run_dir = Path(run_dir)
    rows = routed_rows(run_dir)
    out = run_dir / "routing" if out is None else Path(out)
    written = []
    for row in rows:
        target = out if len(rows) == 1 else out / row.compose.key
        micro = micro_episodes([t for art in row.episodes for t in read_trajectories(art.path)])  # before any model
        meta = read_json(row.moe_dir / "moe_config.json")
        backbone, tokenizer = load(meta["backbone"], device)
        model = LoRAMoEModel.load(row.moe_dir, backbone=backbone).eval()
        router = DecisionRouter(model, tokenizer, row.moe_dir)
        decisions, episodes = routing_rows(router, micro, row.label)
        source = ", ".join(f"episodes/{a.key}" for a in row.episodes)
        atomic_write_text(target / DECISIONS_CSV, csv_text(decisions))
        if episodes:
            atomic_write_text(target / EPISODES_CSV, csv_text(episodes))
        atomic_write_text(target / ROUTING_MD, markdown(f"{row.label} (compose/{row.compose.key})", router.describe,
                                                        router.slots, decisions, episodes, len(micro), source))
        written.append(target / ROUTING_MD)
    return written
