"""Child side of the sandbox: run as ``python -I -B _sandbox_runner.py --root R --workdir W ...``.

Sets its own resource limits first (hard limits, so the untrusted code cannot raise them), moves fd 1 away so
anything the untrusted code prints goes to stderr, imports the trusted protocol, then serves JSON-line requests
from stdin (load, generate, open, call, finish, score) with JSON-line replies on the saved stdout. Before the
untrusted module is imported an audit hook is installed that denies (and records) writes outside the working
directory, process creation, sockets, native library loading and signals; every reply carries the violations
recorded since the previous one.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.util
import json
import os
import resource
import sys
import traceback

# the tracekit this file belongs to (the parent's ``--root``), before an installed one: the sandbox runs its parent's code
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tracekit.synthesis.protocol import EpisodeCore, Instance, find_env_class, score_actions  # noqa: E402
from tracekit.target_index import MOVED_MODULES  # noqa: E402
from tracekit.types import Message, ToolCall  # noqa: E402

MODULE_NAME = "tracekit_generated_env"
_violations: list[str] = []


def _set_limits(args: argparse.Namespace) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (args.memory, args.memory))
    resource.setrlimit(resource.RLIMIT_CPU, (args.cpu_total, args.cpu_total))
    resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize, args.fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _cpu_budget(seconds: float) -> None:
    """Soft CPU limit = CPU used so far + this request's budget (SIGXCPU ends the process past it)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(usage.ru_utime + usage.ru_stime + seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (min(soft, hard), hard))


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {  # event -> indices of path arguments that are written
    "os.remove": (0,), "os.rename": (0, 1), "os.mkdir": (0,), "os.rmdir": (0,), "os.chmod": (0,),
    "os.chown": (0,), "os.truncate": (0,), "os.link": (1,), "os.symlink": (1,), "os.utime": (0,),
    "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copymode": (1,), "shutil.copystat": (1,),
}
_PROCESS_EVENTS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "pty.spawn"}
_NETWORK_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
_OTHER_EVENTS = {"ctypes.dlopen": "native library loading", "os.kill": "signalling a process",
                 "os.killpg": "signalling a process"}


def _install_hook(workdir: str) -> None:
    root = os.path.realpath(workdir)

    def outside(path: object) -> str | None:
        if isinstance(path, int) or path is None:
            return None  # an already-open descriptor
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return repr(path)
        return None if real == root or real.startswith(root + os.sep) or real == os.devnull else real

    def deny(what: str) -> None:
        _violations.append(what)
        raise PermissionError(f"sandbox: {what} denied")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (list(args) + [None, None, 0])[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
            if writing and (where := outside(path)):
                deny(f"writing outside its directory: {where}")
        elif event in _PATH_EVENTS:
            for i in _PATH_EVENTS[event]:
                if i < len(args) and (where := outside(args[i])):
                    deny(f"writing outside its directory ({event}): {where}")
        elif event in _PROCESS_EVENTS:
            deny(f"starting a process ({event})")
        elif event in _NETWORK_EVENTS:
            deny(f"network access ({event})")
        elif event in _OTHER_EVENTS:
            deny(f"{_OTHER_EVENTS[event]} ({event})")

    sys.addaudithook(hook)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a module under the name it had before it moved (:data:`tracekit.target_index.MOVED_MODULES`): an
    environment package cached then imports its family's library by that name. The alias is a new module object
    holding the moved module's names (its classes are the same objects), so the moved module itself is left as is."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001 (importlib's signature)
        return importlib.util.spec_from_loader(name, self) if name in MOVED_MODULES else None

    def exec_module(self, module) -> None:  # noqa: ANN001
        moved = importlib.import_module(MOVED_MODULES[module.__name__])
        module.__dict__.update({k: v for k, v in vars(moved).items() if not k.startswith("__")})


def _where(exc: BaseException, module_path: str) -> str:
    """' (env_module.py line 12, in generate)' for the innermost frame in the untrusted module."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == module_path]
    if isinstance(exc, SyntaxError) or not frames:
        return ""
    f = frames[-1]
    return f" ({os.path.basename(f.filename)} line {f.lineno}, in {f.name})"


class Server:
    def __init__(self, workdir: str):
        self.workdir = workdir
        self.module_path = os.path.join(workdir, "env_module.py")
        self.env = None
        self.episodes: dict[str, object] = {}
        self.counter = 0

    def load(self, req: dict) -> dict:
        sys.meta_path.insert(0, _MovedModules())
        for name in req.get("preload", []):  # trusted imports, before the hook is installed
            importlib.import_module(name)

        _install_hook(self.workdir)
        spec = importlib.util.spec_from_file_location(MODULE_NAME, self.module_path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[MODULE_NAME] = module
        spec.loader.exec_module(module)
        self.env = find_env_class(module)(req.get("difficulty"))
        return self.env.info().model_dump(mode="json")

    def _env(self):
        if self.env is None:
            raise RuntimeError("no environment loaded")
        return self.env

    def generate(self, req: dict) -> list:
        out = []
        for z in req["seeds"]:
            inst = self._env().generate(int(z))
            if not isinstance(inst, Instance):
                raise TypeError(f"generate({z}) returned {type(inst).__name__}, not Instance")
            out.append(inst.model_dump(mode="json"))
        return out

    def open(self, req: dict) -> str:
        self.counter += 1
        handle = f"ep{self.counter}"
        self.episodes[handle] = EpisodeCore(self._env(), Instance.model_validate(req["instance"]))
        return handle

    def call(self, req: dict) -> dict:
        return self.episodes[req["handle"]].execute(ToolCall.model_validate(req["call"])).model_dump(mode="json")

    def finish(self, req: dict) -> dict:
        core = self.episodes.pop(req["handle"])
        return core.finish([Message.model_validate(m) for m in req["messages"]]).model_dump(mode="json")

    def score(self, req: dict) -> list:
        return [score_actions(self._env(), Instance.model_validate(job["instance"]),
                              [Message.model_validate(m) for m in job["actions"]]).model_dump(mode="json")
                for job in req["jobs"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--memory", type=int, required=True)
    ap.add_argument("--cpu-total", type=int, required=True)
    ap.add_argument("--fsize", type=int, required=True)
    args = ap.parse_args()
    _set_limits(args)
    os.chdir(args.workdir)
    sys.path.insert(0, args.root)
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # the untrusted code's prints go to stderr, never into the reply channel
    server = Server(args.workdir)
    import tracekit.synthesis.protocol  # noqa: F401  # deferred: trusted, imported after the limits and sys.path are set, before any untrusted code

    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        _cpu_budget(float(req.get("cpu", 10)))
        try:
            if op not in ("load", "generate", "open", "call", "finish", "score"):
                raise ValueError(f"unknown op {op!r}")
            reply = {"ok": True, "result": getattr(server, op)(req)}
        except MemoryError as e:
            reply = {"ok": False, "kind": "memory", "error": f"MemoryError{_where(e, server.module_path)}"}
        except BaseException as e:  # SystemExit from the module is a failure too, never our exit
            if isinstance(e, KeyboardInterrupt):
                raise
            reply = {"ok": False, "kind": "exception",
                     "error": f"{type(e).__name__}: {e}{_where(e, server.module_path)}"}
        reply["violations"] = list(_violations)
        _violations.clear()
        data = (json.dumps(reply, default=str) + "\n").encode()
        while data:
            data = data[os.write(reply_fd, data):]


if __name__ == "__main__":
    main()
