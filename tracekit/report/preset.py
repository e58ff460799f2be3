"""What a preset built on another changes, and where its warm start comes from: the run's first log line and
``summary.md`` (issue 50).

A preset that is another preset cut to fit (``experiment=micro_ladder``: ``experiment=micro`` in under 10 minutes)
declares ``built_on: {preset: <name>, cuts: {<key>: <why>}}``; each cut is printed with this run's value and the
reason, the way a scale profile's cuts relative to the paper are (:mod:`tracekit.report.paper`). A test holds
the declared cuts to the real difference between the two composed presets (``tests/test_default_experiment.py``).
``warm_start=<name>`` (a shipped warm start, :mod:`tracekit.warmstart.shipped`) is said beside them: it cuts nothing
(the same weights), but the run did not train them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tracekit.config import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
_ABSENT = object()


def _value(cfg: DictConfig, key: str) -> Any:
    value = OmegaConf.select(cfg, key, default=_ABSENT)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def check_built_on(cfg: DictConfig) -> None:
    """``built_on`` names an experiment preset and keys of this config, each with a reason (one line otherwise)."""
    built = cfg.get("built_on")
    if built is None:
        return
    if not OmegaConf.is_dict(built) or set(built) != {"preset", "cuts"}:
        raise ConfigError(f"built_on={_plain(built)}: a mapping {{preset: <experiment name>, cuts: {{<key>: <why>}}}}")
    if not (CONF / "experiment" / f"{built.preset}.yaml").is_file():
        raise ConfigError(f"built_on.preset={built.preset}: no conf/experiment/{built.preset}.yaml")
    for key, why in (built.cuts or {}).items():
        if _value(cfg, key) is _ABSENT:
            raise ConfigError(f"built_on.cuts.{key}: {key} is no key of this config")
        if not isinstance(why, str) or not why.strip():
            raise ConfigError(f"built_on.cuts.{key}: a reason (text) for the cut, got {why!r}")


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _fmt(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def preset_cuts(cfg: DictConfig) -> list[tuple[str, str, str]]:
    """(key, this run's value, why) of each cut relative to ``built_on.preset``."""
    built = cfg.get("built_on")
    if built is None:
        return []
    return [(key, _fmt(_value(cfg, key)), str(why)) for key, why in (built.cuts or {}).items()]


def warm_start_text(cfg: DictConfig) -> str | None:
    name = cfg.get("warm_start")
    if name is None:
        return None
    return (f"warm start: the shipped copy `{name}` (tracekit/warmstart/warmstarts/{name}/, key- and sha256-checked, "
            f"rebuilt bit for bit by `python scripts/build_warmstart.py {name} --check`), not trained by this run")


def built_on_line(cfg: DictConfig) -> str:
    """The first log line's tail: the cuts relative to the preset this one is built on, and the warm start."""
    parts = []
    cuts = preset_cuts(cfg)
    if cuts:
        parts.append(f"built on experiment={cfg.built_on.preset}, CUT relative to it ({len(cuts)}): "
                     + "; ".join(f"{k}={v} ({why})" for k, v, why in cuts))
    if (ws := warm_start_text(cfg)) is not None:
        parts.append(ws.replace("`", ""))
    return "".join(f" | {p}" for p in parts)


def built_on_markdown(cfg: DictConfig) -> str:
    """The summary's section under the setting relative to the paper ('' when the preset is built on none)."""
    lines = []
    cuts = preset_cuts(cfg)
    if cuts:
        lines += [f"**Built on `experiment={cfg.built_on.preset}`, cut ({len(cuts)}):**", "",
                  "| value | this run | why |", "|---|---|---|"]
        lines += [f"| `{k}` | {v} | {why} |" for k, v, why in cuts]
    if (ws := warm_start_text(cfg)) is not None:
        lines += ["", f"The {ws}."]
    return "\n".join(lines).strip()
