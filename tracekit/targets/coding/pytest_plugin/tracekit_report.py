"""The test run's reporter, run inside the sandbox as ``python -B tracekit_report.py --channel W --key-fd K --repo R
--package P[,P...] --protected D[,D...] -- <pytest args>`` (standard library + pytest; the design:
:func:`tracekit.targets.coding.repo.run_tests`).

1. Before pytest starts and before any code of the task's tree is imported: the 32-byte key is read from fd ``K``
   and the fd closed (only this module's closure holds it), and the primitives the reporter writes with
   (``os.write``, SHA-256) are captured.
2. pytest runs in this process with this module registered as a plugin object (``pytest.main(plugins=[...])``).
   At ``pytest_sessionstart`` (configuration done, nothing of the tree imported yet) it snapshots the identity of
   pytest's internals: every function, class and descriptor of the ``_pytest``/``pytest``/``pluggy`` modules, of
   this module, ``builtins``, ``hmac``/``hashlib``, each function's code object, the hook callers and their
   implementations, and the ``sys.modules`` entries of those modules.
3. From then on an audit hook (PEP 578: it cannot be removed) reports what no test run of a package does:
   opening a protected path (the test directories) for writing, removing, renaming or truncating one; listing or
   opening ``/proc/self/fd`` or a process's ``mem``; ``gc.get_objects``/``get_referrers``/``get_referents`` (the
   way to the reporter's key); a trace or profile function in place at any audited event; another
   audit hook; replacing a function's code.
   After each test (and after collection and at the end) it checks: the snapshot still holds (hook implementations
   added only by pristine conftest modules of the tree); no tracer or profiler (``sys.gettrace``/``getprofile``,
   ``threading``'s hooks); every ``sys.modules`` entry of the task's packages is a file inside the tree; the import
   system's finders and hooks are still there (one added since only by the tree's own code); the test's module is
   the test file it was collected from, loaded by pytest's import hook, its function the one collected, with the
   same code, from that file; the report objects are pytest's own class. A failed check is a signed ``tamper``
   record.
4. Every record is one JSON line on fd ``W`` (an inherited pipe; no path anywhere), signed with HMAC-SHA256 under
   the key and numbered: ``start``, one ``test`` per test (outcome, failure text), ``collect_error``, ``tamper``,
   and last ``end`` (pytest's exit status), after which the process exits with that status.
"""

import json
import os
import sys
import threading

_write = os.write  # captured before any code of the tree runs
_getpid = os.getpid
_dumps = json.dumps


def _signer(key: bytes):
    """HMAC-SHA256 under ``key``, built from primitives captured now (no module attribute looked up later)."""
    import _hashlib

    sha = _hashlib.openssl_sha256
    block = 64
    k = key + b"\0" * (block - len(key))
    ipad, opad = bytes(b ^ 0x36 for b in k), bytes(b ^ 0x5C for b in k)
    del key, k

    def sign(msg: bytes) -> str:
        return sha(opad + sha(ipad + msg).digest()).hexdigest()

    return sign


def _args(argv: list) -> tuple[dict, list]:
    sep = argv.index("--")
    opts, rest = argv[:sep], argv[sep + 1:]
    return {opts[i].lstrip("-"): opts[i + 1] for i in range(0, len(opts), 2)}, rest


class Reporter:
    """The pytest plugin object: collects outcomes, checks integrity, writes signed records."""

    import pytest as _pytest_mod

    def __init__(self, channel: int, sign, repo: str, packages: tuple, protected: tuple):
        self._channel, self._sign, self._seq = channel, sign, 0
        self.repo = os.path.realpath(repo)
        self.packages = packages
        self.outcomes: dict = {}
        self.failures: dict = {}
        self.snapshot: dict | None = None
        self.hooks: dict | None = None
        self.reported: set = set()
        self.collected: dict = {}
        self.pid = _getpid()
        self.protected = tuple(os.path.realpath(p) for p in protected)
        self.armed = False

    # ------------------------------------------------------------ the audit hook

    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.truncate", "os.chmod", "os.chown", "os.utime",
                   "os.link", "os.symlink", "os.mkdir", "shutil.rmtree", "shutil.move", "shutil.copyfile")
    ALWAYS = ("gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.addaudithook")

    def _protected_path(self, path) -> bool:
        if isinstance(path, bytes):
            path = path.decode("utf-8", "replace")
        if not isinstance(path, str):
            return False
        real = os.path.realpath(path)
        return any(real == p or real.startswith(p + os.sep) for p in self.protected)

    @staticmethod
    def _peeks(path) -> bool:
        if isinstance(path, bytes):
            path = path.decode("utf-8", "replace")
        if not isinstance(path, str) or not path.startswith("/proc/"):
            return False
        parts = os.path.normpath(path).split("/")
        return len(parts) >= 4 and parts[3] in ("fd", "fdinfo", "mem", "environ", "map_files")

    def audit_hook(self):
        """The hook (installed by :func:`main`, armed at the snapshot): a finding is emitted at once."""
        emit, protected, peeks, pid = self.emit, self._protected_path, self._peeks, self.pid
        gettrace, getprofile = sys.gettrace, sys.getprofile

        def hook(event, args):
            if event in ("builtins.id", "object.__getattr__") or not self.armed or _getpid() != pid:
                return  # (the frequent ones first)
            what = None
            if event == "open" and args:
                mode, flags = (args[1] or ""), (args[2] or 0)
                writes = any(c in str(mode) for c in "wax+") or (isinstance(flags, int) and flags & self.WRITE_FLAGS)
                if writes and protected(args[0]):
                    what = f"opened the protected {args[0]!r} for writing"
                elif peeks(args[0]):
                    what = f"opened {args[0]!r}"
            elif event in ("os.listdir", "os.scandir") and args and peeks(args[0]):
                what = f"listed {args[0]!r}"
            elif event in self.PATH_EVENTS and args and any(protected(a) for a in args[:2]):
                what = f"{event} on the protected {args[0]!r}"
            elif event in self.ALWAYS:
                what = f"called {event}"
            elif event == "object.__setattr__" and len(args) >= 2 and args[1] == "__code__":
                what = f"replaced the code of {getattr(args[0], '__qualname__', args[0])!r}"
            elif gettrace() is not None or getprofile() is not None:  # (doctest's settrace(None) is no finding)
                what = f"a trace or profile function was set (seen at {event})"
            if what is not None:
                self.armed = False  # (emitting opens nothing, but one finding per event is enough)
                try:
                    emit("tamper", where="audit", what=what[:300])
                finally:
                    self.armed = True

        return hook

    # ------------------------------------------------------------ the channel

    def emit(self, kind: str, **fields) -> None:
        if _getpid() != self.pid:  # a forked child of the tree's code says nothing in our name
            return
        body = _dumps({"seq": self._seq, "kind": kind, **fields}, sort_keys=True)
        line = (_dumps({"body": body, "mac": self._sign(body.encode())}) + "\n").encode()
        self._seq += 1
        view = memoryview(line)
        while view:
            n = _write(self._channel, view)
            view = view[n:]

    def tamper(self, where: str, problems: list) -> None:
        for p in problems[:20]:
            self.emit("tamper", where=where, what=p[:300])

    # ------------------------------------------------------------ the snapshot

    SNAPSHOT_PREFIXES = ("_pytest", "pytest", "pluggy")
    SNAPSHOT_MODULES = ("builtins", "hmac", "hashlib", "_hashlib", "json", "os", "importlib",
                        "importlib._bootstrap", "importlib._bootstrap_external", "importlib.util")

    def _modules(self) -> dict:
        out = {}
        for name, mod in list(sys.modules.items()):
            if mod is None:
                continue
            if name in self.SNAPSHOT_MODULES or name.split(".")[0] in self.SNAPSHOT_PREFIXES or \
                    name == __name__:
                out[name] = mod
        return out

    @staticmethod
    def _watched(value) -> bool:
        return callable(value) or isinstance(value, (type(sys), property, staticmethod, classmethod))

    def _snapshot(self, mods: dict) -> tuple[list, list]:
        """(entries, namespaces): ``(namespace, key, object, label)`` of every callable, class and descriptor the
        modules and their classes define, and per namespace its size and watched keys (an addition changes the
        size). A replaced code object is the audit hook's to report (reading ``__code__`` here is an audit event
        per function per test)."""
        entries, spaces, seen = [], [], set()
        for name, mod in mods.items():
            try:
                ns = vars(mod)
            except TypeError:
                continue
            keys = frozenset(k for k, v in list(ns.items()) if self._watched(v))
            spaces.append((name, mod, ns, len(ns), keys))
            entries += [(ns, k, ns[k], f"{name}.{k}") for k in keys]
            for k in keys:
                cls = ns[k]
                if isinstance(cls, type) and cls.__module__ in mods and id(cls) not in seen:
                    seen.add(id(cls))
                    cns = cls.__dict__
                    ckeys = frozenset(c for c, v in list(cns.items()) if self._watched(v))
                    spaces.append((f"{name}.{k}", None, cns, len(cns), ckeys))
                    entries += [(cns, c, cns[c], f"{name}.{k}.{c}") for c in ckeys]
        return entries, spaces

    def _snapshot_problems(self) -> list:
        out = []
        for ns, k, obj, label in self.snapshot:  # (``is``: ``id()`` is an audit event)
            if ns.get(k) is not obj:
                out.append(f"{label} changed since the session started")
        for name, mod, ns, n, keys in self.spaces:
            if mod is not None and sys.modules.get(name) is not mod:
                out.append(f"sys.modules[{name!r}] replaced since the session started")
            if len(ns) != n:
                out += [f"{name}.{k} added to pytest's internals since the session started"
                        for k, v in list(ns.items()) if k not in keys and self._watched(v)
                        and not isinstance(v, type(sys))]
        return out

    def _hook_impls(self, pm) -> dict:
        out = {f"pluginmanager.{a}": id(getattr(getattr(pm, a, None), "__func__", getattr(pm, a, None)))
               for a in ("_hookexec", "_inner_hookexec")}
        for name, caller in list(vars(pm.hook).items()):
            out[f"hook {name}"] = id(caller)
            try:
                impls = caller.get_hookimpls()
            except AttributeError:
                continue
            for impl in impls:
                out[f"hook {name} impl {id(impl.function)}"] = (id(impl.function), id(impl.plugin))
        return out

    def _pristine_conftest(self, plugin) -> bool:
        """A conftest module of the tree (all of them are the task's own: the patch's conftests are never taken)."""
        f = getattr(plugin, "__file__", None)
        return bool(f) and os.path.basename(f) == "conftest.py" and self._inside(f)

    def _inside(self, path: str) -> bool:
        real = os.path.realpath(path)
        return real == self.repo or real.startswith(self.repo + os.sep)

    def check(self, where: str, item=None) -> None:
        problems = []
        if self.snapshot is not None:
            problems += self._snapshot_problems()
            pm = self.config.pluginmanager
            hooks = self._hook_impls(pm)
            for k, v in self.hooks.items():
                if hooks.get(k) != v:
                    problems.append(f"{k} changed or removed since the session started")
            for k in hooks.keys() - self.hooks.keys():
                plugin = next((p for p in pm.get_plugins() if isinstance(hooks[k], tuple) and id(p) == hooks[k][1]),
                              None)
                if not (k.startswith("hook ") and " impl " in k and self._pristine_conftest(plugin)):
                    problems.append(f"{k} registered since the session started (not by a conftest of the tree)")
        if self.snapshot is not None:
            problems += self._import_problems()
        if sys.gettrace() is not None or sys.getprofile() is not None:
            problems.append("a trace or profile function is set (sys.settrace/setprofile)")
        for hook in ("_trace_hook", "_profile_hook"):
            if getattr(threading, hook, None) is not None:
                problems.append(f"threading.{hook} is set (threading.settrace/setprofile)")
        for name, mod in list(sys.modules.items()):
            if name.split(".")[0] in self.packages:
                f = getattr(mod, "__file__", None)
                if not isinstance(f, str) or not self._inside(f):
                    problems.append(f"sys.modules[{name!r}] is not a file of the task's tree ({f!r})")
        if item is not None:
            problems += self._item_problems(item)
        if problems:
            self.tamper(where, problems)

    @staticmethod
    def _import_system() -> tuple:
        return tuple(map(id, sys.meta_path)), tuple(map(id, sys.path_hooks))

    def _import_problems(self) -> list:
        """The import system's finders and hooks of the snapshot are all still there, in order; one added since
        is an object of a class of the tree (a package may install its own finder: toolz's ``tlz`` does)."""
        out = []
        for what, now, then in (("sys.meta_path", sys.meta_path, self.importers[0]),
                                ("sys.path_hooks", sys.path_hooks, self.importers[1])):
            if tuple(i for i in map(id, now) if i in then) != then:
                out.append(f"{what}: an entry of pytest's import system was removed or moved")
            for obj in now:
                if id(obj) in then:
                    continue
                owner = obj if isinstance(obj, type) or type(obj).__name__ == "function" else type(obj)
                mod = sys.modules.get(getattr(owner, "__module__", None) or "")
                f = getattr(mod, "__file__", None)
                if not (isinstance(f, str) and self._inside(f)):
                    out.append(f"{what}: {obj!r} added, not an object of the task's own code")
        return out

    def _item_problems(self, item) -> list:
        import inspect

        out = []
        obj0 = getattr(item, "obj", None)
        if self.collected.get(item.nodeid, (id(obj0), id(getattr(obj0, "__code__", None)))) != \
                (id(obj0), id(getattr(obj0, "__code__", None))):
            out.append(f"{item.nodeid}: its test function was replaced after collection")
        path = os.path.realpath(str(getattr(item, "path", "")))
        mod = getattr(item, "module", None)
        f = getattr(mod, "__file__", None)
        if mod is not None and (not isinstance(f, str) or os.path.realpath(f) != path):
            out.append(f"{item.nodeid}: its module is {f!r}, not the test file it was collected from")
        loader = getattr(getattr(mod, "__spec__", None), "loader", None)
        if mod is not None and (id(loader) not in self.importers[0] or
                                type(loader).__name__ != "AssertionRewritingHook"):
            out.append(f"{item.nodeid}: its module was not loaded by pytest's import hook ({loader!r})")
        obj = getattr(item, "obj", None)
        fn = getattr(obj, "__func__", obj)
        try:
            fn = inspect.unwrap(fn)
        except ValueError:
            pass
        code = getattr(fn, "__code__", None)
        if code is not None and os.path.realpath(code.co_filename) != path:
            out.append(f"{item.nodeid}: its function's code comes from {code.co_filename!r}, not its test file")
        return out

    # ------------------------------------------------------------ pytest hooks

    def pytest_configure(self, config):
        self.config = config

    @_pytest_mod.hookimpl(tryfirst=True)
    def pytest_collection(self, session):  # every plugin configured and started, nothing of the tree imported
        import _pytest.reports

        self.report_types = (_pytest.reports.TestReport, _pytest.reports.CollectReport)
        self.snapshot, self.spaces = self._snapshot(self._modules())
        self.hooks = self._hook_impls(self.config.pluginmanager)
        self.importers = self._import_system()
        self.armed = True

    def pytest_collectreport(self, report):
        if type(report) not in self.report_types:
            self.tamper("collection", [f"a collect report of class {type(report)!r}"])
        if report.failed:
            self.emit("collect_error", nodeid=report.nodeid, text=str(report.longrepr)[-2000:])

    def pytest_collection_finish(self, session):
        for item in session.items:  # what each test will call (a replacement later is tampering)
            obj = getattr(item, "obj", None)
            self.collected[item.nodeid] = (id(obj), id(getattr(obj, "__code__", None)))
        self.check("collection")

    @_pytest_mod.hookimpl(hookwrapper=True, trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        yield
        for nodeid in list(self.outcomes):  # (a test reported outside its protocol: none, normally)
            self._report(nodeid)
        self.check("end")  # before pytest unconfigures (its legacypath plugin then undoes its own patches)

    def pytest_runtest_logreport(self, report):
        if type(report) not in self.report_types:
            self.tamper(report.nodeid, [f"a test report of class {type(report)!r}"])
        previous = self.outcomes.get(report.nodeid)
        if report.failed:
            self.outcomes[report.nodeid] = "failed"
            self.failures.setdefault(report.nodeid, str(report.longrepr)[-2000:])
        elif report.skipped and previous is None:
            self.outcomes[report.nodeid] = "skipped"
        elif report.passed and report.when == "call" and previous is None:
            self.outcomes[report.nodeid] = "passed"

    @_pytest_mod.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        yield
        self.check(item.nodeid, item)
        self._report(item.nodeid)

    del _pytest_mod

    def _report(self, nodeid: str) -> None:
        if nodeid in self.outcomes and nodeid not in self.reported:
            self.reported.add(nodeid)
            self.emit("test", nodeid=nodeid, outcome=self.outcomes[nodeid],
                      text=self.failures.get(nodeid, "")[-2000:])

    def finish(self, exitstatus: int) -> None:
        self.emit("end", exitstatus=int(exitstatus), tests=len(self.reported))


def main() -> int:
    opts, pytest_args = _args(sys.argv[1:])
    fd = int(opts["key-fd"])
    key = os.read(fd, 64)
    os.close(fd)
    sign = _signer(key)
    del key
    repo = opts["repo"]
    sys.path.insert(0, repo)
    import pytest

    protected = tuple(os.path.join(repo, p) for p in opts.get("protected", "").split(",") if p)
    reporter = Reporter(int(opts["channel"]), sign, repo, tuple(p for p in opts["package"].split(",") if p),
                        protected)
    sys.addaudithook(reporter.audit_hook())
    reporter.emit("start")
    rc = int(pytest.main(pytest_args, plugins=[reporter]))
    reporter.finish(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
