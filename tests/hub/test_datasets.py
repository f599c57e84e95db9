"""Standard evaluation texts through the real Hugging Face client, against the local Hub server."""

from __future__ import annotations

import io
import json
import zipfile

import pytest

from tests.conftest import run_cli
from tests.hub_server import HubServer
from tuner.core.errors import HubError, UsageError
from tuner.hub import datasets, repos
from tuner.quality import corpus

WIKI = datasets.DATASETS["wikitext-2"]


@pytest.fixture(scope="module")
def wiki_text() -> bytes:
    return corpus.text()[:60_000].encode()


@pytest.fixture(scope="module")
def server(wiki_text):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(WIKI.member, wiki_text)
        zf.writestr("wikitext-2-raw/wiki.train.raw", b"not the test split")
    with HubServer() as srv:
        srv.add_repo(WIKI.repo_id, {WIKI.filename: buf.getvalue()}, repo_type="dataset")
        yield srv


def test_fetch_extracts_the_test_split_and_then_works_offline(server, wiki_text, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "mt"))
    options = repos.HubOptions(endpoint=server.endpoint, cache_dir=tmp_path / "hf", token=False)
    path = datasets.fetch("wikitext-2", options)
    assert path.read_bytes() == wiki_text
    assert any(WIKI.filename in r.path for r in server.requests)
    server.requests.clear()
    offline = repos.HubOptions(endpoint=server.endpoint, cache_dir=tmp_path / "hf", token=False, offline=True)
    assert datasets.fetch("wikitext-2", offline) == path
    assert server.requests == []  # served from the Hugging Face cache


def test_unknown_dataset_and_uncached_offline_are_one_line_errors(tmp_path):
    with pytest.raises(UsageError, match="unknown dataset 'wikitext-3': use one of wikitext-2"):
        datasets.spec("wikitext-3")
    offline = repos.HubOptions(endpoint="http://127.0.0.1:9", cache_dir=tmp_path / "empty", offline=True)
    with pytest.raises(HubError):
        datasets.fetch("wikitext-2", offline)


def test_quality_on_wikitext_2_through_the_cli(server, demo_models, engine_loc, tmp_path):
    env = {"HF_ENDPOINT": server.endpoint, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_TOKEN": "",
           "MOE_TUNE_CACHE": str(tmp_path / "mt"), "LLAMA_CPP_DIR": str(engine_loc.bin_dir),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = run_cli("quality", str(demo_models[("qwen3moe", "Q8_0")]), "--dataset", "wikitext-2", "-c", "256",
                   "--chunks", "2", "-t", "2", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ppl"] > 1 and report["chunks"] == 2
    assert report["corpus_sha256"] != corpus.sha256()  # measured on the fetched text, named by its hash
