"""One writer per output: ``<out>.lock``, a sibling of the output, held while a command writes it.

Two commands writing one output corrupt each other's work in ways no later check can tell apart from a
good result: a second ``mosaic measure --force`` deleted the first one's journal, two builds swapped their
folders into place in turn. ``mosaic measure`` (and ``--merge``), ``build``, ``rebuild``, ``export gguf``,
``plan --out`` and ``sign`` (``DIR.lock`` beside the folder it signs) and the API functions behind them
therefore take this lock before they look at, delete or open anything of the output, and a second
command is refused (exit 2) with one line naming the holder.

How it is held, and why:

- An ``fcntl.flock`` on the lock file, taken without waiting. The kernel drops it when the holder's file is
  closed, so a holder killed by SIGKILL, the OOM killer or a crashed interpreter releases it with no help; on
  this host the flock alone decides who holds the output. A pid check cannot decide that: a dead holder's
  pid may already belong to another process.
- The file also records the holder (pid, host, command, start time). The record is what a refusal names, and
  it is what protects across machines: on a network filesystem a flock may be kept by each client on its own
  (NFS mounted with ``local_lock``, some SMB and FUSE mounts), so a record written by *another* host is never
  taken over, even when the flock could be taken (its process cannot be checked from here); the refusal
  says which file to remove once that process is known to be gone. It is fsynced, so that another host
  reads it rather than an empty file.
- Where the filesystem refuses flock outright (``ENOLCK``: NFS without a lock daemon), the record alone
  decides: a live pid on this host refuses, a dead one is taken over. That is not atomic between two
  commands started in the same instant; it is the best such a filesystem allows.
- The file is opened with ``O_CREAT`` but not ``O_EXCL``: a leftover file (after a SIGKILL) is simply locked
  again and rewritten, never deleted by a newcomer, so two newcomers cannot each delete the other's file.
- Release removes the file while still holding the flock, then closes it. A newcomer that opened the old
  file meanwhile gets its flock after the holder has gone, sees that the name now leads elsewhere (or
  nowhere) and starts over, so two processes never hold the lock through two different files.

The file descriptor is close-on-exec: runtimes started by a measurement do not keep the output locked.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType

from mosaic._base.errors import OutputError

try:
    import fcntl
except ImportError:  # not a POSIX system: the record alone decides
    fcntl = None  # type: ignore[assignment]

LOCK_SUFFIX = ".lock"
#: How often a newcomer starts over when the file it locked was released and removed meanwhile.
_ATTEMPTS = 50
#: A holder writes its record just after taking the flock: how long a refused newcomer waits to read it.
_RECORD_WAIT_S = 1.0


def lock_path(out: str | os.PathLike[str]) -> Path:
    """``<out>.lock`` beside the output (``out/`` → ``out.lock``); the name is normalised so that ``out``,
    ``out/`` and ``./out`` share one lock."""
    p = Path(os.path.abspath(out))
    if not p.name:
        raise OutputError(f"{out}: not a file or folder name an output can have")
    return p.with_name(p.name + LOCK_SUFFIX)


def this_host() -> str:
    return socket.gethostname()


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) an output's lock, as its lock file records it."""

    pid: int
    host: str
    command: str
    started: str

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, {self.command} since {self.started}"

    def to_json(self) -> bytes:
        return json.dumps({"pid": self.pid, "host": self.host, "command": self.command, "started": self.started}).encode()

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        """The record, or None for an empty or unreadable file (one being written, or a torn write)."""
        try:
            d = json.loads(data.decode())
            h = cls(d["pid"], d["host"], d["command"], d["started"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None
        if not isinstance(h.pid, int) or isinstance(h.pid, bool) or h.pid <= 0 or not isinstance(h.host, str):
            return None
        return h


def pid_alive(pid: int) -> bool:
    """On this host; a process of another user (``EPERM``) is alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def _read(fd: int) -> Holder | None:
    return Holder.parse(os.pread(fd, 65536, 0))


def _peek(path: Path) -> Holder | None:
    try:
        with open(path, "rb") as f:
            return Holder.parse(f.read(65536))
    except OSError:
        return None


def _same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open at ``fd`` (a releasing holder removes it)."""
    try:
        a, b = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _flock(fd: int) -> bool:
    """Take the flock without waiting: True when held, False when the filesystem has no locks; a holder's
    lock raises BlockingIOError."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
            return False
        raise
    return True


class OutputLock:
    """``with OutputLock(out, "mosaic build"):`` holds ``<out>.lock`` or raises :class:`OutputError` naming the
    holder. ``took_over``: the record of a holder that was gone (its file left by a kill), if there was one."""

    def __init__(self, out: str | os.PathLike[str], command: str) -> None:
        self.out = str(out)
        self.path = lock_path(out)
        self.command = command
        self.took_over: Holder | None = None
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> OutputLock:
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: already held by this lock")
        for _ in range(_ATTEMPTS):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
            except OSError as e:
                holder = _peek(self.path)  # another user's lock, say: whom to ask
                who = f"; it names {holder.describe()}" if holder is not None else ""
                raise OutputError(f"{self.out}: cannot create its lock file {self.path}: {e.strerror or e}{who}") from None
            try:
                if self._try(fd):
                    self._fd = fd
                    return self
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # the file was released and removed meanwhile: start over
        raise OutputError(f"{self.out}: its lock file {self.path} keeps being replaced; is a script starting mosaic in a loop?")

    def _try(self, fd: int) -> bool:
        """Hold the lock through ``fd``, or refuse; False: start over with a fresh open."""
        try:
            kernel = _flock(fd)
        except BlockingIOError:
            holder = _read(fd)
            deadline = time.monotonic() + _RECORD_WAIT_S
            while holder is None and _same_file(self.path, fd) and time.monotonic() < deadline:
                time.sleep(0.02)  # the holder has its flock and is writing its record
                holder = _read(fd)
            if not _same_file(self.path, fd):
                return False
            raise OutputError(self._busy(holder)) from None
        except OSError as e:
            raise OutputError(f"{self.out}: cannot lock {self.path}: {e.strerror or e}") from None
        if not _same_file(self.path, fd):
            return False
        previous = _read(fd)
        if previous is not None and previous.host != this_host():
            raise OutputError(f"{self.out}: another mosaic ({previous.describe()}) may be writing it, and from this host "
                              f"it cannot be told whether that process still runs; wait for it or stop it, and remove "
                              f"{self.path} once it is gone")
        if previous is not None and not kernel and previous.pid != os.getpid() and pid_alive(previous.pid):
            raise OutputError(self._busy(previous))
        self.took_over = previous
        me = Holder(os.getpid(), this_host(), self.command, datetime.now().astimezone().isoformat(timespec="seconds"))
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, me.to_json() + b"\n", 0)
            os.fsync(fd)
        except OSError as e:
            raise OutputError(f"{self.out}: cannot write its lock file {self.path}: {e.strerror or e}") from None
        return True

    def _busy(self, holder: Holder | None) -> str:
        who = holder.describe() if holder is not None else f"its lock file {self.path} names no process yet"
        return f"{self.out}: another mosaic ({who}) is writing it; wait for it or stop it"

    def release(self) -> None:
        """Remove the lock file, then let go of it; a no-op when not held. A file someone else put in its place
        (after removing this one by hand) is left alone."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _same_file(self.path, fd):
                self.path.unlink(missing_ok=True)
        except OSError:
            pass  # a leftover file is taken over by the next command: its flock goes with the close below
        finally:
            os.close(fd)

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def output_lock(out: str | os.PathLike[str], command: str) -> OutputLock:
    """The lock of an output, to be entered: ``with output_lock(out, "mosaic measure"): ...``."""
    return OutputLock(out, command)
