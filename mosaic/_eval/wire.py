"""Messages between mosaic and its llama.cpp worker: a JSON header and raw array bytes, nothing else.

No pickle (the package never unpickles anything, and a worker that llama.cpp has corrupted must not be able
to make its parent run code): each message is an 8-byte little-endian length, that many bytes of JSON, then
the bytes of the arrays the header lists (name, dtype, shape), in order, read straight into numpy arrays.
"""

from __future__ import annotations

import json
from typing import BinaryIO

import numpy as np

_LEN = 8
#: A header larger than this is not one of ours (a corrupted stream): refused before it is allocated.
MAX_HEADER = 1 << 28
_DTYPES = {"<f4", "<f8", "<i4", "<i8", "|u1"}


class WireError(Exception):
    """The stream ended or holds something that is not a message."""


def send(f: BinaryIO, head: dict, arrays: dict[str, np.ndarray] | None = None) -> None:
    laid = {name: np.ascontiguousarray(a) for name, a in (arrays or {}).items()}
    listed = [[name, a.dtype.str, list(a.shape)] for name, a in laid.items()]
    raw = json.dumps({**head, "arrays": listed} if listed else head, separators=(",", ":")).encode()
    f.write(len(raw).to_bytes(_LEN, "little"))
    f.write(raw)
    for a in laid.values():
        if a.nbytes:
            f.write(memoryview(a).cast("B"))
    f.flush()


def _exactly(f: BinaryIO, n: int) -> bytes:
    buf = bytearray(n)
    _fill(f, memoryview(buf))
    return bytes(buf)


def _fill(f: BinaryIO, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise WireError("the stream ended inside a message" if got or len(view) != _LEN else "the stream ended")
        got += n


def recv(f: BinaryIO) -> tuple[dict, dict[str, np.ndarray]]:
    size = int.from_bytes(_exactly(f, _LEN), "little")
    if size > MAX_HEADER:
        raise WireError(f"a header of {size} bytes")
    try:
        head = json.loads(_exactly(f, size))
    except ValueError as e:
        raise WireError(f"a header that is not JSON: {e}") from None
    if not isinstance(head, dict):
        raise WireError("a header that is not a JSON object")
    arrays: dict[str, np.ndarray] = {}
    listed = head.pop("arrays", [])
    for spec in listed if isinstance(listed, list) else [None]:
        try:
            name, dtype, shape = spec  # type: ignore[misc]
            ok = isinstance(name, str) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise WireError(f"an array listed as {spec!r}")
        if dtype not in _DTYPES:
            raise WireError(f"array {name!r} of dtype {dtype!r}")
        a = np.empty(tuple(shape), dtype=np.dtype(dtype))
        if a.nbytes:
            _fill(f, memoryview(a).cast("B"))
        arrays[name] = a
    return head, arrays
