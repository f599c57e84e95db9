"""Hugging Face names, listings, header reads and downloads against a real local Hub server."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import gguf
import pytest
from huggingface_hub import hf_hub_download

from tests.conftest import run_cli
from tests.hub_server import HubServer, root_layout, subfolder_layout
from tuner.core.errors import (
    DownloadInterruptedError,
    GatedRepoError,
    HashMismatchError,
    HubDiskSpaceError,
    NotCachedError,
    RepoNotFoundError,
    UnknownQuantError,
)
from tuner.engine import runner
from tuner.hub import client, download, remote_header, repos
from tuner.hub.resolve import resolve_model
from tuner.machine import hardware
from tuner.models import demo_model, gguf_reader

ROOT = "demo/Root-GGUF"
SPLIT = "demo/Split-GGUF"
GATED = "demo/Gated-GGUF"
CORRUPT = "demo/Corrupt-GGUF"
CATALOGUED = "unsloth/Qwen3.5-35B-A3B-GGUF"
BASE = "Demo-30B-A3B"
TOKEN = "hf_granted_token"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def hub_files(demo_models, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Repo path → source file, for the root layout and the split-in-subfolders layout."""
    models = {q: demo_models[("qwen3moe", q)] for q in ("Q8_0", "Q4_K_M")}
    work = tmp_path_factory.mktemp("hub-split")
    hybrid = {q: demo_models[("qwen35moe", q)] for q in ("Q8_0", "Q4_K_M")}
    return {"root": root_layout(models, BASE), "split": subfolder_layout(models, BASE, work, n_parts=2),
            "catalogued": root_layout(hybrid, "Qwen3.5-35B-A3B")}


@pytest.fixture(scope="module")
def hub_module(hub_files):
    with HubServer() as srv:
        srv.add_repo(ROOT, hub_files["root"])
        srv.add_repo(SPLIT, hub_files["split"])
        srv.add_repo(GATED, hub_files["root"], gated=True)
        srv.add_repo(CORRUPT, hub_files["root"])
        srv.add_repo(CATALOGUED, hub_files["catalogued"])
        srv.corrupt(CORRUPT, f"{BASE}-Q4_K_M.gguf")
        srv.granted_tokens.add(TOKEN)
        yield srv


@pytest.fixture
def srv(hub_module, tmp_path, monkeypatch) -> HubServer:
    """The module's server with a fresh request log; header stand-ins go to this test's own cache."""
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "moe-tune"))
    hub_module.requests.clear()
    return hub_module


@pytest.fixture
def opts(srv, tmp_path) -> repos.HubOptions:
    return repos.HubOptions(endpoint=srv.endpoint, cache_dir=tmp_path / "hf", token=False)


# -- names and grouping ----------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "quant"), [
    ("Qwen3-30B-A3B-UD-Q4_K_XL.gguf", "UD-Q4_K_XL"),
    ("Qwen3.6-35B-A3B-Q4_K_M.gguf", "Q4_K_M"),
    ("BF16/Qwen3-30B-A3B-BF16-00001-of-00002.gguf", "BF16"),
    ("Q8_0/Model-00001-of-00003.gguf", "Q8_0"),
    ("gpt-oss-20b-mxfp4.gguf", "MXFP4"),
    ("GLM-4.5-Air-IQ4_XS.gguf", "IQ4_XS"),
    ("UD-Q2_K_XL/GLM-4.5-Air-UD-Q2_K_XL-00001-of-00002.gguf", "UD-Q2_K_XL"),
])
def test_quant_names_from_files(path, quant):
    assert repos.quant_name(path) == quant


def test_grouping_joins_split_parts_and_skips_projectors_and_broken_splits():
    files = [
        repos.RemoteFile("M-Q4_K_M.gguf", 100, None),
        repos.RemoteFile("Q8_0/M-Q8_0-00002-of-00002.gguf", 70, None),
        repos.RemoteFile("Q8_0/M-Q8_0-00001-of-00002.gguf", 80, None),
        repos.RemoteFile("BF16/M-BF16-00001-of-00003.gguf", 90, None),  # parts 2 and 3 missing
        repos.RemoteFile("mmproj-F16.gguf", 10, None),
        repos.RemoteFile("README.md", 5, None),
    ]
    quants = repos.group_quants(files)
    assert [(q.name, q.n_parts, q.total_bytes) for q in quants] == [("Q4_K_M", 1, 100), ("Q8_0", 2, 150)]
    assert [f.path for f in quants[1].files][0].endswith("00001-of-00002.gguf")


@pytest.mark.parametrize(("text", "expected"), [
    ("unsloth/Qwen3.6-35B-A3B-GGUF:Q4_K_M", repos.HubRef("unsloth/Qwen3.6-35B-A3B-GGUF", "Q4_K_M")),
    ("ggml-org/gpt-oss-20b-GGUF", repos.HubRef("ggml-org/gpt-oss-20b-GGUF", None)),
    ("models/Qwen3-30B-A3B-Q4_K_M.gguf", None),
    ("./owner/name", None),
    ("just-a-name", None),
])
def test_hub_names_and_local_paths(text, expected):
    assert repos.parse_hub_ref(text) == expected


# -- listing and headers ---------------------------------------------------------------------------


def test_lists_root_files_with_sizes_and_hashes(opts, hub_files):
    listing = repos.list_quants(ROOT, options=opts)
    assert listing.names == ("Q4_K_M", "Q8_0")  # smallest first
    for q in listing.quants:
        src = hub_files["root"][q.first_file.path]
        assert q.n_parts == 1 and q.total_bytes == src.stat().st_size
        assert q.first_file.sha256 == sha256(src)
    assert listing.commit is not None and len(listing.commit) == 40


def test_lists_split_subfolders_as_one_quant(opts, hub_files):
    listing = repos.list_quants(SPLIT, options=opts)
    q8 = listing.get("q8_0")
    assert q8.n_parts == 2
    assert [f.path for f in q8.files] == [f"Q8_0/{BASE}-Q8_0-0000{k}-of-00002.gguf" for k in (1, 2)]
    assert q8.total_bytes == sum(hub_files["split"][f.path].stat().st_size for f in q8.files)


def test_header_read_fetches_only_the_header(srv, opts, hub_files):
    listing = repos.list_quants(ROOT, options=opts)
    q8 = listing.get("Q8_0")
    srv.requests.clear()
    headers = remote_header.read_quant_headers(ROOT, q8, commit=listing.commit, options=opts)
    source = hub_files["root"][q8.first_file.path]
    part = headers.parts[0]
    assert part.header_bytes == gguf.GGUFReader(source).data_offset  # the gguf package agrees
    assert part.bytes_read == headers.bytes_read == srv.body_bytes("/resolve/")  # every byte accounted for
    assert part.header_bytes <= part.bytes_read < q8.total_bytes / 10
    assert all(r.range is not None for r in srv.requests if r.method == "GET")  # ranges only
    stand_in = headers.first_path
    assert stand_in.stat().st_size == q8.total_bytes
    assert stand_in.stat().st_blocks * 512 < q8.total_bytes / 4  # sparse: the data region is a hole
    assert stand_in.read_bytes()[:part.header_bytes] == source.read_bytes()[:part.header_bytes]
    assert opts.hub_cache not in stand_in.parents  # nothing lands in the HF cache before a download
    remote, local = headers.model_info(), gguf_reader.inspect_model(source)
    spec = demo_model.demo_spec("qwen3moe")
    assert remote.arch == "qwen3moe" and remote.n_layer == spec.n_layer and remote.n_expert == spec.n_expert
    assert remote.tensors == local.tensors and remote.tensor_bytes == local.tensor_bytes
    # A second read is served by the stand-in with no network at all.
    srv.requests.clear()
    again = remote_header.read_quant_headers(ROOT, q8, commit=listing.commit, options=opts)
    assert again.bytes_read == 0 and srv.body_bytes("/resolve/") == 0 and again.first_path == stand_in


def test_split_headers_grow_in_ranges_and_sum_every_part(srv, opts, hub_files):
    listing = repos.list_quants(SPLIT, options=opts)
    q4 = listing.get("Q4_K_M")
    srv.requests.clear()
    headers = remote_header.read_quant_headers(SPLIT, q4, commit=listing.commit, options=opts, first_bytes=16 << 10)
    first = q4.first_file.path
    ranges = srv.ranges_requested(first)
    assert len(ranges) >= 3 and ranges[0] == f"bytes=0-{(16 << 10) - 1}"
    starts = [int(r.split("=")[1].split("-")[0]) for r in ranges if r]
    ends = [int(r.split("-")[1]) + 1 for r in ranges if r]
    assert starts[1:] == ends[:-1]  # contiguous: no byte fetched twice
    assert headers.parts[0].header_bytes <= headers.parts[0].bytes_read < 2 * headers.parts[0].header_bytes
    remote = headers.model_info()
    local = gguf_reader.inspect_model(hub_files["root"][f"{BASE}-Q4_K_M.gguf"])
    assert len(headers.parts) == 2 and len(remote.paths) == 2
    assert remote.tensor_bytes == local.tensor_bytes and {t.name for t in remote.tensors} == {
        t.name for t in local.tensors}
    assert headers.bytes_read < q4.total_bytes / 10
    # Once downloaded, the headers come from the Hugging Face cache itself.
    got = download.download_quant(SPLIT, "Q4_K_M", options=opts)
    cached = remote_header.read_quant_headers(SPLIT, q4, commit=listing.commit, options=opts)
    assert cached.bytes_read == 0 and cached.first_path == got.first_path


def test_header_walk_needs_exactly_the_header(demo_models):
    data = demo_models[("qwen35moe", "Q4_K_M")].read_bytes()
    end = remote_header.header_end(data)
    assert end == gguf.GGUFReader(demo_models[("qwen35moe", "Q4_K_M")]).data_offset
    assert remote_header.header_end(data[:end]) == end
    assert remote_header.header_end(data[:end - 1]) >= end  # says "more", with a lower bound
    assert remote_header.header_end(b"NOTAGGUF" + data[8:100]) is None


# -- downloads -------------------------------------------------------------------------------------


def test_download_split_into_the_hf_cache_then_reuse_and_offline(srv, opts, hub_files):
    got = download.download_quant(SPLIT, "Q8_0", options=opts)
    assert got.quant == "Q8_0" and len(got.paths) == 2 and got.reused_bytes == 0
    for path, f in zip(got.paths, repos.list_quants(SPLIT, options=opts).get("Q8_0").files, strict=True):
        assert path == opts.hub_cache / "models--demo--Split-GGUF" / "snapshots" / got.commit / f.path
        assert sha256(path) == sha256(hub_files["split"][f.path])
    assert got.downloaded_bytes == sum(p.stat().st_size for p in got.paths)
    assert (opts.hub_cache / "models--demo--Split-GGUF" / "refs" / "main").read_text() == got.commit
    # huggingface_hub itself finds the files offline: the cache layout is the standard one.
    cached = hf_hub_download(SPLIT, got.paths[1].relative_to(got.paths[1].parents[1]).as_posix(),
                             cache_dir=opts.hub_cache, local_files_only=True)
    assert Path(cached) == got.paths[1]

    srv.requests.clear()
    again = download.download_quant(SPLIT, "Q8_0", options=opts)
    assert again.paths == got.paths and again.downloaded_bytes == 0 and again.reused_bytes == got.downloaded_bytes
    assert srv.body_bytes("/resolve/") == 0

    offline = repos.HubOptions(cache_dir=opts.hub_cache, offline=True, endpoint="http://127.0.0.1:9")
    assert download.download_quant(SPLIT, "Q8_0", options=offline).paths == got.paths
    assert repos.list_quants(SPLIT, options=offline).names == ("Q8_0",)
    with pytest.raises(NotCachedError, match="Q4_K_M"):
        download.download_quant(SPLIT, "Q4_K_M", options=offline)


def test_cut_connection_resumes_within_the_same_call(srv, opts, hub_files):
    path = f"{BASE}-Q4_K_M.gguf"
    srv.cut_next_download(ROOT, path, after_bytes=3 << 20)
    got = download.download_quant(ROOT, "Q4_K_M", options=opts)
    assert sha256(got.first_path) == sha256(hub_files["root"][path])
    assert srv.ranges_requested(path) == [None, f"bytes={3 << 20}-"]
    assert srv.body_bytes(path) == got.first_path.stat().st_size  # nothing fetched twice


def test_a_server_gone_silent_is_given_up_and_the_download_resumes(srv, opts, hub_files, monkeypatch):
    """huggingface_hub's client waits forever by default (timeout=None, utils/_http.py): a server that takes the GET
    and never answers held `download` for good. Ours gives up after STALL_S and asks again."""
    monkeypatch.setattr(client, "STALL_S", 2.0)
    path = f"{BASE}-Q4_K_M.gguf"
    srv.stall_next(path, seconds=12)  # the first GET of the file: read, then silence
    started = time.monotonic()
    got = download.download_quant(ROOT, "Q4_K_M", options=opts)
    took = time.monotonic() - started
    assert sha256(got.first_path) == sha256(hub_files["root"][path])
    assert 2.0 <= took < 8.0, took  # one stall bound, then the whole file; not the server's 12 s
    gets = [r for r in srv.requests if r.method == "GET" and r.path.endswith(path)]
    assert [r.status for r in gets] == [0, 200], gets  # the silent one, then one whole answer


def test_interrupted_download_resumes_on_the_next_run(srv, opts, hub_files):
    path = f"{BASE}-Q8_0.gguf"
    cut = 5 << 20
    srv.cut_next_download(ROOT, path, after_bytes=cut)
    with pytest.raises(DownloadInterruptedError, match="run the same command again"):
        download.download_quant(ROOT, "Q8_0", options=opts, retries=0)
    partial = list((opts.hub_cache / "models--demo--Root-GGUF" / "blobs").glob("*.incomplete"))
    assert len(partial) == 1 and partial[0].stat().st_size == cut

    got = download.download_quant(ROOT, "Q8_0", options=opts)
    size = hub_files["root"][path].stat().st_size
    assert got.resumed_from_bytes == cut and got.downloaded_bytes == size - cut
    assert srv.ranges_requested(path)[-1] == f"bytes={cut}-"
    assert sha256(got.first_path) == sha256(hub_files["root"][path])
    assert not partial[0].exists()


def test_ctrl_c_keeps_the_partial_download_for_the_next_run(opts, hub_files):
    def interrupt(p: download.DownloadProgress) -> None:
        if p.done_bytes >= 2 << 20:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        download.download_quant(ROOT, "Q8_0", options=opts, on_progress=interrupt)
    partial = list((opts.hub_cache / "models--demo--Root-GGUF" / "blobs").glob("*.incomplete"))
    assert len(partial) == 1
    kept = partial[0].stat().st_size
    assert kept >= 2 << 20
    got = download.download_quant(ROOT, "Q8_0", options=opts)
    assert got.resumed_from_bytes == kept
    assert sha256(got.first_path) == sha256(hub_files["root"][f"{BASE}-Q8_0.gguf"])


def test_corrupted_file_is_rejected_and_deleted(opts):
    with pytest.raises(HashMismatchError, match="corrupted"):
        download.download_quant(CORRUPT, "Q4_K_M", options=opts)
    storage = opts.hub_cache / "models--demo--Corrupt-GGUF"
    assert not list((storage / "blobs").iterdir())
    assert not (storage / "snapshots").exists() or not list((storage / "snapshots").rglob("*.gguf"))


def test_unknown_repo_and_unknown_quant(opts):
    with pytest.raises(RepoNotFoundError, match="nobody/Missing-GGUF not found"):
        repos.list_quants("nobody/Missing-GGUF", options=opts)
    with pytest.raises(UnknownQuantError) as info:
        download.download_quant(ROOT, "Q3_K_M", options=opts)
    assert info.value.available == ("Q4_K_M", "Q8_0") and "Q4_K_M, Q8_0" in str(info.value)


def test_gated_repo_needs_a_token(opts):
    assert repos.list_quants(GATED, options=opts).names == ("Q4_K_M", "Q8_0")  # listing is public, files are not
    with pytest.raises(GatedRepoError, match="HF_TOKEN") as info:
        download.download_quant(GATED, "Q4_K_M", options=opts)
    assert "login" in str(info.value)
    granted = repos.HubOptions(endpoint=opts.endpoint, cache_dir=opts.cache_dir, token=TOKEN)
    assert download.download_quant(GATED, "Q4_K_M", options=granted).first_path.is_file()


def test_cdn_redirect_keeps_the_token_on_the_hub(hub_files, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "moe-tune"))
    with HubServer(cdn_redirect=True) as cdn_srv:
        cdn_srv.add_repo(GATED, hub_files["root"], gated=True)
        cdn_srv.granted_tokens.add(TOKEN)
        o = repos.HubOptions(endpoint=cdn_srv.endpoint, cache_dir=tmp_path / "hf", token=TOKEN)
        listing = repos.list_quants(GATED, options=o)
        q4 = listing.get("Q4_K_M")
        headers = remote_header.read_quant_headers(GATED, q4, commit=listing.commit, options=o)
        got = download.download_quant(GATED, "Q4_K_M", options=o)
        assert sha256(got.first_path) == sha256(hub_files["root"][q4.first_file.path])
        assert headers.parts[0].bytes_read < q4.total_bytes / 10
        cdn = [r for r in cdn_srv.requests if r.path.startswith("/cdn/")]
        resolve = [r for r in cdn_srv.requests if "/resolve/" in r.path]
        assert cdn and all(r.authorization is None for r in cdn)  # the token never leaves the Hub host
        assert resolve and all(r.authorization == f"Bearer {TOKEN}" and r.status == 302 for r in resolve)
        assert sum(r.body_bytes for r in cdn) == headers.bytes_read + got.downloaded_bytes


def test_not_enough_disk_is_refused_before_downloading(tmp_path):
    with pytest.raises(HubDiskSpaceError, match="HF_HOME"):
        download.check_disk_space(1 << 60, tmp_path / "not" / "yet")


def test_resolve_model_accepts_paths_and_hub_names(opts, hub_files):
    local = hub_files["root"][f"{BASE}-Q4_K_M.gguf"]
    assert resolve_model(str(local), options=opts).path == local
    path = resolve_model(f"{ROOT}:q4_k_m", options=opts).path
    assert path.name == f"{BASE}-Q4_K_M.gguf" and opts.hub_cache in path.parents


def test_llama_cpp_loads_a_downloaded_split_model(opts, engine_loc):
    got = download.download_quant(SPLIT, "Q4_K_M", options=opts)
    res = runner.run_process(
        [engine_loc.tool("llama-bench"), "-m", got.first_path, "-p", "16", "-n", "4", "-r", "1", "-t", "2",
         "-o", "jsonl"],
        timeout_s=300, what="llama-bench on a split download", fix="see the log",
    )
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 and all(r["avg_ts"] > 0 for r in rows)
    assert rows[0]["model_n_params"] == demo_model.demo_spec("qwen3moe").n_params  # both parts' tensors loaded


# -- command line ----------------------------------------------------------------------------------


def _env(srv: HubServer, tmp_path: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": srv.endpoint, "HF_HUB_CACHE": str(tmp_path / "hf"), "MOE_TUNE_CACHE": str(tmp_path / "mt"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": ""}


def test_cli_quants_lists_both_layouts(srv, tmp_path):
    proc = run_cli("quants", SPLIT, "-c", "16384", "--json", env=_env(srv, tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [(q["name"], q["n_parts"]) for q in report["quants"]] == [("Q4_K_M", 2), ("Q8_0", 2)]
    assert report["ctx"] == 16384
    if not hardware.probe_gpus().gpus:
        assert all(q["fit"] == "RAM (no GPU)" for q in report["quants"])
    on_card = json.loads(run_cli("quants", SPLIT, "-c", "16384", "--gpu", "RTX 3060 12GB", "--json",
                                 env=_env(srv, tmp_path)).stdout)
    assert all(q["fit"] == "VRAM" for q in on_card["quants"])  # a few MB of demo model fit any card
    assert report["header"]["architecture"] == "qwen3moe" and len(report["header"]["parts"]) == 2
    assert report["header"]["n_layer"] == demo_model.demo_spec("qwen3moe").n_layer
    proc = run_cli("quants", ROOT, env=_env(srv, tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "Q4_K_M" in proc.stdout and "qwen3moe" in proc.stdout
    assert "RAM (no GPU)" in proc.stdout or hardware.probe_gpus().gpus


def test_cli_quants_shows_catalog_figures_labelled_as_published(srv, tmp_path):
    proc = run_cli("quants", CATALOGUED, "--json", env=_env(srv, tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    q4 = next(q for q in report["quants"] if q["name"] == "Q4_K_M")
    at_3090 = next(p for p in q4["published"] if p["gpu"] == "GeForce RTX 3090" and p["ctx"] == 10240)
    assert at_3090["figures"]["ppl"] == 6.559 and "002_d193f0e2717c8333.txt" in at_3090["source"]
    assert report["header"]["architecture"] == "qwen35moe"  # the header, not the catalog, names the arch
    proc = run_cli("quants", CATALOGUED, env=_env(srv, tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "published (catalog, not measured here)" in proc.stdout and "PPL 6.559" in proc.stdout


def test_cli_download_prints_the_first_part(srv, tmp_path):
    env = _env(srv, tmp_path)
    proc = run_cli("download", f"{SPLIT}:Q4_K_M", env=env)
    assert proc.returncode == 0, proc.stderr
    first = Path(proc.stdout.strip())
    assert first.name == f"{BASE}-Q4_K_M-00001-of-00002.gguf" and first.is_file()
    assert (tmp_path / "hf") in first.parents
    proc = run_cli("download", f"{SPLIT}:Q4_K_M", "--offline", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["first_path"] == str(first)


@pytest.mark.parametrize(("name", "words"), [
    ("nobody/Missing-GGUF:Q4_K_M", ["not found", "owner/name"]),
    (f"{ROOT}:Q9_9", ["no quant Q9_9", "Q4_K_M, Q8_0"]),
    (f"{GATED}:Q4_K_M", ["gated", "login", "HF_TOKEN"]),
])
def test_cli_errors_are_one_line(srv, tmp_path, name, words):
    proc = run_cli("download", name, env=_env(srv, tmp_path))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in lines[0]
