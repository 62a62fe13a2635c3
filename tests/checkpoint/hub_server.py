"""A stand-in for the Hugging Face Hub's HTTP API, for the upload and download tests: the routes that
huggingface_hub's create_repo, create_commit (preupload, then the NDJSON commit), list_repo_files and hf_hub_download
(HEAD, then GET of a file's resolve URL) use, on repositories held in memory. Every file is committed inline
("regular"); every request must carry the test's token."""

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

REPO_ROUTE = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/(?P<action>preupload|commit|tree)/(?P<rest>.*)")
RESOLVE_ROUTE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<path>.+)")


class FakeHub:
    """``with FakeHub(token) as hub:`` serves on ``hub.endpoint``; ``hub.repos[repo_id]`` is {path: bytes}."""

    def __init__(self, token: str, namespace: str = "tester"):
        self.token = token
        self.namespace = namespace  # the token's user: where a repository named without one is created
        self.repos: dict[str, dict[str, bytes]] = {}
        self.private: dict[str, bool] = {}
        self.commits: list[tuple[str, str]] = []  # (repo_id, message)
        self.commit_gate = threading.Event()  # cleared: commits wait until it is set
        self.commit_gate.set()
        self.commits_waiting = threading.Semaphore(0)  # released when a commit starts waiting
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(
            target=self.server.serve_forever, args=(0.05,), daemon=True
        ).start()  # quick shutdown
        return self

    def __exit__(self, *exc):
        self.commit_gate.set()
        self.server.shutdown()
        self.server.server_close()

    def steps(self, repo_id: str) -> list[int]:
        """The step-<N> folders of a repository, ascending."""
        found = {int(m.group(1)) for path in self.repos[repo_id] if (m := re.match(r"step-(\d+)/", path))}
        return sorted(found)

    def folder(self, repo_id: str, prefix: str) -> dict[str, bytes]:
        """{path below prefix/: content} of one folder of a repository."""
        return {p[len(prefix) + 1 :]: b for p, b in self.repos[repo_id].items() if p.startswith(prefix + "/")}

    # ---- the routes --------------------------------------------------------------------------------------
    def _create(self, body: dict) -> tuple[int, dict]:
        repo_id = f"{body.get('organization') or self.namespace}/{body['name']}"
        with self.lock:
            if repo_id in self.repos:
                return 409, {
                    "error": "You already created this model repo",
                    "url": f"{self.endpoint}/{repo_id}",
                }
            self.repos[repo_id] = {}
            self.private[repo_id] = body.get("visibility") == "private"
        return 200, {"url": f"{self.endpoint}/{repo_id}"}

    def _preupload(self, body: dict) -> tuple[int, dict]:
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in body["files"]]
        return 200, {"files": files}

    def _commit(self, repo_id: str, ndjson: bytes) -> tuple[int, dict]:
        if not self.commit_gate.is_set():
            self.commits_waiting.release()
            self.commit_gate.wait(
                timeout=60
            )  # bounded: a test that forgets the gate fails instead of hanging
        lines = [json.loads(line) for line in ndjson.splitlines() if line.strip()]
        with self.lock:
            files = dict(self.repos[repo_id])
            for line in lines:
                key, value = line["key"], line["value"]
                if key == "header":
                    message = value["summary"]
                elif key == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    if value["path"] not in files:
                        return 404, {"error": f"A file with this name doesn't exist: {value['path']}"}
                    del files[value["path"]]
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    files = {p: b for p, b in files.items() if not p.startswith(prefix)}
                else:
                    return 400, {"error": f"the stand-in hub does not take '{key}' lines"}
            self.repos[repo_id] = files  # the whole commit or nothing
            self.commits.append((repo_id, message))
            oid = hashlib.sha1(f"{len(self.commits)}".encode()).hexdigest()
        return 200, {
            "commitUrl": f"{self.endpoint}/{repo_id}/commit/{oid}",
            "commitOid": oid,
            "pullRequestUrl": None,
        }

    def _tree(self, repo_id: str, rest: str, recursive: bool) -> tuple[int, list]:
        _, _, below = rest.partition("/")  # rest is <revision>[/<path>]
        prefix = below.rstrip("/") + "/" if below else ""
        entries, folders = [], set()
        for path, content in sorted(self.repos[repo_id].items()):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix) :].split("/")
            for depth in range(1, len(parts)):
                folders.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                oid = hashlib.sha1(content).hexdigest()
                entries.append({"type": "file", "path": path, "size": len(content), "oid": oid})
        for folder in sorted(folders):
            if recursive or "/" not in folder[len(prefix) :]:
                entries.append(
                    {"type": "directory", "path": folder, "oid": hashlib.sha1(folder.encode()).hexdigest()}
                )
        return 200, entries

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: the tests read the trainer's log
                pass

            def _answer(self, status: int, body) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 404:
                    self.send_header("X-Error-Code", "RepoNotFound")
                self.end_headers()
                self.wfile.write(data)

            def _file(self, method: str, repo_id: str, path: str) -> None:
                content = hub.repos[repo_id].get(path)
                if content is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("X-Repo-Commit", hashlib.sha1(f"{len(hub.commits)}".encode()).hexdigest())
                self.send_header("ETag", f'"{hashlib.sha1(content).hexdigest()}"')
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                if method == "GET":
                    self.wfile.write(content)

            def _route(self, method: str) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                if self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._answer(401, {"error": "Invalid credentials in Authorization header"})
                if method == "POST" and url.path == "/api/repos/create":
                    return self._answer(*hub._create(json.loads(raw)))
                if method in ("GET", "HEAD") and (file := RESOLVE_ROUTE.fullmatch(url.path)):
                    if file["repo"] not in hub.repos:
                        return self._answer(404, {"error": "Repository not found"})
                    return self._file(method, file["repo"], file["path"])
                match = REPO_ROUTE.fullmatch(url.path)
                if match is None:
                    return self._answer(404, {"error": f"the stand-in hub has no route {method} {url.path}"})
                repo_id, action = match["repo"], match["action"]
                if repo_id not in hub.repos:
                    return self._answer(404, {"error": "Repository not found"})
                if method == "POST" and action == "preupload":
                    return self._answer(*hub._preupload(json.loads(raw)))
                if method == "POST" and action == "commit":
                    return self._answer(*hub._commit(repo_id, raw))
                if method == "GET" and action == "tree":
                    recursive = "recursive=True" in (url.query or "") or "recursive=true" in (url.query or "")
                    return self._answer(*hub._tree(repo_id, match["rest"], recursive))
                return self._answer(404, {"error": f"the stand-in hub has no route {method} {url.path}"})

            def do_GET(self):
                self._route("GET")

            def do_HEAD(self):
                self._route("HEAD")

            def do_POST(self):
                self._route("POST")

        return Handler
