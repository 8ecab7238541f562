"""A loopback stand-in for the Hugging Face Hub: it serves a folder in the hub's layout
(`datasets/<owner>/<name>/<path>`, as ../shared/hub-mirror) and answers the requests that
huggingface_hub's `snapshot_download` makes for a data set:

- `GET /api/datasets/<owner>/<name>/revision/<rev>`: the repository's id, commit and files;
- `GET /api/datasets/<owner>/<name>/tree/<rev>[/<folder>]`: the file listing (one page), each file
  as an LFS file whose `lfs.oid` is its sha256;
- `HEAD` / `GET /datasets/<owner>/<name>/resolve/<rev>/<path>`: the file, with `X-Repo-Commit`,
  `ETag` / `X-Linked-Etag` (its sha256) and its size.

Every repository has one commit, `main`, whose hash is made from its files' digests. Point
`HF_ENDPOINT` at `url`. Run it alone to serve a folder: `python tests/hub_standin.py FOLDER [PORT]`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Repo:
    """One data set's files and the commit they make."""

    def __init__(self, root: Path, repo_id: str):
        self.root, self.repo_id = root, repo_id
        self.files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        self.digests = {path: sha256_of(root / path) for path in self.files}
        self.commit = hashlib.sha1(json.dumps(self.digests, sort_keys=True).encode()).hexdigest()

    def knows(self, revision: str) -> bool:
        return revision in ("main", self.commit)

    def entry(self, path: str) -> dict:
        data = (self.root / path).read_bytes()
        return {"type": "file", "path": path, "size": len(data), "oid": _git_blob_id(data),
                "lfs": {"oid": self.digests[path], "size": len(data), "pointerSize": 134}}


class HubStandIn:
    """`with HubStandIn(folder) as hub:` serves `folder` at `hub.url` until the block ends."""

    def __init__(self, folder: Path, port: int = 0):
        self.folder = Path(folder)
        self.requests: list[str] = []  # "METHOD path" of every request, for the tests
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: the tests read `requests`
                pass

            def do_GET(self):
                standin.answer(self, body=True)

            def do_HEAD(self):
                standin.answer(self, body=False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HubStandIn":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def repo(self, owner: str, name: str) -> _Repo | None:
        root = self.folder / "datasets" / owner / name
        return _Repo(root, f"{owner}/{name}") if root.is_dir() else None

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        self.requests.append(f"{handler.command} {handler.path}")
        parts = [unquote(p) for p in urlsplit(handler.path).path.strip("/").split("/")]
        if parts[:2] == ["api", "datasets"] and len(parts) >= 6:
            repo = self.repo(parts[2], parts[3])
            if repo is None:
                return self._send(handler, 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            if not repo.knows(parts[5]):
                return self._send(handler, 404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"})
            if parts[4] == "revision":
                return self._send(handler, 200, {"id": repo.repo_id, "sha": repo.commit, "private": False,
                                                 "siblings": [{"rfilename": f} for f in repo.files]})
            if parts[4] == "tree":
                folder = "/".join(parts[6:])
                listed = [repo.entry(f) for f in repo.files if not folder or f.startswith(folder + "/")]
                return self._send(handler, 200, listed)
        if parts[:1] == ["datasets"] and len(parts) >= 6 and parts[3] == "resolve":
            repo = self.repo(parts[1], parts[2])
            path = "/".join(parts[5:])
            if repo is None or not repo.knows(parts[4]) or path not in repo.digests:
                return self._send(handler, 404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
            data = (repo.root / path).read_bytes()
            headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{repo.digests[path]}"',
                       "X-Linked-Etag": f'"{repo.digests[path]}"', "X-Linked-Size": str(len(data)),
                       "Content-Type": "application/octet-stream", "Accept-Ranges": "none"}
            return self._send_bytes(handler, 200, data if body else None, len(data), headers)
        return self._send(handler, 404, {"error": f"not served here: {handler.path}"})

    def _send(self, handler, status: int, payload, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self._send_bytes(handler, status, data if handler.command != "HEAD" else None, len(data),
                         {"Content-Type": "application/json", **(headers or {})})

    @staticmethod
    def _send_bytes(handler, status: int, data: bytes | None, size: int, headers: dict) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(size))
        handler.end_headers()
        if data is not None:
            handler.wfile.write(data)


if __name__ == "__main__":
    with HubStandIn(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0) as hub:
        print(hub.url, flush=True)
        hub.thread.join()
