"""A small Hugging Face Hub look-alike on 127.0.0.1 for tests and examples: just the endpoints huggingface_hub calls.

Covered: model info / revision, recursive tree listings with LFS metadata, ``resolve`` (HEAD and GET,
with the X-Repo-Commit, ETag, X-Linked-Etag and X-Linked-Size headers the client relies on, and
``Range``), repository and branch creation, README YAML validation, ``preupload``, the git LFS batch
API with basic PUT transfers, and NDJSON commits. Not covered: Xet storage (tests disable it),
multipart LFS, pull requests, pagination (one page holds everything), authentication (any token,
or none, is accepted; the Authorization headers seen are recorded so tests can check one was sent).

Knobs for tests: ``corrupt[(repo, path)] = bytes`` serves other bytes than the hub's digests say;
``tamper[(repo, path)] = sha256`` makes the tree listing claim another LFS digest;
``redirect_lfs = True`` answers LFS downloads with a redirect to a storage URL, as the real hub does;
``drop[(repo, path)] = n`` makes the next n data responses for that file close the connection halfway;
``other_commit[repo] = sha`` names another commit in ``X-Repo-Commit``. ``served[(repo, path)]`` counts
the file bytes sent (ranges included), and ``ranges`` lists every ``Range`` header received.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str) -> bool:
    return path.endswith(LFS_SUFFIXES)


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    private: bool = False

    def resolve(self, rev: str) -> str | None:
        if rev in self.refs:
            return self.refs[rev]
        return rev if rev in self.commits else None


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up mid-request (a dropped range, a retry) is expected here, not an error to print."""

    def handle_error(self, request: object, client_address: object) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.corrupt: dict[tuple[str, str], bytes] = {}
        self.tamper: dict[tuple[str, str], str] = {}
        self.log: list[tuple[str, str]] = []
        self.redirect_lfs = False
        self.drop: dict[tuple[str, str], int] = {}
        self.other_commit: dict[str, str] = {}
        self.served: dict[tuple[str, str], int] = {}
        self.ranges: list[tuple[str, str, str]] = []
        self.auth: list[str] = []
        self.lock = threading.Lock()
        self._n = 0
        self.server = _QuietServer(("127.0.0.1", 0), _make_handler(self))
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        #: LFS storage answers on another host name of the same loopback server, as the hub's storage is
        #: another host: huggingface_hub follows redirects within the hub only, and keeps its token there
        self.storage = f"http://localhost:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def environment(self, home: str | os.PathLike[str]) -> dict[str, str]:
        """The variables that point huggingface_hub at this hub, with its cache and token under ``home``."""
        home = Path(home)
        return {
            "HF_ENDPOINT": self.endpoint, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
            "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": "hf_fake_token",
            "HF_HUB_OFFLINE": "0", "NO_PROXY": "127.0.0.1,localhost",
        }

    def serve(self, home: str | os.PathLike[str]) -> FakeHub:
        """Start serving and point this process at the hub until it exits (an example's whole life).

        Sets :meth:`environment`, and, where huggingface_hub was imported before (it reads its variables once,
        at import), its constants too."""
        self.__enter__()
        env = self.environment(home)
        os.environ.update(env)
        for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            os.environ.pop(k, None)
        constants = sys.modules.get("huggingface_hub.constants")
        if constants is not None:
            constants.ENDPOINT = self.endpoint
            constants.HUGGINGFACE_CO_URL_TEMPLATE = self.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
            constants.HF_HOME = env["HF_HOME"]
            constants.HF_HUB_CACHE = env["HF_HUB_CACHE"]
            constants.HF_HUB_OFFLINE = False
            constants.HF_HUB_DISABLE_XET = True
            constants.HF_TOKEN_PATH = str(Path(home) / "token")
            constants.HF_STORED_TOKENS_PATH = str(Path(home) / "stored_tokens")
        return self

    # --- state ------------------------------------------------------------------------------------
    def _new_sha(self, seed: str) -> str:
        self._n += 1
        return hashlib.sha1(f"{seed}:{self._n}".encode()).hexdigest()

    def commit(self, repo_id: str, files: dict[str, bytes], *, branch: str = "main", deleted: tuple[str, ...] = ()) -> str:
        """Add a commit (files on top of the branch's current ones) and return its sha."""
        with self.lock:
            repo = self.repos.setdefault(repo_id, Repo())
            parent = repo.refs.get(branch)
            tree = dict(repo.commits[parent]) if parent else {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}
            for p in deleted:
                tree.pop(p, None)
            tree.update(files)
            for p, data in tree.items():
                if is_lfs(p):
                    self.lfs[hashlib.sha256(data).hexdigest()] = data
            sha = self._new_sha(repo_id + branch)
            repo.commits[sha] = tree
            repo.refs[branch] = sha
            return sha

    def entry(self, repo_id: str, path: str, data: bytes) -> dict:
        e: dict = {"type": "file", "path": path, "size": len(data)}
        if is_lfs(path):
            sha = self.tamper.get((repo_id, path), hashlib.sha256(data).hexdigest())
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()
            e["oid"] = git_blob_id(pointer)
            e["lfs"] = {"oid": sha, "size": len(data), "pointerSize": len(pointer)}
        else:
            e["oid"] = git_blob_id(data)
        return e


_TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$")
_INFO = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_PREUPLOAD = re.compile(r"^/api/models/([^/]+/[^/]+)/preupload/([^/]+)$")
_COMMIT = re.compile(r"^/api/models/([^/]+/[^/]+)/commit/([^/]+)$")
_BRANCH = re.compile(r"^/api/models/([^/]+/[^/]+)/branch/([^/]+)$")
_BATCH = re.compile(r"^/([^/]+/[^/]+)\.git/info/lfs/objects/batch$")
_LFS_PUT = re.compile(r"^/lfs-upload/([0-9a-f]{64})$")
_CDN = re.compile(r"^/lfs-cdn/([0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def _make_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            return None

        # --- helpers ------------------------------------------------------------------------------
        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                for _ in range(1 << 20):  # bounded: a chunked body ends with a zero-size chunk
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        break
                    out += self.rfile.read(size)
                    self.rfile.readline()
                return out
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None, *, head: bool = False) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head and body:
                self.wfile.write(body)

        def _json(self, code: int, doc: object, headers: dict[str, str] | None = None) -> None:
            self._send(code, json.dumps(doc).encode(), {"Content-Type": "application/json", **(headers or {})})

        def _error(self, code: int, error_code: str | None, msg: str, *, head: bool = False, extra: dict[str, str] | None = None) -> None:
            h = {"X-Error-Message": msg, **(extra or {})}
            if error_code:
                h["X-Error-Code"] = error_code
            self._send(code, json.dumps({"error": msg}).encode(), {"Content-Type": "application/json", **h}, head=head)

        def _repo(self, repo_id: str, head: bool = False) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository not found: {repo_id}", head=head)
            return repo

        def _start(self) -> tuple[str, dict[str, list[str]]]:
            parts = urlsplit(self.path)
            with hub.lock:
                hub.log.append((self.command, parts.path))
                if self.headers.get("Authorization"):
                    hub.auth.append(self.headers["Authorization"])
            return unquote(parts.path), parse_qs(parts.query)

        # --- GET / HEAD -----------------------------------------------------------------------------
        def do_HEAD(self) -> None:
            self._get(head=True)

        def do_GET(self) -> None:
            self._get(head=False)

        def _get(self, head: bool) -> None:
            path, _query = self._start()
            if m := _TREE.match(path):
                repo = self._repo(m[1])
                if repo is None:
                    return
                sha = repo.resolve(m[2])
                if sha is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {m[2]}")
                prefix = (m[3] or "").rstrip("/")
                files = repo.commits[sha]
                return self._json(200, [hub.entry(m[1], p, d) for p, d in sorted(files.items()) if not prefix or p.startswith(prefix + "/")])
            if m := _INFO.match(path):
                repo = self._repo(m[1])
                if repo is None:
                    return
                sha = repo.resolve(m[2] or "main")
                if sha is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {m[2]}")
                files = repo.commits[sha]
                return self._json(200, {
                    "id": m[1], "modelId": m[1], "sha": sha, "private": repo.private,
                    "siblings": [{"rfilename": p, **({"blobId": hub.entry(m[1], p, d)["oid"], "size": len(d)})} for p, d in sorted(files.items())],
                })
            if m := _RESOLVE.match(path):
                repo = self._repo(m[1], head)
                if repo is None:
                    return
                sha = repo.resolve(m[2])
                if sha is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {m[2]}", head=head)
                files = repo.commits[sha]
                if m[3] not in files:
                    return self._error(404, "EntryNotFound", f"{m[3]} does not exist", head=head, extra={"X-Repo-Commit": sha})
                data = files[m[3]]
                e = hub.entry(m[1], m[3], data)
                h = {"X-Repo-Commit": sha, "Content-Type": "application/octet-stream"}
                if "lfs" in e:
                    h["ETag"] = f'"{e["lfs"]["oid"]}"'
                    h["X-Linked-Etag"] = f'"{e["lfs"]["oid"]}"'
                    h["X-Linked-Size"] = str(len(data))
                else:
                    h["ETag"] = f'"{e["oid"]}"'
                if m[1] in hub.other_commit:
                    h["X-Repo-Commit"] = hub.other_commit[m[1]]
                if "lfs" in e and hub.redirect_lfs:
                    loc = f"{hub.storage}/lfs-cdn/{e['lfs']['oid']}?repo={m[1]}&path={m[3]}"  # absolute, as the hub's storage URLs are
                    return self._send(302, b"", {**h, "Location": loc, "X-Linked-Size": str(len(data))}, head=head)
                return self._data(m[1], m[3], hub.corrupt.get((m[1], m[3]), data), h, head)
            if m := _CDN.match(path):
                repo_id, fpath = _query["repo"][0], _query["path"][0]
                data = hub.lfs[m[1]]
                return self._data(repo_id, fpath, hub.corrupt.get((repo_id, fpath), data),
                                  {"Content-Type": "application/octet-stream", "ETag": f'"{m[1]}"'}, head)
            self._error(404, None, f"no such endpoint: GET {path}", head=head)

        def _data(self, repo_id: str, fpath: str, body: bytes, h: dict[str, str], head: bool) -> None:
            """A file's bytes, whole or the one range asked for, counted; maybe dropped halfway."""
            rng = self.headers.get("Range", "")
            code, start, end = 200, 0, len(body)
            if rng and not head:
                with hub.lock:
                    hub.ranges.append((repo_id, fpath, rng))
                r = _RANGE.match(rng)
                if r is None or int(r[1]) >= len(body):
                    return self._send(416, b"", {"Content-Range": f"bytes */{len(body)}"})
                start, end = int(r[1]), min(len(body), int(r[2]) + 1 if r[2] else len(body))
                code = 206
                h = {**h, "Content-Range": f"bytes {start}-{end - 1}/{len(body)}"}
            if head:
                return self._send(code, body, h, head=True)
            part = body[start:end]
            with hub.lock:
                drop = hub.drop.get((repo_id, fpath), 0)
                if drop:
                    hub.drop[(repo_id, fpath)] = drop - 1
            if drop:
                half = part[: len(part) // 2]
                self.send_response(code)
                for k, v in h.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(part)))
                self.end_headers()
                self.wfile.write(half)
                self.wfile.flush()
                with hub.lock:
                    hub.served[(repo_id, fpath)] = hub.served.get((repo_id, fpath), 0) + len(half)
                self.close_connection = True
                self.connection.shutdown(2)
                return None
            with hub.lock:
                hub.served[(repo_id, fpath)] = hub.served.get((repo_id, fpath), 0) + len(part)
            return self._send(code, part, h)

        # --- POST / PUT -----------------------------------------------------------------------------
        def do_POST(self) -> None:
            path, query = self._start()
            body = self._body()
            if path == "/api/repos/create":
                doc = json.loads(body)
                repo_id = f"{doc['organization']}/{doc['name']}" if doc.get("organization") else doc["name"]
                if repo_id in hub.repos:
                    body409 = {"error": "You already created this model repo", "url": f"{hub.endpoint}/{repo_id}"}
                    return self._json(409, body409, {"X-Error-Message": body409["error"]})
                hub.commit(repo_id, {}, branch="main")
                hub.repos[repo_id].private = doc.get("visibility") == "private" or bool(doc.get("private"))
                return self._json(200, {"url": f"{hub.endpoint}/{repo_id}", "name": repo_id})
            if path == "/api/validate-yaml":
                return self._json(200, {"errors": [], "warnings": []})
            if m := _BRANCH.match(path):
                repo = self._repo(m[1])
                if repo is None:
                    return
                if m[2] in repo.refs:
                    return self._error(409, None, "Reference already exists")
                repo.refs[m[2]] = repo.refs["main"]
                return self._json(200, {})
            if m := _PREUPLOAD.match(path):
                repo = self._repo(m[1])
                if repo is None:
                    return
                doc = json.loads(body)
                return self._json(200, {"files": [
                    {"path": f["path"], "uploadMode": "lfs" if is_lfs(f["path"]) else "regular", "shouldIgnore": False, "oid": None}
                    for f in doc["files"]
                ]})
            if m := _BATCH.match(path):
                doc = json.loads(body)
                objs = [
                    {"oid": o["oid"], "size": o["size"], "authenticated": True,
                     **({} if o["oid"] in hub.lfs else {"actions": {"upload": {"href": f"{hub.endpoint}/lfs-upload/{o['oid']}"}}})}
                    for o in doc["objects"]
                ]
                return self._json(200, {"transfer": "basic", "objects": objs})
            if m := _COMMIT.match(path):
                repo = self._repo(m[1])
                if repo is None:
                    return
                files: dict[str, bytes] = {}
                deleted: list[str] = []
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    v = item["value"]
                    if item["key"] == "file":
                        files[v["path"]] = base64.b64decode(v["content"])
                    elif item["key"] == "lfsFile":
                        if v["oid"] not in hub.lfs:
                            return self._error(400, None, f"LFS object {v['oid']} was not uploaded")
                        files[v["path"]] = hub.lfs[v["oid"]]
                    elif item["key"] == "deletedFile":
                        deleted.append(v["path"])
                branch = unquote(m[2])
                if branch not in repo.refs:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {branch}")
                sha = hub.commit(m[1], files, branch=branch, deleted=tuple(deleted))
                return self._json(200, {"commitUrl": f"{hub.endpoint}/{m[1]}/commit/{sha}", "commitOid": sha,
                                        "pullRequestUrl": None, "success": True})
            del query
            self._error(404, None, f"no such endpoint: POST {path}")

        def do_PUT(self) -> None:
            path, _ = self._start()
            body = self._body()
            if m := _LFS_PUT.match(path):
                if hashlib.sha256(body).hexdigest() != m[1]:
                    return self._error(400, None, "sha256 mismatch")
                with hub.lock:
                    hub.lfs[m[1]] = body
                return self._send(200)
            self._error(404, None, f"no such endpoint: PUT {path}")

    return Handler


def publish_folder(hub: FakeHub, repo_id: str, folder: str | os.PathLike[str], *, branch: str = "main") -> str:
    """Commit every file of ``folder`` to ``repo_id`` on the fake hub, as an upload would; returns the commit."""
    root = Path(folder)
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    return hub.commit(repo_id, files, branch=branch)
