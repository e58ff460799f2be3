"""pytest plugin (loaded with ``-p tracekit_report`` inside the sandbox): every test's outcome, as JSON, to the file
named by ``$TRACEKIT_REPORT``: ``{"tests": {nodeid: "passed"|"failed"|"skipped"}, "failures": {nodeid: text},
"collect_errors": [nodeid, ...]}``. A test passes when its setup, call and teardown all pass."""

import json
import os

_tests: dict = {}
_failures: dict = {}
_collect_errors: list = []


def pytest_collectreport(report):
    if report.failed:
        _collect_errors.append(report.nodeid)
        _failures[report.nodeid] = str(report.longrepr)[-2000:]


def pytest_runtest_logreport(report):
    previous = _tests.get(report.nodeid)
    if report.failed:
        _tests[report.nodeid] = "failed"
        _failures.setdefault(report.nodeid, str(report.longrepr)[-2000:])
    elif report.skipped and previous is None:
        _tests[report.nodeid] = "skipped"
    elif report.passed and report.when == "call" and previous is None:
        _tests[report.nodeid] = "passed"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("TRACEKIT_REPORT")
    if path:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"tests": _tests, "failures": _failures, "collect_errors": _collect_errors,
                       "exitstatus": int(exitstatus)}, f)
        os.replace(path + ".tmp", path)
