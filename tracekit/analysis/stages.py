"""The analysis stages as the pipeline calls them: discover -> label -> select.

Each writes its artifact files atomically into ``out_dir`` (the stage cache's work dir):

- discover: ``dictionary.json``, ``discovery_log.json``  (see :mod:`.discovery`)
- label:    ``labels.jsonl``, ``labeling_report.json`` (+ ``labels.cache.jsonl``, the resume log); or, imported
            from the official TRACE code's labeling runs (:mod:`.imported`), the same two files
- select:   ``selected.json`` (selection + full per-run stats table), ``selected_names.json``
            (the selection's identity: sorted names + descriptions, for downstream cache keys),
            ``selection_frequency.png``, ``failure_coverage.png``

``select`` reads only labels and thresholds, so a threshold sweep recomputes nothing else, and
two thresholds that keep the same capabilities produce byte-identical ``selected_names.json``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tracekit.analysis.discovery import discover, read_dictionary
from tracekit.analysis.figures import write_figures
from tracekit.analysis.imported import import_runs
from tracekit.analysis.labeling import Labeler, LabelingResult, labeling_report
from tracekit.analysis.select import Thresholds, select, selected_names
from tracekit.artifacts import atomic_write_json, read_jsonl, write_jsonl
from tracekit.types import Capability, Label, Trajectory

__all__ = ["discover", "read_dictionary", "label", "import_labels", "read_labels", "select", "write_selection",
           "select_stage"]

log = logging.getLogger(__name__)

LABELS_FILE = "labels.jsonl"
SELECTED_FILE = "selected.json"
SELECTED_NAMES_FILE = "selected_names.json"


def label(
    trajectories: list[Trajectory],
    dictionary: list[Capability],
    labeler: Labeler,
    runs: int,
    seed: int,
    out_dir: str | Path,
) -> LabelingResult:
    """Labels of ``runs`` independent runs (run r uses seeds derived from ``seed`` and r)."""
    if runs < 1:
        raise ValueError(f"labeling needs runs >= 1, got {runs}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = labeler.label_runs(trajectories, dictionary, list(range(runs)), seed, out)
    write_jsonl(out / LABELS_FILE, result.labels)
    atomic_write_json(out / "labeling_report.json", result.report)
    log.info(
        "labeling (%s): %d labels, %d missing -> %s", labeler.name, len(result.labels), result.report["missing"], out
    )
    return result


def import_labels(folder: str | Path, dictionary: list[Capability], out_dir: str | Path) -> LabelingResult:
    """The labels of the official labeling runs in ``folder`` (``run_NN.json``) over ``dictionary`` (their
    candidates), written as :func:`label` writes its own; ValueError naming the file on bad input."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels, imported = import_runs(folder, [c.name for c in dictionary])
    report = {**labeling_report(labels, dictionary), "labeler": "imported", "imported": imported}
    write_jsonl(out / LABELS_FILE, labels)
    atomic_write_json(out / "labeling_report.json", report)
    log.info("labeling (imported): %d labels of %d runs from %s, %d missing", len(labels), len(imported["files"]),
             imported["source"], report["missing"])
    return LabelingResult(labels, report)


def read_labels(label_dir: str | Path) -> list[Label]:
    return read_jsonl(Path(label_dir) / LABELS_FILE, Label)


def write_selection(selection: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``selected.json``, ``selected_names.json`` and the two figures; return their paths."""
    out = Path(out_dir)
    atomic_write_json(out / SELECTED_FILE, selection)
    atomic_write_json(out / SELECTED_NAMES_FILE, selected_names(selection))
    paths = {"selected": out / SELECTED_FILE, "selected_names": out / SELECTED_NAMES_FILE}
    paths.update(write_figures(selection, out))
    log.info(
        "selection: kept %s of %d candidates (delta=%g, rho=%g, K=%d of N=%d)",
        [c["name"] for c in selection["selected"]],
        len(selection["candidates"]),
        *(selection["thresholds"][k] for k in ("delta", "rho", "k", "n")),
    )
    return paths


def select_stage(
    labels: list[Label], dictionary: list[Capability], thresholds: Thresholds, out_dir: str | Path,
    examples: int = 5,
) -> tuple[dict[str, Any], dict[str, Path]]:
    """``select`` then ``write_selection``: the selection and the paths of its files."""
    selection = select(labels, dictionary, thresholds, examples=examples)
    return selection, write_selection(selection, out_dir)
