"""A Hub-compatible HTTP server for tests (stdlib only), on 127.0.0.1.

It implements what huggingface_hub's client uses to publish and read repos over the plain LFS path
(HF_HUB_DISABLE_XET=1): create repo, preupload, LFS batch / upload / verify, NDJSON commit, tree
listing, paths-info, repo and revision info, resolve (HEAD, GET, Range) and validate-yaml; branches, and
pull requests (create_pull_request: a ref ``refs/pr/N`` that commits and reads may name; a branch under
``refs/`` is refused, as the Hub refuses it). It
rejects what the Hub rejects where it matters here: a commit naming an LFS object that was never
uploaded, an upload whose bytes do not match its sha256.

Faults for tests: ``server.fail(method, path_regex, status, times, headers=...)`` answers matching
requests with an error (a ``Retry-After`` header, say); ``server.storm(fraction, ...)`` answers a random
fraction of matching requests with 429 or 503; ``server.stall(path_regex, seconds)`` holds matching
answers back (a stalled connection); ``server.corrupt(path_regex)`` flips a byte of matching answers; ``server.cut_upload(times, after_bytes)`` drops the connection in
the middle of LFS uploads. ``server.log`` records every (method, path) served, ``server.transfers``
every file answer's (method, path, status, body bytes): what a reader cost the Hub.

Xet (see the "Xet" section below): the server hands out a ``local://`` content store (CAS) from its
Xet token endpoints, so a client with hf_xet enabled uploads and downloads through hf_xet itself;
commits may name files uploaded that way, and resolve answers carry ``X-Xet-Hash``. Commits also
take server-side copies (CommitOperationCopy: an ``lfsFile`` naming an object already stored) and
deletions. ``server.throttle_uploads(rate)`` and ``server.delay_commits(s)`` model a slow uplink and
the Hub's commit latency for benchmarks. ``server.limit_commits(per_hour, hour=60)`` enforces the Hub's commit
rate per repo on a scaled clock (128 commits an "hour" of 60 s, say): a commit past it is answered 429 with a
``Retry-After``, and counted in ``server.state.refused_commits``. Every commit made is recorded in
``server.state.commit_log`` as (repo id, monotonic time it was asked for, commit summary).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

LFS_SUFFIXES = (".safetensors", ".parquet", ".bin", ".npz", ".npy", ".pt")


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Entry:
    size: int
    oid: str  # git blob oid (of the content, or of the LFS pointer)
    sha256: str | None = None  # LFS files
    data: bytes | None = None  # regular files
    xet_hash: str | None = None  # files uploaded through Xet (their bytes are in the local CAS)


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # branch (or a pull request's refs/pr/N) -> commit
    commits: dict[str, dict[str, Entry]] = field(default_factory=dict)  # commit -> tree
    discussions: list[dict] = field(default_factory=list)  # discussions and pull requests, number k at [k - 1]


@dataclass
class Fault:
    method: str
    pattern: re.Pattern
    status: int
    times: int
    skip: int = 0  # let this many matching requests through first
    headers: dict | None = None  # sent with the error (Retry-After, say)


@dataclass
class Storm:
    pattern: re.Pattern
    fraction: float
    statuses: tuple[int, ...]
    headers: dict
    rng: random.Random
    hits: int = 0


@dataclass
class Stall:
    pattern: re.Pattern
    seconds: float
    times: int


class HubState:
    def __init__(self, root: Path):
        self.root = root
        (root / "lfs").mkdir(parents=True, exist_ok=True)
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lock = threading.Lock()
        self.faults: list[Fault] = []
        self.cuts = 0
        self.cut_after = 0
        self.lost_commit_answers = 0  # commits applied whose answer is then dropped
        self.log: list[tuple[str, str]] = []
        self.transfers: list[tuple[str, str, int, int]] = []  # (method, path, status, body bytes) of file answers
        self.storms: list[Storm] = []
        self.stalls: list[Stall] = []
        self.corruptions: list[Stall] = []  # (pattern, -, times): answers whose last byte is flipped
        self.auth_headers: list[str] = []
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization header or None), each
        self.rate: float | None = None  # bytes/s of file downloads, shared by all connections (one link)
        self.rate_pattern: re.Pattern | None = None  # only downloads whose path matches (None: all)
        self.link_free_at = 0.0
        # uploads and commits (benchmarks of the push, Xet): see the sections below
        self.upload_rate: float | None = None  # bytes/s of LFS upload bodies, one shared uplink
        self.uplink_free_at = 0.0
        self.commit_delay = 0.0  # seconds each commit takes (the Hub's commit latency)
        self.commit_limit: tuple[float, float] | None = None  # (commits, per seconds): the Hub's rate, scaled
        self.commit_log: list[tuple[str, float, str]] = []  # (repo id, time.monotonic(), summary) of each commit
        self.refused_commits = 0  # answered 429 by commit_limit
        self.uploaded: list[tuple[str, float]] = []  # (sha256, time.monotonic()) of each LFS object received
        self.xet = XetCAS(root / "xet-cas")
        self.spans: list[tuple[str, float, float]] = []  # ("upload" | "commit", start, end), monotonic

    def lfs_path(self, oid: str) -> Path:
        return self.root / "lfs" / oid

    def has_lfs(self, oid: str) -> bool:
        return self.lfs_path(oid).exists()

    def lfs_bytes(self, e: Entry) -> bytes:
        """The content of an LFS entry; a file uploaded through Xet is fetched from the CAS once, and kept."""
        path = self.lfs_path(e.sha256)
        if not path.exists() and e.xet_hash:
            self.xet.materialize(e.xet_hash, e.size, e.sha256, path)
        return path.read_bytes()


def timed(kind: str):
    """Record when a handler ran, in ``state.spans`` as (kind, start, end): overlaps show pipelining."""
    def wrap(fn):
        def run(self, *args, **kwargs):
            start = time.monotonic()
            try:
                return fn(self, *args, **kwargs)
            finally:
                with self.state.lock:
                    self.state.spans.append((kind, start, time.monotonic()))
        return run
    return wrap


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HubState  # set on the subclass
    base_url: str

    def log_message(self, *args):  # quiet
        pass

    # ------------------------------------------------------------------ helpers
    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, ctype="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None):
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        headers = {"X-Error-Message": message, **(headers or {})}
        if code:
            headers["X-Error-Code"] = code
        self._json(status, {"error": message}, headers)

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _fault(self) -> bool:
        st = self.state
        headers: dict = {}
        with st.lock:
            for f in st.faults:
                if f.times > 0 and f.method in (self.command, "*") and f.pattern.search(self.path):
                    if f.skip > 0:
                        f.skip -= 1
                        continue
                    f.times -= 1
                    status, headers = f.status, dict(f.headers or {})
                    break
            else:
                for storm in st.storms:
                    if storm.pattern.search(self.path) and storm.rng.random() < storm.fraction:
                        storm.hits += 1
                        status, headers = storm.rng.choice(storm.statuses), dict(storm.headers)
                        break
                else:
                    return False
        self._body() if self.command in ("POST", "PUT") else None
        self._json(status, {"error": f"injected {status}"}, {"X-Error-Message": f"injected {status}", **headers})
        with st.lock:
            st.transfers.append((self.command, self.path, status, 0))
        return True

    def _stall(self) -> None:
        st = self.state
        with st.lock:
            found = next((x for x in st.stalls if x.times > 0 and x.pattern.search(self.path)), None)
            if found is not None:
                found.times -= 1
        if found is not None:
            time.sleep(found.seconds)

    def _repo(self, repo_type: str, repo_id: str) -> Repo | None:
        return self.state.repos.get((repo_type, repo_id))

    def _tree(self, repo: Repo, rev: str) -> tuple[str, dict[str, Entry]] | None:
        rev = unquote(rev)
        commit = repo.branches.get(rev, rev if rev in repo.commits else None)
        if commit is None:
            return None
        return commit, repo.commits[commit]

    def _lookup(self, t: str, id: str, rev: str) -> tuple[Repo, str, dict[str, Entry]] | None:
        """(repo, commit, tree) at ``rev``, or None after answering 404 as the Hub does."""
        repo = self._repo(t, id)
        if repo is None:
            self._error(404, "Repository not found", "RepoNotFound")
            return None
        found = self._tree(repo, rev)
        if found is None:
            self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            return None
        return repo, found[0], found[1]

    # ------------------------------------------------------------------ dispatch
    def do_HEAD(self):
        self._dispatch()

    def do_GET(self):
        self._dispatch()

    def do_POST(self):
        self._dispatch()

    def do_PUT(self):
        self._dispatch()

    def _dispatch(self):
        if auth := self.headers.get("Authorization"):
            self.state.auth_headers.append(auth)
        self.state.requests.append((self.command, self.path, auth or None))
        self.state.log.append((self.command, self.path))
        if self._fault():
            return
        self._stall()
        url = urlsplit(self.path)
        path = url.path
        routes = [
            ("POST", r"^/api/repos/create$", self.create_repo),
            ("POST", r"^/api/validate-yaml$", self.validate_yaml),
            ("POST", r"^/api/(?P<t>model|dataset|space)s/(?P<id>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)$", self.preupload),
            ("POST", r"^/api/(?P<t>model|dataset|space)s/(?P<id>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)$", self.commit),
            ("POST", r"^/api/(?P<t>model|dataset|space)s/(?P<id>[^/]+/[^/]+)/paths-info/(?P<rev>[^/]+)$", self.paths_info),
            ("GET", r"^/api/(?P<t>model|dataset|space)s/(?P<id>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?P<sub>/.*)?$", self.tree),
            ("GET", r"^/api/(?P<t>model|dataset|space)s/(?P<id>[^/]+/[^/]+)/revision/(?P<rev>[^/]+)$", self.info),
            ("GET", r"^/api/(?P<t>model|dataset|space)s/(?P<id>[^/]+/[^/]+)$", self.info),
            ("POST", r"^/api/(?P<t>model|dataset|space)s/(?P<id>[^/]+/[^/]+)/branch/(?P<rev>[^/]+)$", self.create_branch),
            ("POST", r"^/api/(?P<t>model|dataset|space)s/(?P<id>[^/]+/[^/]+)/discussions$", self.create_discussion),
            ("GET", r"^/api/(?P<t>model|dataset|space)s/(?P<id>[^/]+/[^/]+)/discussions/(?P<num>\d+)$", self.discussion),
            ("POST", r"^/(?:(?P<t>dataset|space)s/)?(?P<id>[^/]+/[^/]+)\.git/info/lfs/objects/batch$", self.lfs_batch),
            ("PUT", r"^/lfs-upload/(?P<oid>[0-9a-f]{64})$", self.lfs_upload),
            ("POST", r"^/lfs-verify/(?P<oid>[0-9a-f]{64})$", self.lfs_verify),
            ("GET", r"^/(?:(?P<t>dataset|space)s/)?(?P<id>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$", self.resolve),
            ("HEAD", r"^/(?:(?P<t>dataset|space)s/)?(?P<id>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$", self.resolve),
            *self.xet_routes(),
        ]
        for method, pattern, fn in routes:
            m = re.match(pattern, path)
            if m and method == self.command:
                kw = {k: v for k, v in m.groupdict().items()}
                if "t" in kw:
                    kw["t"] = kw["t"] or "model"
                return fn(query=parse_qs(url.query), **kw)
        self._error(404, f"no route for {self.command} {path}")

    # ------------------------------------------------------------------ repos
    def create_repo(self, query):
        body = json.loads(self._body() or b"{}")
        repo_type = body.get("type") or "model"
        repo_id = f"{body.get('organization')}/{body['name']}" if body.get("organization") else f"user/{body['name']}"
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        url = f"{self.base_url}/{prefix}{repo_id}"
        with self.state.lock:
            if (repo_type, repo_id) in self.state.repos:
                return self._json(409, {"error": "You already created this repo", "url": url})
            repo = Repo(repo_type, repo_id, body.get("visibility") == "private")
            initial = uuid.uuid4().hex + "00000000"
            attrs = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.parquet filter=lfs diff=lfs merge=lfs -text\n"
            repo.commits[initial] = {".gitattributes": Entry(len(attrs), git_blob_oid(attrs), data=attrs)}
            repo.branches["main"] = initial
            self.state.repos[(repo_type, repo_id)] = repo
        self._json(200, {"url": url, "name": repo_id})

    def create_branch(self, query, t, id, rev):
        self._body()
        repo = self._repo(t, id)
        if repo is None:
            return self._error(404, "Repository not found", "RepoNotFound")
        if unquote(rev).startswith("refs/"):  # refs/pr/N is made by opening a pull request, never as a branch
            return self._error(400, f"Invalid reference for a branch: {unquote(rev)}")
        with self.state.lock:
            if unquote(rev) in repo.branches:
                return self._error(409, "Reference already exists")
            repo.branches[unquote(rev)] = repo.branches["main"]
        self._json(200, {})

    def create_discussion(self, query, t, id):
        """A discussion, or a pull request (``pullRequest``): a draft whose ref ``refs/pr/N`` starts at main's head,
        numbered with the repo's discussions (create_pull_request, create_discussion)."""
        body = json.loads(self._body() or b"{}")
        repo = self._repo(t, id)
        if repo is None:
            return self._error(404, "Repository not found", "RepoNotFound")
        with self.state.lock:
            num = len(repo.discussions) + 1
            pr = bool(body.get("pullRequest"))
            repo.discussions.append({"num": num, "title": body.get("title", ""), "isPullRequest": pr,
                                     "status": "draft" if pr else "open"})
            if pr:
                repo.branches[f"refs/pr/{num}"] = repo.branches["main"]
        self._json(200, {"num": num, "pullRequest": pr})

    def discussion(self, query, t, id, num):
        repo = self._repo(t, id)
        if repo is None:
            return self._error(404, "Repository not found", "RepoNotFound")
        k = int(num)
        if not 1 <= k <= len(repo.discussions):
            return self._error(404, "Discussion not found")
        d = repo.discussions[k - 1]
        self._json(200, {**d, "author": {"name": "user"}, "createdAt": "2026-01-01T00:00:00.000Z",
                         "repo": {"name": repo.repo_id, "type": repo.repo_type}, "events": [],
                         "changes": {"base": "refs/heads/main"}, "filesWithConflicts": [], "diff": ""})

    def validate_yaml(self, query):
        body = json.loads(self._body() or b"{}")
        content = body.get("content", "")
        if content.startswith("---"):
            try:
                yaml.safe_load(content.split("---", 2)[1])
            except yaml.YAMLError as exc:
                return self._json(400, {"errors": [{"message": f"invalid YAML: {exc}"}], "warnings": []})
        self._json(200, {"errors": [], "warnings": []})

    def info(self, query, t, id, rev="main"):
        if (found := self._lookup(t, id, rev)) is None:
            return
        repo, commit, tree = found
        self._json(200, {
            "id": repo.repo_id, "_id": repo.repo_id, "author": repo.repo_id.split("/")[0], "sha": commit,
            "private": repo.private, "disabled": False, "gated": False, "downloads": 0, "likes": 0, "tags": [],
            "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z",
            "siblings": [{"rfilename": p} for p in sorted(tree)], "cardData": {},
        })

    # ------------------------------------------------------------------ upload
    def preupload(self, query, t, id, rev):
        body = json.loads(self._body())
        repo = self._repo(t, id)
        if repo is None:
            return self._error(404, "Repository not found", "RepoNotFound")
        found = self._tree(repo, rev)
        tree = found[1] if found else {}
        files = []
        for f in body["files"]:
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] > 10 * 2**20
            existing = tree.get(f["path"])
            oid = None
            if existing is not None:
                oid = existing.sha256 if existing.sha256 else existing.oid
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        self._json(200, {"files": files, "commitOid": found[0] if found else None})

    def lfs_batch(self, query, t, id):
        body = json.loads(self._body())
        if self._repo(t or "model", id) is None:
            return self._error(404, "Repository not found", "RepoNotFound")
        objects = []
        for obj in body["objects"]:
            oid, size = obj["oid"], obj["size"]
            if self.state.has_lfs(oid):
                objects.append({"oid": oid, "size": size})
            else:
                objects.append({"oid": oid, "size": size, "authenticated": True, "actions": {
                    "upload": {"href": f"{self.base_url}/lfs-upload/{oid}"},
                    "verify": {"href": f"{self.base_url}/lfs-verify/{oid}"},
                }})
        self._send(200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                   ctype="application/vnd.git-lfs+json")

    @timed("upload")
    def lfs_upload(self, query, oid):
        n = int(self.headers.get("Content-Length") or 0)
        st = self.state
        with st.lock:
            cut = st.cuts > 0
            if cut:
                st.cuts -= 1
        if cut:
            self.rfile.read(min(n, st.cut_after))
            self.close_connection = True
            self.connection.shutdown(2)  # drop the connection mid-upload
            return
        data = self._read_throttled(n)
        if hashlib.sha256(data).hexdigest() != oid:
            return self._error(400, "sha256 of the uploaded bytes does not match the oid")
        tmp = st.lfs_path(oid).with_suffix(".tmp" + uuid.uuid4().hex)
        tmp.write_bytes(data)
        tmp.replace(st.lfs_path(oid))
        with st.lock:
            st.uploaded.append((oid, time.monotonic()))
        self._send(200, b"", ctype="text/plain")

    def lfs_verify(self, query, oid):
        body = json.loads(self._body())
        path = self.state.lfs_path(oid)
        if not path.exists() or path.stat().st_size != body.get("size"):
            return self._error(404, "object not found")
        self._json(200, {})

    @timed("commit")
    def commit(self, query, t, id, rev):
        arrived = time.monotonic()  # the rate counts commits as they are asked for
        lines = [json.loads(x) for x in self._body().splitlines() if x.strip()]
        if self.state.commit_delay:
            time.sleep(self.state.commit_delay)  # the Hub's commit latency
        repo = self._repo(t, id)
        if repo is None:
            return self._error(404, "Repository not found", "RepoNotFound")
        rev = unquote(rev)
        with self.state.lock:
            if rev not in repo.branches:
                return self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            if self.state.commit_limit is not None:  # the Hub's commits an hour per repo, on a scaled clock
                per_hour, hour = self.state.commit_limit
                recent = [t for r, t, _ in self.state.commit_log if r == id and t > arrived - hour]
                if len(recent) >= per_hour:
                    self.state.refused_commits += 1
                    wait = recent[len(recent) - int(per_hour)] + hour - arrived
                    return self._error(429, "You have exceeded the rate limit for repository commits",
                                       headers={"Retry-After": str(max(1, math.ceil(wait)))})
            tree = dict(repo.commits[repo.branches[rev]])
            summary = ""
            for item in lines:
                key, value = item["key"], item["value"]
                if key == "header":
                    summary = value.get("summary", "")
                    parent = value.get("parentCommit")
                    if parent and parent != repo.branches[rev]:
                        return self._error(412, "A commit has happened since. Please refresh and try again.")
                elif key == "file":
                    data = base64.b64decode(value["content"])
                    tree[value["path"]] = Entry(len(data), git_blob_oid(data), data=data)
                elif key == "lfsFile":  # an upload (LFS or Xet), or a server-side copy (no size)
                    oid = value["oid"]
                    xet = None if self.state.has_lfs(oid) else self.state.xet.lookup(oid)
                    if not self.state.has_lfs(oid) and xet is None:
                        return self._error(
                            422, f"Your push was rejected because an LFS pointer pointed to a file that does not exist ({value['path']})")
                    size = self.state.lfs_path(oid).stat().st_size if xet is None else xet[1]
                    if value.get("size") is not None and value["size"] != size:
                        return self._error(422, f"{value['path']}: size {value['size']} does not match the object's {size}")
                    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()
                    tree[value["path"]] = Entry(size, git_blob_oid(pointer), sha256=oid,
                                                xet_hash=None if xet is None else xet[0])
                elif key == "deletedFile":
                    if value["path"] not in tree:
                        return self._error(404, "A file with this name doesn't exist", "EntryNotFound")
                    del tree[value["path"]]
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    for p in [p for p in tree if p.startswith(prefix)]:
                        del tree[p]
            commit = hashlib.sha1(f"{time.time_ns()}{uuid.uuid4()}".encode()).hexdigest()
            repo.commits[commit] = tree
            repo.branches[rev] = commit
            self.state.commit_log.append((id, arrived, summary))
            lose = self.state.lost_commit_answers > 0
            if lose:
                self.state.lost_commit_answers -= 1
        if lose:
            self.close_connection = True
            self.connection.shutdown(2)
            return
        prefix = "" if t == "model" else f"{t}s/"
        self._json(200, {"commitUrl": f"{self.base_url}/{prefix}{id}/commit/{commit}", "commitOid": commit,
                         "pullRequestUrl": None})

    # ------------------------------------------------------------------ listing and reading
    def _entry_json(self, path: str, e: Entry) -> dict:
        d = {"type": "file", "oid": e.oid, "size": e.size, "path": path}
        if e.sha256:
            d["lfs"] = {"oid": e.sha256, "size": e.size, "pointerSize": 130}
        if e.xet_hash:
            d["xetHash"] = e.xet_hash
        return d

    def _listing(self, tree: dict[str, Entry], sub: str, recursive: bool) -> list[dict]:
        sub = sub.strip("/")
        prefix = sub + "/" if sub else ""
        out, folders = [], set()
        for path in sorted(tree):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):]
            parts = rest.split("/")
            for i in range(1, len(parts)):
                folder = prefix + "/".join(parts[:i])
                if (recursive or i == 1) and folder not in folders:
                    folders.add(folder)
                    out.append({"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(), "size": 0,
                                "path": folder})
            if recursive or len(parts) == 1:
                out.append(self._entry_json(path, tree[path]))
        return out

    def tree(self, query, t, id, rev, sub=None):
        if (found := self._lookup(t, id, rev)) is None:
            return
        sub = unquote(sub or "")
        listing = self._listing(found[2], sub, query.get("recursive", ["false"])[0].lower() in ("true", "1"))
        if sub.strip("/") and not listing:
            return self._error(404, f"{sub} does not exist", "EntryNotFound")
        self._json(200, listing)

    def paths_info(self, query, t, id, rev):
        raw = self._body().decode()
        form = parse_qs(raw) if "application/json" not in (self.headers.get("Content-Type") or "") else json.loads(raw)
        paths = form.get("paths", [])
        if (found := self._lookup(t, id, rev)) is None:
            return
        tree = found[2]
        out = []
        for p in paths:
            p = p.strip("/")
            if p in tree:
                out.append(self._entry_json(p, tree[p]))
            elif any(q.startswith(p + "/") for q in tree) or p == "":
                out.append({"type": "directory", "oid": hashlib.sha1(p.encode()).hexdigest(), "size": 0, "path": p})
        self._json(200, out)

    def resolve(self, query, t, id, rev, file):
        if (found := self._lookup(t, id, rev)) is None:
            return
        _, commit, tree = found
        file = unquote(file)
        e = tree.get(file)
        if e is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        etag = e.sha256 or e.oid
        headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if e.sha256:
            headers["X-Linked-Etag"] = f'"{e.sha256}"'
            headers["X-Linked-Size"] = str(e.size)
        if e.xet_hash:
            headers.update(self.xet_headers(t, id, commit, e))
            if self.command == "HEAD":  # a client with hf_xet reads the bytes from the CAS, not from here
                self.send_response(200)
                for k, v in {"Content-Type": "application/octet-stream", **headers, "Content-Length": str(e.size)}.items():
                    self.send_header(k, v)
                self.end_headers()
                with self.state.lock:
                    self.state.transfers.append((self.command, self.path, 200, 0))
                return
        data = e.data if e.data is not None else self.state.lfs_bytes(e)
        rng = self.headers.get("Range")
        if rng and self.command == "GET":
            m = re.match(r"bytes=(\d*)-(\d*)", rng)
            start = int(m.group(1)) if m.group(1) else max(0, len(data) - int(m.group(2)))
            end = int(m.group(2)) if m.group(1) and m.group(2) else len(data) - 1
            end = min(end, len(data) - 1)
            if start >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start : end + 1], 206
        else:
            status = 200
        if self.command == "GET" and data:
            with self.state.lock:
                bad = next((c for c in self.state.corruptions if c.times > 0 and c.pattern.search(self.path)), None)
                if bad is not None:
                    bad.times -= 1
            if bad is not None:  # a proxy's wrong bytes of the right length
                data = data[:-1] + bytes([data[-1] ^ 0xFF])
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with self.state.lock:
            self.state.transfers.append((self.command, self.path, status, len(data) if self.command == "GET" else 0))
        if self.command == "GET":
            try:
                self._write_throttled(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a read timeout): fine
                pass

    def _write_throttled(self, data: bytes) -> None:
        """The body at the server's link rate: every connection shares one link, as on a real network."""
        pattern = self.state.rate_pattern
        if self.state.rate is None or (pattern is not None and not pattern.search(self.path)):
            self.wfile.write(data)
            return
        view = memoryview(data)
        for i in range(0, len(view), 1 << 18):
            chunk = view[i : i + (1 << 18)]
            with self.state.lock:
                start = max(time.monotonic(), self.state.link_free_at)
                self.state.link_free_at = start + len(chunk) / self.state.rate
                done = self.state.link_free_at
            time.sleep(max(0.0, done - time.monotonic()))
            self.wfile.write(chunk)

    # ------------------------------------------------------------------ uploads, commits and Xet
    def _read_throttled(self, n: int) -> bytes:
        """An upload body of ``n`` bytes, at the server's uplink rate (every connection shares one uplink)."""
        if self.state.upload_rate is None:
            return self.rfile.read(n)
        out = bytearray()
        while len(out) < n:
            chunk = self.rfile.read(min(1 << 18, n - len(out)))
            if not chunk:
                break
            with self.state.lock:
                start = max(time.monotonic(), self.state.uplink_free_at)
                self.state.uplink_free_at = start + len(chunk) / self.state.upload_rate
                done = self.state.uplink_free_at
            time.sleep(max(0.0, done - time.monotonic()))
            out += chunk
        return bytes(out)

    def xet_routes(self) -> list:
        repo = r"^/api/(?P<t>model|dataset|space)s/(?P<id>[^/]+/[^/]+)"
        return [("GET", repo + r"/xet-(?P<kind>read|write)-token/(?P<rev>[^/]+)$", self.xet_token)]

    def xet_token(self, query, t, id, kind, rev):
        """A Xet access token: where the CAS is (casUrl) and until when the token holds (exp).

        huggingface_hub reads the X-Xet-* headers (downloads), hf_xet the JSON body (its token refresh).
        """
        repo = self._repo(t, id)
        if repo is None:
            return self._error(404, "Repository not found", "RepoNotFound")
        if kind == "read" and self._tree(repo, rev) is None:
            return self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        exp = int(time.time()) + 3600
        token = f"xet-{kind}-{uuid.uuid4().hex}"  # any token: the local CAS checks none
        url = self.state.xet.url
        self._json(200, {"casUrl": url, "accessToken": token, "exp": exp},
                   {"X-Xet-Cas-Url": url, "X-Xet-Access-Token": token, "X-Xet-Token-Expiration": str(exp)})

    def xet_headers(self, t: str, id: str, commit: str, e: Entry) -> dict:
        """What the Hub adds to a resolve answer for a Xet file: its hash, and where a read token comes from."""
        prefix = f"{self.base_url}/api/{t}s/{id}"
        return {"X-Xet-Hash": e.xet_hash, "X-Xet-Refresh-Route": f"{prefix}/xet-read-token/{commit}",
                "Link": f'<{prefix}/xet-read-token/{commit}>; rel="xet-auth"'}


class XetCAS:
    """The local Xet content store (``local://`` CAS) the server hands out, and what the server reads from it.

    hf_xet writes xorbs (chunk data) and shards (file -> xorb ranges) into this folder itself; the
    server only reads the shards the client uploaded, as the Hub learns of Xet files from the shards
    sent to its CAS: each file entry gives the Xet file hash and size, and the sha256 the client
    recorded (the commit names a file by that sha256). Shard format (xet-core ``metadata_shard``):
    a 48-byte header (32-byte tag, version, footer size: little-endian u64s), then per file a 48-byte
    header (file hash, flags u32, number of entries u32, 8 unused bytes) followed by 48-byte entries:
    the segments (xorb hash, flags, bytes u32, chunk range), verification entries when flag bit 31 is
    set, one metadata entry (sha256) when bit 30 is set; a header of all 0xff ends the section. A
    32-byte hash is four little-endian u64s, written in hex word by word.
    """

    TAG = b"HFRepoMetaData" + bytes([0, 85, 105, 103, 69, 106, 123, 129, 87, 131, 165, 189, 217, 92, 205, 209, 74, 169])

    def __init__(self, root: Path):
        self.root = root
        self.url = f"local://{root}"
        self.files: dict[str, tuple[str, int]] = {}  # sha256 -> (xet file hash, size)
        self.seen: set[Path] = set()
        self.lock = threading.Lock()

    @staticmethod
    def hash_hex(b: bytes) -> str:
        return "".join(b[i : i + 8][::-1].hex() for i in range(0, 32, 8))

    def shard_files(self) -> list[Path]:
        """The shards uploaded to the CAS (not hf_xet's client-side ``shard-cache``)."""
        if not self.root.exists():
            return []
        return sorted(p for p in self.root.rglob("*.mdb") if p.parent.name == "shards" and p.is_file())

    def scan(self, path: Path) -> None:
        import struct

        data = path.read_bytes()
        if len(data) < 48 or data[:32] != self.TAG:
            raise ValueError(f"{path} is not a Xet shard")
        off = 48
        while off + 48 <= len(data):
            file_hash = data[off : off + 32]
            flags, n, _ = struct.unpack_from("<IIQ", data, off + 32)
            if file_hash == b"\xff" * 32:
                return
            n_info = n * (2 if flags & (1 << 31) else 1) + (1 if flags & (1 << 30) else 0)
            end = off + 48 + 48 * n_info
            if end > len(data):
                raise ValueError(f"{path}: a file entry runs past the end of the shard")
            size = sum(struct.unpack_from("<I", data, off + 48 + 48 * i + 36)[0] for i in range(n))
            if flags & (1 << 30):  # the sha256 the client recorded for the file
                sha256 = self.hash_hex(data[end - 48 : end - 16])
                self.files[sha256] = (self.hash_hex(file_hash), size)
            off = end

    def lookup(self, sha256: str) -> tuple[str, int] | None:
        """(Xet file hash, size) of the file with this sha256, if a client uploaded it to the CAS."""
        with self.lock:
            if sha256 not in self.files:
                for path in self.shard_files():
                    if path not in self.seen:
                        self.scan(path)
                        self.seen.add(path)
            return self.files.get(sha256)

    def n_objects(self) -> int:
        """How many xorbs and shards the CAS holds (a re-upload adds some; a server-side copy none)."""
        if not self.root.exists():
            return 0
        return sum(1 for p in self.root.rglob("*") if p.is_file() and p.parent.name in ("xorbs", "shards")
                   and p.suffix not in (".tagset", ".redb"))

    def materialize(self, xet_hash: str, size: int, sha256: str, dest: Path) -> None:
        """Fetch a file's bytes from the CAS with hf_xet (for a client that reads it over plain HTTP)."""
        import hf_xet

        tmp = dest.with_suffix(".tmp" + uuid.uuid4().hex)
        with hf_xet.XetSession().new_file_download_group(endpoint=self.url) as group:
            group.start_download_file(hf_xet.XetFileInfo(xet_hash, size), str(tmp))
        if hashlib.sha256(tmp.read_bytes()).hexdigest() != sha256:
            tmp.unlink()
            raise ValueError(f"the CAS's bytes of Xet file {xet_hash} do not have the sha256 {sha256} its shard records")
        tmp.replace(dest)


class HubServer:
    """Start with ``HubServer(root, port).start()``; ``url`` is the endpoint for HF_ENDPOINT."""

    def __init__(self, root: Path, port: int = 0):
        self.state = HubState(Path(root))
        handler = type("BoundHandler", (Handler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        handler.base_url = self.url
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> HubServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # faults and inspection
    def throttle(self, bytes_per_s: float | None, pattern: str | None = None) -> None:
        """Serve file downloads (those whose path matches ``pattern``) at most this fast in all (None: as fast as
        the loopback goes)."""
        with self.state.lock:
            self.state.rate, self.state.link_free_at = bytes_per_s, 0.0
            self.state.rate_pattern = re.compile(pattern) if pattern else None

    def fail(self, method: str, pattern: str, status: int, times: int = 1, skip: int = 0,
             headers: dict | None = None) -> None:
        with self.state.lock:
            self.state.faults.append(Fault(method, re.compile(pattern), status, times, skip, headers))

    def storm(self, fraction: float, pattern: str = r"/resolve/", statuses: tuple[int, ...] = (429, 503),
              headers: dict | None = None, seed: int = 0) -> Storm:
        """Answer a random ``fraction`` of the requests matching ``pattern`` with one of ``statuses``."""
        storm = Storm(re.compile(pattern), fraction, tuple(statuses), dict(headers or {}), random.Random(seed))
        with self.state.lock:
            self.state.storms.append(storm)
        return storm

    def corrupt(self, pattern: str, times: int = 1) -> None:
        """Flip the last byte of the next ``times`` file answers to requests matching ``pattern``."""
        with self.state.lock:
            self.state.corruptions.append(Stall(re.compile(pattern), 0.0, times))

    def stall(self, pattern: str, seconds: float, times: int = 1) -> None:
        """Hold the next ``times`` answers to requests matching ``pattern`` back for ``seconds``."""
        with self.state.lock:
            self.state.stalls.append(Stall(re.compile(pattern), seconds, times))

    def throttle_uploads(self, bytes_per_s: float | None) -> None:
        """Receive LFS uploads at most this fast in all, one shared uplink (None: as fast as the loopback goes).

        Xet uploads go from hf_xet straight to the local CAS folder, not through the server: not throttled.
        """
        with self.state.lock:
            self.state.upload_rate, self.state.uplink_free_at = bytes_per_s, 0.0

    def delay_commits(self, seconds: float) -> None:
        """Make every commit take this long before it is applied (the Hub's commit latency)."""
        with self.state.lock:
            self.state.commit_delay = seconds

    def limit_commits(self, per_hour: float | None, hour: float = 60.0) -> None:
        """Allow at most ``per_hour`` commits to a repo in any ``hour`` seconds (sliding, as the Hub counts them);
        a commit past it is answered 429 with a Retry-After (None: no limit)."""
        with self.state.lock:
            self.state.commit_limit = None if per_hour is None else (per_hour, hour)
            self.state.refused_commits = 0

    @property
    def xet_url(self) -> str:
        """The ``local://`` CAS the Xet token endpoints hand out."""
        return self.state.xet.url

    def cut_upload(self, times: int = 1, after_bytes: int = 100) -> None:
        with self.state.lock:
            self.state.cuts, self.state.cut_after = times, after_bytes

    def lose_commit_answers(self, times: int = 1) -> None:
        with self.state.lock:
            self.state.lost_commit_answers = times

    def clear_faults(self) -> None:
        with self.state.lock:
            self.state.faults.clear()
            self.state.storms.clear()
            self.state.stalls.clear()
            self.state.corruptions.clear()
            self.state.cuts = 0
            self.state.lost_commit_answers = 0

    @property
    def log(self) -> list[tuple[str, str]]:
        return self.state.log

    @property
    def transfers(self) -> list[tuple[str, str, int, int]]:
        return self.state.transfers

    def files(self, repo_id: str, repo_type: str = "dataset", rev: str = "main") -> dict[str, Entry]:
        repo = self.state.repos[(repo_type, repo_id)]
        return repo.commits[repo.branches[rev]]

    def commits(self, repo_id: str, repo_type: str = "dataset") -> int:
        return len(self.state.repos[(repo_type, repo_id)].commits)

    def read(self, repo_id: str, path: str, repo_type: str = "dataset", rev: str = "main") -> bytes:
        """The content of a file at the head of a branch."""
        e = self.files(repo_id, repo_type, rev)[path]
        return e.data if e.data is not None else self.state.lfs_bytes(e)


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.support.hub_server --port N``: serve a local Hub until Ctrl-C, to try publishing offline."""
    import argparse
    import shutil
    import signal
    import tempfile

    p = argparse.ArgumentParser(prog="python -m tests.support.hub_server", description=main.__doc__)
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    p.add_argument("--root", default=None, help="folder for the repos (default: a new temporary folder)")
    args = p.parse_args(argv)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="lmprobe-hub-"))
    root.mkdir(parents=True, exist_ok=True)

    def stop(signum, frame):  # SIGTERM (kill, a job scheduler) ends it as Ctrl-C does, cleaning up
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    server = HubServer(root, port=args.port).start()
    try:
        print(f"local Hub test server on {server.url}, repos kept in {root}; in another shell run:\n"
              f"  export HF_ENDPOINT={server.url} HF_HUB_DISABLE_XET=1\n"
              "then lmprobe push/pull/load against it (any token is accepted). Ctrl-C stops it.", flush=True)
        server.thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        if not args.root:  # a folder of its own: it goes with the server; one the user named is kept
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
