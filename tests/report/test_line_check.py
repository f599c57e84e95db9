"""Whether a result's line still holds here: engine, card, free VRAM against the tuned budget and the measured
peak, and the model file against the time the result was written; which result `serve` picks for a model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fakes import FakeNVML
from tuner.core.errors import UsageError
from tuner.engine import build
from tuner.report import line_check
from tuner.search.finish import Finish, ServerMeasurement
from tuner.search.result import StudyResult, write_result

MIB = 2**20
CARD = "NVIDIA GeForce RTX 3060"
ENGINE = {"commit": "abc1234", "version": "x", "backend": "cuda"}
GPU_HW = {"describe": "a 3060", "gpu": CARD, "has_gpu": True, "vram_total_bytes": 12288 * MIB,
          "vram_budget_bytes": 10000 * MIB}


def measurement(label: str, model: Path, vram_peak_mib: int | None) -> ServerMeasurement:
    return ServerMeasurement(label=label, config={"model": str(model)}, launch_line="", argv=[], gen_tok_s=10.0,
                             gen_samples_tok_s=[10.0], gen_cv_pct=None, prompt_tok_s=None, ttft_s=None,
                             aggregate_gen_tok_s=None,
                             vram_peak_bytes=None if vram_peak_mib is None else vram_peak_mib * MIB)


def found(tmp_path: Path, *, model: Path | None = None, hw: dict | None = None, engine: dict | None = None,
          peak_mib: int | None = 6000, name: str = "study") -> line_check.Found:
    model = model or tmp_path / "m.gguf"
    if not model.exists():
        model.write_bytes(b"GGUF")
        os.utime(model, (1_000_000, 1_000_000))  # well before the result
    res = StudyResult(study=name, model=str(model), finish=Finish((), (measurement("default", model, peak_mib),)),
                      hardware=GPU_HW if hw is None else hw, engine=ENGINE if engine is None else engine)
    return line_check.found_at(write_result(res, tmp_path / "results" / name))


def now(free_mib: int, gpu: str = CARD, commit: str = "abc1234", backend: str = "cuda") -> line_check.Now:
    return line_check.Now(commit, backend, gpu, free_mib * MIB)


def judge(f: line_check.Found, n: line_check.Now) -> line_check.LineCheck:
    return line_check.check(f, {"model": f.result.model}, "default", n)


def test_a_line_on_the_same_engine_card_and_model_holds(tmp_path):
    c = judge(found(tmp_path), now(11000))
    assert c.holds and c.notes == ()
    assert any("records no fingerprint" in u for u in c.unchecked)  # said, not hidden


def test_too_little_vram_for_the_measured_peak_is_named(tmp_path):
    c = judge(found(tmp_path), now(5000))
    assert not c.holds
    assert c.changes == ("5,000 MiB of VRAM is free now, the line measured a peak of 6,000 MiB (tuned with a budget "
                         "of 10,000 MiB): close what holds VRAM",)


def test_less_than_the_budget_but_room_for_the_peak_is_a_note(tmp_path):
    c = judge(found(tmp_path), now(7000))
    assert c.holds and "below the budget it was tuned for (10,000 MiB)" in c.notes[0]


def test_without_a_measured_peak_the_budget_decides(tmp_path):
    assert not judge(found(tmp_path, peak_mib=None), now(7000)).holds
    assert judge(found(tmp_path, peak_mib=None, name="b"), now(10000)).holds


@pytest.mark.parametrize(("n", "words"), [
    (now(11000, gpu="NVIDIA GeForce RTX 4090"), "the card is NVIDIA GeForce RTX 4090 now; the line was measured on "
                                                f"{CARD}"),
    (now(0, gpu=""), f"the line was measured on {CARD}; no NVIDIA GPU is visible now"),
    (now(11000, commit="def5678"), "the engine is llama.cpp def5678 (cuda) now; the line was measured on llama.cpp "
                                   "abc1234 (cuda)"),
    (now(11000, backend="vulkan"), "the engine is llama.cpp abc1234 (vulkan) now"),
])
def test_another_card_or_engine_is_named(tmp_path, n, words):
    c = judge(found(tmp_path), n)
    assert not c.holds and words in c.changes[0]


def test_a_cpu_line_on_a_machine_that_now_offloads_is_named(tmp_path):
    cpu = {"describe": "CPU only", "gpu": "", "has_gpu": False, "vram_budget_bytes": 0}
    f = found(tmp_path, hw=cpu, engine={"commit": "abc1234", "backend": "cuda"})  # the card was hidden then
    assert "measured without a GPU; NVIDIA GeForce RTX 3060 is visible now" in judge(f, now(11000)).changes[0]
    assert line_check.check(f, {"model": f.result.model, "device": "none"}, "default", now(11000)).holds
    on_cpu_build = found(tmp_path, hw=cpu, engine={"commit": "abc1234", "backend": "cpu"}, name="cpu")
    assert judge(on_cpu_build, now(11000, backend="cpu")).holds  # a CPU build cannot offload


def test_a_model_file_changed_after_the_tune_is_named(tmp_path):
    f = found(tmp_path)
    model = Path(f.result.model or "")
    os.utime(model, (f.written_s + 60, f.written_s + 60))
    c = judge(f, now(11000))
    assert not c.holds and c.changes[0].startswith(f"the model file {model} was modified at ")
    model.unlink()
    assert judge(f, now(11000)).changes == (f"the model file {model} is gone",)


def test_the_probe_reads_the_engine_and_the_card(engine_loc):
    card = FakeNVML([(CARD, 12288 * MIB, 3288 * MIB)])  # (name, total, used)
    n = line_check.probe_now(engine_loc, card)
    caps = build.capabilities(engine_loc)
    assert n == line_check.Now(caps.commit, caps.backend, CARD, 9000 * MIB)
    assert line_check.probe_now(engine_loc, FakeNVML([])).gpu_name == ""


def test_the_newest_result_for_a_model_is_picked(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    old = found(tmp_path, model=a, name="a-old")
    os.utime(old.file, (2_000_000, 2_000_000))
    new = found(tmp_path, model=a, name="a-new")
    other = found(tmp_path, model=b, name="b")
    results = tmp_path / "results"
    assert line_check.latest(results, a).file == new.file
    assert line_check.latest(results, b).file == other.file
    assert [f.file for f in line_check.find_results(results)][-1] == old.file
    with pytest.raises(UsageError, match=r"no tuned result for .*c\.gguf.*moe-tune auto-tune"):
        line_check.latest(results, tmp_path / "c.gguf")
    (results / "broken").mkdir()
    (results / "broken" / "result.json").write_text("{")
    assert len(line_check.find_results(results)) == 3  # an unreadable result is left out, not fatal


def test_the_model_file_is_checked_by_its_contents_when_the_result_has_its_fingerprint(tmp_path):
    """A result records the tuned file's size and sampled hashes: an identical copy with a newer modification time
    (re-downloaded, copied) holds, with a note; a different file of the same size and an older time is named (the
    modification time alone let it pass)."""
    import dataclasses

    from tuner.models import fingerprint

    model = tmp_path / "m.gguf"
    data = bytearray(os.urandom(10 * MIB))
    model.write_bytes(data)
    os.utime(model, (1_000_000, 1_000_000))
    f = found(tmp_path, model=model)
    f = dataclasses.replace(f, result=dataclasses.replace(f.result, model_fingerprint=fingerprint.fingerprint(model)))
    assert judge(f, now(11000)).unchecked == ()
    later = f.written_s + 120
    os.utime(model, (later, later))  # the same bytes, written again
    c = judge(f, now(11000))
    assert c.holds and "its contents are the tuned file's" in c.notes[0]
    for offset, words in ((100, "its header (or first tensors) differs"),
                          (len(data) - 100, "its last tensor data differs")):
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        model.write_bytes(changed)
        os.utime(model, (1_000_000, 1_000_000))  # older than the result: the time alone says nothing changed
        c = judge(f, now(11000))
        assert not c.holds and c.changes == (f"the model file {model} is not the file that was tuned: {words}"
                                             " from the tuned file's",)
    model.write_bytes(data[:-1])
    c = judge(f, now(11000))
    assert c.changes == (f"the model file {model} is not the file that was tuned: its size is {len(data) - 1:,} "
                         f"bytes, the tuned file's was {len(data):,}",)
