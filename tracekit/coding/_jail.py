"""The jail of one sandboxed command (started by :mod:`tracekit.coding.sandbox` as ``python -I -S -B _jail.py SPEC --
ARGV...``; standard library only, so any interpreter runs it).

``SPEC`` is a dict built by ``sandbox._spec`` (the view, the limits, the accounting), ``marshal``-ed and hex-encoded
(the same interpreter reads it; no import on the path of every command); what happens:

1. (P0, in the host's PID namespace) joins the command's cgroups (``spec["cgroup_procs"]``), then
   ``unshare(2)``: fresh mount, PID, network, IPC, UTS and cgroup namespaces, and with ``mode="userns"`` (not root)
   a user namespace in which the caller's uid is root (so it may mount); forks P1 and exits with its status.
2. (P1, PID 1 of the new PID namespace, killed when P0 dies) builds the command's root: an empty tmpfs into which
   only ``spec["mounts"]`` are bound (read-only: /usr, the libraries, the interpreter's prefix with the task runtime
   over its site directories, tracekit's pytest plugin; writable: the task copy); masks (over a secret or a copy of
   a task's package inside a bound directory) are empty read-only tmpfs or an empty read-only file (``optional``:
   skipped where the view has no such path), /etc holds a few
   generated files and read-only binds of loader files, /dev a few device nodes, /tmp /var/tmp /dev/shm are fresh
   size-limited tmpfs, /proc is a fresh procfs of the new PID namespace; then ``pivot_root(2)`` into it, the old root
   detached (nothing of the host but what was bound exists for the command), the new root remounted read-only.
   It says ``ready`` on the status pipe (or one ``error`` line naming what failed, exit 125).
3. (P2, the command) no new privileges, rlimits, and as root: uid/gid ``nobody``, no groups; with
   ``spec["command_userns"]`` its own user namespace (the mount namespace then belongs to an ancestor namespace, so
   nothing mounted here can be unmounted or made writable, and RLIMIT_NPROC counts only this command's processes);
   cwd the copy; ``execvp``.
4. P1 reaps every process; with ``spec["watch"]`` it is the watchdog: the resident memory of every process of the
   namespace plus the jail's tmpfs usage, and the size of the writable paths, polled; over a limit it reports
   ``event memory`` / ``event disk`` on the status pipe and kills the namespace. When the command exits (or at the
   deadline) P1 exits and the kernel kills whatever is left in the PID namespace.
"""

import ctypes
import marshal
import os
import resource
import select
import signal
import stat
import sys
import time

NOBODY = 65534
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203,
                  "s390x": 217, "i686": 217, "i386": 217, "armv7l": 218, "loongarch64": 41}
NEW_ROOT_AT = ("/tmp", "/mnt", "/media", "/srv")  # the first that exists holds the new root until pivot_root

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.unshare.argtypes = [ctypes.c_int]
libc.syscall.restype = ctypes.c_long


class Failed(Exception):
    """The jail cannot be built: the message names what is missing."""


def _err(what: str) -> Failed:
    n = ctypes.get_errno()
    return Failed(f"{what}: {os.strerror(n)} (errno {n})")


def _mount(source, target, fstype, flags, data=""):
    if libc.mount(source.encode() if source else None, target.encode(), fstype.encode() if fstype else None,
                  flags, data.encode() if data else None) != 0:
        raise _err(f"cannot mount {fstype or source or 'a remount'} on {target}")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class Status:
    def __init__(self, fd: int):
        self.fd = fd

    def say(self, line: str) -> None:
        try:
            os.write(self.fd, (" ".join(line.split()) + "\n").encode())
        except OSError:
            pass


# ---------------------------------------------------------------- P0: namespaces


def _join_cgroups(paths) -> None:
    for p in paths:
        try:
            _write(p, str(os.getpid()))
        except OSError as e:
            raise Failed(f"cannot join the command's cgroup {os.path.dirname(p)}: {e.strerror}") from None


def _unshare(mode: str, cgroup: bool) -> None:
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | (CLONE_NEWCGROUP if cgroup else 0)
    if mode == "userns":
        uid, gid = os.geteuid(), os.getegid()
        if libc.unshare(CLONE_NEWUSER) != 0:
            n = ctypes.get_errno()
            raise Failed(f"no user namespaces for uid {uid} (unshare(CLONE_NEWUSER): {os.strerror(n)}; they are off "
                         "when user.max_user_namespaces=0, kernel.unprivileged_userns_clone=0 or "
                         "kernel.apparmor_restrict_unprivileged_userns=1, or a seccomp profile forbids them): "
                         "enable them or run as root")
        try:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"0 {uid} 1")
            _write("/proc/self/gid_map", f"0 {gid} 1")
        except OSError as e:
            raise Failed(f"cannot map uid {uid} in a new user namespace: {e.strerror}") from None
    if libc.unshare(flags) != 0:
        n = ctypes.get_errno()
        why = ("as root without CAP_SYS_ADMIN (a container started without it, or a seccomp profile)"
               if mode == "root" else "in the user namespace")
        raise Failed(f"no mount permission: cannot create mount/PID/network namespaces {why}: "
                     f"unshare: {os.strerror(n)} (errno {n})")


# ---------------------------------------------------------------- P1: the root


def _source_flags(fd: int) -> int:
    """The flags the source's mount has (a bind's remount keeps them: a user namespace may not clear locked ones)."""
    f = os.statvfs(f"/proc/self/fd/{fd}").f_flag
    out = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
        if f & st:
            out |= ms
    return out


def _mountpoint(path: str, is_dir: bool) -> None:
    if os.path.lexists(path):
        return
    try:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        if is_dir:
            os.mkdir(path, 0o755)
        else:
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
    except OSError as e:
        raise Failed(f"cannot make the mount point {path}: {e.strerror}") from None


def _build(spec: dict) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    held = {}
    for m in spec["mounts"]:
        if m["kind"] == "bind" and m["src"] not in held:
            try:  # held open: the new root may cover the path (a venv under /tmp)
                held[m["src"]] = os.open(m["src"], os.O_PATH | os.O_CLOEXEC)
            except OSError as e:
                raise Failed(f"cannot open {m['src']} to bind it into the jail: {e.strerror}") from None
    at = next(p for p in NEW_ROOT_AT + ("/",) if os.path.isdir(p))
    _mount("tmpfs", at, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=16m,nr_inodes=8192")
    root = at.rstrip("/")
    for target, value in spec["symlinks"]:
        os.makedirs(os.path.dirname(root + target), mode=0o755, exist_ok=True)
        os.symlink(value, root + target)
    readonly_tmpfs = []
    for m in spec["mounts"]:
        dst = root + m["dst"]
        if m.get("optional") and not os.path.lexists(dst):  # a mask over what the jail's view does not show
            continue
        if m["kind"] == "bind":
            fd = held[m["src"]]
            is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
            _mountpoint(dst, is_dir)
            _mount(f"/proc/self/fd/{fd}", dst, None, MS_BIND)
            flags = MS_REMOUNT | MS_BIND | MS_NOSUID | _source_flags(fd) | (0 if m.get("dev") else MS_NODEV)
            _mount(None, dst, None, flags | (0 if m["rw"] else MS_RDONLY))
        else:  # tmpfs: a private temp directory, or a mask over something a bound directory holds
            _mountpoint(dst, True)
            _mount("tmpfs", dst, "tmpfs", MS_NOSUID | MS_NODEV,
                   f"mode={m['mode']},size={m['size']},nr_inodes={m.get('inodes', 65536)}")
            if not m["rw"]:
                readonly_tmpfs.append(m["dst"])
    for fd in held.values():
        os.close(fd)
    for name, text in spec["etc"].items():
        os.makedirs(root + "/etc", mode=0o755, exist_ok=True)
        with open(root + "/etc/" + name, "w") as f:
            f.write(text)
    _mountpoint(root + "/proc", True)
    try:  # before pivot_root: a user namespace may mount a procfs only while a full one is visible
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except Failed as e:
        raise Failed(f"{e}: no fresh /proc for the jail's PID namespace (a user namespace may not mount one where "
                     "the host's /proc has masked paths, as in a container): run as root") from None
    os.chdir(root)
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise Failed(f"no pivot_root syscall number for {os.uname().machine}")
    if libc.syscall(nr, b".", b".") != 0:
        raise _err("pivot_root into the jail's root")
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise _err("cannot detach the host's root")
    os.chdir("/")
    for target in readonly_tmpfs:
        _mount(None, target, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


# ---------------------------------------------------------------- P2: the command


def _command(spec: dict, argv: list) -> None:
    lim = spec["limits"]
    try:
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu"], lim["cpu"] + 1))
        resource.setrlimit(resource.RLIMIT_AS, (lim["memory"], lim["memory"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file"], lim["file"]))
        resource.setrlimit(resource.RLIMIT_CORE, (1, 1))  # no core files (1: not even to a core_pattern pipe)
        if spec["mode"] == "root":
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # cleared by P1 and by a uid change: /proc/self/uid_map needs it
        if spec["command_userns"]:
            outer = os.geteuid(), os.getegid()  # nobody (root mode), or the namespace's root = the caller
            if libc.unshare(CLONE_NEWUSER) != 0:
                raise _err("cannot give the command its own user namespace")
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{NOBODY} {outer[0]} 1")
            _write("/proc/self/gid_map", f"{NOBODY} {outer[1]} 1")
        if lim.get("nproc"):  # after the user namespace: it counts this command's processes only
            resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
        os.chdir(spec["cwd"])
        os.execvp(argv[0], argv)
    except BaseException as e:  # noqa: BLE001 - reported through the exit status and stderr
        print(f"jail: cannot start {argv[0]!r}: {e}", file=sys.stderr)
        os._exit(126)


# ---------------------------------------------------------------- P1: init and watchdog


def _rss() -> int:
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/statm", "rb") as f:
                    total += int(f.read().split()[1]) * page
            except (OSError, IndexError, ValueError):
                pass
    for mnt in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            s = os.statvfs(mnt)
            total += (s.f_blocks - s.f_bfree) * s.f_frsize
        except OSError:
            pass
    return total


def _tree_size(paths, max_entries: int) -> tuple[int, int]:
    """(bytes allocated, entries) under ``paths``, not following links; stops counting at ``max_entries``."""
    used = entries = 0
    stack = list(paths)
    while stack and entries <= max_entries:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for e in it:
                entries += 1
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                used += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
    return used, entries


def _init(spec: dict, argv: list, status: Status) -> int:
    watch = spec.get("watch") or {}
    if watch.get("disk"):  # only growth past the budget is stopped (a command that deletes files must run)
        start = _tree_size(watch["disk_paths"], watch["disk_inodes"])
    child = os.fork()
    if child == 0:
        os.close(status.fd)
        _command(spec, argv)
    deadline = time.monotonic() + spec["deadline_s"]
    interval = float(watch.get("interval", 0.05)) if watch else 0.5
    try:  # wakes the loop when the command exits
        wake = os.pidfd_open(child)
    except (AttributeError, OSError):
        wake = None
    next_disk = 0.0
    code = None
    while code is None:
        while True:  # reap everything (PID 1); note the command's status
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                break
            if pid == child:
                code = 128 + os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)
        if code is not None:
            break
        now = time.monotonic()
        if now > deadline:
            code = 128 + signal.SIGKILL
            break
        if watch.get("memory") and _rss() > watch["memory"]:
            status.say("event memory")
            code = 128 + signal.SIGKILL
            break
        if watch.get("disk") and now >= next_disk:
            t = time.monotonic()
            used, entries = _tree_size(watch["disk_paths"], watch["disk_inodes"])
            if (used > watch["disk"] and used > start[0]) or (entries > watch["disk_inodes"] and entries > start[1]):
                status.say("event disk")
                code = 128 + signal.SIGKILL
                break
            next_disk = time.monotonic() + max(0.2, 10 * (time.monotonic() - t))
        if wake is None:
            time.sleep(interval)
        else:
            select.select([wake], [], [], interval)
    try:
        os.kill(-1, signal.SIGKILL)  # from PID 1: every other process of the namespace
    except ProcessLookupError:
        pass
    return code


def main() -> int:
    sep = sys.argv.index("--")
    spec = marshal.loads(bytes.fromhex(sys.argv[1]))
    argv = sys.argv[sep + 1:]
    status = Status(spec["status_fd"])
    os.set_inheritable(status.fd, False)
    try:
        _join_cgroups(spec["cgroup_procs"])
        _unshare(spec["mode"], bool(spec["cgroup_procs"]))
    except Failed as e:
        status.say(f"error {e}")
        return 125
    pid = os.fork()
    if pid == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # P0 killed (the wall limit): the namespace dies
        try:
            _build(spec)
        except Failed as e:
            status.say(f"error {e}")
            os._exit(125)
        except OSError as e:
            status.say(f"error cannot build the jail's root: {e}")
            os._exit(125)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no process of the same uid may ptrace PID 1 (its capabilities)
        status.say("ready")
        os._exit(_init(spec, argv, status))
    os.close(status.fd)
    while True:
        try:
            _, st = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    return 128 + os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)


if __name__ == "__main__":
    sys.exit(main())
