"""A Hugging Face Hub mirror on a local port, for what `huggingface_hub.snapshot_download` asks
of a model repository: the commit a revision names, the file tree at that commit, then each
file (HEAD for its size, ETag and commit, GET for its bytes). Each revision (branch or tag)
names a commit of its own files.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote


@dataclass(frozen=True)
class Revision:
    """One commit of the repository: its sha and its files (path in the repo → local file)."""

    sha: str
    files: dict[str, Path]


class _Handler(http.server.BaseHTTPRequestHandler):
    repo_id = ""
    revisions: dict[str, Revision] = {}
    requested: list[str] = []

    def do_GET(self) -> None:
        self._answer(with_body=True)

    def do_HEAD(self) -> None:
        self._answer(with_body=False)

    def _answer(self, *, with_body: bool) -> None:
        self.requested.append(f"{self.command} {self.path}")
        path = unquote(self.path.split("?", 1)[0])
        info_prefix = f"/api/models/{self.repo_id}/revision/"
        tree_prefix = f"/api/models/{self.repo_id}/tree/"
        file_prefix = f"/{self.repo_id}/resolve/"
        if path.startswith(info_prefix):
            revision = self._revision(path.removeprefix(info_prefix))
            if revision is not None:
                siblings = [{"rfilename": name} for name in sorted(revision.files)]
                body = json.dumps({"id": self.repo_id, "sha": revision.sha, "siblings": siblings})
                self._send(200, body.encode(), {"Content-Type": "application/json"}, with_body)
                return
        elif path.startswith(tree_prefix):
            revision = self._revision(path.removeprefix(tree_prefix).strip("/"))
            if revision is not None:
                entries = [
                    {"type": "file", "path": name, "size": file.stat().st_size, "oid": _oid(file)}
                    for name, file in sorted(revision.files.items())
                ]
                body = json.dumps(entries)
                self._send(200, body.encode(), {"Content-Type": "application/json"}, with_body)
                return
        elif path.startswith(file_prefix):
            name, _, file = path.removeprefix(file_prefix).partition("/")
            revision = self._revision(name)
            if revision is not None and file in revision.files:
                data = revision.files[file].read_bytes()
                headers = {"X-Repo-Commit": revision.sha, "ETag": f'"{_oid(revision.files[file])}"'}
                self._send(200, data, headers, with_body)
                return
        self._send(404, b'{"error": "not found"}', {"X-Error-Code": "EntryNotFound"}, with_body)

    def _revision(self, name: str) -> Revision | None:
        by_sha = {r.sha: r for r in self.revisions.values()}
        return self.revisions.get(name) or by_sha.get(name)

    def _send(self, status: int, body: bytes, headers: dict[str, str], with_body: bool) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _oid(file: Path) -> str:
    """A file's git blob id, as the Hub names a file that is not in LFS."""
    data = file.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@contextlib.contextmanager
def hub_mirror(repo_id: str, revisions: dict[str, Revision]) -> Iterator[tuple[str, list[str]]]:
    """Serves `repo_id` at these revisions; yields the endpoint URL (for `HF_ENDPOINT`) and the
    list of requests it answers, as they come."""
    requested: list[str] = []
    handler = type(
        "Handler", (_Handler,), {"repo_id": repo_id, "revisions": revisions, "requested": requested}
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requested
    finally:
        server.shutdown()
        server.server_close()
