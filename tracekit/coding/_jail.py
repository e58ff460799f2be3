"""Init of one sandboxed command (run by :mod:`tracekit.coding.sandbox` as PID 1 of fresh mount/net/PID namespaces,
as root, with ``python -I -S -B``; standard library only).

usage: _jail.py CWD CPU_SECONDS MEMORY_BYTES FILE_BYTES NPROC [READ_ONLY_DIR...] -- ARGV...

It mounts private tmpfs over the world-writable temp directories (unless the copy lives inside one) and binds each
READ_ONLY_DIR that such a tmpfs would hide (tracekit's own pytest plugin in a checkout under /tmp) back, read-only,
at its path; when the
Python installation sits under a directory ``nobody`` cannot traverse (``/root/.pyenv``), it covers that directory
with an empty tmpfs and binds only the installation back (read-only), so tests can run and nothing else of it is
visible; then it forks
the command: no new privileges, rlimits set, uid/gid ``nobody``, no supplementary groups, cwd the copy. It reaps
every process and exits with the command's status (128 + signal for a signal death); when it exits the kernel
kills whatever is left in the PID namespace.
"""

import ctypes
import os
import resource
import sys

NOBODY = 65534
PR_SET_NO_NEW_PRIVS = 38
OVERLAYS = ("/tmp", "/var/tmp", "/dev/shm")
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC = 1, 32, 4096, 8192, 16384


def _mount(libc, source, target, fstype, flags, data=b""):
    if libc.mount(source.encode() if source else None, target.encode(), fstype.encode() if fstype else None,
                  flags, data) != 0:
        raise OSError(ctypes.get_errno(), f"mount {source} -> {target}: {os.strerror(ctypes.get_errno())}")


def _expose_python(libc):
    """Make the interpreter's installation reachable for nobody when an ancestor is not traversable."""
    for path in dict.fromkeys(os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)):
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            closed = "/" + "/".join(parts[:i])
            if os.stat(closed).st_mode & 0o001:
                continue
            child = closed + "/" + parts[i]
            stage = "/tmp/.jail-stage-" + str(i) + "-" + parts[i]
            os.mkdir(stage)
            _mount(libc, child, stage, None, MS_BIND | MS_REC)
            _mount(libc, "tmpfs", closed, "tmpfs", 0, b"mode=0755,size=1048576")
            os.mkdir(child)
            _mount(libc, stage, child, None, MS_MOVE)
            _mount(libc, None, child, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            break


def _inside(path: str, directory: str) -> bool:
    return (path + "/").startswith(directory + "/")


def _bind_back(libc, held: dict[str, int]) -> None:
    """Bind each directory (held open since before a tmpfs covered it) back at its path, read-only."""
    for path, fd in held.items():
        os.makedirs(path, mode=0o755, exist_ok=True)
        _mount(libc, f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        _mount(libc, None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        os.close(fd)


def main() -> int:
    sep = sys.argv.index("--")
    cwd, cpu, mem, fsize, nproc, *read_only = sys.argv[1:sep]
    argv = sys.argv[sep + 1:]
    libc = ctypes.CDLL(None, use_errno=True)
    real_cwd = os.path.realpath(cwd)
    covered = [os.path.realpath(t) for t in OVERLAYS if os.path.isdir(t) and not _inside(real_cwd, os.path.realpath(t))]
    keep = [p for p in dict.fromkeys(os.path.realpath(d) for d in read_only) if any(_inside(p, t) for t in covered)]
    try:  # held open: the tmpfs about to cover them hides their paths
        held = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in keep}
    except OSError as e:
        print(f"jail: cannot keep {e.filename} visible: {e.strerror}", file=sys.stderr)
        return 125
    for target in covered:
        if libc.mount(b"tmpfs", target.encode(), b"tmpfs", 0, b"mode=1777,size=268435456") != 0:
            print(f"jail: cannot mount tmpfs on {target} (errno {ctypes.get_errno()})", file=sys.stderr)
            return 125
    try:
        _bind_back(libc, held)
        _expose_python(libc)
    except OSError as e:
        print(f"jail: {e}", file=sys.stderr)
        return 125
    pid = os.fork()
    if pid == 0:
        try:
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            resource.setrlimit(resource.RLIMIT_CPU, (int(cpu), int(cpu) + 1))
            resource.setrlimit(resource.RLIMIT_AS, (int(mem), int(mem)))
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(fsize), int(fsize)))
            resource.setrlimit(resource.RLIMIT_NPROC, (int(nproc), int(nproc)))
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.chdir(cwd)
            os.execvp(argv[0], argv)
        except BaseException as e:  # noqa: BLE001 - reported through the exit status and stderr
            print(f"jail: cannot start {argv[0]!r}: {e}", file=sys.stderr)
            os._exit(126)
    while True:
        try:
            done, status = os.wait()
        except ChildProcessError:
            return 125
        if done == pid:
            if os.WIFSIGNALED(status):
                return 128 + os.WTERMSIG(status)
            return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main())
