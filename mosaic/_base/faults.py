"""Named fault points of a build, and the cancellation flag that stops its worker threads.

The fault suite proves that a build interrupted anywhere leaves nothing that looks finished. To
reach every stage deterministically, a build calls :func:`point` at named places (after planning,
after each source file is hashed, after each range is copied, after each shard is verified, after
each metadata file, before the final rename). With ``MOSAIC_FAULT=<name>:<n>:<action>`` in the
environment, the ``n``-th call of point ``name`` performs ``action``: ``kill`` (SIGKILL the process),
``int`` (SIGINT, as Ctrl-C), ``term`` (SIGTERM), ``enospc`` or ``eio`` (raise that OSError, as a full
disk or a failing device would). Without the variable a point costs one attribute test.

:data:`CANCEL` is set when a build is interrupted: copy and hash loops on other threads check it
between chunks, so Ctrl-C stops a multi-gigabyte shard at once instead of after it.
"""

from __future__ import annotations

import errno
import os
import signal
import threading

CANCEL = threading.Event()


class Cancelled(KeyboardInterrupt):
    """Raised on worker threads when the work has been interrupted (it ends like Ctrl-C)."""


def check_cancel() -> None:
    if CANCEL.is_set():
        raise Cancelled("build interrupted")


def _parse(spec: str | None) -> tuple[str, int, str] | None:
    if not spec:
        return None
    try:
        name, n, action = spec.split(":")
        return name, int(n), action
    except ValueError:
        return None


_SPEC = _parse(os.environ.get("MOSAIC_FAULT"))
_counts: dict[str, int] = {}
_lock = threading.Lock()


def point(name: str) -> None:
    """A place where a fault can be injected (see the module docstring)."""
    if _SPEC is None or _SPEC[0] != name:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        hit = _counts[name] == _SPEC[1]
    if not hit:
        return
    action = _SPEC[2]
    if action in ("kill", "int", "term"):
        sig = {"kill": signal.SIGKILL, "int": signal.SIGINT, "term": signal.SIGTERM}[action]
        os.kill(os.getpid(), sig)
        if action != "kill" and threading.current_thread() is not threading.main_thread():
            raise Cancelled("interrupted")  # the main thread gets the signal; this worker stops here
    elif action in ("enospc", "eio"):
        code = errno.ENOSPC if action == "enospc" else errno.EIO
        raise OSError(code, os.strerror(code))
