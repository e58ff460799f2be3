"""`python -m tracekit` on user errors and failures: refused before any work in one line, nothing left of a
rejected run, a failed run's traceback in its log and its status in summary.md; endpoints probed up front."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.openai_stub import StubOpenAIServer
from tracekit.config import ConfigError, _stage_names, needed_endpoints, probe_endpoints


def _cli(*args: str, root: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracekit", "experiment=smoke", *args], capture_output=True,
                          text=True, timeout=120, cwd=root, env={**os.environ, "TRACEKIT_ROOT": str(root), **env})


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("override,message", [
    ("moe.steps=0", "moe.steps=0 is invalid: must be >= 1"),
    ("agent.max_new_tokens=0", "agent.max_new_tokens=0 is invalid: must be >= 1"),
    ("benchmark.limit=0", "benchmark.limit=0 is invalid: must be >= 1"),
    ("grpo.lr=-1", "grpo.lr=-1.0 is invalid: must be > 0"),
    ("grpo.lr=0", "grpo.lr=0.0 is invalid: must be > 0"),
])
def test_values_that_fail_later_are_refused_before_any_work(tmp_path, override, message):
    out = _cli(override, root=tmp_path)
    assert out.returncode == 2 and _lines(out.stderr) == [f"tracekit: config error: {message}"]


def test_binary_pinned_dictionary_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "dictionary.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    out = _cli("analysis.discovery=pinned", f"analysis.dictionary_path={path}", root=tmp_path)
    assert out.returncode == 2
    assert _lines(out.stderr) == [f"tracekit: config error: analysis.dictionary_path: {path}: not UTF-8 text "
                                  "(invalid start byte at byte 0)"]


@pytest.mark.parametrize("override", ["+thresholds.deltaa=0.5", "+thresholds.deltaa="])
def test_added_unknown_key_is_refused(tmp_path, override):
    out = _cli(override, root=tmp_path)
    assert out.returncode == 2
    assert _lines(out.stderr) == ["tracekit: config error: unknown key thresholds.deltaa "
                                  "(valid: delta, rho, k, n, undefined_er_pos)"]


def test_rejected_run_leaves_nothing(tmp_path):
    assert _cli("thresholds.delta=2", root=tmp_path).returncode == 2
    assert list(tmp_path.iterdir()) == []  # neither its run dir nor the outputs/runs/ made for it
    earlier = tmp_path / "outputs" / "runs" / "earlier_run"
    earlier.mkdir(parents=True)
    assert _cli("thresholds.delta=2", root=tmp_path).returncode == 2
    assert list((tmp_path / "outputs" / "runs").iterdir()) == [earlier]  # another run's dir stays


def test_runtime_failure_is_one_line_with_the_traceback_in_the_log_and_the_summary_failed(tmp_path):
    blocked = tmp_path / "not_a_dir"
    blocked.write_text("")
    out = _cli(root=tmp_path, TRACEKIT_CACHE=str(blocked))  # the cache cannot be made: fails before any model
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr
    [line] = _lines(out.stderr)
    [run_dir] = (tmp_path / "outputs" / "runs").iterdir()
    log_file = run_dir / "tracekit.log"
    assert line.startswith("tracekit: failed: NotADirectoryError: ") and line.endswith(f"(traceback: {log_file})")
    assert "Traceback" in log_file.read_text()
    assert "Status: failed (NotADirectoryError: " in (run_dir / "summary.md").read_text()


def test_user_error_during_a_run_is_one_line_with_the_traceback_in_the_log(tmp_path, capsys):
    from tracekit.cli import report_failure

    handlers = [logging.FileHandler(tmp_path / "tracekit.log"), logging.StreamHandler(sys.stderr)]
    for h in handlers:
        logging.getLogger().addHandler(h)
    try:
        try:
            raise ConfigError("llm.endpoints.analysis: endpoint http://127.0.0.1:9/v1 unreachable")
        except ConfigError as e:
            code = report_failure(e)
    finally:
        for h in handlers:
            logging.getLogger().removeHandler(h)
            h.close()
    assert code == 2
    assert _lines(capsys.readouterr().err) == ["tracekit: error: llm.endpoints.analysis: endpoint "
                                                "http://127.0.0.1:9/v1 unreachable"]
    assert "Traceback" in (tmp_path / "tracekit.log").read_text()


def test_summary_records_the_run_status(make_cfg, tmp_path):
    from tracekit.cli import write_summary
    from tracekit.pipeline import RunRecord

    cfg = make_cfg()
    write_summary(tmp_path, cfg, RunRecord(tmp_path))
    assert "Status: ok" in (tmp_path / "summary.md").read_text().splitlines()[:3]
    write_summary(tmp_path, cfg, RunRecord(tmp_path), RuntimeError("no ready\nenvironment"))
    failed = (tmp_path / "summary.md").read_text().splitlines()[:3]
    assert "Status: failed (RuntimeError: no ready environment)" in failed


def test_needed_endpoints(make_cfg):
    # offline: reference roles and a scripted user; only GEPA's reflection LM is an endpoint (in process: llm=local)
    assert {stage: needed_endpoints(make_cfg(), stage) for stage in _stage_names()} == {
        **{stage: [] for stage in _stage_names()}, "gepa": ["analysis"], "figure4": ["analysis"]}
    cfg = make_cfg("llm=openai", "analysis=llm", "user=llm", "synthesis=generate")
    assert {stage: needed_endpoints(cfg, stage) for stage in _stage_names()} == {
        "rollout": ["user"], "discover": ["analysis"], "label": ["analysis"], "select": [],
        "synthesize": ["generation"], "train": [], "compose": [], "evaluate": ["user"],
        "grpo_target": ["user"], "gepa": ["user", "analysis"], "figure4": ["user", "analysis"],  # figure4: gepa + grpo_target
        "untargeted_synthetic": [], "adp_sft": [], "swe_rl": ["user"]}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_probe_refuses_an_unreachable_endpoint_at_once(make_cfg):
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    cfg = make_cfg("llm=openai", "analysis=llm", f"llm.endpoints.analysis.base_url={url}")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        probe_endpoints(cfg, needed_endpoints(cfg, "discover"))
    assert time.monotonic() - t0 < 3
    msg = str(e.value)
    assert msg.startswith(f"llm.endpoints.analysis: endpoint {url} unreachable: ConnectError") and "\n" not in msg


def test_probe_asks_a_live_endpoint_once_and_skips_in_process_ones(make_cfg):
    with StubOpenAIServer() as srv:
        cfg = make_cfg("llm=openai", f"llm.endpoints.analysis.base_url={srv.url}", "llm.endpoints.user.kind=hf")
        probe_endpoints(cfg, ["analysis", "user", "analysis"])
        assert [(r["method"], r["path"]) for r in srv.requests] == [("GET", "/v1/models")]


def test_probe_reports_a_refused_key(make_cfg, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    with StubOpenAIServer(require_key="right") as srv:
        cfg = make_cfg("llm=openai", f"llm.endpoints.analysis.base_url={srv.url}")
        with pytest.raises(ConfigError, match=r"^llm\.endpoints\.analysis: endpoint .* refused the API key"):
            probe_endpoints(cfg, ["analysis"])


def test_an_unreachable_endpoint_is_reported_before_any_stage_computes(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _cli("llm=openai", "analysis=llm", f"llm.endpoints.analysis.base_url=http://127.0.0.1:{port}/v1",
               root=tmp_path, TRACEKIT_CACHE=str(tmp_path / "cache"))
    assert out.returncode == 2
    (line,) = _lines(out.stderr)
    assert line.startswith(f"tracekit: error: llm.endpoints.analysis: endpoint http://127.0.0.1:{port}/v1")
    assert not (tmp_path / "cache" / "rollout").exists()  # nothing was computed first
