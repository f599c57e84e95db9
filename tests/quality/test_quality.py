"""Quality measurement with the real llama-perplexity on the demo models: KLD per quant and per KV type."""

from __future__ import annotations

import functools
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tuner.core.config import CacheType
from tuner.core.errors import OutputCutError, QualityError, TextTooShortError, UsageError
from tuner.models import gguf_reader
from tuner.quality import kld, kv_price, perplexity, store

CTX = 256
CHUNKS = 4  # 4 × 127 scored tokens: above the 100 llama-perplexity needs for statistics, in one batch
N_VOCAB = 4096

KLD_OUTPUT = """\
0.01.43 I kl_divergence: computing over 4 chunks, n_ctx=512, batch_size=2048, n_seq=4
   4    4428.2371 ±   43.6613      -0.00027 ±    0.00001       0.00005 ±    0.00000       0.046 ±  0.001 %

====== Perplexity statistics ======
Mean PPL(Q)                   : 4428.237131 ±  43.661302
Mean PPL(base)                : 4429.423300 ±  43.668690
====== KL divergence statistics ======
Mean    KLD:   0.000048 ±   0.000002
Maximum KLD:   0.000900
99.9%   KLD:   0.000800
99.0%   KLD:   0.000324
Median  KLD:   0.000030
Same top p: 91.667 ± 0.866 %
"""


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory, engine_loc):
    """A private cache for this module (results, reference logits, corpus file) and the engine for the CLI."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("quality-cache")
    mp.setenv("MOE_TUNE_CACHE", str(root))
    mp.setenv("LLAMA_CPP_DIR", str(engine_loc.bin_dir))
    yield {"MOE_TUNE_CACHE": str(root), "LLAMA_CPP_DIR": str(engine_loc.bin_dir)}
    mp.undo()


def test_parse_kld_reads_every_figure():
    fig = kld.parse_kld(KLD_OUTPUT, want_chunks=4)
    assert (fig.kld_mean, fig.kld_mean_error, fig.kld_p99, fig.kld_max) == (0.000048, 0.000002, 0.000324, 0.0009)
    assert (fig.ppl, fig.ppl_base, fig.same_top_pct, fig.n_chunks) == (4428.237131, 4429.4233, 91.667, 4)


def test_output_without_the_summary_is_cut_not_a_number():
    cut = KLD_OUTPUT.split("====== Perplexity")[0]
    with pytest.raises(OutputCutError):
        kld.parse_kld(cut, want_chunks=4)
    with pytest.raises(OutputCutError):
        kld.parse_perplexity("perplexity: calculating perplexity over 4 chunks, n_ctx=512\n[1]12.5,", 4)


def test_too_few_scored_tokens_and_non_finite_figures_are_errors():
    few = "kl_divergence: computing over 1 chunks, n_ctx=64, batch_size=2048, n_seq=32\n"
    with pytest.raises(QualityError, match="raise --chunks"):
        kld.parse_kld(few, want_chunks=1)
    nan = "calculating perplexity over 2 chunks, n_ctx=512\nFinal estimate: PPL = nan +/- nan\n"
    with pytest.raises(QualityError, match="non-finite"):
        kld.parse_perplexity(nan, want_chunks=2)
    short = ("perplexity: you need at least 1024 tokens to evaluate perplexity with a context of 512\n"
             "perplexity: the data file you provided tokenizes to only 3 tokens\n")
    with pytest.raises(TextTooShortError, match="only 3 tokens.*at least 1024 at -c 512"):
        kld.parse_perplexity(short, want_chunks=2)


def test_reference_is_the_highest_precision_sibling(demo_models, tmp_path):
    for arch in ("qwen3moe", "qwen35moe"):
        for quant in ("Q4_K_M", "Q8_0", "F16"):
            assert perplexity.find_reference(demo_models[(arch, quant)]) == demo_models[(arch, "F16")]
    alone = tmp_path / "solo" / "model-Q4_K_M.gguf"
    alone.parent.mkdir()
    shutil.copy(demo_models[("qwen3moe", "Q4_K_M")], alone)
    assert perplexity.find_reference(alone) is None


def test_kld_ranks_quants_and_kv_types(engine_loc, demo_models, cache_env):
    f16 = demo_models[("qwen3moe", "F16")]

    def kld_of(model, k=CacheType.F16, v=CacheType.F16):
        return perplexity.measure(engine_loc, model, cache_type_k=k, cache_type_v=v, ctx=CTX, chunks=CHUNKS)

    q8 = kld_of(demo_models[("qwen3moe", "Q8_0")])
    q4 = kld_of(demo_models[("qwen3moe", "Q4_K_M")])
    kv8 = kld_of(f16, CacheType.Q8_0, CacheType.Q8_0)
    kv4 = kld_of(f16, CacheType.Q4_0, CacheType.Q4_0)
    for r in (q8, q4, kv8, kv4):
        assert r.reference == str(f16) and r.kld_mean is not None and r.kld_p99 is not None
        assert r.kld_mean > 0 and r.kld_p99 >= r.kld_mean and 0 < (r.same_top_pct or 0) <= 100
        assert r.ppl > 1 and r.chunks == CHUNKS and not r.from_cache
        assert r.reference_logits_bytes == kld.logits_bytes(N_VOCAB, CTX, CHUNKS)
    assert 0 < q8.kld_mean < q4.kld_mean  # type: ignore[operator]
    assert 0 < kv8.kld_mean < kv4.kld_mean  # type: ignore[operator]
    assert (kv4.cache_type_k, kv4.cache_type_v) == ("q4_0", "q4_0") and "-ctk" in kv4.argv
    # One reference logits file served all four, and it sits in the cache with the size reported.
    files = list(perplexity.logits_dir().glob("*.logits"))
    assert len(files) == 1 and files[0].stat().st_size == q8.reference_logits_bytes

    again = kld_of(demo_models[("qwen3moe", "Q4_K_M")])
    assert again.from_cache and again.kld_mean == q4.kld_mean and again.argv == q4.argv

    itself = kld_of(f16)
    assert itself.is_reference and itself.kld_mean == 0.0 and itself.ppl == q8.reference_ppl


def test_a_reference_over_the_disk_budget_is_refused_before_running(engine_loc, demo_models, cache_env):
    with pytest.raises(UsageError, match="disk budget.*lower --chunks"):
        perplexity.measure(engine_loc, demo_models[("qwen35moe", "Q8_0")], chunks=64, disk_budget_bytes=2**20)


def test_without_a_reference_it_measures_perplexity_only(engine_loc, demo_models, cache_env, tmp_path):
    alone = tmp_path / "model-Q4_K_M.gguf"
    shutil.copy(demo_models[("qwen35moe", "Q4_K_M")], alone)
    result = perplexity.measure(engine_loc, alone, chunks=2, auto_reference=False)
    assert result.reference is None and result.kld_mean is None
    assert result.ppl > 1 and result.ppl_error > 0 and "--kl-divergence" not in result.argv


def test_cli_too_short_text_is_one_line(demo_models, cache_env, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Far too short to measure anything.\n")
    proc = run_cli("quality", str(demo_models[("qwen3moe", "Q4_K_M")]), "-f", str(short), "--chunks", "2",
                   env=cache_env)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs at least 1024 at -c 512" in lines[0] and "Traceback" not in proc.stderr


def test_cli_json_names_the_text_and_serves_the_cache(demo_models, cache_env):
    model = str(demo_models[("qwen3moe", "Q8_0")])
    args = ("quality", model, "-c", str(CTX), "--chunks", str(CHUNKS), "--json")
    first = run_cli(*args, env=cache_env)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert len(report["corpus_sha256"]) == 64 and report["engine_commit"]
    assert report["kld_mean"] > 0 and report["reference"].endswith("-F16.gguf") and report["ctx"] == CTX
    second = json.loads(run_cli(*args, env=cache_env).stdout)
    assert second["from_cache"] is True and second["kld_mean"] == report["kld_mean"]


def test_a_run_reads_and_hashes_each_file_once(engine_loc, demo_models, cache_env, monkeypatch):
    """Counted with wrappers (instrumentation, nothing faked): a quality run reads each file's header once and
    hashes each file once; a KV pricing pass over several types reads and hashes the model once in all. Before,
    a run inspected the reference 3 times and hashed it twice, and pricing hashed the model 3 times per KV pair."""
    reads, hashes, inspects = Counter(), Counter(), Counter()
    read_part, inspect = gguf_reader._read_part, gguf_reader.inspect_model
    hash_parts = store._hash_parts.__wrapped__  # the hashing itself, under its memo

    def counted_read(path):
        reads[Path(path).name] += 1
        return read_part(path)

    def counted_hash(stamp):
        hashes[Path(stamp[0][0]).name] += 1
        return hash_parts(stamp)

    def counted_inspect(path):
        inspects[Path(path).name] += 1
        return inspect(path)

    monkeypatch.setattr(gguf_reader, "_read_part", counted_read)
    monkeypatch.setattr(gguf_reader, "inspect_model", counted_inspect)
    monkeypatch.setattr(store, "_hash_parts", functools.lru_cache(maxsize=64)(counted_hash))
    gguf_reader._inspect_parts.cache_clear()  # headers read earlier in this process are read again, and counted
    q4, q8, f16 = (demo_models[("qwen3moe", q)] for q in ("Q4_K_M", "Q8_0", "F16"))

    run = perplexity.measure(engine_loc, q4, ctx=CTX, chunks=CHUNKS)
    assert run.reference == str(f16) and run.kld_mean is not None
    # Q8_0 is a candidate reference beside it: its header is read (once) to rank it, never hashed.
    assert reads == inspects == {q4.name: 1, q8.name: 1, f16.name: 1}
    assert hashes == {q4.name: 1, f16.name: 1}

    for counter in (reads, hashes, inspects):
        counter.clear()
    gguf_reader._inspect_parts.cache_clear()
    store._hash_parts.cache_clear()
    pairs = [(CacheType.Q8_0, CacheType.Q8_0), (CacheType.Q4_0, CacheType.Q4_0)]
    prices = [kv_price.price(engine_loc, q4, k, v, ctx=CTX, chunks=CHUNKS) for k, v in pairs]
    assert [(p.cache_type_k, p.cache_type_v) for p in prices] == [(k.value, v.value) for k, v in pairs]
    assert reads == hashes == {q4.name: 1}
    assert inspects == {q4.name: len(pairs)}  # one call per price, served from memory after the first
