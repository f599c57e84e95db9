"""`moe-tune lookup` as a user runs it, its peak RSS and wall time, over two pools served by the local Hub server
(tests/hub_server.py, a real HTTP server speaking the Hub's routes):

- the 100,000-record pool of bench_share_lookup.py (3 Parquet shards, 4 cards x 250 models x 3 quants, each row's
  uploader in its account column, 3,000 accounts) with 300 records not yet consolidated, brought by 50 accounts in
  merged pull requests (the look-up asks the Hub who opened them);
- the decoded-size bombs of issue 57: a 200,000-row shard of one dictionary-encoded 10 KB string (one row group)
  and 97 row groups of 512 such rows, every row naming the looked-up model, beside one honest record.

Each look-up is a fresh process (`moe-tune lookup …`, three times each); its peak RSS is wait4's rusage of that
one process, started from a small wrapper (a child forked from this script would count the 1.9 GB of records the
script holds: tests/share/hostile.py). Prints the figures and writes results/benchmarks/share-lookup-rss.md with
the load the machine carried.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.*: the project's Hub server and test bombs

from bench_share_lookup import N_INBOX, N_RECORDS, as_record, simulated  # noqa: E402

from tests.hub_server import HubServer  # noqa: E402
from tests.share.hostile import bomb, run_measured  # noqa: E402
from tuner.models import fingerprint, shape_model  # noqa: E402
from tuner.share import shards  # noqa: E402
from tuner.share.gate import SCHEMA, SCHEMA_VERSION  # noqa: E402

RUNS = 3
N_INBOX_ACCOUNTS = 50
EXE = Path(sys.executable).parent / "moe-tune"


def run(args: list[str], env: dict[str, str], work: Path) -> dict[str, Any]:
    """One `moe-tune lookup` process: wall seconds, its own peak RSS (MiB), exit code, what it printed."""
    got = run_measured([str(EXE), "lookup", *args], {**os.environ, **env, "COLUMNS": "80"}, work)
    return {"s": got.wall_s, "rss_mib": got.peak_rss_mib, "rc": got.returncode, "out": got.stdout, "err": got.stderr}


def measured(name: str, args: list[str], env: dict[str, str], work: Path, say: harness.Log) -> None:
    runs = []
    for i in range(RUNS):
        (work / f"cache{i}").mkdir()
        r, noise = harness.watched(lambda i=i: run(args, {**env, "MOE_TUNE_CACHE": str(work / f"cache{i}")}, work))
        runs.append(r | {"noise": noise})
    last = runs[-1]
    say(f"{name}: `moe-tune lookup {' '.join(args[:1] + ['…'] + args[-4:])}`")
    say(f"  peak RSS {statistics.median(r['rss_mib'] for r in runs):,.0f} MiB median, "
        f"{max(r['rss_mib'] for r in runs):,.0f} MiB most; wall {statistics.median(r['s'] for r in runs):.2f} s "
        f"median, {max(r['s'] for r in runs):.2f} s most ({RUNS} fresh processes, exit codes "
        f"{sorted({r['rc'] for r in runs})})")
    say(f"  printed {len(last['out'].splitlines())} lines, warned {len(last['err'].splitlines())} lines; "
        "the warnings of the last run:")
    for line in last["err"].splitlines():
        say(f"    {line}")
    for r in runs:
        if r["noise"]:
            say(f"  busy meanwhile: {r['noise']}")


def hundred_thousand(hub: HubServer) -> tuple[str, str]:
    rng = random.Random(50)
    sharers = [f"{rng.getrandbits(64):016x}" for _ in range(3000)]
    data = [simulated(rng, i, sharers) for i in range(N_RECORDS + N_INBOX)]
    configs: dict[str, Any] = {}
    records = [as_record(f"{i:016x}", d, configs) for i, d in enumerate(data[:N_RECORDS])]
    accounts = {r.record_id: f"user{sharers.index(r.data['sharer']):04d}" for r in records}
    built = shards.build_shards(records, accounts)
    repo = hub.add_repo("pool/moe-tune-100k", built, repo_type="dataset")
    inbox: dict[str, dict[str, bytes]] = {}
    for i, d in enumerate(data[N_RECORDS:]):
        inbox.setdefault(f"sharer{i % N_INBOX_ACCOUNTS:02d}", {})[f"records/{N_RECORDS + i:016x}.json"] = json.dumps(
            d, indent=1).encode()
    for account, files in inbox.items():
        hub.merge_pull(repo, hub.open_pull(repo, account, files))
    return repo.repo_id, f"{sum(map(len, built.values())) / 2**20:,.1f} MiB in {len(built)} shards"


def bombs(hub: HubServer, work: Path) -> tuple[str, Path]:
    model = shape_model.write_shape_model(shape_model.small_spec("qwen3moe"), "Q8_0", work / "small-Q8_0.gguf").path
    fp = fingerprint.fingerprint(model)
    key, head = f"sha:{fp['head_sha256']}", fp["head_sha256"]
    honest = {"schema": SCHEMA, "version": SCHEMA_VERSION, "tool": "moe-tune 0", "sharer": "a" * 16,
              "card": {"name": "cpu", "vram_total_bytes": 0, "vram_budget_bytes": None, "driver": None,
                       "pcie_link": None},
              "host": {"ram_total_bytes": 2**35, "physical_cores": 8, "cpu_model": None},
              "engine": {"version": "b1", "commit": "0c1e570", "backend": "cpu", "fa_quants": None},
              "model": {"hub_repo": None, "hub_file": None, "file_name": model.name, "quant": "Q8_0",
                        "size_bytes": fp["size"], "head_sha256": head, "tail_sha256": fp["tail_sha256"]},
              "workload": {"kind": "chat", "prompt_tokens": 512, "gen_tokens": 128, "depth_tokens": 512,
                           "concurrency": 1},
              "lines": [{"label": "default", "round": "selection", "line": f"llama-server -m {model.name} -c 4096",
                         "slots": 1, "gen_tok_s": 50.0, "gen_cv_pct": 2.0, "prompt_tok_s": 300.0, "ttft_s": 0.1,
                         "loaded_gen_tok_s": 50.0, "end_to_end_gen_tok_s": 40.0, "vram_peak_bytes": None,
                         "spill": "none", "kld_mean": None, "failure": None}],
              "verdicts": [], "printed": {"label": "default", "line": f"llama-server -m {model.name} -c 4096",
                                          "why": "the default"},
              "speedup_vs_default": None, "speedup_vs_fit": None}
    repo = hub.add_repo("pool/bombs", {"shards/vram-0/aaaa.parquet": bomb(200_000, 200_000, 10_000, key, head),
                                       "shards/vram-0/bbbb.parquet": bomb(97 * 512, 512, 10_000, key, head)},
                        repo_type="dataset")
    hub.merge_pull(repo, hub.open_pull(repo, "alice", {"records/00000000000000aa.json": json.dumps(honest).encode()}))
    return repo.repo_id, model


@harness.bench("bench_lookup_rss")
def main() -> None:
    say = harness.Log()
    with tempfile.TemporaryDirectory() as tmp, HubServer() as hub:
        work = Path(tmp)
        env = {"HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(work / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
               "MOE_TUNE_CONFIG": str(work / "config")}
        started = time.perf_counter()
        big, shape = hundred_thousand(hub)
        bombed, model = bombs(hub, work)
        harness.progress(f"pools built in {time.perf_counter() - started:.0f} s")
        say(f"pool {big}: {N_RECORDS:,} records, {shape}; {N_INBOX} more in records/ from {N_INBOX_ACCOUNTS} "
            "accounts' merged pull requests")
        one = len(bomb(200_000, 200_000, 10_000, "k", "h"))
        say(f"pool {bombed}: a 200,000-row shard of one dictionary-encoded 10 KB string ({one:,} bytes), 97 row "
            "groups of 512 such rows, one honest record")
        looked = ["org042/Model042-GGUF:Q4_K_M", "--gpu", "RTX 3060 12GB", "--repo", big]
        for name, args in (("100,000 records", looked), ("the bombs", [str(model), "--gpu", "cpu", "--repo", bombed])):
            d = work / name.replace(" ", "-").replace(",", "")
            d.mkdir()
            measured(name, args, env, d, say)
    say.write(harness.OUT / "share-lookup-rss.md", "lookup's peak RSS and time: 100,000 records, and the bombs",
              "Each look-up a fresh `moe-tune lookup` process at COLUMNS=80 against the local Hub server "
              "(tests/hub_server.py) on this machine: every byte crosses a real HTTP socket on loopback. Peak RSS "
              "is the process's own (wait4), the Python interpreter and every library it loads included; "
              "docs/sharing.md states the cap it is held to (256 MiB).")


if __name__ == "__main__":
    main()
