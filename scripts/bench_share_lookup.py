"""`moe-tune lookup` over a pool of 100,000 simulated records: consolidated Parquet shards against one file per record,
side by side, through the local Hub server (tests/hub_server.py, a real HTTP server speaking the Hub protocol).

The pool: 4 cards (two of them in the 12 GiB class) x 250 model repos x 3 quants x 6 engine commits, 3,000 accounts,
each record the schema's full shape (6 measured lines, 3 verdicts, a reason) with random figures. Consolidated
into shards (tuner/share/shards.py) plus 300 records still in records/. The file-by-file pool holds 20,000 records
in records/ (the most a look-up lists): a look-up reads a random 1,000 of them and says what it skipped.

Prints, for one model on an RTX 3060 12GB: seconds (median of 3), bytes read from the server, requests, and the
records found; then the ratios. Last lines: the figures as written to results/benchmarks/share-lookup-100k.md.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.hub_server: the project's Hub server

from tests.hub_server import HubServer  # noqa: E402
from tuner.engine import flags  # noqa: E402
from tuner.hub.repos import HubOptions  # noqa: E402
from tuner.share import lookup, physics, pool, shards  # noqa: E402
from tuner.share.gate import SCHEMA, SCHEMA_VERSION, SharedRecord  # noqa: E402
from tuner.share.match import CardQuery, ModelQuery  # noqa: E402

N_RECORDS = 100_000
N_FILES_POOL = 20_000
N_INBOX = 300
CARDS = [("NVIDIA GeForce RTX 3060", 12), ("NVIDIA GeForce RTX 4070", 12), ("NVIDIA GeForce RTX 4060 Ti", 16),
         ("NVIDIA GeForce RTX 3090", 24)]
QUANTS = ["Q4_K_M", "Q5_K_M", "Q8_0"]
N_MODELS = 250
COMMITS = [f"{c:07x}" for c in (0x0C1E570, 0x1A2B3C4, 0x5D6E7F8, 0x9ABCDEF, 0x2468ACE, 0x13579BD)]
# Qwen3-30B-A3B Q4_K_M reads ~1.91 GB a token (published ceiling ~490 tok/s at 936 GB/s, DESIGN.md §6): every
# simulated model is bound by it, and its figures sit below a 3060's ceiling.
BYTES_PER_TOKEN = 936e9 / 490
REPO, FILES_REPO = "pool/moe-tune-100k", "pool/moe-tune-files"
LOOKED_UP = ("org042/Model042-GGUF", "Q4_K_M")


def simulated(rng: random.Random, i: int, sharers: list[str]) -> dict[str, Any]:
    card, gib = CARDS[i % len(CARDS)]
    m = rng.randrange(N_MODELS)
    quant = QUANTS[rng.randrange(len(QUANTS))]
    file_name = f"Model{m:03d}-{quant}.gguf"
    lines = []
    for j, label in enumerate(("default", "fit", "candidate-1", "candidate-2", "candidate-3", "candidate-4")):
        extra = "" if j < 2 else f" --n-cpu-moe {rng.randrange(48)} -ctk q8_0 -ctv q8_0 -fa on -ub {256 << j % 3}"
        gen = round(rng.uniform(20, 150), 2)
        lines.append({"label": label, "round": "selection" if j < 4 else "confirmation",
                      "line": f"llama-server -m {file_name} -c 32768 -np 1{extra}", "slots": 1, "gen_tok_s": gen,
                      "gen_cv_pct": round(rng.uniform(0.5, 6), 2), "prompt_tok_s": round(rng.uniform(200, 3000), 1),
                      "ttft_s": round(rng.uniform(0.05, 2), 3), "loaded_gen_tok_s": gen,
                      "end_to_end_gen_tok_s": round(gen * 0.8, 2), "vram_peak_bytes": rng.randrange(8, 12) << 30,
                      "spill": "none", "kld_mean": None, "failure": None})
    printed = lines[rng.randrange(2, 6)]
    verdicts = [{"a": printed["label"], "b": b, "rounds": 4, "ratio": r, "low": round(r * 0.95, 3),
                 "high": round(r * 1.05, 3), "noise_pct": round(rng.uniform(1, 5), 2), "outcome": "better"}
                for b in ("default", "fit", "candidate-1") for r in [round(rng.uniform(1.05, 2.0), 3)]]
    return {
        "schema": SCHEMA, "version": SCHEMA_VERSION, "tool": "moe-tune 0.1", "sharer": rng.choice(sharers),
        "card": {"name": card, "vram_total_bytes": gib << 30, "vram_budget_bytes": (gib << 30) - (1 << 29),
                 "driver": "575.64", "pcie_link": "gen4 x16"},
        "host": {"ram_total_bytes": 64 << 30, "physical_cores": 8, "cpu_model": "AMD Ryzen 7 5800X"},
        "engine": {"version": "b7000", "commit": COMMITS[rng.randrange(len(COMMITS))], "backend": "cuda",
                   "fa_quants": None},
        "model": {"hub_repo": f"org{m:03d}/Model{m:03d}-GGUF", "hub_file": file_name, "file_name": file_name,
                  "quant": quant, "size_bytes": 18_556_685_088, "head_sha256": f"{rng.getrandbits(256):064x}",
                  "tail_sha256": f"{rng.getrandbits(256):064x}"},
        "workload": {"kind": "chat", "prompt_tokens": 512, "gen_tokens": 128, "depth_tokens": 4096, "concurrency": 1},
        "lines": lines, "verdicts": verdicts,
        "printed": {"label": printed["label"], "line": printed["line"],
                    "why": f"{printed['label']} was decided faster than default ({verdicts[0]['ratio']:.2f}x)"},
        "speedup_vs_default": verdicts[0]["ratio"], "speedup_vs_fit": verdicts[1]["ratio"],
    }


def as_record(rid: str, d: dict[str, Any], configs: dict[str, Any]) -> SharedRecord:
    """Consolidated without the gate here (the look-up gates every row it reads)."""
    line = d["printed"]["line"]
    if line not in configs:
        configs[line] = flags.parse_command(line).config
    return SharedRecord(rid, d, configs[line])


def timed(hub: HubServer, repo: str, options: HubOptions) -> dict[str, Any]:
    runs = []
    for _ in range(3):
        before, n_before = hub.body_bytes(), len(hub.requests)
        query = ModelQuery(f"{LOOKED_UP[0]}:{LOOKED_UP[1]}", LOOKED_UP[0], LOOKED_UP[1])
        start = time.perf_counter()
        answer, noise = harness.watched(lambda q=query: lookup.lookup(
            repo, q, CardQuery.parse("RTX 3060 12GB"), options,
            bound=physics.ModelBound(exact_bytes=BYTES_PER_TOKEN, exact_quant=LOOKED_UP[1])))
        mine = hub.requests[n_before:]
        runs.append({"s": time.perf_counter() - start, "bytes": hub.body_bytes() - before,
                     "requests": len(mine), "shard_bytes": sum(r.body_bytes for r in mine if "/shards/" in r.path),
                     "shard_requests": sum("/shards/" in r.path for r in mine), "found": len(answer.matched),
                     "lines": sum(len(g) for g in answer.groups.values()), "noise": noise,
                     "skipped": [s for s in answer.skipped if "were not read" in s]})
    return {**runs[-1], "s": statistics.median(r["s"] for r in runs)}


@harness.bench("bench_share_lookup")
def main() -> None:
    say = harness.Log()
    rng = random.Random(50)
    sharers = [f"{rng.getrandbits(64):016x}" for _ in range(3000)]
    start = time.perf_counter()
    data = [simulated(rng, i, sharers) for i in range(N_RECORDS + N_INBOX)]
    configs: dict[str, Any] = {}
    records = [as_record(f"{i:016x}", d, configs) for i, d in enumerate(data[:N_RECORDS])]
    account = {sharer: f"user{i:04d}" for i, sharer in enumerate(sharers)}  # each sharer's Hub account, as consolidated
    built = shards.build_shards(records, {r.record_id: account[r.data["sharer"]] for r in records})
    harness.progress(f"{N_RECORDS:,} records simulated and consolidated in {time.perf_counter() - start:.1f} s")
    inbox = {f"records/{N_RECORDS + i:016x}.json": json.dumps(d, indent=1).encode()
             for i, d in enumerate(data[N_RECORDS:])}
    files_pool = {f"records/{i:016x}.json": json.dumps(d, indent=1).encode() for i, d in enumerate(data[:N_FILES_POOL])}
    say(f"pool: {N_RECORDS:,} records ({len(CARDS)} cards, {N_MODELS} models x {len(QUANTS)} quants, "
        f"{len(COMMITS)} engine commits, {len(sharers):,} accounts) in {len(built)} shards, "
        f"{sum(map(len, built.values())) / 2**20:,.1f} MiB; {N_INBOX} more in records/")
    say(f"file-by-file pool: {N_FILES_POOL:,} records in records/, "
        f"{sum(map(len, files_pool.values())) / 2**20:,.1f} MiB; look-up reads at most {pool.MAX_FILES:,} of them")
    with HubServer() as hub:
        hub.add_repo(REPO, {**built, **inbox}, repo_type="dataset")
        hub.add_repo(FILES_REPO, files_pool, repo_type="dataset")
        options = HubOptions(endpoint=hub.endpoint, token=False)
        by_shard = timed(hub, REPO, options)
        by_file = timed(hub, FILES_REPO, options)
    per_file_s = by_file["s"] / max(1, pool.MAX_FILES)
    say(f"look-up of {LOOKED_UP[0]}:{LOOKED_UP[1]} on an RTX 3060 12GB (median of 3 runs):")
    for name, r in (("shards (100,000 records)", by_shard), ("one file per record (20,000)", by_file)):
        say(f"  {name:30s} {r['s']:7.2f} s  {r['bytes'] / 2**20:8.2f} MiB read  {r['requests']:6,} requests  "
            f"{r['found']:4} records found, {r['lines']} lines" + (f"  (busy: {r['noise']})" if r["noise"] else ""))
        if r["shard_requests"]:
            say(f"    of which the shards: {r['shard_bytes'] / 2**20:.2f} MiB in {r['shard_requests']} range requests "
                f"(the rest: the listing and the {N_INBOX} records not yet consolidated)")
        for s in r["skipped"]:
            say(f"    said: {s}")
    say(f"ratio, files / shards: {by_file['s'] / by_shard['s']:.1f}x the seconds, "
        f"{by_file['bytes'] / max(1, by_shard['bytes']):.1f}x the bytes, for "
        f"{by_file['found']} of the records the shards found ({by_shard['found']})")
    say(f"reading all 100,000 records file by file at this rate: ~{per_file_s * N_RECORDS:,.0f} s and "
        f"~{by_file['bytes'] / max(1, pool.MAX_FILES) * N_RECORDS / 2**20:,.0f} MiB")
    say.write(harness.OUT / "share-lookup-100k.md", "lookup over 100,000 shared records: shards vs files",
              "Local Hub server (tests/hub_server.py) on this machine: every byte crosses a real HTTP socket on "
              "loopback, so the seconds are CPU and protocol cost without network latency; bytes and requests "
              "are what the Hub would serve.")


if __name__ == "__main__":
    main()
