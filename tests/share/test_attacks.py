"""The pool under attack, round two (issue 57): each attack against the local Hub server (tests/hub_server.py, a
real HTTP server speaking the Hub's routes), read by the real `moe-tune lookup` or the library under it.

A decoded-size bomb (peak RSS measured), a refusal flood, a record lifting its own physics ceiling, a sybil of
made-up sharer ids from one Hub account, lines the engine would not read as measured, padded and filler text, a
server that drips bytes, a server that ignores Range."""

from __future__ import annotations

import json
import os
import random
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.hub_server import HubServer
from tests.share.hostile import bomb, run_measured
from tests.share.test_pool import agreeing, data, env_for, line, pooled, record
from tuner.catalog.cards import find_card
from tuner.hub import client
from tuner.hub import records as hub_records
from tuner.hub.repos import HubOptions
from tuner.models import shape_model
from tuner.share import lookup, pool, seeds, shards
from tuner.share.gate import read_record
from tuner.share.match import CardQuery, ModelQuery

REPO = "pool/moe-tune-shared"
RSS_CAP_MIB = 256  # docs/sharing.md: a look-up's RAM whatever the pool holds


def lookup_cli(args: list[str], env: dict[str, str], tmp: Path, timeout_s: float = 300) -> tuple[int, str, str, float]:
    """`moe-tune lookup ARGS` as a user runs it (80 columns): exit code, stdout, stderr and the process's own peak
    RSS in MiB (through a small wrapper: a child forked from this test process would count its memory too)."""
    full = {**os.environ, **env, "COLUMNS": "80"}
    full.pop("MOE_TUNE_DEBUG", None)
    got = run_measured([str(Path(sys.executable).parent / "moe-tune"), "lookup", *args], full, tmp, timeout_s)
    return got.returncode, got.stdout, got.stderr, got.peak_rss_mib


def unwrapped(text: str) -> str:
    """Lines as lookup said them, before it wrapped them to 80 columns (continuations are indented 4)."""
    return text.replace("\n    ", " ")


def test_a_decoded_size_bomb_stays_under_the_ram_cap_and_is_one_line(model, tmp_path):
    """Issue 57, hole 1: 200,000 rows of one 10 KB string in a 9.5 KB shard peaked lookup at 2,318 MiB. Now the
    footer is read first (at most 512 rows a row group), and a shard within those bounds is read as dictionaries:
    the second bomb (97 row groups of 512 rows, every row our model's) decodes its 10 KB once per row group."""
    fp = record(model, None)["model"]
    key, head = f"sha:{fp['head_sha256']}", fp["head_sha256"]
    huge = bomb(200_000, 200_000, 10_000, key, head)
    wide = bomb(97 * 512, 512, 10_000, key, head)
    assert len(huge) < 64 * 1024 and len(wide) < 256 * 1024
    with HubServer() as hub:
        repo = hub.add_repo(REPO, {"shards/vram-0/aaaa.parquet": huge, "shards/vram-0/bbbb.parquet": wide},
                            repo_type="dataset")
        cpu = record(model, "a" * 16)
        cpu["card"] = {"name": "cpu", "vram_total_bytes": 0, "vram_budget_bytes": None, "driver": None,
                       "pcie_link": None}
        valid = {"records/00000000000000aa.json": data(cpu)}
        hub.merge_pull(repo, hub.open_pull(repo, "alice", valid))
        rc, out, err, rss_mib = lookup_cli([str(model), "--gpu", "cpu", "--repo", REPO], env_for(hub, tmp_path),
                                           tmp_path)
    assert rc == 0 and "Traceback" not in err, err
    assert rss_mib < RSS_CAP_MIB, f"peak RSS {rss_mib:.0f} MiB"
    print(f"peak RSS of lookup over the bombs: {rss_mib:.0f} MiB")
    err = unwrapped(err)
    assert "shard shards/vram-0/aaaa.parquet skipped: 200,000 rows in 1 row groups (at most 512 a row group" in err
    # The wide bomb's rows are all read (as far as a look-up takes rows) and refused: counted, not one line each.
    assert len(err.splitlines()) <= 10, err
    assert "warning: 20,001 shared records skipped in all (20,000 not JSON, 1 bad shard)" in err, err
    assert agreeing(out) == [("1 account (unconfirmed)", line(model))]


def test_a_refusal_flood_is_counted_by_reason_in_a_few_lines(model, tmp_path):
    """Issue 57, hole 2: every refused row was its own warning line (20,012 for one shard)."""
    junk = {f"records/{i:016x}.json": b"{" * 64 for i in range(1, 400)}
    junk |= {f"records/{i:016x}.json": data(record(model, "b" * 16, gen=-1.0)) for i in range(400, 500)}
    # And a flood of lines that pass: thirty distinct ones, each from one account.
    lines_flood = {f"records/{i:016x}.json": data(record(model, "c" * 16, printed=line(model, f" -t {i - 999}")))
                   for i in range(1000, 1030)}
    with HubServer() as hub:
        pooled(hub, REPO, {"mallory": junk | lines_flood,
                           "alice": {"records/0000000000000000.json": data(record(model, "a" * 16))},
                           "bob": {"records/0000000000000fff.json": data(record(model, "b" * 16))}})
        rc, out, err, _ = lookup_cli([str(model), "--gpu", "RTX 3060 12GB", "--repo", REPO], env_for(hub, tmp_path),
                                     tmp_path)
    assert rc == 0, err
    warnings = unwrapped(err).splitlines()
    assert len(warnings) == 6, warnings  # five named, then the counts
    assert warnings[-1] == ("warning: 499 shared records skipped in all (399 not JSON, 100 bad field); the first 5 "
                            "are above")
    shown = agreeing(out)
    assert shown[0] == ("2 accounts agree", line(model)) and len(shown) == 8  # the agreed line, then 7 of 30
    assert unwrapped(out).splitlines()[-1] == ("23 more line(s), fewer accounts behind each, not shown: --json lists "
                                               "every one")
    assert len(out.splitlines()) < 120  # 8 lines shown, each with its table row, reasons and verdicts


def test_no_field_or_flag_of_a_record_lifts_its_physics_ceiling_and_totals_are_bound_as_totals(tmp_path):
    """Issue 57, holes 3 and 6: ``--spec-draft-n-max 999999`` lifted a record's ceiling to 1e8 tok/s; and an
    8-slot RTX 3090 record at 75 tok/s a request (600 in all) was refused by the one-stream ceiling."""
    made = shape_model.write_catalog_model("qwen3-30b-a3b:Q4_K_M", tmp_path / "qwen3-30b-a3b-Q4_K_M.gguf").path
    lift = record(made, "a" * 16, printed=line(made, " --spec-type ngram-mod --spec-draft-n-max 999999"))
    lift["lines"][1]["gen_tok_s"] = 1e8  # the speculative line
    slots = record(made, "b" * 16, printed=line(made, " -np 8"), gen=75.0)
    slots["workload"] |= {"concurrency": 8}
    for ln in slots["lines"]:
        ln |= {"slots": 8, "end_to_end_gen_tok_s": 600.0}
    for d in (lift, slots):
        d["card"] |= {"name": "NVIDIA GeForce RTX 3090", "vram_total_bytes": 24 * 2**30}
    with HubServer() as hub:
        pooled(hub, REPO, {"mallory": {"records/000000000000000a.json": data(lift)},
                           "bob": {"records/000000000000000b.json": data(slots)}})
        rc, out, err, _ = lookup_cli([str(made), "--gpu", "RTX 3090 24GB", "--repo", REPO, "--json"],
                                     env_for(hub, tmp_path), tmp_path)
    assert rc == 0, err
    answer = json.loads(out)
    [group] = answer["by_engine_commit"]["0c1e570"]
    assert group["record_ids"] == ["000000000000000b"]  # the honest 8-slot record is shown
    [refused] = answer["skipped"]
    # 936 GB/s over ~1.9 GB a token, times 1.1, times 65 for speculation (a constant): about 35,000 tok/s.
    assert refused.startswith("shared record 000000000000000a skipped: candidate-1 claims gen_tok_s 1e+08, above the")
    ceiling = float(refused.split("above the ")[1].split(" ")[0].replace(",", ""))
    assert 20_000 < ceiling < 50_000 and "tok/s per request" in refused


SHARED = "alice/moe-tune-pool"


def _share(hub: HubServer, token: str, path: str, raw: bytes) -> int:
    """One record sent as huggingface_hub sends it from `moe-tune share` to someone else's pool: a pull request."""
    pushed = hub_records.push(SHARED, path, raw, "moe-tune share", HubOptions(endpoint=hub.endpoint, token=token),
                              create_pr=True)
    assert pushed.pull_request
    return int(pushed.url.rsplit("/", 1)[1])


def test_agreement_counts_hub_accounts_two_agree_and_one_accounts_five_made_up_ids_count_once(model, tmp_path):
    """Issue 57, hole 4: five records with five self-declared sharer ids, a line nobody measured and 3x the speed,
    were shown first as "5 sharers agree". Who opened each pull request is the Hub's to say."""
    from huggingface_hub import HfApi

    with HubServer() as hub:
        hub.users |= {"hf_alice": ("alice", ()), "hf_bob": ("bob", ()), "hf_carol": ("carol", ()),
                      "hf_mallory": ("mallory", ())}
        hub.add_repo(SHARED, {}, repo_type="dataset")
        prs = [_share(hub, "hf_bob", "records/000000000000000b.json", data(record(model, "b" * 16))),
               _share(hub, "hf_carol", "records/000000000000000c.json", data(record(model, "c" * 16)))]
        for i in range(5):  # mallory: five made-up sharer ids, one unmeasured line at 3x
            prs.append(_share(hub, "hf_mallory", f"records/00000000000000f{i}.json", data(record(
                model, f"{i}" * 16, printed=line(model, " -ub 256"), gen=300.0, tool=f"t{i}"))))
        owner = HfApi(endpoint=hub.endpoint, token="hf_alice")
        for num in prs:
            owner.merge_pull_request(SHARED, num, repo_type="dataset")
        env = env_for(hub, tmp_path)
        rc, out, err, _ = lookup_cli([str(model), "--gpu", "RTX 3060 12GB", "--repo", SHARED], env, tmp_path)
        rc_json, as_json, _, _ = lookup_cli([str(model), "--gpu", "RTX 3060 12GB", "--repo", SHARED, "--json"], env,
                                            tmp_path)
        # Every merge commit names alice (she merged them): the openers come from the discussions API, once.
        assert {c.author for c in hub.repos[("dataset", SHARED)].history[1:]} == {"alice"}
        asked = len([r for r in hub.requests if "/discussions/" in r.path and r.method == "GET"])
    assert rc == rc_json == 0, err
    assert agreeing(out) == [("2 accounts agree", line(model)), ("1 account (unconfirmed)", line(model, " -ub 256"))]
    assert "  accounts: bob, carol" in out
    groups = json.loads(as_json)["by_engine_commit"]["0c1e570"]
    assert [(g["accounts"], g["account_names"], g["records"], len(g["sharer_ids"])) for g in groups] == [
        (2, ["bob", "carol"], 2, 2), (1, ["mallory"], 5, 5)]
    assert asked == 7  # each merged pull request asked about once; the second look-up read the cache


def test_lines_the_engine_would_not_read_as_measured_are_refused_never_shown(model, tmp_path):
    """Issue 57, hole 5: ``--spec-draft-n-max 1000000`` rendered as ``1e+06`` (llama.cpp's std::stoi reads 1) and a
    re-parse raised an error nothing caught; ``-c 99999999999999999999``, ``-ngl 100000000000000000``,
    ``--spec-synth-len nan`` and ``-cram -1`` passed the gate."""
    bad = [" --spec-type ngram-mod --spec-draft-n-max 1000000", " --spec-type ngram-mod --spec-draft-n-max 1234567",
           " -c 99999999999999999999", " -ngl 100000000000000000", " --spec-type ngram-mod --spec-synth-len nan",
           " -cram -1"]
    files = {f"records/{i:016x}.json": data(record(model, "c" * 16, printed=line(model, extra), tool=f"t{i}"))
             for i, extra in enumerate(bad, start=1)}
    with HubServer() as hub:
        pooled(hub, REPO, {"mallory": files, "alice": {"records/0000000000000000.json": data(record(model, "a" * 16))}})
        rc, out, err, _ = lookup_cli([str(model), "--gpu", "RTX 3060 12GB", "--repo", REPO, "--json"],
                                     env_for(hub, tmp_path), tmp_path)
    assert rc == 0 and "Traceback" not in err, err
    answer = json.loads(out)
    assert answer["refused"] == {"line refused": 4}  # beyond 32 bits (twice), nan, and -1 (no limit)
    # What llama.cpp reads back as it was measured is shown, in digits; nothing in exponent form.
    assert sorted(g["line"] for g in answer["by_engine_commit"]["0c1e570"]) == sorted(
        [line(model), line(model, bad[0]), line(model, bad[1])])
    assert not any(re.search(r"\de[+-]\d", g["line"]) for g in answer["by_engine_commit"]["0c1e570"])


def test_a_strangers_text_never_stands_where_a_line_to_run_does_and_output_fits_80_columns(model, tmp_path):
    """Issue 57, hole 8: a reason padded with spaces to the terminal's width put a forged line at column 0; U+3164
    fillers and 500 stacked combining marks passed isprintable()."""
    forged = "3 accounts agree: llama-server -m x.gguf --rpc 10.0.0.1:50052"
    d = record(model, "a" * 16)
    d["printed"]["why"] = "faster" + " " * 74 + forged + " " + "\u3164" * 20 + "e" + "\u0301" * 400
    d["card"]["name"] = "NVIDIA GeForce RTX 3060"
    with HubServer() as hub:
        pooled(hub, REPO, {"alice": {"records/0000000000000000.json": data(d)}})
        rc, out, err, _ = lookup_cli([str(model), "--gpu", "RTX 3060 12GB", "--repo", REPO], env_for(hub, tmp_path),
                                     tmp_path)
    assert rc == 0, err
    lines = out.splitlines()
    launch = [ln for ln in lines if ln.startswith("llama-server")]
    assert launch == [line(model)]  # the one line to run, whole, on its own
    assert all(len(ln) <= 80 for ln in lines if ln not in launch), [ln for ln in lines if len(ln) > 80]
    # The forged count and line stand nowhere a line to run does: every line holding them is indented.
    assert not any(ln.startswith(("3 accounts agree", "llama-server -m x.gguf")) for ln in lines)
    assert all(ln.startswith(("  why: ", "    ")) for ln in lines if "--rpc" in ln or "accounts agree" in ln[1:])
    assert "\u3164" not in out and "\u0301" not in out and "\\u3164" in out


def _slow_pool(hub: HubServer, model: Path) -> None:
    pooled(hub, REPO, {who: {f"records/{i:016x}.json": data(record(model, f"{i}" * 16, tool=who))}
                       for i, who in enumerate(("alice", "bob", "carol"))})


@pytest.mark.parametrize("bound", ["deadline", "request"])
def test_a_server_that_drips_bytes_cannot_hold_lookup_or_seed_from_past_its_bounds(model, tmp_path, monkeypatch,
                                                                                    bound):
    """Issue 57, hole 7: the deadline was checked only between batches; a server sending a byte every 19 s (never
    silent for the 20 s stall bound) kept a read going for good. Here a byte a second against a 2 s stall bound:
    the look-up ends by its deadline (or each request by its own bound), and says what it could not read."""
    monkeypatch.setattr(client, "STALL_S", 2.0)
    monkeypatch.setattr(pool, "DEADLINE_S", 6.0 if bound == "deadline" else 60.0)
    monkeypatch.setattr(pool, "REQUEST_S", 30.0 if bound == "deadline" else 3.0)
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    options = HubOptions(endpoint="", token=False, cache_dir=tmp_path / "hf")
    took: dict[str, float] = {}
    answers: dict[str, Any] = {}
    with HubServer() as hub:
        _slow_pool(hub, model)
        options = HubOptions(endpoint=hub.endpoint, token=False, cache_dir=tmp_path / "hf")
        hw = find_card("RTX 3060 12GB").hardware(64 << 30, 60 << 30, 50e9)
        calls = {"lookup": lambda: lookup.lookup(REPO, ModelQuery.parse(str(model)), CardQuery.parse("RTX 3060 12GB"),
                                                 options),
                 "seed-from": lambda: seeds.seeds_from(REPO, model, hw, options, on_step=answers.setdefault(
                     "steps", []).append)}
        for name, call in calls.items():
            hub.drip_next("/records/", seconds_per_byte=1.0, times=3)
            start = time.monotonic()
            worker = threading.Thread(target=lambda n=name, c=call: answers.__setitem__(n, c()), daemon=True)
            worker.start()
            worker.join(timeout=20.0)
            took[name] = time.monotonic() - start
            assert not worker.is_alive(), f"{name} still reading after {took[name]:.0f} s"
    limit = 6.0 if bound == "deadline" else 3.0
    assert all(t < limit + 2.5 for t in took.values()), took
    said = " ".join(answers["lookup"].skipped)
    assert "download failed" in said and ("the look-up's 6 s were spent" in said if bound == "deadline"
                                          else "one request's 3 s were spent" in said), said
    assert answers["seed-from"] == [] and answers["steps"][-1].endswith("0 distinct line(s) proposed as seeds")


def test_a_server_that_ignores_range_sends_no_byte_nobody_counts(model, tmp_path):
    """Issue 57, hole 7: a server that ignores Range answers every range read of a shard with the whole file from
    its start; the bytes before the range were read and thrown away, uncounted. Now such an answer is refused."""
    rng = random.Random(57)  # text that does not compress, as real reasons and figures do not
    many = [record(model, f"{i % 7}" * 16, tool=rng.randbytes(250).hex()) for i in range(1500)]
    built = shards.build_shards([read_record(data(d), f"{i:016x}") for i, d in enumerate(many)])
    [(path, blob)] = built.items()
    assert len(blob) > 300_000 and len(built) == 1  # three row groups, read in several ranges
    with HubServer() as hub:
        hub.add_repo(REPO, built, repo_type="dataset")
        hub.ignore_range = True
        rc, out, err, _ = lookup_cli([str(model), "--gpu", "RTX 3060 12GB", "--repo", REPO], env_for(hub, tmp_path),
                                     tmp_path)
        sent = hub.body_bytes(path)
    assert rc == 0, err
    assert sent <= len(blob), (sent, len(blob))  # at most the one answer it broke off
    err = unwrapped(err)
    assert f"warning: shard {path} skipped: " in err and "the server ignored Range" in err
