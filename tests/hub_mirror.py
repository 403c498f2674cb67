"""A local Hugging Face Hub mirror for tests: the endpoints `huggingface_hub`'s
`snapshot_download` calls, serving folders of files as repositories, on a free port.

    GET  /api/models/{repo}[/revision/{rev}]      the revision's commit and file list
    GET  /api/models/{repo}/tree/{rev}            the files (path, size, oid), one page
    HEAD /{repo}/resolve/{rev}/{path}             the file's commit, ETag and size
    GET  /{repo}/resolve/{rev}/{path}             the file

A revision is a branch name or its commit (40 hex digits). Unknown repositories and revisions
answer 404 with the Hub's `X-Error-Code`, so `huggingface_hub` raises its own errors. Every
request's method and path is recorded in `requests`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass(frozen=True)
class Revision:
    commit: str  # 40 hex digits
    folder: Path

    def files(self) -> list[str]:
        return sorted(
            str(p.relative_to(self.folder)) for p in self.folder.rglob("*") if p.is_file()
        )


@dataclass
class HubMirror:
    """repo id → branch name → revision; `url` once serving."""

    repos: dict[str, dict[str, Revision]]
    url: str = ""
    requests: list[tuple[str, str]] = field(default_factory=list)

    def add(self, repo_id: str, branch: str, folder: Path) -> Revision:
        """Serves `folder` as `repo_id` at `branch` (its commit derived from the two)."""
        commit = hashlib.sha1(f"{repo_id}@{branch}".encode()).hexdigest()
        revision = Revision(commit, folder)
        self.repos.setdefault(repo_id, {})[branch] = revision
        return revision

    def find(self, repo_id: str, rev: str) -> Revision | None:
        branches = self.repos.get(repo_id, {})
        if rev in branches:
            return branches[rev]
        return next((r for r in branches.values() if r.commit == rev), None)

    def split(self, path: str) -> tuple[str, str] | None:
        """(repo id, rest) of a path that starts with a served repository's id."""
        for repo_id in self.repos:
            if path == repo_id or path.startswith(repo_id + "/"):
                return repo_id, path[len(repo_id) + 1 :]
        return None


class _Handler(BaseHTTPRequestHandler):
    mirror: HubMirror

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        pass

    def do_HEAD(self) -> None:
        self._serve(with_body=False)

    def do_GET(self) -> None:
        self._serve(with_body=True)

    def _serve(self, *, with_body: bool) -> None:
        path = unquote(urlsplit(self.path).path).lstrip("/")
        self.mirror.requests.append((self.command, path))
        if path.startswith("api/models/"):
            self._api(path.removeprefix("api/models/"))
        else:
            self._resolve(path, with_body)

    def _api(self, path: str) -> None:
        found = self.mirror.split(path)
        if found is None:
            return self._error("RepoNotFound")
        repo_id, rest = found
        kind, _, rev = rest.partition("/")
        revision = self.mirror.find(repo_id, rev or "main")
        if revision is None:
            return self._error("RevisionNotFound")
        files = revision.files()
        if kind == "tree":
            body = [
                {"type": "file", "path": f, "size": (revision.folder / f).stat().st_size,
                 "oid": _etag(revision.folder / f)}
                for f in files
            ]  # fmt: skip
            return self._json(body)
        siblings = [{"rfilename": f} for f in files]
        self._json({"id": repo_id, "modelId": repo_id, "sha": revision.commit,
                    "siblings": siblings, "private": False})  # fmt: skip

    def _resolve(self, path: str, with_body: bool) -> None:
        found = self.mirror.split(path)
        if found is None:
            return self._error("RepoNotFound")
        repo_id, rest = found
        rev, _, name = rest.removeprefix("resolve/").partition("/")
        revision = self.mirror.find(repo_id, rev)
        if revision is None:
            return self._error("RevisionNotFound")
        file = revision.folder / name
        if name not in revision.files():
            return self._error("EntryNotFound", commit=revision.commit)
        data = file.read_bytes()
        self.send_response(200)
        self.send_header("X-Repo-Commit", revision.commit)
        self.send_header("ETag", f'"{_etag(file)}"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if with_body:
            self.wfile.write(data)

    def _json(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: str, commit: str | None = None) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", code)
        if commit is not None:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Length", "0")
        self.end_headers()


def _etag(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


@contextmanager
def serving_hub(mirror: HubMirror) -> Iterator[HubMirror]:
    """Serves `mirror` on 127.0.0.1 (a free port) until the block exits; sets `mirror.url`."""
    handler = type("Handler", (_Handler,), {"mirror": mirror})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    mirror.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="hub-mirror", daemon=True)
    thread.start()
    try:
        yield mirror
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
