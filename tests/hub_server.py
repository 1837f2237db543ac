"""A local stand-in for the Hugging Face Hub, for tests that run huggingface_hub's real client with
no internet: :class:`LocalHub` answers the HTTP routes the client calls to list and download a
model repo (``HF_ENDPOINT=hub.url``), and :func:`lay_out_cache` writes a repo into a cache
folder as huggingface_hub lays it out (``HF_HUB_CACHE``), for loads with ``HF_HUB_OFFLINE=1``.

Repos hold files by path; each revision (a branch or tag) points at a commit whose id is a hash
of its files, as the hub's commits are named by hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

FileContents = Path | bytes


def _read(contents: FileContents) -> bytes:
    return contents.read_bytes() if isinstance(contents, Path) else contents


def _blob_id(data: bytes) -> str:
    """A file's id as git names a blob."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _commit_id(files: Mapping[str, bytes]) -> str:
    digest = hashlib.sha1()
    for path in sorted(files):
        digest.update(path.encode() + b"\0" + _blob_id(files[path]).encode())
    return digest.hexdigest()


class LocalHub:
    """An HTTP server on 127.0.0.1 answering huggingface_hub's repo info, tree listing and file
    download routes for the repos added with :meth:`add`. ``requests`` records each request as
    ``(method, path, authorization header)``. Use as a context manager."""

    def __init__(self) -> None:
        self._commits: dict[str, dict[str, dict[str, bytes]]] = {}  # repo -> commit -> files
        self._refs: dict[str, dict[str, str]] = {}  # repo -> branch or tag -> commit
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add(self, repo_id: str, files: Mapping[str, FileContents],
            revision: str = "main") -> str:
        """Puts ``files`` (path in the repo -> bytes, or a file to read them from) at
        ``revision`` of ``repo_id``; returns the commit id."""
        contents = {path: _read(data) for path, data in files.items()}
        commit = _commit_id(contents)
        self._commits.setdefault(repo_id, {})[commit] = contents
        self._refs.setdefault(repo_id, {})[revision] = commit
        return commit

    def environ(self, cache: Path, **extra: str) -> dict[str, str]:
        """This process's environment for a subprocess that uses the hub as a user would:
        ``HF_ENDPOINT`` here, ``HF_HUB_CACHE`` at ``cache``, online (whatever this process set:
        some test modules set ``HF_HUB_OFFLINE`` for their own references), plus ``extra``."""
        return {**os.environ, "HF_ENDPOINT": self.url, "HF_HUB_CACHE": str(cache),
                "HF_HUB_OFFLINE": "0", **extra}

    def requested(self, suffix: str) -> list[str]:
        """The paths requested that end with ``suffix``."""
        return [path for _, path, _ in self.requests if path.endswith(suffix)]

    def __enter__(self) -> LocalHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---- the routes ---------------------------------------------------------------------------

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        url = urlsplit(handler.path)
        self.requests.append((handler.command, url.path,
                              handler.headers.get("Authorization")))
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(/.*)?", url.path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", url.path)
        if api is not None:
            repo_id, route, revision = api.group(1), api.group(2), unquote(api.group(3))
            found = self._commit(handler, repo_id, revision)
            if found is None:
                return
            commit, files = found
            if route == "revision":
                answer = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                          "siblings": [{"rfilename": path} for path in sorted(files)]}
            else:
                answer = [{"type": "file", "path": path, "size": len(data),
                           "oid": _blob_id(data)} for path, data in sorted(files.items())]
            self._send(handler, 200, json.dumps(answer).encode(),
                       {"Content-Type": "application/json"}, body)
        elif resolve is not None:
            repo_id, revision, path = resolve.group(1), unquote(resolve.group(2)), \
                unquote(resolve.group(3))
            found = self._commit(handler, repo_id, revision)
            if found is None:
                return
            commit, files = found
            if path not in files:
                self._send(handler, 404, b"Entry not found", {"X-Error-Code": "EntryNotFound"},
                           body)
                return
            data = files[path]
            self._send(handler, 200, data, {"X-Repo-Commit": commit,
                                            "ETag": f'"{_blob_id(data)}"',
                                            "Content-Type": "application/octet-stream"}, body)
        else:
            self._send(handler, 404, b"Not found", {}, body)

    def _commit(self, handler: BaseHTTPRequestHandler, repo_id: str, revision: str
                ) -> tuple[str, dict[str, bytes]] | None:
        """The commit and files ``revision`` names in ``repo_id``; None once a 404 is sent."""
        if repo_id not in self._commits:
            self._send(handler, 404, b"Repository not found", {"X-Error-Code": "RepoNotFound"},
                       handler.command == "GET")
            return None
        commit = self._refs[repo_id].get(revision, revision)
        if commit not in self._commits[repo_id]:
            self._send(handler, 404, b"Revision not found",
                       {"X-Error-Code": "RevisionNotFound"}, handler.command == "GET")
            return None
        return commit, self._commits[repo_id][commit]

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, data: bytes,
              headers: Mapping[str, str], body: bool) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)


def lay_out_cache(cache: Path, repo_id: str, files: Mapping[str, FileContents],
                  revision: str = "main") -> Path:
    """Writes ``files`` of ``repo_id`` at ``revision`` into the hub cache folder ``cache`` as
    huggingface_hub lays a download out (``models--org--name/{blobs,refs,snapshots}``, the
    snapshot's files links to blobs named by their ids); returns the snapshot folder."""
    contents = {path: _read(data) for path, data in files.items()}
    commit = _commit_id(contents)
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    for path, data in contents.items():
        blob = repo / "blobs" / _blob_id(data)
        blob.write_bytes(data)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot
