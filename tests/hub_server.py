"""A real HTTP server on 127.0.0.1 that speaks the Hugging Face Hub routes huggingface_hub uses.

Routes (models and datasets): ``GET /api/{models,datasets}/REPO[/revision/REV]`` (repo info),
``GET /api/{models,datasets}/REPO/tree/REV[/PATH]?recursive=true`` (tree with sizes and LFS sha256),
``HEAD|GET /[datasets/]REPO/resolve/REV/PATH`` with ``Range`` and the headers the client reads
(``X-Repo-Commit``, ``ETag``/``X-Linked-Etag``, ``X-Linked-Size``, ``Content-Length``, ``Content-Range``).
Errors carry ``X-Error-Code`` the way the Hub sends them (RepoNotFound, GatedRepo, RevisionNotFound,
EntryNotFound), so the client raises its own typed errors.

Writes (what ``HfApi.create_repo`` and ``upload_file``/``create_commit`` send): ``POST /api/repos/create``
(409 when it exists), ``POST /api/{models,datasets}/REPO/preupload/REV`` (every file "regular": no LFS, no
Xet) and ``POST /api/{models,datasets}/REPO/commit/REV`` (the NDJSON commit: a header line, then
``file`` lines with base64 content and ``deletedFile`` lines); each commit gets a new commit id. As on the Hub,
a write needs a known token (``users``: token → user and organizations, ``GET /api/whoami-v2``); a commit to
main needs the repo's namespace to be the user's or one of their organizations' (else 403), while
``?create_pr=1`` (huggingface_hub's ``create_pr=True``) from any known user opens a pull request instead: the
commit lands on ``refs/pr/N`` (kept in ``HubRepo.pulls``, main untouched) and the answer carries
``pullRequestUrl`` (``…/discussions/N``). A private repo is answered 404 (RepoNotFound) to anyone but its
namespace's users, and its info says ``private: true``. Tree listings are paginated as the Hub's are (``Link:
<…&cursor=…>; rel="next"``, ``tree_page`` entries a page).

Who did what, as the Hub tells it: every commit has an author (the token's user; a repo's first files are its
namespace's, or ``add_repo(author=)``'s), ``GET /api/{…}/REPO/commits/REV`` lists them newest first in pages
(``commits_page``, ``Link: rel="next"``), ``POST /api/{…}/REPO/paths-info/REV`` with ``expand`` answers each path's
``lastCommit``, ``GET /api/{…}/REPO/discussions`` lists the pull requests newest first (50 a page, ``count`` and
``start`` as the Hub sends them) and ``…/discussions/N`` details one (its opener, ``changes.mergeCommitId``).
``POST …/discussions/N/merge`` (``HfApi.merge_pull_request``) needs a user of the repo's namespace and applies the
pull request's files to main as one new commit, authored by the user who merged (the opener is known from the
discussions API only).

Test hooks: ``cut_next_download`` (close the socket mid-body), ``stall_next`` (answer nothing), ``drip_next`` (send
the body a byte at a time, slowly), ``ignore_range`` (answer every GET whole, 200), ``corrupt`` (serve different
bytes than the advertised sha256), gated repos answering 401/403 unless a granted token is sent. Every request is
recorded with the body bytes it sent, so tests can assert how much was transferred.

Also here: ``split_gguf`` writes real llama.cpp split GGUFs (``split.no``/``split.count``/
``split.tensors.count``) with the gguf package, and helpers that lay out demo models as Hub repos.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlparse

import gguf

CHUNK_BYTES = 64 * 1024
LFS_SUFFIXES = (".gguf", ".bin", ".safetensors", ".parquet")
DISCUSSIONS_PAGE = 50
EPOCH = 1_767_225_600  # 2026-01-01: commit dates count seconds from it, one a commit


@dataclass(frozen=True)
class Commit:
    commit_id: str
    author: str
    title: str
    date: str


@dataclass
class Pull:
    num: int
    author: str
    title: str
    status: str = "open"  # or "merged"
    merge_commit: str | None = None


@dataclass
class HubFile:
    path: str
    data: bytes
    lfs: bool

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def git_oid(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()


@dataclass
class HubRepo:
    repo_id: str
    repo_type: str
    files: dict[str, HubFile]
    commit: str
    gated: bool = False
    commits: list[str] = field(default_factory=list)  # summaries of the commits pushed to it, oldest first
    private: bool = False
    pulls: list[dict[str, bytes | None]] = field(default_factory=list)  # refs/pr/N (N = index + 1): its files
    pull_info: list[Pull] = field(default_factory=list)  # the same pull requests: opener, status, merge commit
    history: list[Commit] = field(default_factory=list)  # every commit to main, oldest first
    last_commit: dict[str, str] = field(default_factory=dict)  # path → the commit that last changed it


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int
    authorization: str | None


@dataclass
class _Hooks:
    cut_after: dict[str, list[int]] = field(default_factory=dict)  # file url path → byte counts, one per GET
    stalls: list[tuple[str, str, float]] = field(default_factory=list)  # (method, url part, seconds), one request each
    drips: list[tuple[str, float]] = field(default_factory=list)  # (url part, seconds between bytes), one GET each
    throttles: list[str] = field(default_factory=list)  # url parts answered 429 "Retry-After: 3600", one GET each
    corrupt: set[str] = field(default_factory=set)


class HubServer:
    """Start with ``with HubServer() as hub:``; ``hub.endpoint`` goes into HF_ENDPOINT or ``endpoint=``.

    With ``cdn_redirect=True``, LFS files answer ``resolve`` with a 302 to ``http://localhost:PORT/cdn/...``
    (another host name for the same server), as the Hub redirects to its CDN: the metadata then travels
    on the redirect response and clients must not forward the token to the CDN host.
    """

    def __init__(self, cdn_redirect: bool = False, tree_page: int = 1000, commits_page: int = 50) -> None:
        self.cdn_redirect = cdn_redirect
        self.tree_page = tree_page
        self.commits_page = commits_page
        self.ignore_range = False  # a server (a proxy, a mirror) that answers every GET with the whole file
        # token → (user name, organizations): who may write, and where (whoami-v2)
        self.users: dict[str, tuple[str, tuple[str, ...]]] = {"hf_test": ("alice", ())}
        self.repos: dict[tuple[str, str], HubRepo] = {}
        self.granted_tokens: set[str] = set()
        self.requests: list[Request] = []
        self._hooks = _Hooks()
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- repos -------------------------------------------------------------------------------------

    def add_repo(
        self, repo_id: str, files: Mapping[str, Path | bytes], *, repo_type: str = "model", gated: bool = False,
        private: bool = False, author: str | None = None,
    ) -> HubRepo:
        entries = {}
        for path, source in files.items():
            data = source if isinstance(source, bytes) else Path(source).read_bytes()
            entries[path] = HubFile(path, data, lfs=path.endswith(LFS_SUFFIXES))
        digest = hashlib.sha1(repo_id.encode())
        for path in sorted(entries):
            digest.update(path.encode() + entries[path].sha256.encode())
        repo = HubRepo(repo_id, repo_type, entries, digest.hexdigest(), gated, private=private)
        self._log(repo, repo.commit, author or repo_id.split("/")[0], "initial commit", entries)
        self.repos[(repo_type, repo_id)] = repo
        return repo

    def _log(self, repo: HubRepo, commit: str, author: str, title: str, paths: Mapping[str, object]) -> None:
        date = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(EPOCH + len(repo.history)))
        repo.history.append(Commit(commit, author, title, date))
        for path in paths:
            repo.last_commit[path] = commit

    def commit(self, repo: HubRepo, summary: str, files: Mapping[str, bytes | None], author: str | None = None) -> str:
        """Apply one commit by ``author`` (default: the repo's namespace; a path mapped to None is deleted); the
        repo's new commit id."""
        with self._lock:
            for path, data in files.items():
                if data is None:
                    repo.files.pop(path, None)
                else:
                    repo.files[path] = HubFile(path, data, lfs=path.endswith(LFS_SUFFIXES))
            repo.commit = hashlib.sha1(f"{repo.commit}\n{summary}\n{sorted(files)}".encode()).hexdigest()
            repo.commits.append(summary)
            self._log(repo, repo.commit, author or repo.repo_id.split("/")[0], summary,
                      {p: d for p, d in files.items() if d is not None})
            return repo.commit

    def open_pull(self, repo: HubRepo, author: str, files: Mapping[str, bytes | None], title: str = "") -> int:
        """What ``create_pr=1`` does for ``author``: the files wait on refs/pr/N; N."""
        with self._lock:
            repo.pulls.append(dict(files))
            repo.pull_info.append(Pull(len(repo.pulls), author, title or f"Upload {', '.join(sorted(files))}"))
            return len(repo.pulls)

    def merge_pull(self, repo: HubRepo, num: int, merger: str | None = None) -> str:
        """Merge pull request ``num`` into main as one commit made by ``merger`` (default: the namespace)."""
        pull = repo.pull_info[num - 1]
        commit = self.commit(repo, f"{pull.title} (#{num})", repo.pulls[num - 1], author=merger)
        pull.status, pull.merge_commit = "merged", commit
        return commit

    # -- hooks -------------------------------------------------------------------------------------

    def cut_next_download(self, repo_id: str, path: str, after_bytes: int, times: int = 1) -> None:
        """The next ``times`` GETs of this file send full headers, then ``after_bytes`` of body, then close."""
        with self._lock:
            self._hooks.cut_after.setdefault(f"{repo_id}/{path}", []).extend([after_bytes] * times)

    def stall_next(self, url_part: str, seconds: float, method: str = "GET", times: int = 1) -> None:
        """The next ``times`` requests whose URL (path and query) holds ``url_part`` are read and never answered:
        the server stays silent for ``seconds``, then hangs up, as a Hub front end that lost its backend does."""
        with self._lock:
            self._hooks.stalls.extend([(method, url_part, seconds)] * times)

    def drip_next(self, url_part: str, seconds_per_byte: float, times: int = 1) -> None:
        """The next ``times`` GETs whose URL holds ``url_part`` send their headers at once, then the body one byte
        every ``seconds_per_byte`` (never silent for a whole stall bound, never done)."""
        with self._lock:
            self._hooks.drips.extend([(url_part, seconds_per_byte)] * times)

    def throttle_next(self, url_part: str, times: int = 1) -> None:
        """The next ``times`` GETs whose URL holds ``url_part`` are answered 429 with ``Retry-After: 3600`` (which
        huggingface_hub's backoff waits out: an hour and a second)."""
        with self._lock:
            self._hooks.throttles.extend([url_part] * times)

    def corrupt(self, repo_id: str, path: str) -> None:
        """Serve this file with one byte flipped while the listing and headers keep the true sha256."""
        self._hooks.corrupt.add(f"{repo_id}/{path}")

    def body_bytes(self, path_contains: str = "") -> int:
        with self._lock:
            return sum(r.body_bytes for r in self.requests if path_contains in r.path)

    def ranges_requested(self, path_contains: str) -> list[str | None]:
        with self._lock:
            return [r.range for r in self.requests if r.method == "GET" and path_contains in r.path]

    # -- lifecycle ---------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        handler = type("BoundHandler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- used by the handler -----------------------------------------------------------------------

    def _record(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    def _take(self, pending: list[Any], wanted: Callable[[Any], bool]) -> Any:
        """The first pending hook ``wanted`` accepts, taken off its list (None: none is)."""
        with self._lock:
            for i, hook in enumerate(pending):
                if wanted(hook):
                    return pending.pop(i)
            return None

    def _take_stall(self, method: str, url: str) -> float | None:
        stall = self._take(self._hooks.stalls, lambda h: h[0] == method and h[1] in url)
        return None if stall is None else stall[2]

    def _take_throttle(self, url: str) -> bool:
        return self._take(self._hooks.throttles, lambda part: part in url) is not None

    def _take_drip(self, url: str) -> float | None:
        drip = self._take(self._hooks.drips, lambda h: h[0] in url)
        return None if drip is None else drip[1]

    def _take_cut(self, key: str) -> int | None:
        with self._lock:
            pending = self._hooks.cut_after.get(key)
            return pending.pop(0) if pending else None


_RESOLVE = re.compile(r"^/(?:(?P<kind>datasets|spaces)/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_API = re.compile(r"^/api/(?P<kind>models|datasets|spaces)/(?P<repo>[^/]+/[^/]+)(?P<rest>/.*)?$")
_CDN = re.compile(r"^/cdn/(?P<kind>models|datasets)/(?P<repo>[^/]+/[^/]+)/(?P<path>.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence the default stderr log
        pass

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def do_POST(self) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, sent = 404, 0
        try:
            user = self._user()
            if (m := _API.match(path)) and re.match(r"^/paths-info/[^/]+$", m.group("rest") or ""):
                status, sent = self._paths_info(m.group("kind")[:-1], m.group("repo"), body)  # a read: no token
            elif user is None:
                status, sent = self._error(401, "Unauthorized", "Invalid credentials in Authorization header")
            elif path == "/api/repos/create":
                status, sent = self._create(json.loads(body or b"{}"), user)
            elif (m := _API.match(path)) and (p := re.match(r"^/discussions/(\d+)/merge$", m.group("rest") or "")):
                repo = self._repo(m.group("kind")[:-1], m.group("repo"))
                num = int(p.group(1))
                if repo is None or not 0 < num <= len(repo.pull_info):
                    status, sent = self._error(404, "RepoNotFound", "No such pull request")
                elif repo.repo_id.split("/")[0] not in user:
                    status, sent = self._error(403, "Forbidden", "Only the repo's owners merge", repo)
                else:
                    self.hub.merge_pull(repo, num, merger=user[0])
                    status, sent = self._json(200, {}, repo)
            elif (m := _API.match(path)) and (w := re.match(r"^/(preupload|commit)/[^/]+$", m.group("rest") or "")):
                repo = self._repo(m.group("kind")[:-1], m.group("repo"))
                as_pr = parse_qs(url.query).get("create_pr", ["0"])[0] == "1"
                if repo is None:
                    status, sent = self._error(404, "RepoNotFound", "Repository not found")
                elif not as_pr and repo.repo_id.split("/")[0] not in user:
                    status, sent = self._error(403, "Forbidden", "You don't have the rights to push to this repo: "
                                               "open a pull request (create_pr=1)", repo)
                elif w.group(1) == "preupload":
                    files = json.loads(body or b"{}").get("files", [])
                    status, sent = self._json(200, {"files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                         "oid": repo.files[f["path"]].git_oid if f["path"] in repo.files else None}
                        for f in files]}, repo)
                else:
                    status, sent = self._commit(repo, body, as_pr)
            else:
                status, sent = self._error(404, "RepoNotFound", "Unknown route")
        finally:
            self.hub._record(Request("POST", path, None, status, sent, self.headers.get("Authorization")))

    def _user(self) -> tuple[str, ...] | None:
        """The namespaces of the token's user (their name first, then their organizations), or None."""
        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        known = self.hub.users.get(token)
        return None if known is None else (known[0], *known[1])

    def _create(self, payload: dict[str, Any], user: tuple[str, ...]) -> tuple[int, int]:
        kind = payload.get("type") or "model"
        repo_id = f"{payload.get('organization') or user[0]}/{payload['name']}"
        existing = self._repo(kind, repo_id)
        if existing is not None:
            return self._error(409, "RepoExists", "You already created this repo", existing)
        if repo_id.split("/")[0] not in user:
            return self._error(403, "Forbidden", "You don't have the rights to create a repo in this namespace")
        repo = self.hub.add_repo(repo_id, {}, repo_type=kind)
        prefix = "" if kind == "model" else f"{kind}s/"
        return self._json(200, {"url": f"{self.hub.endpoint}/{prefix}{repo_id}", "name": repo_id}, repo)

    def _commit(self, repo: HubRepo, body: bytes, as_pr: bool = False) -> tuple[int, int]:
        summary = ""
        files: dict[str, bytes | None] = {}
        for line in body.splitlines():
            item = json.loads(line)
            value = item.get("value") or {}
            if item.get("key") == "header":
                summary = value.get("summary", "")
            elif item.get("key") == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif item.get("key") == "deletedFile":
                files[value["path"]] = None
            else:
                return self._error(400, "BadRequest", f"unsupported commit operation {item.get('key')}", repo)
        prefix = "" if repo.repo_type == "model" else f"{repo.repo_type}s/"
        if as_pr:  # main stays as it is: the commit goes on refs/pr/N
            number = self.hub.open_pull(repo, (self._user() or ("?",))[0], files, summary)
            commit = hashlib.sha1(f"{repo.commit}\npr {number}\n{summary}".encode()).hexdigest()
            page = f"{self.hub.endpoint}/{prefix}{repo.repo_id}"
            return self._json(200, {"success": True, "commitOid": commit, "commitUrl": f"{page}/commit/{commit}",
                                    "pullRequestUrl": f"{page}/discussions/{number}"}, repo)
        commit = self.hub.commit(repo, summary, files, author=(self._user() or (None,))[0])
        return self._json(200, {"success": True, "commitOid": commit, "pullRequestUrl": None,
                                "commitUrl": f"{self.hub.endpoint}/{prefix}{repo.repo_id}/commit/{commit}"}, repo)

    # -- routing -----------------------------------------------------------------------------------

    def _dispatch(self, head: bool) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        sent = 0
        status = 404
        if (seconds := self.hub._take_stall(self.command, unquote(self.path))) is not None:
            self.hub._record(Request(self.command, path, self.headers.get("Range"), 0, 0,
                                     self.headers.get("Authorization")))  # status 0: never answered
            time.sleep(seconds)
            self.close_connection = True
            return
        try:
            if self.command == "GET" and self.hub._take_throttle(unquote(self.path)):
                self.send_response(429)
                self.send_header("Retry-After", "3600")
                self.send_header("Content-Length", "0")
                self.end_headers()
                status = 429
            elif path == "/api/whoami-v2":
                user = self._user()
                if user is None:
                    status, sent = self._error(401, "Unauthorized", "Invalid credentials in Authorization header")
                else:
                    status, sent = self._json(200, {"type": "user", "name": user[0],
                                                    "orgs": [{"name": o} for o in user[1:]]}, None)
            elif m := _API.match(path):
                status, sent = self._api(m.group("kind")[:-1], m.group("repo"), m.group("rest") or "", url.query)
            elif m := _RESOLVE.match(path):
                kind = (m.group("kind") or "models")[:-1]
                status, sent = self._resolve(kind, m.group("repo"), m.group("rev"), m.group("path"), head)
            elif m := _CDN.match(path):
                repo = self._repo(m.group("kind")[:-1], m.group("repo"))
                entry = repo.files.get(m.group("path")) if repo is not None else None
                if repo is None or entry is None:
                    status, sent = self._error(404, "EntryNotFound", "No such object")
                else:
                    status, sent = self._serve(repo, entry, head)
            else:
                status, sent = self._error(404, "RepoNotFound", "Not found")
        finally:
            self.hub._record(Request(self.command, path, self.headers.get("Range"), status, sent,
                                     self.headers.get("Authorization")))

    def _repo(self, kind: str, repo_id: str) -> HubRepo | None:
        """The repo, as this request may see it: a private one only to its namespace's users."""
        repo = self.hub.repos.get((kind, repo_id))
        if repo is not None and repo.private and repo_id.split("/")[0] not in (self._user() or ()):
            return None
        return repo

    def _revision_ok(self, repo: HubRepo, rev: str) -> bool:
        return rev in ("main", repo.commit)

    def _api(self, kind: str, repo_id: str, rest: str, query: str) -> tuple[int, int]:
        repo = self._repo(kind, repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if rest in ("", "/") or rest.startswith("/revision/"):
            rev = rest.removeprefix("/revision/") if rest.startswith("/revision/") else "main"
            if not self._revision_ok(repo, rev):
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            info = {
                "_id": repo.commit[:24], "id": repo.repo_id, "author": repo.repo_id.split("/")[0],
                "sha": repo.commit, "private": repo.private, "gated": "manual" if repo.gated else False,
                "disabled": False, "tags": ["gguf"], "library_name": "gguf",
                "siblings": [{"rfilename": p} for p in sorted(repo.files)],
            }
            return self._json(200, info, repo)
        if m := re.match(r"^/commits/(?P<rev>[^/]+)$", rest):
            if not self._revision_ok(repo, unquote(m.group("rev"))):
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            return self._commits(repo, kind, query)
        if rest == "/discussions":
            return self._discussions(repo, query)
        if m := re.match(r"^/discussions/(\d+)$", rest):
            num = int(m.group(1))
            if not 0 < num <= len(repo.pull_info):
                return self._error(404, "RepoNotFound", "No such discussion", repo)
            return self._json(200, self._discussion(repo, repo.pull_info[num - 1]) | {
                "events": [], "filesWithConflicts": [], "diff": "",
                "changes": {"base": "refs/heads/main", "mergeCommitId": repo.pull_info[num - 1].merge_commit}}, repo)
        if m := re.match(r"^/tree/(?P<rev>[^/]+)(?:/(?P<sub>.*))?$", rest):
            if not self._revision_ok(repo, m.group("rev")):
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            params = parse_qs(query)
            recursive = params.get("recursive", ["false"])[0].lower() in ("true", "1")
            entries = _tree(repo, (m.group("sub") or "").strip("/"), recursive)
            start = int(params.get("cursor", ["0"])[0])
            page = entries[start:start + self.hub.tree_page]
            more = start + self.hub.tree_page < len(entries)
            link = None
            if more:
                rest_query = urlencode({**{k: v[0] for k, v in params.items()}, "cursor": start + self.hub.tree_page})
                link = f'<{self.hub.endpoint}/api/{kind}s/{repo_id}{rest}?{rest_query}>; rel="next"'
            return self._json(200, page, repo, link=link)
        return self._error(404, "RepoNotFound", "Unknown route")

    def _commits(self, repo: HubRepo, kind: str, query: str) -> tuple[int, int]:
        """The commits API: newest first, ``commits_page`` a page, the next page by ``Link``."""
        params = parse_qs(query)
        page = int(params.get("p", ["0"])[0])
        size = self.hub.commits_page
        newest = list(reversed(repo.history))
        items = [{"id": c.commit_id, "title": c.title, "message": "", "date": c.date,
                  "authors": [{"user": c.author, "avatar": ""}]} for c in newest[page * size:(page + 1) * size]]
        link = None
        if (page + 1) * size < len(newest):
            link = f'<{self.hub.endpoint}/api/{kind}s/{repo.repo_id}/commits/{repo.commit}?p={page + 1}>; rel="next"'
        return self._json(200, items, repo, link=link)

    def _paths_info(self, kind: str, repo_id: str, body: bytes) -> tuple[int, int]:
        repo = self._repo(kind, repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        form = parse_qs(body.decode())
        expand = form.get("expand", ["False"])[0].lower() == "true"
        out = []
        for path in form.get("paths", []):
            f = repo.files.get(path)
            if f is None:
                continue
            entry: dict[str, Any] = {"type": "file", "path": path, "size": f.size, "oid": f.git_oid}
            commit = repo.last_commit.get(path)
            if expand and commit is not None:
                c = next(c for c in repo.history if c.commit_id == commit)
                entry["lastCommit"] = {"id": c.commit_id, "title": c.title, "date": c.date}
            out.append(entry)
        return self._json(200, out, repo)

    def _discussion(self, repo: HubRepo, pull: Pull) -> dict[str, Any]:
        return {"num": pull.num, "title": pull.title, "author": {"name": pull.author},
                "createdAt": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(EPOCH + pull.num)),
                "status": pull.status, "repo": {"name": repo.repo_id, "type": repo.repo_type},
                "isPullRequest": True}

    def _discussions(self, repo: HubRepo, query: str) -> tuple[int, int]:
        """The discussions API: newest first, DISCUSSIONS_PAGE a page (``p``), with ``count`` and ``start``."""
        params = parse_qs(query)
        page = int(params.get("p", ["0"])[0])
        pulls = list(reversed(repo.pull_info))
        if "author" in params:
            pulls = [p for p in pulls if p.author == params["author"][0]]
        start = page * DISCUSSIONS_PAGE
        page_of = [self._discussion(repo, p) for p in pulls[start:start + DISCUSSIONS_PAGE]]
        return self._json(200, {"discussions": page_of, "count": len(pulls), "start": start}, repo)

    def _resolve(self, kind: str, repo_id: str, rev: str, path: str, head: bool) -> tuple[int, int]:
        repo = self._repo(kind, repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if repo.gated:
            auth = self.headers.get("Authorization") or ""
            token = auth.removeprefix("Bearer ").strip()
            if token not in self.hub.granted_tokens:
                status = 403 if token else 401
                return self._error(status, "GatedRepo", f"Access to model {repo_id} is restricted.")
        if not self._revision_ok(repo, rev):
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        entry = repo.files.get(path)
        if entry is None:
            return self._error(404, "EntryNotFound", "Entry not found", repo)
        if self.hub.cdn_redirect and entry.lfs:
            port = self.server.server_address[1]
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/cdn/{kind}s/{repo_id}/{path}?sig=test")
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("X-Linked-Etag", f'"{entry.sha256}"')
            self.send_header("X-Linked-Size", str(entry.size))
            self.send_header("ETag", f'"{entry.git_oid}"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return 302, 0
        return self._serve(repo, entry, head)

    def _serve(self, repo: HubRepo, entry: HubFile, head: bool) -> tuple[int, int]:
        key = f"{repo.repo_id}/{entry.path}"
        data = entry.data
        if key in self.hub._hooks.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        total = len(data)
        start, end = 0, total - 1
        status = 200
        if not self.hub.ignore_range and (rng := self.headers.get("Range")) and (m := _RANGE.match(rng.strip())):
            start = int(m.group(1))
            end = min(int(m.group(2)), total - 1) if m.group(2) else total - 1
            if start >= total:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{total}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return 416, 0
            status = 206
        etag = entry.sha256 if entry.lfs else entry.git_oid
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{total}")
        self.send_header("ETag", f'"{etag}"')
        if entry.lfs:
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(entry.size))
        self.send_header("X-Repo-Commit", repo.commit)
        self.end_headers()
        if head:
            return status, 0
        cut = self.hub._take_cut(key)
        drip = self.hub._take_drip(unquote(self.path))
        body = memoryview(data)[start:end + 1]
        limit = len(body) if cut is None else min(cut, len(body))
        sent = 0
        try:
            while sent < limit:
                if drip is not None:
                    self.wfile.write(body[sent:sent + 1])
                    self.wfile.flush()
                    sent += 1
                    time.sleep(drip)
                    continue
                chunk = body[sent:min(sent + CHUNK_BYTES, limit)]
                self.wfile.write(chunk)
                sent += len(chunk)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        if cut is not None and limit < len(body):
            self.close_connection = True
            self.connection.shutdown(2)  # the client sees the body end early: a cut connection
        return status, sent

    # -- responses ---------------------------------------------------------------------------------

    def _json(self, status: int, payload: Any, repo: HubRepo | None, link: str | None = None) -> tuple[int, int]:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if repo is not None:
            self.send_header("X-Repo-Commit", repo.commit)
        if link is not None:
            self.send_header("Link", link)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        return status, len(body)

    def _error(self, status: int, code: str, message: str, repo: HubRepo | None = None) -> tuple[int, int]:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if repo is not None:
            self.send_header("X-Repo-Commit", repo.commit)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        return status, len(body)


def _tree(repo: HubRepo, sub: str, recursive: bool) -> list[dict[str, Any]]:
    prefix = f"{sub}/" if sub else ""
    folders: set[str] = set()
    entries: list[dict[str, Any]] = []
    for path in sorted(repo.files):
        if not path.startswith(prefix):
            continue
        rel = path[len(prefix):]
        parts = rel.split("/")
        for depth in range(1, len(parts)):
            if recursive or depth == 1:
                folders.add(prefix + "/".join(parts[:depth]))
        if not recursive and len(parts) > 1:
            continue
        f = repo.files[path]
        entry: dict[str, Any] = {"type": "file", "oid": f.git_oid, "size": f.size, "path": path}
        if f.lfs:
            entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
        entries.append(entry)
    dirs = [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "path": d} for d in sorted(folders)]
    return dirs + entries


# -- GGUF layouts ------------------------------------------------------------------------------------


def split_gguf(source: Path, dest: Path, n_parts: int) -> list[Path]:
    """Write ``source`` as ``n_parts`` llama.cpp split files named ``dest.stem-0000k-of-0000n.gguf``.

    The first part carries every metadata key plus ``split.no``/``split.count``/``split.tensors.count``;
    the others carry only the split keys, as llama.cpp's gguf-split writes them.
    """
    reader = gguf.GGUFReader(source)
    n_tensors = len(reader.tensors)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(dest, arch, split_max_tensors=-(-n_tensors // n_parts))
    for name, fld in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name.startswith("split."):
            continue
        main_type = fld.types[0]
        sub_type = fld.types[-1] if main_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, fld.contents(), main_type, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    dest.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file(dest)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()
    return writer.format_shard_names(dest)


def root_layout(models: Mapping[str, Path], base: str) -> dict[str, Path]:
    """``{quant: file}`` → repo paths ``base-QUANT.gguf`` at the root."""
    return {f"{base}-{quant}.gguf": path for quant, path in models.items()}


def subfolder_layout(models: Mapping[str, Path], base: str, work: Path, n_parts: int = 2) -> dict[str, Path]:
    """``{quant: file}`` → ``QUANT/base-QUANT-0000k-of-0000n.gguf`` split parts in per-quant folders."""
    files: dict[str, Path] = {}
    for quant, path in models.items():
        parts = split_gguf(path, work / quant / f"{base}-{quant}.gguf", n_parts)
        for part in parts:
            files[f"{quant}/{part.name}"] = part
    return files
