"""Byte ranges of a pinned hub commit's files, over HTTP range requests.

A mosaic takes 12 of a donor's 45 layers; reading only those tensors' bytes moves a quarter of what a
download would. This module reads one range of one file, streaming it to a sink in bounded chunks,
through huggingface_hub's own HTTP session and headers (token, user agent, endpoint). Each request is
checked the way the hub lets it be checked: the resolve answer must name the pinned commit
(``X-Repo-Commit``) and, for LFS files, the file's SHA-256 as its ETag; the server must answer with
exactly the range asked for (``206`` + ``Content-Range``). Connection drops, short bodies and server
errors are retried with exponential backoff, resuming where the bytes stopped; refusals (4xx) are not.

What a range cannot be checked against: the hub publishes only whole-file digests. The caller keeps
each range's SHA-256 and says, in PROVENANCE.json, which files were read only in part.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urljoin, urlsplit

from mosaic._base.errors import SourceError, VerificationError
from mosaic._hub.snapshot import HubFile, require_pinned, scrub_token

#: Bytes handed to the sink at a time.
CHUNK = 1 << 20
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class RangeError(SourceError):
    """A range could not be read as asked (after retries), or the hub answered for another file."""


class _Transient(Exception):
    """A failure worth another try: a dropped connection, a short body, a 5xx, a timeout."""


class _SinkFailed(Exception):
    """Writing what was read failed locally; carries the OSError out past the network retries."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _strip(etag: str | None) -> str:
    return (etag or "").strip().removeprefix("W/").strip('"')


class RangeReader:
    """Reads byte ranges of the files of ``repo`` at the pinned ``revision``; counts what it moved.

    Thread-safe: one reader serves the parallel range requests of a build.
    """

    def __init__(self, repo: str, revision: str, *, retries: int = 5, backoff: float = 0.5, timeout: float = 60.0) -> None:
        self.repo = repo
        self.revision = require_pinned(repo, revision)
        self.retries = retries
        self.backoff = backoff
        self.timeout = timeout
        self.bytes_read = 0
        self.requests = 0
        self._lock = threading.Lock()

    def _count(self, n: int, request: bool = False) -> None:
        with self._lock:
            self.bytes_read += n
            self.requests += int(request)

    def _url(self, name: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo, name, revision=self.revision)

    def read(self, f: HubFile, start: int, end: int, sink: Callable[[bytes], None]) -> None:
        """Stream bytes ``[start, end)`` of ``f`` to ``sink``, in order, each byte once."""
        if not 0 <= start < end <= f.size:
            raise RangeError(f"{self.repo}@{self.revision}: {f.name}: range [{start}, {end}) outside its {f.size} bytes")
        at = [start]  # how far the sink has been fed; a retry resumes there
        last: str = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * (2 ** (attempt - 1)), 30.0))
            try:
                self._request(f, at, end, sink)
                return
            except _Transient as e:
                last = str(e)
        raise RangeError(
            f"{self.repo}@{self.revision}: {f.name}: bytes {at[0]}-{end - 1} could not be read after "
            f"{self.retries + 1} tries ({scrub_token(last)})"
        )

    def _request(self, f: HubFile, at: list[int], end: int, sink: Callable[[bytes], None]) -> None:
        """One try from ``at[0]``, advancing it as bytes reach the sink; raises unless it reaches ``end``."""
        import httpx2
        from huggingface_hub.utils import build_hf_headers, get_session

        url = self._url(f.name)
        pos = at[0]
        headers = {**build_hf_headers(), "Range": f"bytes={pos}-{end - 1}", "Accept-Encoding": "identity"}
        session = get_session()
        self._count(0, request=True)
        named = False  # whether an answer from the hub itself has named the pinned commit yet
        try:
            for _hop in range(6):  # the hub redirects LFS files to its storage; follow, checking the hub's answer
                with session.stream("GET", url, headers=headers, timeout=self.timeout, follow_redirects=False) as r:
                    if r.status_code in (301, 302, 303, 307, 308):
                        self._check_identity(f, r.headers)
                        named = named or "x-repo-commit" in r.headers
                        target = urljoin(url, r.headers.get("Location", ""))
                        if urlsplit(target).netloc != urlsplit(url).netloc:  # the token stays with the hub
                            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
                        url = target
                        continue
                    if r.status_code >= 500 or r.status_code == 429:
                        raise _Transient(f"HTTP {r.status_code}")
                    if r.status_code != 206:
                        raise RangeError(
                            f"{self.repo}@{self.revision}: {f.name}: the hub answered HTTP {r.status_code} to a range "
                            f"request{': ' + r.headers.get('X-Error-Message', '') if r.headers.get('X-Error-Message') else ''}"
                        )
                    self._check_identity(f, r.headers)
                    if not named and "x-repo-commit" not in r.headers:
                        raise RangeError(f"{self.repo}@{self.revision}: {f.name}: the answer names no commit "
                                         "(X-Repo-Commit); not a Hugging Face Hub endpoint?")
                    self._check_content_range(f, r.headers.get("Content-Range", ""), pos, end)
                    for chunk in r.iter_raw(CHUNK):
                        take = chunk[: end - pos]
                        if take:
                            try:
                                sink(take)
                            except OSError as e:  # the local disk (full, failing): not worth a retry
                                raise _SinkFailed(e) from e
                            pos += len(take)
                            at[0] = pos
                            self._count(len(take))
                        if pos >= end:
                            break
                    if pos < end:
                        raise _Transient(f"connection closed at byte {pos}, {end - pos} bytes short")
                    return
            raise RangeError(f"{self.repo}@{self.revision}: {f.name}: too many redirects")
        except _SinkFailed as e:
            raise e.error from None
        except (httpx2.TransportError, httpx2.StreamError, OSError) as e:
            raise _Transient(f"{type(e).__name__}: {e}") from None

    def _check_identity(self, f: HubFile, headers: Any) -> None:
        """The hub's answer must be for the pinned commit and, for an LFS file, for the listed content."""
        commit = headers.get("x-repo-commit")
        if commit is not None and commit != self.revision:
            raise VerificationError(
                f"{self.repo}@{self.revision}: {f.name}: the hub served commit {commit} instead of the pinned one"
            )
        if f.lfs_sha256 is not None:
            etag = _strip(headers.get("x-linked-etag") or headers.get("etag"))
            if etag and len(etag) == 64 and etag != f.lfs_sha256:
                raise VerificationError(
                    f"{self.repo}@{self.revision}: {f.name}: the hub served content {etag}, its listing says {f.lfs_sha256}"
                )

    def _check_content_range(self, f: HubFile, value: str, start: int, end: int) -> None:
        m = _CONTENT_RANGE.match(value.strip())
        if m is None or int(m[1]) != start or int(m[2]) != end - 1 or (m[3] != "*" and int(m[3]) != f.size):
            raise RangeError(
                f"{self.repo}@{self.revision}: {f.name}: asked for bytes {start}-{end - 1} of {f.size}, "
                f"the server sent {value or 'no Content-Range'}"
            )
