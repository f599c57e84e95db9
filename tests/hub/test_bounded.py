"""Bounded Hub requests (tuner/hub/client.py) and who uploaded what (tuner/hub/history.py), against the local Hub
server: inside ``client.bounded`` a request ends by its deadline and carries at most its bytes whatever the server
does; the commits and discussions APIs are read only as far as needed."""

from __future__ import annotations

import time

import pytest

from tests.hub_server import HubServer
from tuner.core.errors import HubError
from tuner.hub import client, history
from tuner.hub import records as hub_records
from tuner.hub.repos import HubOptions

REPO = "alice/data"


@pytest.fixture
def srv():
    with HubServer(commits_page=2) as hub:
        hub.add_repo(REPO, {"big.bin": b"x" * (3 << 20), "small.json": b"{}"}, repo_type="dataset")
        yield hub


def opts(hub: HubServer, tmp_path) -> HubOptions:
    return HubOptions(endpoint=hub.endpoint, token=False, cache_dir=tmp_path / "hf")


def test_a_bounded_request_carries_at_most_its_bytes(srv, tmp_path):
    o = opts(srv, tmp_path)
    with client.bounded(30, request_s=30, max_bytes=1 << 20, what="the test's 30 s"), \
            pytest.raises(HubError, match="announced 2,097,152 bytes, more than the 1,048,576 one request may carry"):
        hub_records.read_range(REPO, "big.bin", "main", 0, 2 << 20, o)
    assert len(hub_records.read_range(REPO, "big.bin", "main", 0, 2 << 20, o)) == 2 << 20  # unbounded outside


def test_a_bounded_request_ends_by_its_deadline_though_the_server_never_goes_quiet(srv, tmp_path, monkeypatch):
    monkeypatch.setattr(client, "STALL_S", 2.0)
    srv.drip_next("big.bin", seconds_per_byte=0.6)  # never silent for a stall bound, never done in time
    start = time.monotonic()
    with client.bounded(1.5, request_s=30, max_bytes=1 << 20, what="the test's 1.5 s"), \
            pytest.raises(HubError, match="the test's 1.5 s were spent"):
        hub_records.read_range(REPO, "big.bin", "main", 0, 64, opts(srv, tmp_path))
    assert time.monotonic() - start < 2.5


def test_a_throttled_answer_is_not_waited_out_inside_a_bound(srv, tmp_path):
    """huggingface_hub's backoff sleeps Retry-After + 1 s on a 429 (here an hour): a bounded read says so instead."""
    srv.throttle_next("/tree/")  # a listing: huggingface_hub's paginate asks through http_backoff
    start = time.monotonic()
    with client.bounded(30, request_s=30, max_bytes=1 << 20, what="the test's 30 s"), \
            pytest.raises(HubError, match="answered HTTP 429, not waited out"):
        hub_records.list_files(REPO, "main", "", "", opts(srv, tmp_path), max_entries=10, late=lambda: False)
    assert time.monotonic() - start < 5


def test_the_commits_api_is_read_only_as_far_as_the_wanted_commits(srv, tmp_path):
    repo = srv.repos[("dataset", REPO)]
    made = [srv.commit(repo, f"c{i}", {f"f{i}.json": b"{}"}, author=("bob" if i % 2 else "carol"))
            for i in range(10)]
    got = history.commit_accounts(REPO, repo.commit, set(made[-3:]), opts(srv, tmp_path), max_commits=100,
                                  late=lambda: False)
    assert {c: got[c] for c in made[-3:]} == {made[-3]: ("bob",), made[-2]: ("carol",), made[-1]: ("bob",)}
    pages = [r for r in srv.requests if "/commits/" in r.path]
    assert len(pages) == 2  # two commits a page: the third wanted one is on the second page, and no further
    last = history.last_commits(REPO, repo.commit, ["f0.json", "f9.json", "missing.json"], opts(srv, tmp_path),
                                late=lambda: False)
    assert last == {"f0.json": made[0], "f9.json": made[-1]}


def test_a_merged_pull_request_names_its_opener_not_its_merger(srv, tmp_path):
    repo = srv.repos[("dataset", REPO)]
    nums = [srv.open_pull(repo, who, {f"records/{who}.json": b"{}"}) for who in ("bob", "carol", "dave")]
    merges = [srv.merge_pull(repo, n) for n in nums[:2]]  # dave's stays open
    assert {c.author for c in repo.history[1:]} == {"alice"}
    pulls = history.merged_pulls(REPO, opts(srv, tmp_path), known=set(), wanted=set(merges), max_details=10,
                                 late=lambda: False)
    assert [(p.num, p.author, p.merge_commit) for p in pulls] == [(2, "carol", merges[1]), (1, "bob", merges[0])]
    again = history.merged_pulls(REPO, opts(srv, tmp_path), known={1, 2}, wanted={merges[0]}, max_details=10,
                                 late=lambda: False)
    assert again == []  # what is known is not asked again
