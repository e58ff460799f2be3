"""The default run's cost, fresh: ``bash scripts/install.sh && python -m tracekit`` (issue 50).

Wall time of the install and of the run, each stage's seconds (from every job's ``artifacts.json``: the default
experiment is a two-job multirun over one upstream), the peak resident memory (of the whole process tree, and of
its largest process), the machine (CPU model, cores, memory) and its load average (before, sampled during, after),
so a timing taken on a shared machine says so. The run is fresh: ``TRACEKIT_ROOT`` and ``TRACEKIT_CACHE`` point
into an empty directory, so no stage, model or warm start comes from an earlier run.

    python benchmarks/default_run.py --out benchmarks/results/default_run             # run only (installed already)
    python benchmarks/default_run.py --install --out ...                                # install.sh, then the run
    python benchmarks/default_run.py --install --venv /tmp/fresh-venv --out ...        # into a new virtualenv
    python benchmarks/default_run.py --out ... -- experiment=embedded                  # another preset's cost

Writes ``<out>/default_run.json`` and ``<out>/default_run.md`` (and copies the run's table and ladder chart).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict[str, object]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else ""
    mem = next((int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), None) if Path("/proc/meminfo").is_file() else None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cores_usable": cores, "cores_host": os.cpu_count(), "memory_gb": mem and round(mem / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version()}


class Sampler(threading.Thread):
    """Every ``period`` s: the process tree's summed RSS, its largest process's RSS, and the 1-minute load."""

    def __init__(self, pid: int, period: float = 0.5):
        super().__init__(daemon=True)
        import psutil

        self.proc, self.period, self.stop = psutil.Process(pid), period, threading.Event()
        self.peak_tree = self.peak_one = 0
        self.loads: list[float] = []

    def run(self) -> None:
        import psutil

        last_load = 0.0
        while not self.stop.is_set():
            try:
                procs = [self.proc, *self.proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            rss = []
            for p in procs:
                try:
                    rss.append(p.memory_info().rss)
                except psutil.Error:
                    continue
            self.peak_tree, self.peak_one = max(self.peak_tree, sum(rss)), max(self.peak_one, max(rss, default=0))
            if time.time() - last_load >= 5:
                self.loads.append(os.getloadavg()[0])
                last_load = time.time()
            self.stop.wait(self.period)


def timed(cmd: list[str], env: dict[str, str], log: Path) -> tuple[float, int, Sampler]:
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        sampler = Sampler(proc.pid)
        sampler.start()
        rc = proc.wait()
        sampler.stop.set()
        sampler.join()
    return time.time() - t0, rc, sampler


def stage_seconds(root: Path) -> list[dict[str, object]]:
    """Every job's stages (multirun jobs, or a single run): job, stage, cache hit, seconds."""
    out = []
    for art in sorted(root.glob("outputs/**/artifacts.json")):
        job = art.parent.relative_to(root / "outputs").as_posix()
        for a in json.loads(art.read_text()).values():
            out.append({"job": job, "stage": a["stage"], "hit": a["cache_hit"], "seconds": a["seconds"]})
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--install", action="store_true", help="time `bash scripts/install.sh` first")
    p.add_argument("--venv", type=Path, help="with --install: a new virtualenv to install into and run from")
    p.add_argument("--keep", type=Path, help="keep the run's root here (default: a temporary directory, removed)")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    root = a.keep or Path(tempfile.mkdtemp(prefix="tracekit-default-run-"))
    if root.exists() and any(root.iterdir()):
        p.error(f"--keep {root}: not empty (the run must be fresh)")
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TRACEKIT_ROOT": str(root), "TRACEKIT_CACHE": str(root / "cache"),
           "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    python = sys.executable
    record: dict[str, object] = {"machine": machine(), "load_before": list(os.getloadavg()),
                                 "command": "bash scripts/install.sh && python -m tracekit " + " ".join(overrides),
                                 "overrides": overrides, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if a.install:
        if a.venv:
            subprocess.run([sys.executable, "-m", "venv", str(a.venv)], check=True)
            env["PATH"] = f"{a.venv / 'bin'}{os.pathsep}{env['PATH']}"
            env["VIRTUAL_ENV"] = str(a.venv)
            python = str(a.venv / "bin" / "python")
        seconds, rc, _ = timed(["bash", "scripts/install.sh"], env, a.out / "install.log")
        record["install"] = {"seconds": round(seconds, 1), "rc": rc, "venv": str(a.venv) if a.venv else None}
        if rc:
            print(f"install.sh failed (exit {rc}): {a.out / 'install.log'}", file=sys.stderr)
            return 1
    else:
        record["install"] = None
    seconds, rc, sampler = timed([python, "-m", "tracekit", *overrides], env, a.out / "run.log")
    record.update({
        "run": {"seconds": round(seconds, 1), "rc": rc},
        "total_seconds": round(seconds + (record["install"] or {"seconds": 0})["seconds"], 1),
        "peak_rss_gb": {"tree": round(sampler.peak_tree / 2**30, 2), "largest_process": round(sampler.peak_one / 2**30, 2)},
        "load_during": {"mean": round(sum(sampler.loads) / max(1, len(sampler.loads)), 2),
                        "max": round(max(sampler.loads), 2) if sampler.loads else None, "samples": len(sampler.loads)},
        "load_after": list(os.getloadavg()), "stages": stage_seconds(root)})
    log_tail = (a.out / "run.log").read_text().splitlines()[-3:]
    record["last_log_lines"] = log_tail
    for name in ("results.md", "results.json", "paired.json", "ladder.png"):  # the table, its rows and its chart
        found = sorted(root.glob(f"outputs/multirun/*/{name}")) or sorted(root.glob(f"outputs/runs/*/{name}"))
        if found:
            shutil.copy2(found[-1], a.out / name)
    shutil.rmtree(a.out / "jobs", ignore_errors=True)
    for config in sorted(root.glob("outputs/multirun/*/*/config.yaml")) or sorted(root.glob("outputs/runs/*/config.yaml")):
        job = a.out / "jobs" / (config.parent.name if config.parent.name.isdigit() else "0")
        job.mkdir(parents=True, exist_ok=True)  # each job's resolved config and summary: what was measured
        for name in ("config.yaml", "summary.md", "artifacts.json"):  # artifacts.json: each stage's key
            if (config.parent / name).is_file():
                shutil.copy2(config.parent / name, job / name)
    (a.out / "default_run.json").write_text(json.dumps(record, indent=1) + "\n")
    m, ins = record["machine"], record["install"]
    lines = [f"# Default run, fresh (`{record['command'].strip()}`)", "",
             f"Machine: {m['cpu']}, {m['cores_usable']} usable cores, {m['memory_gb']} GB; {m['platform']}. "
             f"Load average (1 min) before {record['load_before'][0]:.2f}, during mean {record['load_during']['mean']} "
             f"(max {record['load_during']['max']}), after {record['load_after'][0]:.2f}. Started {record['started']}.",
             "", f"- install: {'not timed (installed already)' if ins is None else str(ins['seconds']) + ' s'}",
             f"- run: {record['run']['seconds']} s (exit {rc})", f"- total: {record['total_seconds']} s",
             f"- peak RSS: {record['peak_rss_gb']['tree']} GB (process tree), "
             f"{record['peak_rss_gb']['largest_process']} GB (largest process)", "",
             "| job | stage | cache | seconds |", "|---|---|---|---|"]
    lines += [f"| {s['job']} | {s['stage']} | {'hit' if s['hit'] else 'computed'} | {s['seconds']} |"
              for s in record["stages"]]
    lines += ["", "Last log lines:", "", "```", *log_tail, "```"]
    (a.out / "default_run.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if a.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
