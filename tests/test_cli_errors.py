"""`python -m tracekit` on user errors and failures: refused before any work in one line, nothing left of a
rejected run, a failed run's traceback in its log and its status in summary.md; endpoints probed up front."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import procs
from tests.openai_stub import StubOpenAIServer
from tracekit.artifacts import COMPLETE
from tracekit.config import ConfigError
from tracekit.schema import stage_names
from tracekit.validate import needed_endpoints, probe_endpoints


def _cli(*args: str, root: Path, **env: str) -> subprocess.CompletedProcess:
    return procs.run([sys.executable, "-m", "tracekit", "experiment=smoke", *args], capture_output=True,
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
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "rollout").write_text("")  # the stage's folder cannot be made: fails before any model
    out = _cli(root=tmp_path, TRACEKIT_CACHE=str(cache))
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr
    [line] = _lines(out.stderr)
    [run_dir] = (tmp_path / "outputs" / "runs").iterdir()
    log_file = run_dir / "tracekit.log"
    assert line.startswith("tracekit: failed: FileExistsError: ") and line.endswith(f"(traceback: {log_file})")
    assert "Traceback" in log_file.read_text()
    assert "Status: failed (FileExistsError: " in (run_dir / "summary.md").read_text()


def test_a_failed_sweep_job_leaves_the_next_jobs_running_and_the_sweep_exits_1(tmp_path):
    """A sequential multirun: job 0 fails at run time (its cache cannot hold the rollout stage), job 1 (another
    cache) still runs; each failure is said when it happens and once more, by job, when the sweep ends."""
    broken, good = tmp_path / "broken", tmp_path / "good"
    broken.mkdir()
    (broken / "rollout").write_text("")
    out = procs.run([sys.executable, "-m", "tracekit", "-m", "experiment=smoke", f"paths.cache_dir={broken},{good}",
                     "stages=[rollout]"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                    env={**os.environ, "TRACEKIT_ROOT": str(tmp_path)})
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr
    failed = [line for line in _lines(out.stderr) if line.startswith("tracekit: ")]
    assert failed[0].startswith("tracekit: failed: FileExistsError: ")
    assert failed[-1].startswith("tracekit: 1 sweep job(s) failed, the others ran: job 0 (") and str(broken) in failed[-1]
    assert len(failed) == 2
    assert any(p.relative_to(good).parts[0] == "rollout" for p in good.rglob(COMPLETE))  # job 1 computed its stage


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
    assert {stage: needed_endpoints(make_cfg(), stage) for stage in stage_names()} == {
        **{stage: [] for stage in stage_names()}, "gepa": ["analysis"], "figure4": ["analysis"]}
    cfg = make_cfg("llm=openai", "analysis=llm", "user=llm", "synthesis=generate")
    assert {stage: needed_endpoints(cfg, stage) for stage in stage_names()} == {
        "rollout": ["user"], "discover": ["analysis"], "label": ["analysis"], "select": [],
        "synthesize": ["generation"], "train": [], "compose": [], "evaluate": ["user"],
        "grpo_target": ["user"], "gepa": ["user", "analysis"], "figure4": ["user", "analysis"],  # figure4: gepa + grpo_target
        "untargeted_synthetic": [], "adp_sft": [], "swe_rl": ["user"]}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_probe_refuses_an_unreachable_endpoint_at_once(make_cfg, monkeypatch):
    import httpx

    url = f"http://127.0.0.1:{_closed_port()}/v1"
    cfg = make_cfg("llm=openai", "analysis=llm", f"llm.endpoints.analysis.base_url={url}")
    gets = []
    real_get = httpx.Client.get
    monkeypatch.setattr(httpx.Client, "get", lambda self, *a, **kw: gets.append(a[0]) or real_get(self, *a, **kw))
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        probe_endpoints(cfg, needed_endpoints(cfg, "discover"))
    # at once: one request, no retry (counted, not timed); the clock bound only catches a hang (a loaded machine
    # may take seconds where an idle one takes milliseconds)
    assert gets == [f"{url}/models"] and time.monotonic() - t0 < 30
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


# --------------------------------------------------------------------------------------------
# bad values found at validation: an empty method list, an interpolation that cannot be resolved


def test_an_empty_method_list_is_refused_before_any_work(tmp_path):
    out = _cli("eval.methods=[]", root=tmp_path)
    assert out.returncode == 2 and list(tmp_path.iterdir()) == []
    [line] = _lines(out.stderr)
    assert line.startswith("tracekit: config error: eval.methods=[] is invalid: must be a non-empty list (the rows "
                           "of the results table: base, ")


@pytest.mark.parametrize("override,message", [
    ("~seed", "seed is not in the config (an override like ~seed removes it): every stage derives its seeds from "
              "it; drop the override, or give it a value: seed=<int>"),
    ("grpo.seed=${nope}", "grpo.seed=${nope}: nope is not in the config (an override like ~nope removes it); give "
                          "nope a value, or set grpo.seed itself"),
    ("analysis.temperature=${oc.env:TRACEKIT_TEST_UNSET}",
     "analysis.temperature=${oc.env:TRACEKIT_TEST_UNSET} cannot be resolved: KeyError raised while resolving "
     "interpolation: \"Environment variable 'TRACEKIT_TEST_UNSET' not found\"; set analysis.temperature to a value"),
    ("~name", "hydra.run.dir: name is not in the config (an override like ~name removes it); give name a value, "
              "or set hydra.run.dir itself"),  # Hydra's own phase: the run dir's name
    ("name=${oc.env:TRACEKIT_TEST_UNSET}",  # Hydra's own phase resolves the run dir's ${name}: the override is named
     "name=${oc.env:TRACEKIT_TEST_UNSET} cannot be resolved: KeyError raised while resolving interpolation: "
     "\"Environment variable 'TRACEKIT_TEST_UNSET' not found\"; set name to a value (the override is used by "
     "hydra.run.dir)"),
    ("name=${nope}", "name=${nope}: nope is not in the config (an override like ~nope removes it); give nope a value, "
                     "or set name itself (the override is used by hydra.run.dir)"),
])
def test_an_interpolation_that_cannot_be_resolved_is_one_line(tmp_path, override, message):
    out = _cli(override, root=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr
    assert _lines(out.stderr) == [f"tracekit: config error: {message}"]
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# a root or a cache the run cannot use: one line saying what to do, before any work


def _mount_ns() -> list[str]:
    """The prefix that runs a command in a private mount namespace (root: ``unshare -m``; others in a user namespace
    too); skips where the machine allows neither."""
    cmd = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    try:
        ok = procs.run([*cmd, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip("no private mount namespace (unshare -m) here: no read-only or full mount to test with")
    return cmd


def _read_only(d: Path) -> str:
    return f"mount --bind {d} {d} && mount -o remount,bind,ro {d} {d}"


def _full(d: Path) -> str:
    return f"mount -t tmpfs -o size=256k tmpfs {d} && (dd if=/dev/zero of={d}/fill bs=4k 2>/dev/null || true)"


def _cli_in(setup: str, *args: str, root: Path, **env: str) -> subprocess.CompletedProcess:
    """:func:`_cli` after the shell commands ``setup`` (mounts) in a private mount namespace."""
    return procs.run([*_mount_ns(), "sh", "-c", f'{setup} && exec "$@"', "sh", sys.executable, "-m", "tracekit",
                      "experiment=smoke", "logger=none", *args], capture_output=True, text=True, timeout=120,
                          cwd=root.parent, env={**os.environ, "TRACEKIT_ROOT": str(root), **env})


def _tracekit_lines(out: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in out.stdout + out.stderr
    return [line for line in out.stderr.splitlines() if line.startswith("tracekit:")]


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_a_root_under_a_file_is_one_line_before_hydra_writes(tmp_path, where):
    f = tmp_path / "f"
    f.write_text("")
    root = f if where == "file" else f / "root"
    out = _cli(root=root.parent if where == "file" else tmp_path, TRACEKIT_ROOT=str(root))
    wrong = f"{f} is not a directory" if where == "file" else f"{f} is a file, not a directory"
    assert out.returncode == 2 and _lines(out.stderr) == [
        f"tracekit: error: TRACEKIT_ROOT={root}: {wrong}: every run writes its run dir under it (outputs/runs/); "
        "point TRACEKIT_ROOT at a writable directory with free space"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


@pytest.mark.parametrize("holding", ["nothing", "a cache"])
def test_a_read_only_root_is_one_line_naming_the_cache_it_can_still_serve(tmp_path, holding):
    root = tmp_path / "root"
    (root / "outputs" / "cache" if holding == "a cache" else root).mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "TRACEKIT_CACHE"}
    out = procs.run([*_mount_ns(), "sh", "-c", f'{_read_only(root)} && exec "$@"', "sh", sys.executable, "-m",
                     "tracekit", "experiment=smoke"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={**env, "TRACEKIT_ROOT": str(root)})
    reuse = (f" (its cache can still serve a run that is all cache hits, read-only: "
             f"TRACEKIT_CACHE={root}/outputs/cache)" if holding == "a cache" else "")
    assert out.returncode == 2 and _lines(out.stderr) == [
        f"tracekit: error: TRACEKIT_ROOT={root}: {root} is on a read-only file system: every run writes its run dir "
        f"under it (outputs/runs/); point TRACEKIT_ROOT at a writable directory with free space{reuse}"]


def test_a_full_root_is_one_line(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    out = _cli_in(_full(root), root=root)
    assert out.returncode == 2 and _lines(out.stderr) == [
        f"tracekit: error: TRACEKIT_ROOT={root}: {root} has no space left (No space left on device): every run "
        "writes its run dir under it (outputs/runs/); point TRACEKIT_ROOT at a writable directory with free space"]


_ALL_STAGES = "rollout, discover, label, select, synthesize, train, compose, evaluate"


def test_a_cache_under_a_file_is_one_line_before_any_work(tmp_path):
    (tmp_path / "f").write_text("")
    cache = tmp_path / "f" / "cache"
    out = _cli("logger=none", root=tmp_path, TRACEKIT_CACHE=str(cache))
    assert out.returncode == 2 and _lines(out.stderr) == [
        f"tracekit: error: the cache paths.cache_dir={cache} cannot be written: {tmp_path / 'f'} is a file, not a "
        f"directory; this run computes {_ALL_STAGES}: point TRACEKIT_CACHE at a writable directory with free space "
        "(a run that is all cache hits needs no write)"]
    assert "stage rollout: computing" not in out.stdout


def test_a_full_cache_with_misses_is_one_line_before_any_work(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    out = _cli_in(_full(cache), root=tmp_path / "root", TRACEKIT_CACHE=str(cache))
    assert out.returncode == 2 and _lines(out.stderr) == [
        f"tracekit: error: the cache paths.cache_dir={cache} cannot be written: {cache} has no space left (No space "
        f"left on device); this run computes {_ALL_STAGES}: point TRACEKIT_CACHE at a writable directory with free "
        "space (a run that is all cache hits needs no write)"]
    assert "stage rollout: computing" not in out.stdout


_GOLD = ("stages=[rollout]", "agent.kind=gold", "logger=none")  # the target's gold agent: a rollout without a model


@pytest.fixture(scope="module")
def gold_cache(tmp_path_factory) -> Path:
    """A cache holding the smoke preset's rollout by the gold agent (rollout/ and its episodes/ sub-artifact)."""
    root = tmp_path_factory.mktemp("gold")
    out = _cli(*_GOLD, root=root)
    assert out.returncode == 0, out.stderr
    return root / "outputs" / "cache"


def _copy(cache: Path, tmp_path: Path) -> Path:
    shutil.copytree(cache, tmp_path / "cache")
    return tmp_path / "cache"


def test_a_read_only_cache_serves_a_run_of_hits_and_refuses_one_with_misses_in_one_line(gold_cache, tmp_path):
    cache = _copy(gold_cache, tmp_path)
    root = tmp_path / "root"
    hits = _cli_in(_read_only(cache), *_GOLD, root=root, TRACEKIT_CACHE=str(cache))
    assert hits.returncode == 0, hits.stderr
    assert "stages to compute: none (all cached)" in hits.stdout and _tracekit_lines(hits) == []
    misses = _cli_in(_read_only(cache), "stages=[discover]", "agent.kind=gold", root=root, TRACEKIT_CACHE=str(cache))
    assert misses.returncode == 2 and _lines(misses.stderr) == [
        f"tracekit: error: the cache paths.cache_dir={cache} cannot be written: {cache} is on a read-only file "
        "system; this run computes discover: point TRACEKIT_CACHE at a writable directory with free space (a run that "
        "is all cache hits needs no write)"]


def test_the_rm_a_corrupt_episodes_sub_artifact_names_recomputes_it_in_one_step(gold_cache, tmp_path):
    cache = _copy(gold_cache, tmp_path)
    [episodes] = (p for p in (cache / "episodes").iterdir() if p.is_dir())
    rows = episodes / "trajectories.jsonl"
    rows.write_bytes(rows.read_bytes()[: len(rows.read_bytes()) // 2])
    out = _cli(*_GOLD, root=tmp_path, TRACEKIT_CACHE=str(cache))
    assert out.returncode == 2
    [line] = _lines(out.stderr)
    assert line.startswith("tracekit: error: artifact episodes/") and line.endswith(f"; recompute: rm -r {episodes}")
    shutil.rmtree(line.rsplit("rm -r ", 1)[1])  # the one command the message names
    again = _cli(*_GOLD, root=tmp_path, TRACEKIT_CACHE=str(cache))
    assert again.returncode == 0, again.stderr
    assert "its sub-artifact episodes/" in again.stdout and rows.is_file()  # rollout/ made it again


def test_a_file_added_to_a_complete_artifact_is_refused_as_corrupt(gold_cache, tmp_path):
    cache = _copy(gold_cache, tmp_path)
    [rollout] = (p for p in (cache / "rollout").iterdir() if p.is_dir())
    (rollout / "planted.py").write_text("print('hi')\n")
    out = _cli(*_GOLD, root=tmp_path, TRACEKIT_CACHE=str(cache))
    assert out.returncode == 2 and _lines(out.stderr) == [
        f"tracekit: error: artifact rollout/{rollout.name} is corrupt: planted.py is not in its manifest (added after "
        f"it completed); recompute: rm -r {rollout}"]


def test_a_disk_that_fills_during_the_run_is_one_line_naming_where(tmp_path, capsys, monkeypatch):
    import tracekit.cli as cli

    monkeypatch.setattr(cli, "_model_cache", lambda: None)
    assert cli.report_failure(OSError(28, "No space left on device", str(tmp_path / "x.jsonl"))) == 2
    assert _lines(capsys.readouterr().err) == [
        f"tracekit: error: No space left on device: {tmp_path / 'x.jsonl'}: free space there (or point TRACEKIT_CACHE "
        "and TRACEKIT_ROOT at another disk) and run again: finished artifacts are kept, the unfinished one resumes"]
    try:  # a library's own error quoting the OS (tokenizers: "No space left on device (os error 28)"), no file
        raise RuntimeError("save failed") from Exception("No space left on device (os error 28)")
    except RuntimeError as e:
        assert cli.report_failure(e, (tmp_path / "cache", tmp_path / "run")) == 2
    [line] = _lines(capsys.readouterr().err)
    assert line.startswith(f"tracekit: error: No space left on device writing under {tmp_path / 'cache'} or "
                           f"{tmp_path / 'run'}: free space there")


# --------------------------------------------------------------------------------------------
# SIGINT and SIGTERM: one line, the summary says interrupted, the unfinished artifact resumes


@pytest.mark.timeout(900)  # a child that never reaches the stage fails the test rather than hanging the suite
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_the_run_in_one_line_with_the_summary_interrupted(tmp_path, sig):
    from filelock import FileLock

    # procs.popen: the child starts with SIGINT at its default action (pytest run by a script in the background
    # inherits it ignored, and the CLI keeps an ignored SIGINT ignored: the run would exit 0) and no stdin; stderr
    # goes to a file, so that a chatty child cannot fill a pipe nobody reads while the test waits on stdout
    with open(tmp_path / "stderr.txt", "w+") as err_file:
        p = procs.popen([sys.executable, "-m", "tracekit", "experiment=smoke", "logger=none", "stages=[rollout]"],
                        stdout=subprocess.PIPE, stderr=err_file, text=True, cwd=tmp_path,
                        env={**os.environ, "TRACEKIT_ROOT": str(tmp_path)})
        try:
            sent = False
            for line in p.stdout:
                if "stage rollout: computing" in line:  # the model loads next: the run is mid-stage
                    p.send_signal(sig)
                    sent = True
                    break
            p.communicate(timeout=600)
        finally:
            p.kill()
            p.wait()
        err_file.seek(0)
        err = err_file.read()
    assert sent, f"the run ended (exit {p.returncode}) before its rollout stage started: {err[-3000:]}"
    name = signal.Signals(sig).name
    [run_dir] = (tmp_path / "outputs" / "runs").iterdir()
    assert p.returncode == 128 + sig and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("tracekit:")] == [
        f"tracekit: interrupted by {name}: finished artifacts are kept and an unfinished one resumes: run the same "
        f"command again (run dir {run_dir})"]
    assert f"Status: interrupted ({name})" in (run_dir / "summary.md").read_text()
    stage = tmp_path / "outputs" / "cache" / "rollout"
    [partial] = stage.glob("*.partial")  # kept, to resume from; nothing looks complete
    assert not list(stage.glob(f"*/{COMPLETE}"))
    lock = FileLock(str(stage / f"{partial.name[:-len('.partial')]}.lock"))
    lock.acquire(timeout=0)  # released: the next run takes it at once
    lock.release()


# --------------------------------------------------------------------------------------------
# an endpoint that answers, but not as an OpenAI-compatible server


class _NotOpenAI:
    """A local HTTP server answering every request with one status and body (a web page, a proxy's error)."""

    def __init__(self, status: int, body: bytes):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        srv = self
        self.paths: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                return

            def do_GET(self):  # noqa: N802
                srv.paths.append(self.path)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        import threading

        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("status,body,says", [
    (500, b'{"error": "internal"}', 'answered HTTP 500: {"error": "internal"}; check the URL'),
    (404, b"Not Found", "answered HTTP 404: Not Found; check the URL"),
    (200, b"<html><body>router login</body></html>", "answered HTTP 200 but not a model list (JSONDecodeError: "),
    (200, b'{"status": "ok"}', "answered HTTP 200 but not a model list (KeyError: "),
])
def test_probe_refuses_an_endpoint_that_is_not_openai_compatible_in_one_request(make_cfg, status, body, says):
    with _NotOpenAI(status, body) as srv:
        cfg = make_cfg("llm=openai", "analysis=llm", f"llm.endpoints.analysis.base_url={srv.url}")
        with pytest.raises(ConfigError) as e:
            probe_endpoints(cfg, needed_endpoints(cfg, "discover"))
        assert srv.paths == ["/v1/models"]
    msg = str(e.value)
    assert msg.startswith(f"llm.endpoints.analysis: endpoint {srv.url} is not an OpenAI-compatible server: GET "
                          f"{srv.url}/models {says}") and "\n" not in msg


def test_an_endpoint_that_is_not_openai_is_reported_before_any_stage_computes(tmp_path):
    with _NotOpenAI(500, b"upstream error") as srv:
        out = _cli("llm=openai", "analysis=llm", f"llm.endpoints.analysis.base_url={srv.url}", "logger=none",
                   root=tmp_path, TRACEKIT_CACHE=str(tmp_path / "cache"))
    assert out.returncode == 2 and _lines(out.stderr) == [
        f"tracekit: error: llm.endpoints.analysis: endpoint {srv.url} is not an OpenAI-compatible server: GET "
        f"{srv.url}/models answered HTTP 500: upstream error; check the URL (it ends with the API root, e.g. "
        "http://host:8000/v1) and that the server is up"]
    assert not (tmp_path / "cache" / "rollout").exists()


# --------------------------------------------------------------------------------------------
# -m: every sweep point validated before any job runs


def _multirun(*args: str, root: Path) -> subprocess.CompletedProcess:
    return procs.run([sys.executable, "-m", "tracekit", "-m", "experiment=smoke", *args], capture_output=True,
                     text=True, timeout=600, cwd=root, env={**os.environ, "TRACEKIT_ROOT": str(root)})


def test_a_bad_sweep_point_is_refused_in_one_line_before_job_0(tmp_path):
    t0 = time.monotonic()
    out = _multirun("logger=none", "moe.steps=2,0,3", root=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr
    assert _lines(out.stderr) == ["tracekit: config error: 1 of 3 sweep jobs would be refused, so none was started: "
                                  "job #1 (moe.steps=0): moe.steps=0 is invalid: must be >= 1"]
    assert "Launching" not in out.stdout + out.stderr and list(tmp_path.iterdir()) == []  # no job, no multirun dir
    assert time.monotonic() - t0 < 300  # no job ran (a bound against one, loose enough for a loaded machine)


def test_a_sweep_presets_points_are_validated_too_each_named(tmp_path):
    """sweep=thresholds sweeps delta x rho (hydra.sweeper.params); the command line's delta replaces the preset's:
    the three points with delta=1.5 are named, in one line."""
    out = _multirun("sweep=thresholds", "logger=none", "thresholds.delta=0.1,1.5", root=tmp_path)
    assert out.returncode == 2 and list(tmp_path.iterdir()) == []
    [line] = _lines(out.stderr)
    assert line.startswith("tracekit: config error: 3 of 6 sweep jobs would be refused, so none was started: job #3 "
                           "(thresholds.delta=1.5 thresholds.rho=0.05): thresholds.delta=1.5 is invalid: must be in "
                           "[0, 1]; job #4 (thresholds.delta=1.5 thresholds.rho=0.1): ")


def test_valid_sweep_points_pass_the_check(tmp_path):
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from tracekit.cli import CONF_DIR, sweep_points, sweep_problems

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="tracekit"):
        master = GlobalHydra.instance().hydra.compose_config(
            "config", overrides=["sweep=consolidation", "experiment=smoke", "logger=none", "moe.steps=2,3",
                                 f"paths.root_dir={tmp_path}"], run_mode=RunMode.MULTIRUN)
        points = sweep_points(master)
        assert len(points) == 20 and points[0][0] == "consolidation=moe moe.steps=2"  # 10 strategies x 2
        assert sweep_problems(master) == []
    GlobalHydra.instance().clear()


# --------------------------------------------------------------------------------------------
# a signal while the app still imports; the first error is the one reported; a mistyped backbone name


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_starting_is_one_line(tmp_path, sig):
    """The app's imports take seconds: a signal in them ends the command in one line (130 / 143), nothing written."""
    p = procs.popen([sys.executable, "-m", "tracekit", "experiment=smoke"], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True, cwd=tmp_path, env={**os.environ, "TRACEKIT_ROOT": str(tmp_path)})
    try:
        # an event, not a clock: python is up and tracekit/__main__.py has installed its early handlers (SIGINT's,
        # then SIGTERM's: no handler of SIGTERM before it); the imports after them take seconds
        procs.wait_for(lambda: procs.catches(p.pid, signal.SIGTERM), "the early signal handlers", proc=p,
                       poll=0.002)
        p.send_signal(sig)
        out, err = p.communicate(timeout=600)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 128 + sig and "Traceback" not in out + err, err
    [line] = _lines(err)
    assert line.startswith(f"tracekit: interrupted by {signal.Signals(sig).name}")
    assert list(tmp_path.iterdir()) == []


def test_the_first_error_is_reported_when_the_summary_cannot_be_written_after_it(make_cfg, tmp_path, capsys,
                                                                                 monkeypatch):
    """The whole root on a full disk: the artifact's write fails first (ENOSPC naming its file), then summary.md's.
    The run raises the first; its one line names the artifact and then the summary's failure."""
    import errno

    import tracekit.cli as cli

    artifact = tmp_path / "cache" / "rollout" / "k.partial" / "trajectories.jsonl"

    class FullPipeline:
        def to_compute(self, *a):
            return []

        def run(self, *a):
            raise OSError(errno.ENOSPC, "No space left on device", str(artifact))

    real = cli.atomic_write_text

    def write(path, text):
        if Path(path).name == "summary.md":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, text)

    monkeypatch.setattr(cli, "build_pipeline", FullPipeline)
    monkeypatch.setattr(cli, "atomic_write_text", write)
    monkeypatch.setattr(cli, "_model_cache", lambda: None)
    cfg = make_cfg("experiment=smoke")
    with pytest.raises(OSError) as e:
        cli.run(cfg)
    assert e.value.filename == str(artifact)
    assert cli.report_failure(e.value, (cfg.paths.cache_dir, cfg.paths.run_dir)) == 2
    [line] = _lines(capsys.readouterr().err)
    assert line.startswith(f"tracekit: error: No space left on device: {artifact}: free space there")
    assert line.endswith(f"the unfinished one resumes (summary.md could not be written either: OSError: [Errno 28] No "
                         f"space left on device: '{cfg.paths.run_dir}/summary.md')")

    monkeypatch.setattr(cli, "atomic_write_text", real)  # the summary written after the first error says it
    with pytest.raises(OSError):
        cli.run(cfg)
    assert "Status: failed (OSError: [Errno 28] No space left on device" in (Path(cfg.paths.run_dir) / "summary.md").read_text()


def test_an_unknown_backbone_name_without_its_own_source_is_refused_listing_the_known_ones(make_cfg):
    from tracekit.llm.backbones import BACKBONES
    from tracekit.validate import validate

    with pytest.raises(ConfigError) as e:
        validate(make_cfg("experiment=smoke", "backbone.name=tinyy"))
    assert str(e.value) == (f"backbone.name='tinyy' is invalid: must be a known backbone ({', '.join(sorted(BACKBONES))}; "
                            "backbone=<name> picks one), or a custom one with its own source: backbone.source=hub and "
                            "backbone.hf_id=<a hub model no known backbone names>")
    assert "smollm2_135m, tiny" in str(e.value)
    with pytest.raises(ConfigError, match="backbone.name='qwen3_30b'"):  # a known model under a new name
        validate(make_cfg("experiment=smoke", "backbone=qwen3_30b_a3b", "backbone.name=qwen3_30b"))
    validate(make_cfg("experiment=smoke", "backbone.name=my_model", "backbone.source=hub", "backbone.hf_id=org/my-model"))
