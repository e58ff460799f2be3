"""Hostile and broken generated modules fail validation with a precise reason; the sandbox's limits hold."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import procs
from tracekit.synthesis.sandbox import SandboxBackend, SandboxError, SandboxLimits, isolation
from tracekit.synthesis.validate import ValidationConfig, validate_source

VALID = (Path(__file__).parent / "data" / "synthesis" / "valid_env.py").read_text()
ESCAPE = "/tmp/tracekit_sandbox_escape_test.txt"
LIMITS = SandboxLimits(cpu_seconds=2, wall_seconds=60, memory_bytes=1 << 30)  # wall: far past the 2 s CPU limit on a loaded machine
CFG = ValidationConfig(n_seeds=50)


def hooked(where: str, code: str) -> str:
    """The valid module with ``code`` spliced in at ``# HOOK:<where>`` (indentation kept)."""
    marker = f"# HOOK:{where}"
    line = next(l for l in VALID.splitlines() if l.strip() == marker)
    indent = line[: len(line) - len(line.lstrip())]
    return VALID.replace(line, "\n".join(indent + c for c in code.splitlines()))


def replaced(old: str, new: str) -> str:
    assert old in VALID
    return VALID.replace(old, new)


# name -> (source, limits, failing check, substring of the reason)
HOSTILE = {
    "syntax_error": (hooked("module", "def broken(:"), LIMITS, "load", "SyntaxError"),
    "missing_import": (hooked("module", "import definitely_not_a_module_xyz"), LIMITS, "load",
                       "No module named 'definitely_not_a_module_xyz'"),
    "exception": (hooked("generate", "1 / 0"), LIMITS, "deterministic",
                  "ZeroDivisionError: division by zero (env_module.py line"),
    "sys_exit": (hooked("module", "import sys\nsys.exit(3)"), LIMITS, "load", "SystemExit"),
    "infinite_loop": (hooked("generate", "while True:\n    pass"), LIMITS, "deterministic", "CPU time limit exceeded"),
    "hang": (hooked("generate", "import time\ntime.sleep(600)"), SandboxLimits(wall_seconds=2, memory_bytes=1 << 30),
             "deterministic", "wall-time limit exceeded (2s)"),
    "huge_allocation": (hooked("module", "_blob = bytearray(64 << 30)"), LIMITS, "load", "memory limit (1024 MiB)"),
    "write_outside": (hooked("generate", f"try:\n    open({ESCAPE!r}, 'w').write('x')\nexcept Exception:\n    pass"),
                      LIMITS, "deterministic", f"writing outside its directory: {ESCAPE}"),
    "spawn_process": (hooked("generate", "import subprocess\nsubprocess.run(['true'])"), LIMITS, "deterministic",
                      "starting a process (subprocess.Popen)"),
    "network": (hooked("module", "import socket\nsocket.create_connection(('203.0.113.1', 80), timeout=1)"), LIMITS,
                "load", "network access (socket.connect)"),
    # the verifier expects a state the ground truth never produces (low battery mode still on)
    "ground_truth_wrong": (hooked("verify", "ok = final_state['wifi'] and final_state['low_battery_mode']\n"
                                            "return float(ok), ok"), LIMITS, "solvable",
                           "ground-truth solution scored reward 0"),
    "ignores_seed": (replaced('random.Random(f"wifi:{self.difficulty}:{seed}")', "random.Random(0)"), LIMITS,
                     "diverse", "1 distinct instances over 50 seeds"),
    "nondeterministic": (replaced('random.Random(f"wifi:{self.difficulty}:{seed}")', "random.Random()"), LIMITS,
                         "deterministic", "differs between two generations"),
    "always_rewards": (hooked("verify", "return 1.0, True"), LIMITS, "noop_scores_zero",
                       "an empty trajectory scored 1"),
    "schema_changed": (replaced('return tool_schemas(self.target, ["set_wifi_status", "get_wifi_status",',
                                'return [dict(t, function=dict(t["function"], description="Turn wifi on or off")) '
                                'for t in tool_schemas(self.target, ["set_wifi_status"])] + '
                                'tool_schemas(self.target, ["get_wifi_status",'),
                       LIMITS, "interface", "'set_wifi_status' differs from the target's schema at /function/description"),
    "foreign_tool": (replaced('"get_low_battery_mode_status"])', '"get_low_battery_mode_status"]) + [{"type": '
                              '"function", "function": {"name": "hack_the_planet", "parameters": {}}}]'), LIMITS,
                     "interface", "'hack_the_planet' is not a tool of target toolsandbox"),
}


@pytest.fixture(scope="module")
def reports():
    if os.path.exists(ESCAPE):
        os.remove(ESCAPE)
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = {name: pool.submit(validate_source, src, name, CFG, limits) for name, (src, limits, _, _) in HOSTILE.items()}
        futures["valid"] = pool.submit(validate_source, VALID, "valid", CFG, LIMITS)
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_module_fails_with_precise_reason(reports, name):
    _, _, check, reason = HOSTILE[name]
    report = reports[name]
    assert not report.passed
    failed = [c for c in report.checks if not c.passed]
    assert failed[0].name == check, report.reason
    assert reason in failed[0].detail, report.reason
    assert report.reason.startswith(check)


def test_pipeline_goes_on_and_valid_module_passes(reports):
    report = reports["valid"]
    assert report.passed, report.reason
    assert [c.name for c in report.checks] == ["load", "interface", "deterministic", "diverse", "solvable",
                                               "noop_scores_zero", "random_scores_low"]
    assert report.isolation["network"] == isolation()["network"]


def test_nothing_escaped(reports):
    assert not os.path.exists(ESCAPE)


def test_environment_is_scrubbed_and_workdir_private(monkeypatch):
    monkeypatch.setenv("TRACEKIT_FAKE_API_KEY", "sk-should-not-leak")
    src = replaced('state = {"device": device,',
                   'import os\n        state = {"env": dict(os.environ), "cwd": os.getcwd(), "device": device,')
    backend = SandboxBackend(src, LIMITS)
    try:
        state = backend.generate([0])[0].state
        workdir = backend.worker.workdir
    finally:
        backend.close()
    assert "TRACEKIT_FAKE_API_KEY" not in state["env"]
    assert set(state["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "TZ", "LITELLM_LOCAL_MODEL_COST_MAP",
                                 "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "LC_CTYPE"}
    assert state["cwd"] == os.path.realpath(workdir) and state["env"]["HOME"] == workdir
    assert not os.path.exists(workdir)  # deleted on close


def test_dead_worker_reports_instead_of_hanging():
    backend = SandboxBackend(hooked("generate", "import os\nos._exit(7)"), LIMITS)
    with pytest.raises(SandboxError, match="exited with status 7 during generate"):
        backend.generate([0])
    with pytest.raises(SandboxError, match="no longer usable"):
        backend.generate([1])
    backend.close()


def test_tool_errors_inside_the_sandbox_reach_the_agent():
    from tracekit.types import ToolCall

    backend = SandboxBackend(VALID, LIMITS)
    try:
        inst = next(i for i in backend.generate(list(range(10))) if i.state["low_battery_mode"])
        handle = backend.open(inst)
        msg = backend.call(handle, ToolCall(id="c1", name="set_wifi_status", arguments={"on": True}))
        assert msg.error and "Wifi cannot be turned on in low battery mode" in msg.content
        unknown = backend.call(handle, ToolCall(id="c2", name="rm_rf", arguments={}))
        assert unknown.error and "Tool 'rm_rf' not found" in unknown.content
        verdict = backend.finish(handle, [])
        assert verdict.reward == 0.0 and not verdict.success
    finally:
        backend.close()


def test_ground_truth_using_a_hidden_tool_is_named():
    src = replaced('solution.append(Call(name="set_wifi_status", arguments={"on": True}))',
                   'solution.append(Call(name="set_cellular_service_status", arguments={"on": True}))')
    report = validate_source(src, "hidden-tool", ValidationConfig(n_seeds=10), LIMITS)
    assert report.reason == ("solvable: seed 0: the ground truth calls tools the environment does not expose: "
                             "['set_cellular_service_status']")


def test_what_generated_environments_import_loads_no_native_library():
    """A generated environment imports the protocol and the target interfaces inside the sandbox, whose hook
    refuses native library loading (tests above): those modules stay plain Python (no torch, no ctypes)."""
    import sys

    code = ("import sys\nloaded = []\nsys.addaudithook(lambda e, a: loaded.append(a[0]) if e == 'ctypes.dlopen' else None)\n"
            "import tracekit.synthesis.protocol, tracekit.synthesis.targets\n"
            "from tracekit.synthesis.targets import target_policy, tool_schemas\n"
            "tool_schemas('toolsandbox', ['get_current_timestamp']), target_policy('coding')\n"
            "assert not loaded and 'torch' not in sys.modules, (loaded, 'torch' in sys.modules)\n")
    r = procs.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_package_cached_before_the_worlds_moved_imports_their_old_module_paths():
    """Issue 51 moved each world's library into tracekit/targets/<kind>/: a generated environment cached before
    imports its family's module by its old name, which the sandbox still serves (tracekit.target_index.MOVED_MODULES)."""
    src = "from tracekit.envs.toolsandbox_interface import TOOLSANDBOX_SYSTEM_PROMPT as OLD_PROMPT\n" + replaced(
        'state = {"device": device,', 'state = {"old_prompt": OLD_PROMPT, "device": device,')
    backend = SandboxBackend(src, LIMITS, target="toolsandbox")
    try:
        assert backend.generate([0])[0].state["old_prompt"].startswith("Don't make assumptions")
    finally:
        backend.close()
