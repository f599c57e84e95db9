"""A line priced as it runs (tuner.quality.engine_price.price_line): the perplexity run carries the printed line's KV
types, flash attention, placement, ubatch and engine levers; the reference logits are llama.cpp's bare launch at f16,
whichever engine's line is priced (issue 61: ik's -rtr once reached llama.cpp's reference run, which refused it); a line
that loads its weights into RAM is refused before any run where the model does not fit the RAM free. A price stops once
its verdict is clear (issue 65): a model that predicts no text after the reference's first chunk, then no line run at
all; a line far above or below the floor after a few chunks. A price that fails says why in one line (issue 66)."""

from __future__ import annotations

import errno
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import QualityError
from tuner.engine import runner
from tuner.engine.kinds import IK_LLAMA
from tuner.machine import paths
from tuner.quality import engine_price, kv_price, perplexity, store

M = Path("/m.gguf")
IK_LINE = LaunchConfig(model=M, ctx=8192, parallel=2, engine=IK_LLAMA.name, cache_type_k=CacheType.Q8_0,
                       cache_type_v=CacheType.Q8_0, flash_attn=FlashAttn.ON, run_time_repack=True, merge_up_gate=True,
                       ubatch=16, threads=1, n_gpu_layers=99, n_cpu_moe=12, cache_ram_mib=1024)


@pytest.mark.fast
def test_the_priced_run_keeps_the_line_s_numerics_and_drops_what_changes_no_figure():
    run = perplexity.as_run(IK_LINE, M, IK_LLAMA.name, ctx=512)
    kept = {k: getattr(run, k) for k in ("cache_type_k", "cache_type_v", "flash_attn", "run_time_repack",
                                         "merge_up_gate", "ubatch", "threads", "n_gpu_layers", "n_cpu_moe", "engine")}
    assert kept == {"cache_type_k": CacheType.Q8_0, "cache_type_v": CacheType.Q8_0, "flash_attn": FlashAttn.ON,
                    "run_time_repack": True, "merge_up_gate": True, "ubatch": 16, "threads": 1, "n_gpu_layers": 99,
                    "n_cpu_moe": 12, "engine": IK_LLAMA.name}
    assert run.ctx is None and run.parallel is None and run.cache_ram_mib is None  # no figure depends on them
    assert perplexity.as_run(LaunchConfig(model=M, ubatch=2048), M, "llama.cpp", ctx=512).ubatch == 512  # one chunk


@pytest.mark.fast
def test_which_lines_need_a_price():
    assert engine_price.needs_price(IK_LINE)
    assert engine_price.needs_price(LaunchConfig(model=M, cache_type_v=CacheType.Q4_0, flash_attn=FlashAttn.ON))
    assert not engine_price.needs_price(LaunchConfig(model=M, threads=2, flash_attn=FlashAttn.OFF))


@pytest.mark.fast
def test_a_resident_line_is_refused_before_pricing_where_the_model_does_not_fit(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 4096)
    with pytest.raises(QualityError, match=r"loads all 0.0 GiB of m.gguf into RAM \(.*--run-time-repack.*\) and 0.0 GiB"
                                           r" is free: free RAM, or price it with --max-kld off"):
        engine_price.check_room(IK_LINE, model, available_bytes=1024)
    engine_price.check_room(IK_LINE, model, available_bytes=8192)  # it fits: no refusal
    engine_price.check_room(LaunchConfig(model=model), model, available_bytes=1024)  # mapped: the page cache's


def test_an_ik_line_is_priced_as_it_runs_against_llama_cpp_s_bare_reference(engine_loc, ik_loc, trained_dense_f16,
                                                                             tmp_path, monkeypatch):
    # No earlier price in this cache: the reference logits are written here, by llama.cpp, from its bare launch. A
    # model that predicts text (a random-weight demo predicts none: its price runs no line), and one both engines
    # compute alike (SmolLM2's dense F16 twin: ik's KLD ~3e-6, -rtr too; results/benchmarks/engine-kld-trained.md).
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path))
    line = LaunchConfig(model=trained_dense_f16, engine=IK_LLAMA.name, cache_type_k=CacheType.Q8_0,
                        cache_type_v=CacheType.Q8_0, flash_attn=FlashAttn.ON, run_time_repack=True, ubatch=16,
                        threads=1)
    said: list[str] = []
    got = engine_price.price_line(line, ik_loc, engine_loc, ctx=128, chunks=2, on_step=said.append,
                                  available_bytes=2**40)
    argv = list(got.argv)
    assert argv[0] == str(ik_loc.tool("llama-perplexity"))
    for flag, value in (("-ctk", "q8_0"), ("-ctv", "q8_0"), ("-ub", "16"), ("-t", "1")):
        assert argv[argv.index(flag) + 1] == value, argv
    assert argv[argv.index("-fa") + 1] in ("on", "1") and ("--run-time-repack" in argv or "-rtr" in argv), argv
    assert "--kl-divergence" in argv
    assert any(s.startswith("writing reference logits") for s in said), said  # written now, by llama.cpp
    assert got.reference.startswith("llama.cpp") and got.engine.startswith("ik_llama.cpp")
    assert 0.0 <= got.kld_mean < 1.0 and got.chunks == 2 and "-ctk q8_0" in got.priced_as


@pytest.mark.fast
def test_a_price_against_a_model_that_predicts_no_text_says_nothing_and_refuses_nothing():
    # The Qwen3-30B-A3B shape with direct (untrained) weights: its own perplexity on the corpus was 230,547 over a
    # 151,936-token vocabulary; llama.cpp against itself with only --no-repack read a KLD of 0.53 there, ik's lines
    # 0.59-0.62 (results/benchmarks/which-engine-cpu.md). Trained SmolLM2-135M: 18.8 over 49,152.
    why = engine_price.says_nothing(230_547.1, 151_936)
    assert why is not None and why.startswith("the model predicts no text (its perplexity on the corpus, 230,547, ")
    assert engine_price.says_nothing(18.8, 49_152) is None and engine_price.says_nothing(None, 10) is None
    untrained = engine_price.LinePrice("ik_llama.cpp", "llama.cpp", 0.59, 0.002, 0.1, 2e5, 230_547.1, 512, 8,
                                       says_nothing=why)
    trained = replace(untrained, reference_ppl=18.8, says_nothing=None)
    assert not untrained.refused_by(0.01) and trained.refused_by(0.01) and not trained.refused_by(None)


@pytest.mark.fast
def test_a_price_with_no_line_run_is_said_and_json_safe():
    why = engine_price.says_nothing(12_383.0, 8192, "the first 1 of 4 chunks of the corpus")
    assert why is not None and why.startswith("the model predicts no text (its perplexity on the first 1 of 4 chunks "
                                              "of the corpus, 12,383, ")
    none = engine_price.LinePrice("llama.cpp", "llama.cpp", None, 0.0, None, None, 12_383.0, 512, 4, "-ctk q8_0",
                                  says_nothing=why, chunks_used=0)
    assert none.describe() == f"llama.cpp (-ctk q8_0) not priced against llama.cpp's f16 logits: {why}"
    assert not none.refused_by(0.01) and json.loads(json.dumps(none.to_dict()))["kld_mean"] is None
    stopped = replace(none, kld_mean=17.8, kld_mean_error=0.3, ppl=2e8, reference_ppl=17.8, says_nothing=None,
                      chunks_used=1, stopped="refused: the mean over all 4 chunks would read 4.45 or more")
    assert stopped.refused_by(0.01)
    assert "(stopped after 1 of 4 chunks of 512 tokens, refused: the mean over all 4" in stopped.describe()


@pytest.mark.fast
def test_a_cache_that_cannot_be_written_is_one_line_naming_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path))
    store.quality_dir().mkdir(parents=True)
    store.logits_dir().write_text("not a folder")  # a file where the reference logits' folder goes
    with pytest.raises(FileExistsError) as exc:
        store.logits_dir().mkdir(parents=True, exist_ok=True)
    said = str(store.unwritable(exc.value))
    assert said == (f"the reference logits cannot be written to {store.logits_dir()} (a file is in the way: "
                    f"{store.logits_dir()}): remove it, or set MOE_TUNE_CACHE to another folder")
    with pytest.raises(NotADirectoryError) as under:  # a file where a folder above it goes
        (store.logits_dir() / "x.lock").open("a")
    assert f"(a file is in the way: {store.logits_dir()})" in str(store.unwritable(under.value))
    full = OSError(errno.ENOSPC, "No space left on device", str(store.results_dir() / "k.json"))
    assert str(store.unwritable(full)) == (f"the quality figures cannot be written to {store.results_dir() / 'k.json'} "
                                           "(the disk is full): free space, or set MOE_TUNE_CACHE to another folder")
    assert paths.cache_root() == tmp_path  # the folder the fix names is the one MOE_TUNE_CACHE chose


# ------------------------------------------------------------------------------------ with the engines


def untrained_model(folder: Path) -> Path:
    """A model that predicts no text, as the real shapes with drawn weights do: Qwen3-30B-A3B's layout at its width
    (2048) over 2 layers and an 8,192-token vocabulary (tuner.models.shape_model). Its logits spread as the real
    shape's, so its perplexity is ~1.5x its vocabulary (12,383 on the first chunk), as the real one's is (230,547 over
    151,936). 100 MB, written in a second."""
    from tuner.models import shape_model

    spec = replace(shape_model.small_spec("qwen3moe"), n_embd=2048, n_layer=2)
    return shape_model.write_shape_model(spec, "Q8_0", folder / "untrained.gguf", weights="direct", seed=0).path


@pytest.fixture
def perplexity_runs(monkeypatch) -> list[list[str]]:
    """Every llama-perplexity run over a model the runner starts from here on (the runner's own spawn, counted and
    passed through; the capability probe's ``--help`` is no run)."""
    started: list[list[str]] = []
    spawn = runner._popen

    def counted(argv, **kwargs):
        if Path(str(argv[0])).name == "llama-perplexity" and "-m" in argv:
            started.append([str(a) for a in argv])
        return spawn(argv, **kwargs)

    monkeypatch.setattr(runner, "_popen", counted)
    return started


def test_a_model_that_predicts_no_text_is_known_after_one_chunk_and_never_priced_again(engine_loc, tmp_path,
                                                                                       monkeypatch, perplexity_runs):
    model = untrained_model(tmp_path)
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    said: list[str] = []
    verdict = engine_price.reference_says(model, engine_loc, ctx=512, chunks=4, on_step=said.append)
    assert verdict.says_nothing is not None and verdict.says_nothing.startswith(
        "the model predicts no text (its perplexity on the first 1 of 4 chunks of the corpus, ")
    assert (verdict.chunks_read, verdict.complete, verdict.from_cache) == (1, False, False)
    assert [s for s in said if " done" in s] == ["  chunk 1 of 4 done"], said
    assert len(perplexity_runs) == 1 and "--ppl-output-type" in perplexity_runs[0]
    assert not [p.name for p in store.logits_dir().iterdir() if ".logits" in p.name]  # the cut file is not kept

    perplexity_runs.clear()
    start = time.monotonic()
    again = engine_price.reference_says(model, engine_loc, ctx=512, chunks=4)
    line = LaunchConfig(model=model, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0, flash_attn=FlashAttn.ON)
    price = engine_price.price_line(line, engine_loc, engine_loc, ctx=512, chunks=4, max_kld=kv_price.DEFAULT_MAX_KLD)
    other_chunks = engine_price.price_line(line, engine_loc, engine_loc, ctx=512, chunks=8)
    assert time.monotonic() - start < 2.0 and perplexity_runs == []  # answered from the kept read: no process
    assert again.from_cache and again.says_nothing == verdict.says_nothing
    for got in (price, other_chunks):
        assert got.says_nothing == verdict.says_nothing and got.kld_mean is None and got.chunks_used == 0
        assert not got.refused_by(kv_price.DEFAULT_MAX_KLD) and got.argv == () and "-ctk q8_0" in got.priced_as
    assert json.loads(json.dumps(price.to_dict()))["says_nothing"] == verdict.says_nothing


def test_a_reference_that_predicts_text_is_written_whole_for_the_price_to_read(engine_loc, trained_model, tmp_path,
                                                                               monkeypatch, perplexity_runs):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path))
    verdict = engine_price.reference_says(trained_model, engine_loc, ctx=256, chunks=2)
    assert verdict.says_nothing is None and verdict.complete and verdict.chunks_read == 2
    assert 5.0 < verdict.reference_ppl < 60.0, verdict
    assert perplexity.cached_logits_path(engine_loc, trained_model, ctx=256, chunks=2) is not None
    line = LaunchConfig(model=trained_model, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0,
                        flash_attn=FlashAttn.ON)
    got = engine_price.price_line(line, engine_loc, engine_loc, ctx=256, chunks=2)
    assert len(perplexity_runs) == 2 and "--kl-divergence" in perplexity_runs[1]  # the reference is not written again
    assert got.reference_ppl == verdict.reference_ppl and got.kld_mean is not None and got.chunks_used == 2
    # Asked at another chunk count, the kept read says the model predicts text: its logits are written there now.
    other = engine_price.reference_says(trained_model, engine_loc, ctx=256, chunks=3)
    assert other.says_nothing is None and other.complete and not other.from_cache and len(perplexity_runs) == 3
    assert perplexity.cached_logits_path(engine_loc, trained_model, ctx=256, chunks=3) is not None


@pytest.mark.parametrize("in_the_way", ["quality/logits", "quality"])
def test_reference_logits_that_cannot_be_written_fail_the_price_in_one_line(engine_loc, demo_models, tmp_path,
                                                                            monkeypatch, in_the_way):
    """Issue 66: a file where the reference logits' folder goes (a full disk does the same) ended a 36-75 minute
    auto-tune in a FileExistsError traceback from file_lock's mkdir; it is one QualityError line naming the fix."""
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path))
    blocker = tmp_path / in_the_way
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("in the way")
    line = LaunchConfig(model=demo_models[("qwen3moe", "Q8_0")], engine=IK_LLAMA.name)
    with pytest.raises(QualityError) as exc:
        engine_price.price_line(line, engine_loc, engine_loc, ctx=128, chunks=2, max_kld=kv_price.DEFAULT_MAX_KLD)
    said = str(exc.value)
    assert "\n" not in said and said.startswith(f"the reference logits cannot be written to {store.logits_dir()}")
    assert said.endswith(f"(a file is in the way: {blocker}): remove it, or set MOE_TUNE_CACHE to another folder")
    with pytest.raises(QualityError, match="a file is in the way"):
        engine_price.reference_says(line.model, engine_loc, ctx=128, chunks=2)


def test_a_refused_and_a_passing_line_stop_early_with_the_whole_price_s_verdict(engine_loc, ik_loc, trained_moe,
                                                                                tmp_path, monkeypatch):
    """On the trained SmolLM2 MoE (llama architecture) ik_llama.cpp's line reads ~18 nats (its MoE adds back the
    normalised input: docs/engines.md) and is refused after its first chunk; llama.cpp's q8_0 cache reads ~0.0045
    and passes after about half the chunks (results/benchmarks/early-stop-price.md); each with the verdict its whole
    price gives. The stopped run leaves no process behind (the suite's guard checks after every test)."""
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path))
    floor = kv_price.DEFAULT_MAX_KLD
    ik_line = LaunchConfig(model=trained_moe, engine=IK_LLAMA.name)
    q8 = LaunchConfig(model=trained_moe, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0,
                      flash_attn=FlashAttn.ON)
    for line, loc, verdict, at_most in ((ik_line, ik_loc, "refused", 1), (q8, engine_loc, "passes", 6)):
        whole = engine_price.price_line(line, loc, engine_loc, chunks=8, use_cache=False)
        said: list[str] = []
        early = engine_price.price_line(line, loc, engine_loc, chunks=8, use_cache=False, max_kld=floor,
                                        on_step=said.append)
        assert (whole.chunks_used, whole.stopped) == (8, None)
        assert early.chunks_used is not None and early.chunks_used <= at_most, early
        assert early.stopped is not None and early.stopped.startswith(verdict), early.stopped
        assert early.refused_by(floor) == whole.refused_by(floor) == (verdict == "refused")
        assert f"  stopped: {early.stopped}" in said and f"stopped after {early.chunks_used} of 8" in early.describe()
        argv = list(early.argv)
        assert argv[argv.index("-b") + 1] == "512"  # one chunk a pass: each chunk's row comes as it ends
        assert json.loads(json.dumps(early.to_dict()))["chunks_used"] == early.chunks_used
