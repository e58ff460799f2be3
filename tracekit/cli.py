"""The Hydra app: ``python -m tracekit [overrides]`` runs the configured stages.

    python -m tracekit                                # the default experiment (README)
    python -m tracekit stages=[rollout,evaluate]      # a chosen list of stages (+ missing inputs)
    python -m tracekit experiment=smoke               # a preset
    python -m tracekit -m thresholds.delta=0.1,0.2,0.3    # a multirun sweep
    python -m tracekit.reproduce table1 scale=embedded    # a paper table (tracekit/reproduce/)

Every run's first log line and ``summary.md`` state its preset and each value that differs from the paper's
(:mod:`tracekit.report.paper`), so a cut run never passes for a paper run.

What the user must fix ends the run with one ``tracekit:`` line on stderr and exit status 2, before any work where it
can be known then: a root the run dir cannot be written under, a cache a run with misses cannot write, a bad value or
an unresolvable interpolation, an endpoint that is not an OpenAI-compatible server. SIGINT and SIGTERM end it with one
line too (status 130 / 143) and ``summary.md`` saying ``interrupted``; unfinished artifacts resume on the next run.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from tracekit.coding.sandbox import system_binds
from tracekit.artifacts import StageCache, atomic_write_text, unwritable
from tracekit.config import USER_ERRORS, ConfigError, interpolation_message
from tracekit.schema import register_configs
from tracekit.llm.backbones import cache_root
from tracekit.pipeline import RunRecord
from tracekit.warmstart.shipped import install_shipped
from tracekit.report.ladder import LADDER_PNG, RESULTS_MD
from tracekit.report.preset import built_on_line, built_on_markdown, preset_cuts
from tracekit.report.logging import RESUMING_ENV, RunLogger, check_resumed_config, log_traceback_to_file
from tracekit.report.paper import cuts, cuts_dict, setting_line, setting_markdown
from tracekit.stages import build_pipeline
from tracekit.validate import needed_endpoints, probe_endpoints, validate

log = logging.getLogger("tracekit")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

register_configs()


def compose_config(overrides: list[str]) -> DictConfig:
    """The app's config for ``overrides`` through Hydra's compose API (no run dir, no logging), validated: what
    scripts and analyses that drive stages in process start from."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    validate(cfg)
    return cfg


def describe(e: BaseException) -> str:
    """``ExcType: message`` on one line."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM: raised in the main thread, so that the run's ``finally`` blocks run (its summary says
    ``interrupted``, locks are released, partial artifacts stay to resume from)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def catch_signals() -> None:
    """SIGINT and SIGTERM raise :class:`Interrupted` (where their handlers are the default, or the one-line handler
    ``python -m tracekit`` sets before its imports: one the parent set to ignore stays ignored)."""
    for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        handler = signal.getsignal(sig)
        if handler is default or getattr(handler, "tracekit_early", False):
            signal.signal(sig, _raise_interrupted)


def _signal_name(e: KeyboardInterrupt) -> str:
    return signal.Signals(getattr(e, "signum", signal.SIGINT)).name


def write_summary(run_dir: Path, cfg: DictConfig, record, failure: BaseException | None = None) -> None:
    """The run's Markdown summary: its status, stages (cache hits or computed) and each stage's report."""
    status = (f"interrupted ({_signal_name(failure)}): finished artifacts are kept, an unfinished one resumes on the "
              "next run" if isinstance(failure, KeyboardInterrupt)
              else f"failed ({describe(failure)})" if failure else "ok")
    lines = [f"# tracekit run `{cfg.name}`", "", f"Status: {status}", "", f"Run dir: `{run_dir}`", "",
             "## Setting relative to the paper", "", setting_markdown(cfg), "",
             *([md, ""] if (md := built_on_markdown(cfg)) else []), "## Stages", "",
             "| stage | key | cache | seconds |", "|---|---|---|---|"]
    for a in record.artifacts.values():
        lines.append(f"| {a['stage']} | `{a['key']}` | {'hit' if a['cache_hit'] else 'computed'} | {a['seconds']} |")
    for title, md in record.sections:
        lines += ["", f"## {title}", "", md]
    atomic_write_text(run_dir / "summary.md", "\n".join(lines) + "\n")


def also(e: BaseException, what: str) -> None:
    """Note on the run's first failure ``e`` what failed after it (its summary, its logger), for its one line."""
    try:
        e.tracekit_also = [*getattr(e, "tracekit_also", []), what]  # type: ignore[attr-defined]
    except (AttributeError, TypeError):  # an exception type that takes no attributes
        log.warning("after %s: %s", describe(e), what)


def _also(e: BaseException) -> str:
    return "".join(f" ({' '.join(w.split())})" for w in getattr(e, "tracekit_also", []))


def install_warm_start(cfg: DictConfig) -> None:
    """``warm_start=<name>``: the shipped warm start, verified (validate did), copied into the planted cache folder
    where every stage loads it from (:mod:`tracekit.warmstart.shipped`)."""
    if cfg.get("warm_start") is None:
        return
    path, copied = install_shipped(cfg.warm_start, cfg.backbone)
    log.info("warm start: %s %s", "installed the shipped copy in" if copied else "shipped copy already in", path)


def run(cfg: DictConfig) -> None:
    # the first line: the preset, every value that differs from the paper's, and from the preset it is built on
    log.info(setting_line(cfg) + built_on_line(cfg))
    run_dir = Path(cfg.paths.run_dir)
    continues = check_resumed_config(cfg, run_dir)  # --resume of a run dir: the same config, or one line
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    record = RunRecord(run_dir)
    failure = None
    try:
        record.logger = RunLogger(cfg, run_dir, continues)
        if record.logger.run is not None:  # a cut run's W&B config says so too
            record.logger.run.config.update({"paper_setting": cuts_dict(cfg)}, allow_val_change=True)
        pipeline, cache = build_pipeline(), StageCache(cfg.paths.cache_dir)
        to_compute = pipeline.to_compute(cfg, list(cfg.stages), cache)  # corrupt artifacts are named here
        log.info("stages to compute: %s", ", ".join(to_compute) or "none (all cached)")
        if to_compute and (why := unwritable(cache.root)):  # all hits: nothing is written there, a read-only one serves
            raise ConfigError(f"the cache paths.cache_dir={cache.root} cannot be written: {why}; this run computes "
                              f"{', '.join(to_compute)}: point TRACEKIT_CACHE at a writable directory with free space "
                              "(a run that is all cache hits needs no write)")
        probe_endpoints(cfg, [role for stage in to_compute for role in needed_endpoints(cfg, stage)])
        install_warm_start(cfg)
        pipeline.run(cfg, list(cfg.stages), cache, record)
    except BaseException as e:
        failure = e
        raise
    finally:  # the summary and the logger's end, whatever failed first; their own failure never replaces that one
        try:
            write_summary(run_dir, cfg, record, failure)
        except Exception as e:  # noqa: BLE001
            if failure is None:
                raise
            also(failure, f"summary.md could not be written either: {describe(e)}")
        if record.logger is not None:
            try:
                record.logger.finish(1 if failure else 0)
            except Exception as e:  # noqa: BLE001
                if failure is None:
                    raise
                also(failure, f"the run logger could not finish either: {describe(e)}")
    n, m = len(cuts(cfg)), len(preset_cuts(cfg))
    also_cut = f" and {m} from experiment={cfg.built_on.preset}'s" if m else ""
    log.info("summary: %s (%s)", run_dir / "summary.md",
             f"CUT: {n} values differ from the paper's{also_cut}, named in it" if n or m else "the paper's setting, no cut")
    if (run_dir / LADDER_PNG).is_file():  # the run evaluated: its last line names the table and the chart
        log.info("table: %s | chart: %s", run_dir / RESULTS_MD, run_dir / LADDER_PNG)


def discard_rejected_run(run_dir: Path, root_dir: Path) -> None:
    """Remove the run dir Hydra made before validation when it holds only Hydra's own files (its config copies
    and the log), then the parents that leaves empty, up to ``root_dir``."""
    hydra = HydraConfig.get()
    if any(p.name not in (hydra.output_subdir, f"{hydra.job.name}.log") for p in run_dir.iterdir()):
        return
    shutil.rmtree(run_dir)
    for parent in run_dir.parents:
        if root_dir.resolve() not in parent.resolve().parents:
            break
        try:
            parent.rmdir()
        except OSError:  # not empty: another run's
            break


DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # a disk that filled (or went read-only) during the run
_DISK_TEXTS = tuple(os.strerror(n) for n in DISK_ERRNOS)  # quoted by libraries' own errors (tokenizers: os error 28)


def disk_error(e: BaseException | None) -> tuple[str, str | None] | None:
    """(the OS's words, the file when known) when ``e``, or what it was raised from, is a disk that filled or went
    read-only: an OSError, or another library's exception quoting the OS's message; None otherwise."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return e.strerror or os.strerror(e.errno), e.filename
        if text := next((t for t in _DISK_TEXTS if t in str(e)), None):
            return text, None
        e = e.__cause__ or e.__context__
    return None


def _model_cache() -> str | None:
    return str(cache_root())


def report_failure(e: Exception, dirs: tuple[object, ...] = ()) -> int:
    """One line on the terminal, the traceback in the run's log file; the exit status (2: the user's to fix).
    ``dirs``: where the run writes (cache, run dir), to name the full one when the error names no file."""
    log_file = log_traceback_to_file(log, f"run failed: {describe(e)}", e)
    if isinstance(e, USER_ERRORS):
        print(f"tracekit: error: {' '.join(str(e).split())}{_also(e)}", file=sys.stderr)
        return 2
    if found := disk_error(e):
        what, filename = found
        full = next((why for d in (*dirs, _model_cache()) if d and (why := unwritable(str(d)))), None)
        where = (f"{what}: {filename}" if filename else full
                 or f"{what} writing under {' or '.join(map(str, dirs)) or 'the run dir or the cache'}")
        print(f"tracekit: error: {where}: free space there (or point TRACEKIT_CACHE and TRACEKIT_ROOT at another disk) "
              f"and run again: finished artifacts are kept, the unfinished one resumes{_also(e)}", file=sys.stderr)
        return 2
    print(f"tracekit: failed: {describe(e)}" + (f" (traceback: {log_file})" if log_file else "") + _also(e),
          file=sys.stderr)
    return 1


def task(cfg: DictConfig) -> dict[str, object]:
    """One run of the app on a composed config, as a Hydra job of a table (``tracekit.reproduce``): validate, run,
    and raise on failure (the traceback in the job's log file); its run dir and seconds."""
    t0 = time.time()
    validate(cfg)
    try:
        run(cfg)
    except Exception as e:
        log_traceback_to_file(log, f"run failed: {describe(e)}", e)
        raise
    return {"run_dir": str(cfg.paths.run_dir), "seconds": time.time() - t0}


def interrupted(e: KeyboardInterrupt, run_dir: object = None) -> int:
    """One line for a run stopped by SIGINT or SIGTERM; its exit status (128 + the signal's number)."""
    where = f" (run dir {run_dir})" if run_dir else ""
    print(f"tracekit: interrupted by {_signal_name(e)}: finished artifacts are kept and an unfinished one resumes: "
          f"run the same command again{where}{_also(e)}", file=sys.stderr)
    return 128 + int(getattr(e, "signum", signal.SIGINT))


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def app(cfg: DictConfig) -> None:
    if _OWN_FULL_ERROR:  # set for Hydra's own phase only (main): not for what the run starts
        os.environ.pop("HYDRA_FULL_ERROR", None)
    try:
        assign_job_devices(cfg, HydraConfig.get())  # a parallel sweep job: its own GPUs, before CUDA starts
        validate(cfg)
    except ConfigError as e:
        discard_rejected_run(Path(cfg.paths.run_dir), Path(cfg.paths.root_dir))
        print(f"tracekit: config error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        run(cfg)
    except KeyboardInterrupt as e:
        sys.exit(interrupted(e, cfg.paths.run_dir))
    except Exception as e:
        status = report_failure(e, (cfg.paths.cache_dir, cfg.paths.run_dir))
        if not in_sequential_sweep(HydraConfig.get()):
            sys.exit(status)
        # one variant of a sweep failing (say a strategy with no data) must not cost the others' runs and the
        # side-by-side table, which names the job without results; the sweep's process exits 1 at its end
        job = HydraConfig.get().job
        _FAILED_JOBS.append(f"job {job.num} ({' '.join(job.override_dirname.split(',')) or 'no overrides'})")


BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
_FAILED_JOBS: list[str] = []  # the failed jobs of a sequential sweep (this process), said when the sweep ends


def in_sequential_sweep(hc: Any) -> bool:
    """A multirun whose jobs run one after another in this process (Hydra's basic launcher)."""
    return hc.mode == RunMode.MULTIRUN and hc.launcher.get("_target_") == BASIC_LAUNCHER


def exit_if_jobs_failed() -> None:
    """After a sequential sweep: one line naming its failed jobs (each said when it failed, its traceback in its
    run dir's log) and exit status 1, so a script that runs a sweep sees it."""
    if _FAILED_JOBS:
        print(f"tracekit: {len(_FAILED_JOBS)} sweep job(s) failed, the others ran: {'; '.join(_FAILED_JOBS)}",
              file=sys.stderr)
        sys.exit(1)


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"

# Sweeps on a multi-GPU host: a joblib job's GPUs. Each job needs launcher.nproc GPUs (1 unless a training run spans
# several); the host's GPUs (CUDA_VISIBLE_DEVICES as the sweep was started with, else every GPU nvidia-smi lists) are
# cut into slots of that many, and a worker process takes the slot of the first job it runs (job number modulo the
# slots) and keeps it: joblib reuses workers, and a process's CUDA devices are fixed once CUDA starts in it, so the
# n_jobs workers running at once hold distinct slots while n_jobs <= slots. A SLURM (submitit) job gets its GPUs from
# the launcher (hydra.launcher.gpus_per_task or gpus_per_node): SLURM sets CUDA_VISIBLE_DEVICES in the job itself.
HOST_DEVICES_ENV = "TRACEKIT_HOST_DEVICES"  # the sweep's host GPUs, handed from the parent to its job processes
_WORKER_DEVICES: list[str] | None = None


def host_devices() -> list[str]:
    """The GPUs a sweep may hand out: CUDA_VISIBLE_DEVICES as set when the sweep started, else nvidia-smi's list."""
    for var in (HOST_DEVICES_ENV, "CUDA_VISIBLE_DEVICES"):
        if (value := os.environ.get(var)) is not None:
            return [d for d in value.split(",") if d.strip()]
    try:
        import subprocess

        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(line for line in listed.splitlines() if line.startswith("GPU "))]


def job_devices(job_num: int, per_job: int, host: list[str]) -> list[str]:
    """The devices of sweep job ``job_num`` (its worker's slot): slot ``job_num % (len(host) // per_job)``."""
    if per_job > len(host):
        raise ConfigError(f"launcher.nproc={per_job}: each sweep job needs {per_job} GPUs and this host has "
                          f"{len(host)} ({', '.join(host)}): lower launcher.nproc, or run the sweep on a larger host")
    slot = job_num % (len(host) // per_job)
    return host[slot * per_job:(slot + 1) * per_job]


def parallel_launcher(hydra_cfg: Any) -> str | None:
    """'joblib' or 'submitit' when the multirun's jobs run in parallel through that launcher, else None."""
    target = str(OmegaConf.select(hydra_cfg, "launcher._target_") or "")
    return "joblib" if "joblib" in target.lower() else "submitit" if "submitit" in target.lower() else None


def assign_job_devices(cfg: DictConfig, hydra_cfg: Any, env: dict[str, str] | None = None,
                       host: list[str] | None = None) -> list[str] | None:
    """Set this joblib sweep job's CUDA_VISIBLE_DEVICES in ``env`` (os.environ) from its job number (once per
    worker process: later jobs of the worker keep its devices); the devices, or None when nothing is assigned (no
    parallel joblib multirun, or a CPU host)."""
    global _WORKER_DEVICES
    env = os.environ if env is None else env
    if str(OmegaConf.select(hydra_cfg, "mode")).split(".")[-1] != "MULTIRUN" or parallel_launcher(hydra_cfg) != "joblib":
        return None
    if _WORKER_DEVICES is None:
        host = host_devices() if host is None else host
        if not host:
            return None
        per_job = max(1, int(cfg.launcher.nproc))
        _WORKER_DEVICES = job_devices(int(hydra_cfg.job.num), per_job, host)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(_WORKER_DEVICES)
    log.info("sweep job #%s: CUDA_VISIBLE_DEVICES=%s", hydra_cfg.job.num, ",".join(_WORKER_DEVICES))
    return _WORKER_DEVICES


def sweep_points(config: DictConfig) -> list[tuple[str, list[str]]]:
    """Every job of a multirun as the basic sweeper will launch it: (the swept values, e.g. ``moe.steps=0``, the
    job's overrides), from ``hydra.sweeper.params`` (a ``sweep=`` preset) and the command line, expanded by the
    sweeper's own ``split_arguments``."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    args = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    parsed = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader()).parse_overrides(args)
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    return [(" ".join(o for o in point if o.split("=", 1)[0] in swept) or " ".join(point), point)
            for point in BasicSweeper.split_arguments(parsed, None)[0]]


def sweep_problems(config: DictConfig) -> list[str]:
    """Each sweep job whose composed config would be refused: ``job #i (its swept values): why``; composed the way
    the launcher composes it (``load_sweep_config``) and checked by :func:`validate`, before any job runs."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

    loader = GlobalHydra.instance().config_loader()
    problems = []
    for i, (label, point) in enumerate(sweep_points(config)):
        try:
            job = loader.load_sweep_config(config, list(point))
            with open_dict(job):  # the job's config as the app gets it: without Hydra's own node
                del job["hydra"]
            validate(job)
        except ConfigError as e:
            why = str(e)
        except InterpolationResolutionError as e:
            why = interpolation_message(e)
        except (HydraException, OmegaConfBaseException) as e:  # an override the composition refuses (a type)
            cause = f" {e.__cause__}" if isinstance(e.__cause__, OmegaConfBaseException) else ""
            why = str(e) + cause
        else:
            continue
        problems.append(f"job #{i} ({label}): {' '.join(why.split())}")
    return problems


class ValidateSweep(Callback):
    """``-m``: every sweep point's composed config is validated before job #0 runs; a refused one ends the multirun
    in one line naming it and its value (exit 2), nothing launched (registered in ``conf/config.yaml``)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if parallel_launcher(config.hydra) == "joblib" and (host := host_devices()):
            try:  # a job needing more GPUs than the host has: refused before any job starts
                job_devices(0, max(1, int(config.launcher.nproc)), host)
            except ConfigError as e:
                print(f"tracekit: config error: {e}", file=sys.stderr)
                sys.exit(2)
            os.environ[HOST_DEVICES_ENV] = ",".join(host)  # the jobs cut the sweep's devices, not their own
        if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
            log.info("sweep points are validated as each job starts (sweeper %s)",
                     OmegaConf.select(config, "hydra.sweeper._target_"))
            return
        if problems := sweep_problems(config):
            n = len(sweep_points(config))
            print(f"tracekit: config error: {len(problems)} of {n} sweep jobs would be refused, so none was started: "
                  + "; ".join(problems), file=sys.stderr)
            sys.exit(2)


# Hydra's flags that print and write nothing (no run dir)
_INFO_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion",
               "--experimental-rerun")


def run_root(args: list[str]) -> tuple[Path, str] | None:
    """The directory this command's run dir (or multirun dir) goes under, as conf/config.yaml puts it, and what
    names it; None when the command writes no run dir (help, ``--cfg``) or an override places it itself."""
    if any(a.split("=")[0] in _INFO_FLAGS for a in args):
        return None
    if any(a.lstrip("+").startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for a in args):
        return None  # Hydra resolves it; a failure to make it is still one line (main)
    if not {"-m", "--multirun"} & set(args):  # the sweep dir is under $TRACEKIT_ROOT whatever paths.root_dir says
        for a in args:
            if a.lstrip("+").startswith("paths.root_dir="):
                value = a.split("=", 1)[1]
                return (Path(value).expanduser(), f"paths.root_dir={value}") if value and "${" not in value else None
    env = os.environ.get("TRACEKIT_ROOT")
    if env:
        return Path(env).expanduser(), f"TRACEKIT_ROOT={env}"
    return Path.cwd(), f"the working directory {Path.cwd()} (TRACEKIT_ROOT is unset)"


def root_problem(args: list[str]) -> str | None:
    """Why this command's run dir cannot be written (a file in the way, read-only, no permission, no space), as one
    line saying what to do; None when it can (or the command writes none)."""
    found = run_root(args)
    if found is None:
        return None
    root, named = found
    why = unwritable(root)
    if why is None:
        return None
    cache = root / "outputs" / "cache"
    reuse = (f" (its cache can still serve a run that is all cache hits, read-only: TRACEKIT_CACHE={cache})"
             if "TRACEKIT_CACHE" not in os.environ and cache.is_dir() else "")
    return (f"{named}: {why}: every run writes its run dir under it (outputs/runs/); point TRACEKIT_ROOT at a "
            f"writable directory with free space{reuse}")


def override_behind(e: BaseException, args: list[str]) -> str | None:
    """One line naming the command-line override whose ``${...}`` fails the way ``e`` does (Hydra's phase reports
    the key that uses it: ``name=${oc.env:UNSET}`` surfaces as ``hydra.run.dir``, which holds ``${name}``); None when
    no override's interpolation fails so on its own."""
    from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

    def first_line(x: BaseException) -> str:
        return " ".join(str(x).split("\n")[0].split())

    for a in args:
        key, sep, value = a.lstrip("+").partition("=")
        if not sep or "${" not in value or key.startswith("hydra."):
            continue
        try:
            probe = OmegaConf.create({})
            OmegaConf.update(probe, key, value, force_add=True)
            OmegaConf.to_container(probe, resolve=True)
        except InterpolationResolutionError as p:
            if first_line(p) == first_line(e):
                user_key = getattr(e, "full_key", None)
                via = f" (the override is used by {user_key})" if user_key and user_key != key else ""
                return interpolation_message(p, probe) + via
        except (OmegaConfBaseException, ValueError):
            continue
    return None


def argument_problem(args: list[str]) -> str | None:
    """Why Hydra's command line parser refuses ``args`` (a flag such as ``-m`` between overrides), as one line with
    the command in the order it takes (flags first); None when it parses."""
    from hydra._internal.utils import get_args_parser

    class Refused(Exception):
        pass

    parser = get_args_parser()
    parser.error = lambda message: (_ for _ in ()).throw(Refused(message))  # its own prints the usage and exits
    try:
        parser.parse_args(args)
    except Refused as e:
        overrides = [a for a in args if not a.startswith("-") and "=" in a]
        flags = [a for a in args if a not in overrides]
        return (f"{e}: Hydra's flags go before the overrides: python -m tracekit "
                f"{' '.join([*flags, *overrides])}")
    return None


def exposed_root_problem(args: list[str]) -> str | None:
    """Why the config refuses a run whose root lies inside a directory the coding jail binds into every command
    (the coding target refuses such a root: an agent could read the cache there), found by composing and validating
    it before Hydra makes the run dir (or a multirun's sweep dir) in it, a multirun as its first sweep point; None
    for any other root or target."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    found = run_root(args)
    if found is None:
        return None
    root = os.path.realpath(found[0])
    if not any(root == b or root.startswith(b.rstrip("/") + "/") for b in system_binds()):
        return None
    own_root = any(a.lstrip("+").startswith("paths.root_dir=") for a in args)
    try:
        parser, overrides = OverridesParser.create(), []
        for a in args:
            if a.startswith("-"):
                continue
            o = parser.parse_override(a)
            overrides.append(f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"
                             if o.is_sweep_override() else a)
        compose_config([*overrides, *([] if own_root else [f"paths.root_dir={found[0]}"])])
    except ConfigError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - an override Hydra refuses: its own one line comes from Hydra's phase
        return None
    return None


def override_problem(e: BaseException, args: list[str]) -> str | None:
    """One line naming the command-line override Hydra's override grammar refuses (the exception names only the
    character), saying that quoting the value works where it holds characters the grammar takes only quoted (a
    non-ASCII name); None when every override parses alone."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for a in args:
        if a.startswith("-") or "=" not in a:
            continue
        try:
            parser.parse_override(a)
        except HydraException as p:
            why = " ".join(str(p).split("\n")[0].split())
            key, _, value = a.partition("=")
            hint = ""
            if "${" in value and value.count("{") != value.count("}"):
                hint = ": an interpolation ${...} opened and never closed"
            elif not value.isascii() or any(c in value for c in " ;&|<>()"):
                hint = (f": the grammar takes such characters only in a quoted value: "
                        f"'{key}=\"{value}\"' (quoted for the shell too)")
            return f"the override {a!r} cannot be parsed ({why}){hint}"
    return None


def resume_args(args: list[str]) -> list[str]:
    """``--resume <dir>``: the run (or multirun) directory of an earlier run, run again in place: its stages resume
    from the cache, its W&B run continues (the id derives from the directory: report.logging.wandb_run_id), and a
    config that differs from the one it was started with is refused (report.logging.check_resumed_config). Becomes
    ``hydra.run.dir=<dir>``, or ``hydra.sweep.dir=<dir>`` for a multirun's directory (jobs 0, 1, ... inside)."""
    if not any(a == "--resume" or a.startswith("--resume=") for a in args):
        return args
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if a == "--resume" or a.startswith("--resume="):
            value = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            i += 1 if "=" in a else 2
            path = Path(value).expanduser().resolve() if value else None
            if path is None or not path.is_dir():
                raise ValueError(f"--resume {value or '<missing>'}: not a directory (give the run dir of an earlier "
                                 "run: outputs/runs/<time>_<name>, or a multirun's outputs/multirun/<time>_<name>)")
            jobs = [p for p in path.iterdir() if p.name.isdigit() and (p / "config.yaml").is_file()]
            if not jobs and not (path / "config.yaml").is_file():
                raise ValueError(f"--resume {path}: no earlier run there (no config.yaml, nor multirun jobs 0, 1, ...)")
            out += [f"hydra.sweep.dir={path}", "hydra.mode=MULTIRUN"] if jobs else [f"hydra.run.dir={path}",
                                                                                  "hydra.mode=RUN"]
            continue
        out.append(a)
        i += 1
    return out


_OWN_FULL_ERROR = False  # main set HYDRA_FULL_ERROR: Hydra raises what fails in its phase, main says it in one line


def main() -> None:
    """``python -m tracekit``: the root checked before Hydra writes anything, SIGINT and SIGTERM caught, and what
    fails in Hydra's own phase (an override, an interpolation, the run dir) said in one line."""
    global _OWN_FULL_ERROR
    from hydra.errors import HydraException
    from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

    try:
        args = resume_args(sys.argv[1:])
        if args != sys.argv[1:]:  # this run and its sweep jobs (other processes, too) resume: RunLogger, run()
            os.environ[RESUMING_ENV] = "1"
        sys.argv[1:] = args
    except ValueError as e:
        print(f"tracekit: error: {e}", file=sys.stderr)
        sys.exit(2)
    if why := argument_problem(sys.argv[1:]) or root_problem(sys.argv[1:]):
        print(f"tracekit: error: {why}", file=sys.stderr)
        sys.exit(2)
    if why := exposed_root_problem(sys.argv[1:]):  # nothing may be written there, the run dir included
        print(f"tracekit: config error: {why}", file=sys.stderr)
        sys.exit(2)
    catch_signals()
    logging.raiseExceptions = False  # a log line that cannot be written (a full disk) is dropped, not a traceback
    _OWN_FULL_ERROR = "HYDRA_FULL_ERROR" not in os.environ
    if not _OWN_FULL_ERROR:  # the user asked for Hydra's full tracebacks
        app()
        exit_if_jobs_failed()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        app()
    except KeyboardInterrupt as e:  # before the run started (composing, validating)
        sys.exit(interrupted(e))
    except InterpolationResolutionError as e:
        print(f"tracekit: config error: {override_behind(e, sys.argv[1:]) or interpolation_message(e)}", file=sys.stderr)
        sys.exit(2)
    except (HydraException, OmegaConfBaseException) as e:  # an override Hydra refused, an unknown config group
        cause = f" {e.__cause__}" if isinstance(e.__cause__, OmegaConfBaseException) else ""
        why = override_problem(e, sys.argv[1:]) or " ".join((str(e) + cause).split())
        print(f"tracekit: config error: {why}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # the run dir (or its files) could not be written after all
        print(f"tracekit: error: cannot write the run dir: {describe(e)}; point TRACEKIT_ROOT at a writable "
              "directory with free space", file=sys.stderr)
        sys.exit(2)
    finally:
        if _OWN_FULL_ERROR:
            os.environ.pop("HYDRA_FULL_ERROR", None)
    exit_if_jobs_failed()
