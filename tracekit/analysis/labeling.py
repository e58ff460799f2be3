"""Labeling phase (paper section 3.3): NA / PRESENT / LACKING per (trajectory, capability, run).

The LLM labeler asks the analysis agent about one trajectory and a group of capabilities per call
(the whole dictionary by default), for N runs with distinct seeds and temperature > 0 so that runs
are independent samples. Requests go to ``client.chat`` in chunks (remote clients run a chunk
concurrently). Every reply is validated: JSON, the ``{"labels": [...]}`` schema, known and
requested capability names, label values. Valid entries are kept; the rest are asked again with the
errors appended, up to ``max_attempts`` calls; what is still missing is recorded as
``Label.value=None`` (never guessed) and counted. ``on_missing="fail"`` stops instead.

Each finished (trajectory, run, capability group) is appended to ``labels.cache.jsonl`` in the work
dir (one fsynced line, keyed also by dictionary hash and prompt sha), so an interrupted labeling
resumes with exactly the unfinished requests.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError
from tqdm import tqdm

from tracekit.analysis.compact import CompactConfig, compact_trajectory, token_counter
from tracekit.analysis.discovery import dictionary_hash
from tracekit.analysis.llmjson import extract_json, load_prompt, reply_text, response_format, short_error, strict_object
from tracekit.artifacts import JsonlAppender, iter_jsonl
from tracekit.llm.base import ChatClient, ChatRequest
from tracekit.ranges import check_choice
from tracekit.types import Capability, Label, LabelValue, Message, Trajectory, stable_hash

log = logging.getLogger(__name__)

CACHE_FILE = "labels.cache.jsonl"


class LabelingError(RuntimeError):
    """A label could not be obtained and ``on_missing="fail"`` (one clear line)."""


ON_MISSING = ("skip", "fail")  # a label the labeler cannot give: recorded as missing, or the stage fails

@dataclass
class LabelingResult:
    """All labels (sorted by run, trajectory, capability) and the labeling report."""

    labels: list[Label]
    report: dict[str, Any]


class Labeler(Protocol):
    """Anything that labels trajectories against a fixed dictionary for given run indices."""

    name: str

    def label_runs(
        self,
        trajectories: list[Trajectory],
        dictionary: list[Capability],
        runs: Sequence[int],
        seed: int,
        work_dir: Path,
    ) -> LabelingResult: ...


@dataclass(frozen=True)
class LabelingConfig:
    """LLM labeling settings (the number of runs and the base seed are stage arguments).

    ``capabilities_per_call``: 0 = the whole dictionary in one call per trajectory and run. These defaults are the
    ``analysis`` group's (:class:`tracekit.analysis.settings.AnalysisSettings` takes them from here).
    ``chunk_size``: requests handed to ``client.chat`` at once (the unit of concurrency and of
    checkpointing). ``on_missing``: ``skip`` records unobtainable labels as missing and goes on;
    ``fail`` raises :class:`LabelingError`. ``show_outcome``: tell the labeler whether the episode
    succeeded (the paper's analysis agent contrasts outcomes; turn off to label outcome-blind).
    """

    temperature: float = 0.7
    top_p: float = 1.0
    capabilities_per_call: int = 10  # the paper's (the analysis group's default)
    max_attempts: int = 3
    max_new_tokens: int = 1024
    chunk_size: int = 16
    on_missing: str = "skip"  # one of ON_MISSING
    show_outcome: bool = True
    prompt: str = "labeling_v1"
    compact: CompactConfig = field(default_factory=CompactConfig)
    use_response_format: bool = True

    def __post_init__(self) -> None:
        check_choice("labeling.on_missing", self.on_missing, ON_MISSING)
        if self.max_attempts < 1 or self.chunk_size < 1 or self.capabilities_per_call < 0:
            raise ValueError("labeling.max_attempts and chunk_size must be >= 1, capabilities_per_call >= 0")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"labeling.temperature must be in [0, 2], got {self.temperature}")


class LabelItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    capability: str
    label: str
    rationale: str = ""


class LabelReply(BaseModel):
    """Schema of a labeling reply: ``{"labels": [{"capability", "label", "rationale"}, ...]}``."""

    model_config = ConfigDict(extra="ignore")
    labels: list[dict[str, Any]]


class LabelRecord(BaseModel):
    """One cached (trajectory, run, capability group) result: the unit of resume."""

    dictionary: str
    prompt: str
    trajectory: str
    run: int
    capabilities: list[str]
    labels: list[Label]
    attempts: int
    errors: list[str]


def parse_label_reply(
    text: str, requested: Sequence[str], known: set[str]
) -> tuple[dict[str, tuple[LabelValue, str]], list[tuple[str, str]]]:
    """Validate one reply against the requested capabilities.

    Returns (accepted labels {capability: (value, rationale)}, errors [(kind, message)]) where
    kind is one of not_json, schema, unknown_capability, not_requested, invalid_label,
    conflicting, missing. Label values are matched case-insensitively; nothing is inferred.
    """
    try:
        obj = extract_json(text)
    except ValueError as e:
        return {}, [("not_json", str(e))]
    try:
        items = LabelReply.model_validate(obj).labels
    except ValidationError as e:
        return {}, [("schema", f'wrong schema (need {{"labels": [...]}}): {short_error(e, 300)}')]
    accepted: dict[str, tuple[LabelValue, str]] = {}
    errors: list[tuple[str, str]] = []
    wanted = set(requested)
    for raw in items:
        try:
            item = LabelItem.model_validate(raw)
        except ValidationError as e:
            errors.append(("schema", f"entry {short_error(raw, 120)} is malformed: {short_error(e, 200)}"))
            continue
        name = item.capability.strip()
        if name not in known:
            errors.append(("unknown_capability", f"unknown capability {name!r}"))
            continue
        if name not in wanted:
            errors.append(("not_requested", f"capability {name!r} was not asked for in this request"))
            continue
        value = item.label.strip().upper()
        if value not in LabelValue.__members__:
            errors.append(("invalid_label", f"label {item.label!r} for {name!r} is not NA, PRESENT or LACKING"))
            continue
        rationale = " ".join(item.rationale.split())[:300]
        if name in accepted and accepted[name][0] != LabelValue(value):
            errors.append(("conflicting", f"capability {name!r} got two different labels"))
            del accepted[name]
            wanted.discard(name)  # a conflicting capability is asked again, not accepted
            continue
        accepted[name] = (LabelValue(value), rationale)
    missing = [c for c in requested if c not in accepted]
    if missing:
        errors.append(("missing", f"no valid label for: {', '.join(missing)}"))
    return accepted, errors


def label_schema(names: Sequence[str]) -> dict[str, Any]:
    """The reply schema for labeling ``names``: one entry each, known names and values only.

    Constrained decoders (vLLM, OpenAI structured outputs, the hf client's grammar) then cannot
    produce an unknown capability or label; the count is fixed but not the order, so a reply may
    still repeat one name and miss another, which validation catches.
    """
    item = strict_object(
        {
            "capability": {"type": "string", "enum": list(names)},
            "label": {"type": "string", "enum": [v.value for v in LabelValue]},
            "rationale": {"type": "string", "maxLength": 200},
        }
    )
    return strict_object({"labels": {"type": "array", "items": item, "minItems": len(names), "maxItems": len(names)}})


def request_seed(seed: int, run: int, uid: str, group: int, attempt: int) -> int:
    """Distinct, reproducible sampling seed per (run, trajectory, group, attempt)."""
    return int(stable_hash([seed, run, uid, group, attempt], 8), 16) % (2**31)


def capability_groups(dictionary: list[Capability], per_call: int) -> list[list[Capability]]:
    """The dictionary split into consecutive groups of ``per_call`` (0 = one group)."""
    if per_call <= 0 or per_call >= len(dictionary):
        return [list(dictionary)]
    return [dictionary[i : i + per_call] for i in range(0, len(dictionary), per_call)]


@dataclass
class _Pending:
    """An in-flight request: its conversation and the capabilities still unlabeled."""

    traj: Trajectory
    run: int
    group: int
    caps: list[str]
    messages: list[Message]
    accepted: dict[str, tuple[LabelValue, str]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    attempts: int = 0

    @property
    def remaining(self) -> list[str]:
        return [c for c in self.caps if c not in self.accepted]


class LLMLabeler:
    """Labels with an analysis agent (any :class:`ChatClient`); see the module docstring."""

    name = "llm"

    def __init__(self, client: ChatClient, cfg: LabelingConfig | None = None):
        self.client = client
        self.cfg = cfg or LabelingConfig()

    def _prompt(self, template: Any, transcript: str, group: list[Capability], traj: Trajectory) -> str:
        caps = "\n".join(f"- {c.name}: {c.description}" for c in group)
        note = (
            f"; the episode {'SUCCEEDED' if traj.success else 'FAILED'} (its header says so)"
            if self.cfg.show_outcome
            else ""
        )
        return template.substitute(
            outcome_note=note,
            capabilities=caps,
            n_caps=len(group),
            names=", ".join(c.name for c in group),
            trajectory=transcript,
        )

    def label_runs(
        self,
        trajectories: list[Trajectory],
        dictionary: list[Capability],
        runs: Sequence[int],
        seed: int,
        work_dir: Path,
    ) -> LabelingResult:
        """Label every (trajectory, capability) for each run in ``runs``, resuming from the cache."""
        cfg = self.cfg
        if len(runs) > 1 and cfg.temperature <= 0:
            raise ValueError(
                f"labeling.temperature must be > 0 for {len(runs)} runs (greedy runs would be identical)"
            )
        uids = [t.uid for t in trajectories]
        if len(set(uids)) != len(uids):
            raise ValueError("labeling: trajectory uids (env/task/sample) are not unique")
        t0 = time.time()
        template, sha = load_prompt(cfg.prompt)
        dict_key = dictionary_hash(dictionary)
        known = {c.name for c in dictionary}
        groups = capability_groups(dictionary, cfg.capabilities_per_call)
        cache_path = Path(work_dir) / CACHE_FILE

        done: dict[tuple[str, int, tuple[str, ...]], LabelRecord] = {}
        if cache_path.exists():
            for rec in iter_jsonl(cache_path, LabelRecord):
                if rec.dictionary == dict_key and rec.prompt == sha:
                    done[(rec.trajectory, rec.run, tuple(rec.capabilities))] = rec
        todo = [
            (t, r, gi)
            for r in runs
            for t in trajectories
            for gi, g in enumerate(groups)
            if (t.uid, r, tuple(c.name for c in g)) not in done
        ]
        resumed = len(runs) * len(trajectories) * len(groups) - len(todo)
        if resumed:
            log.info("labeling: resuming, %d of %d requests cached", resumed, resumed + len(todo))

        count = token_counter(self.client) if cfg.compact.max_tokens else None
        transcripts: dict[str, str] = {}
        error_kinds: Counter[str] = Counter()
        attempts_hist: Counter[int] = Counter()
        with JsonlAppender(cache_path) as sink, tqdm(total=len(todo), desc="labeling", unit="req") as bar:
            for start in range(0, len(todo), cfg.chunk_size):
                chunk = []
                for t, r, gi in todo[start : start + cfg.chunk_size]:
                    if t.uid not in transcripts:
                        transcripts[t.uid] = compact_trajectory(t, cfg.compact, count)
                    prompt = self._prompt(template, transcripts[t.uid], groups[gi], t)
                    chunk.append(_Pending(t, r, gi, [c.name for c in groups[gi]], [Message(role="user", content=prompt)]))
                self._run_chunk(chunk, known, seed, error_kinds)
                for p in chunk:
                    rec = LabelRecord(
                        dictionary=dict_key,
                        prompt=sha,
                        trajectory=p.traj.uid,
                        run=p.run,
                        capabilities=p.caps,
                        labels=[self._make_label(p, c) for c in p.caps],
                        attempts=p.attempts,
                        errors=p.errors,
                    )
                    sink.append(rec)
                    done[(rec.trajectory, rec.run, tuple(rec.capabilities))] = rec
                    attempts_hist[p.attempts] += 1
                bar.update(len(chunk))
                if cfg.on_missing == "fail":  # stop at the first chunk with a gap (its rows are cached)
                    _raise_if_missing([lab for p in chunk for lab in done[(p.traj.uid, p.run, tuple(p.caps))].labels])

        labels = [
            lab
            for r in runs
            for t in trajectories
            for g in groups
            for lab in done[(t.uid, r, tuple(c.name for c in g))].labels
        ]
        if cfg.on_missing == "fail":  # gaps recorded by an earlier, interrupted run of this work dir
            _raise_if_missing(labels)
        report = labeling_report(labels, dictionary)
        report.update(
            labeler=self.name,
            prompt=cfg.prompt,
            prompt_sha=sha,
            dictionary_hash=dict_key,
            requests_resumed=resumed,
            requests_sent=len(todo),
            attempts_histogram={str(k): v for k, v in sorted(attempts_hist.items())},
            error_kinds=dict(sorted(error_kinds.items())),
            seconds=round(time.time() - t0, 3),
        )
        if report["missing"]:
            log.warning("labeling: %d of %d labels missing (recorded, not guessed)", report["missing"], len(labels))
        return LabelingResult(labels, report)

    def _run_chunk(
        self,
        chunk: list[_Pending],
        known: set[str],
        seed: int,
        error_kinds: Counter[str],
    ) -> None:
        """Ask, validate and re-ask (with the errors appended) until each request is done or out of attempts."""
        cfg = self.cfg
        active = list(chunk)
        while active:
            reqs = [
                ChatRequest(
                    messages=list(p.messages),
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    max_new_tokens=cfg.max_new_tokens,
                    seed=request_seed(seed, p.run, p.traj.uid, p.group, p.attempts),
                    response_format=response_format(label_schema(p.remaining), "capability_labels")
                    if cfg.use_response_format
                    else None,
                )
                for p in active
            ]
            responses = self.client.chat(reqs)
            if len(responses) != len(reqs):
                raise RuntimeError(f"chat client returned {len(responses)} responses for {len(reqs)} requests")
            still = []
            for p, resp in zip(active, responses):
                p.attempts += 1
                remaining = p.remaining
                if resp.finish_reason == "error":
                    accepted, errors = {}, [("endpoint_error", f"endpoint error: {resp.text[:200]}")]
                else:
                    accepted, errors = parse_label_reply(reply_text(resp), remaining, known)
                p.accepted.update(accepted)
                error_kinds.update(kind for kind, _ in errors)
                if errors:
                    p.errors.append(f"attempt {p.attempts}: " + "; ".join(msg for _, msg in errors))
                if p.remaining and p.attempts < cfg.max_attempts:
                    p.messages += [
                        Message(role="assistant", content=reply_text(resp)),
                        Message(
                            role="user",
                            content="Your answer had problems: "
                            + "; ".join(msg for _, msg in errors)
                            + f"\nAnswer again with ONE JSON object "
                            f'{{"labels": [{{"capability": ..., "label": "NA" | "PRESENT" | "LACKING", '
                            f'"rationale": ...}}]}} for exactly these capabilities: {", ".join(p.remaining)}.',
                        ),
                    ]
                    still.append(p)
            active = still

    @staticmethod
    def _make_label(p: _Pending, cap: str) -> Label:
        if cap in p.accepted:
            value, rationale = p.accepted[cap]
            return Label(
                trajectory=p.traj.uid, capability=cap, run=p.run, value=value, rationale=rationale, success=p.traj.success
            )
        last = p.errors[-1] if p.errors else "no reply"
        return Label(
            trajectory=p.traj.uid,
            capability=cap,
            run=p.run,
            value=None,
            rationale=f"missing after {p.attempts} attempts: {last}"[:300],
            success=p.traj.success,
        )


def _raise_if_missing(labels: list[Label]) -> None:
    gaps = [lab for lab in labels if lab.value is None]
    if gaps:
        g = gaps[0]
        raise LabelingError(
            f"labeling: no valid label for {g.capability!r} on {g.trajectory} run {g.run} ({len(gaps)} missing; "
            f"{g.rationale}); set on_missing=skip to record unobtainable labels as missing"
        )


def labeling_report(labels: list[Label], dictionary: list[Capability]) -> dict[str, Any]:
    """Counts of a label table: per value, missing per capability and per run."""
    values = Counter(lab.value.value if lab.value else "missing" for lab in labels)
    miss_cap = Counter(lab.capability for lab in labels if lab.value is None)
    miss_run = Counter(lab.run for lab in labels if lab.value is None)
    return {
        "labels": len(labels),
        "capabilities": [c.name for c in dictionary],
        "trajectories": len({lab.trajectory for lab in labels}),
        "runs": sorted({lab.run for lab in labels}),
        "values": dict(sorted(values.items())),
        "missing": values.get("missing", 0),
        "missing_by_capability": {c.name: miss_cap.get(c.name, 0) for c in dictionary},
        "missing_by_run": {str(r): n for r, n in sorted(miss_run.items())},
    }
