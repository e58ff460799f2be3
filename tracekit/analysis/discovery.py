"""Discovery phase (paper section 3.3): induce a canonical capability dictionary from trajectories.

The analysis agent (any :class:`ChatClient`) reads compacted successful and failed trajectories
and answers with ``{"capabilities": [{"name", "description"}, ...]}`` (5-10 entries, unique
snake_case names). A reply that is not JSON or breaks the schema is retried with the validation
error appended to the conversation; after ``max_attempts`` discovery fails with
:class:`DiscoveryError`. A user-edited dictionary file (JSON or YAML) can be pinned instead.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tracekit.analysis.compact import CompactConfig, compact_many, token_counter
from tracekit.analysis.llmjson import extract_json, load_prompt, reply_text, response_format, short_error, strict_object
from tracekit.artifacts import atomic_write_json, read_json
from tracekit.llm.base import ChatClient, ChatRequest
from tracekit.types import Capability, Message, Trajectory, stable_hash

log = logging.getLogger(__name__)

DICTIONARY_FILE = "dictionary.json"
NAME_PATTERN = Capability.model_json_schema()["properties"]["name"]["pattern"]


class DiscoveryError(RuntimeError):
    """Discovery could not obtain a valid dictionary (one clear line: attempts and last error)."""


class _Entry(BaseModel):
    model_config = ConfigDict(extra="ignore")  # extra keys (examples, notes) are harmless
    name: str = Field(pattern=NAME_PATTERN)
    description: str


class DictionaryFile(BaseModel):
    """Schema of a dictionary reply / file: ``{"capabilities": [{"name", "description"}, ...]}``."""

    model_config = ConfigDict(extra="ignore")
    capabilities: list[_Entry]


@dataclass(frozen=True)
class DiscoveryConfig:
    """Discovery settings. ``pinned``: a dictionary file that replaces discovery (no LLM call)."""

    min_capabilities: int = 5
    max_capabilities: int = 10
    max_attempts: int = 3
    temperature: float = 0.0
    max_new_tokens: int = 1024
    seed: int = 0
    prompt: str = "discovery_v1"
    prompt_chars: int = 24000  # budget of the trajectories block
    prompt_tokens: int | None = None  # token budget of that block (counted with the client)
    compact: CompactConfig = field(default_factory=CompactConfig)  # analysis.compact_chars' default, as the runs use
    use_response_format: bool = True
    pinned: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_capabilities <= self.max_capabilities:
            raise ValueError(
                f"discovery needs 1 <= min_capabilities <= max_capabilities, got "
                f"{self.min_capabilities}..{self.max_capabilities}"
            )
        if self.max_attempts < 1:
            raise ValueError(f"discovery.max_attempts must be >= 1, got {self.max_attempts}")


def dictionary_schema(cfg: DiscoveryConfig) -> dict[str, Any]:
    """The reply schema: ``min..max`` capabilities with snake_case names (for constrained decoding)."""
    cap = strict_object(
        {
            "name": {"type": "string", "pattern": NAME_PATTERN, "maxLength": 60},
            "description": {"type": "string", "maxLength": 400},
        }
    )
    return strict_object(
        {"capabilities": {"type": "array", "items": cap, "minItems": cfg.min_capabilities, "maxItems": cfg.max_capabilities}}
    )


def dictionary_hash(dictionary: list[Capability]) -> str:
    """Identity of a dictionary: hash of its (name, description) entries in order."""
    return stable_hash([c.model_dump() for c in dictionary])


def validate_dictionary(obj: Any, min_n: int = 1, max_n: int | None = None) -> list[Capability]:
    """Parse ``{"capabilities": [...]}`` (or a bare list) into capabilities; raise ``ValueError`` with the reason."""
    if isinstance(obj, list):
        obj = {"capabilities": obj}
    try:
        caps = [Capability(name=e.name, description=e.description) for e in DictionaryFile.model_validate(obj).capabilities]
    except ValidationError as e:
        raise ValueError(f"wrong schema: {short_error(e)}") from None
    names = [c.name for c in caps]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"duplicate capability names: {dup}")
    if len(caps) < min_n or (max_n is not None and len(caps) > max_n):
        bound = f"{min_n} to {max_n}" if max_n is not None else f"at least {min_n}"
        raise ValueError(f"expected {bound} capabilities, got {len(caps)}")
    if any(not c.description.strip() for c in caps):
        raise ValueError("every capability needs a non-empty description")
    return caps


def load_dictionary(path: str | Path) -> list[Capability]:
    """A pinned dictionary from a JSON or YAML file (``capabilities:`` list, or a bare list), or the official TRACE
    code's ``pipeline/candidate_capabilities.json`` as it is (``candidates:`` entries of name, description and
    example trajectories; the examples are not part of a dictionary and are dropped)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"pinned capability dictionary not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        obj = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot parse capability dictionary: {short_error(e, 200)}") from None
    if isinstance(obj, dict) and "candidates" in obj and "capabilities" not in obj:
        obj = {"capabilities": obj["candidates"]}  # the official code's candidate file (issue 39)
    try:
        return validate_dictionary(obj)
    except ValueError as e:
        raise ValueError(f"{path}: invalid capability dictionary: {e}") from None


def write_dictionary(dictionary: list[Capability], out_dir: str | Path, source: str) -> Path:
    path = Path(out_dir) / DICTIONARY_FILE
    atomic_write_json(
        path,
        {"capabilities": [c.model_dump() for c in dictionary], "hash": dictionary_hash(dictionary), "source": source},
    )
    return path


def read_dictionary(out_dir: str | Path) -> list[Capability]:
    """The dictionary a discover stage wrote."""
    return validate_dictionary(read_json(Path(out_dir) / DICTIONARY_FILE))


def _order_for_prompt(trajectories: list[Trajectory], seed: int) -> list[Trajectory]:
    """Deterministic shuffle (by uid, then seeded) so the budget samples tasks evenly, not by file order."""
    ordered = sorted(trajectories, key=lambda t: t.uid)
    random.Random(seed).shuffle(ordered)
    return ordered


def build_discovery_prompt(
    trajectories: list[Trajectory], cfg: DiscoveryConfig, client: ChatClient | None = None
) -> tuple[str, list[str], str]:
    """(prompt text, uids shown, prompt sha) for the discovery call."""
    template, sha = load_prompt(cfg.prompt)
    counter = token_counter(client) if cfg.prompt_tokens or cfg.compact.max_tokens else None
    block, shown = compact_many(
        _order_for_prompt(trajectories, cfg.seed), cfg.compact, cfg.prompt_chars, counter, cfg.prompt_tokens
    )
    if not shown:
        raise ValueError(
            f"no trajectory fits the discovery budget (prompt_chars={cfg.prompt_chars}, "
            f"compact.max_chars={cfg.compact.max_chars})"
        )
    shown_set = set(shown)
    n_success = sum(t.success for t in trajectories if t.uid in shown_set)
    text = template.substitute(
        n_shown=len(shown),
        n_success=n_success,
        n_failure=len(shown) - n_success,
        n_total=len(trajectories),
        n_min=cfg.min_capabilities,
        n_max=cfg.max_capabilities,
        trajectories=block,
    )
    return text, shown, sha


def discover(
    trajectories: list[Trajectory], client: ChatClient | None, cfg: DiscoveryConfig, out_dir: str | Path
) -> list[Capability]:
    """Run discovery (or load the pinned dictionary) and write ``dictionary.json`` + ``discovery_log.json``.

    Raises :class:`DiscoveryError` after ``cfg.max_attempts`` invalid replies, ``ValueError`` when
    there are no trajectories or no failed ones (nothing to contrast).
    """
    out_dir = Path(out_dir)
    if cfg.pinned:
        caps = load_dictionary(cfg.pinned)
        write_dictionary(caps, out_dir, source=f"pinned:{cfg.pinned}")
        atomic_write_json(out_dir / "discovery_log.json", {"pinned": str(cfg.pinned), "n_capabilities": len(caps)})
        log.info("discovery: pinned dictionary %s (%d capabilities)", cfg.pinned, len(caps))
        return caps
    if client is None:
        raise ValueError("discovery needs an analysis client (llm) or a pinned dictionary file")
    if not trajectories:
        raise ValueError("discovery needs trajectories, got none")
    if all(t.success for t in trajectories):
        raise ValueError(f"discovery needs failed trajectories to contrast; all {len(trajectories)} succeeded")

    prompt, shown, sha = build_discovery_prompt(trajectories, cfg, client)
    messages = [Message(role="user", content=prompt)]
    attempts: list[dict[str, Any]] = []
    fmt = response_format(dictionary_schema(cfg), "capability_dictionary") if cfg.use_response_format else None
    caps: list[Capability] | None = None
    for attempt in range(cfg.max_attempts):
        req = ChatRequest(
            messages=list(messages),
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            seed=cfg.seed + attempt,
            response_format=fmt,
        )
        resp = client.chat([req])[0]
        text = reply_text(resp)
        try:
            if resp.finish_reason == "error":
                raise ValueError(f"endpoint error: {resp.text[:200]}")
            caps = validate_dictionary(extract_json(text), cfg.min_capabilities, cfg.max_capabilities)
            attempts.append({"attempt": attempt, "reply": text, "error": None})
            break
        except ValueError as e:
            err = str(e)
            attempts.append({"attempt": attempt, "reply": text, "error": err})
            log.warning("discovery attempt %d/%d invalid: %s", attempt + 1, cfg.max_attempts, err)
            messages += [
                Message(role="assistant", content=text),
                Message(
                    role="user",
                    content=f"Your answer was invalid: {err}\nAnswer again with ONE JSON object of the form "
                    f'{{"capabilities": [{{"name": "snake_case_name", "description": "..."}}]}} holding '
                    f"{cfg.min_capabilities} to {cfg.max_capabilities} capabilities with unique names.",
                ),
            ]
    log_obj = {"prompt": cfg.prompt, "prompt_sha": sha, "trajectories_shown": shown, "attempts": attempts}
    atomic_write_json(out_dir / "discovery_log.json", log_obj)
    if caps is None:
        raise DiscoveryError(
            f"discovery failed: no valid capability dictionary after {cfg.max_attempts} attempts; "
            f"last error: {attempts[-1]['error']} (replies in {out_dir / 'discovery_log.json'})"
        )
    write_dictionary(caps, out_dir, source=f"discovered:{cfg.prompt}@{sha}")
    log.info("discovery: %d capabilities after %d attempt(s)", len(caps), len(attempts))
    return caps
