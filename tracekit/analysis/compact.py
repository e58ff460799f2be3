"""Deterministic trajectory compaction for the analysis agent's prompts.

A trajectory becomes a plain-text transcript: outcome header, user turns, agent text, every tool
call with its JSON arguments, every tool result (head/tail truncated with an elision marker),
the final response. The system prompt (the environment policy, identical across trajectories)
is left out. To fit a budget the renderer first shrinks the per-field limits (tool results
before text), then elides whole messages from the middle of the conversation, keeping its
beginning and its end; the output is a pure function of (trajectory, config).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tracekit.types import Message, Trajectory

if TYPE_CHECKING:
    from tracekit.llm.base import ChatClient


@dataclass(frozen=True)
class CompactConfig:
    """Budgets for one compacted trajectory.

    ``max_chars`` bounds the whole transcript; ``max_tokens`` (with a token counter passed to
    :func:`compact_trajectory`) bounds it in tokens too. ``result_chars``/``text_chars``/
    ``args_chars`` are the starting per-field limits for tool results, message text and tool-call
    arguments; they are halved (down to ``min_field_chars``) until the transcript fits.
    """

    max_chars: int = 6000
    max_tokens: int | None = None
    result_chars: int = 600
    text_chars: int = 400
    args_chars: int = 300
    min_field_chars: int = 60

    def __post_init__(self) -> None:
        if self.max_chars < 200:
            raise ValueError(f"compact.max_chars must be >= 200, got {self.max_chars}")
        if min(self.result_chars, self.text_chars, self.args_chars) < self.min_field_chars:
            raise ValueError("compact field limits must be >= compact.min_field_chars")
        if self.min_field_chars < 40:
            raise ValueError(f"compact.min_field_chars must be >= 40, got {self.min_field_chars}")


def truncate_middle(text: str, limit: int) -> str:
    """``text`` if it fits in ``limit`` chars, else its head and tail around an elision marker.

    The result is at most ``limit`` chars; the head gets the larger half (openings of tool
    results carry ids and keys, tails carry totals and status).
    """
    if len(text) <= limit:
        return text
    marker = f" …[{len(text)} chars, middle elided]… "
    keep = limit - len(marker)
    if keep < 2:  # too small for head+tail: a bare head is the most informative
        return text[:limit]
    head = (keep + 1) // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _render_message(m: Message, text_chars: int, result_chars: int, args_chars: int) -> list[str]:
    if m.role == "system":
        return []
    if m.role == "user":
        return [f"USER: {truncate_middle(_one_line(m.content or ''), text_chars)}"]
    if m.role == "tool":
        tag = "ERROR " if m.error else ""
        name = m.name or "?"
        return [f"RESULT {name} {tag}-> {truncate_middle(_one_line(m.content or ''), result_chars)}"]
    lines = []
    if m.content and m.content.strip():
        lines.append(f"AGENT: {truncate_middle(_one_line(m.content), text_chars)}")
    if m.parse_error:
        lines.append(f"AGENT TOOL-CALL PARSE ERROR: {truncate_middle(_one_line(m.parse_error), text_chars)}")
    for c in m.tool_calls:
        args = json.dumps(c.arguments, sort_keys=True, ensure_ascii=False, default=str)
        lines.append(f"CALL {c.name}({truncate_middle(args, args_chars)})")
    return lines


def header(traj: Trajectory) -> str:
    outcome = "SUCCESS" if traj.success else "FAILURE"
    parts = [f"trajectory {traj.uid}", f"outcome {outcome}", f"reward {traj.reward:g}"]
    if traj.termination:
        parts.append(f"ended by {traj.termination}")
    if traj.error:
        parts.append(f"error {truncate_middle(_one_line(traj.error), 120)}")
    return "=== " + " | ".join(parts) + " ==="


def _render(traj: Trajectory, text_chars: int, result_chars: int, args_chars: int, elide: int) -> str:
    """Transcript with ``elide`` messages cut from the middle of the (non-system) conversation."""
    msgs = [m for m in traj.messages if m.role != "system"]
    blocks = [_render_message(m, text_chars, result_chars, args_chars) for m in msgs]
    if elide > 0:
        keep = len(blocks) - elide
        head = (keep + 1) // 2
        blocks = blocks[:head] + [[f"[… {elide} messages elided …]"]] + blocks[len(blocks) - (keep - head) :]
    return "\n".join([header(traj)] + [line for b in blocks for line in b])


def compact_trajectory(
    traj: Trajectory, cfg: CompactConfig, count_tokens: Callable[[str], int] | None = None
) -> str:
    """The trajectory as a transcript that fits ``cfg`` (chars, and tokens when a counter is given).

    Shrink order: tool-result limit, then text and argument limits (halving each down to
    ``cfg.min_field_chars``), then elide middle messages one at a time. If even the header and
    the two end messages do not fit, the transcript is cut to ``max_chars`` with a marker.
    """

    def fits(s: str) -> bool:
        if len(s) > cfg.max_chars:
            return False
        return count_tokens is None or cfg.max_tokens is None or count_tokens(s) <= cfg.max_tokens

    text, result, args = cfg.text_chars, cfg.result_chars, cfg.args_chars
    out = _render(traj, text, result, args, 0)
    while not fits(out) and (result > cfg.min_field_chars or text > cfg.min_field_chars or args > cfg.min_field_chars):
        if result > cfg.min_field_chars:
            result = max(cfg.min_field_chars, result // 2)
        else:
            text = max(cfg.min_field_chars, text // 2)
            args = max(cfg.min_field_chars, args // 2)
        out = _render(traj, text, result, args, 0)
    n = sum(1 for m in traj.messages if m.role != "system")
    elide = 0
    while not fits(out) and elide < n - 2:
        elide += 1
        out = _render(traj, text, result, args, elide)
    if not fits(out):
        out = truncate_middle(out, cfg.max_chars)
    return out


def compact_many(
    trajs: list[Trajectory],
    cfg: CompactConfig,
    total_chars: int,
    count_tokens: Callable[[str], int] | None = None,
    total_tokens: int | None = None,
) -> tuple[str, list[str]]:
    """Several trajectories in one prompt block of at most ``total_chars`` (and ``total_tokens``).

    Successes and failures alternate (failures first, in the given order) so both sides of the
    contrast are represented whatever the budget; each trajectory is compacted to ``cfg`` and
    added if it still fits, else skipped. Returns (block, uids included).
    """
    fails = [t for t in trajs if not t.success]
    wins = [t for t in trajs if t.success]
    order: list[Trajectory] = []
    for i in range(max(len(fails), len(wins))):
        order += [t[i] for t in (fails, wins) if i < len(t)]
    parts: list[str] = []
    used = used_tokens = 0
    included: list[str] = []
    for t in order:
        block = compact_trajectory(t, cfg, count_tokens)
        n_tok = count_tokens(block) if count_tokens is not None and total_tokens is not None else 0
        if used + len(block) + 2 > total_chars or (total_tokens is not None and used_tokens + n_tok > total_tokens):
            continue
        parts.append(block)
        used += len(block) + 2
        used_tokens += n_tok
        included.append(t.uid)
    return "\n\n".join(parts), included


def token_counter(client: ChatClient | None) -> Callable[[str], int] | None:
    """``text -> tokens`` with the client's tokenizer (as one user message), or None without a client."""
    if client is None:
        return None
    return lambda text: client.count_tokens([Message(role="user", content=text)])
