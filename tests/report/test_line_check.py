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
# A 12 GiB card that drives the desktop: 1,500 MiB held by the display server, compositor and a browser (DESIGN.md
# section 12: a few hundred MiB each), so 10,788 MiB free; the budget leaves llama.cpp's 1,024 MiB margin of that
# (rounded down), and the tuned line fills it: its server grew the card's use by 9,500 MiB, a peak of 11,000.
DESKTOP_MIB = 1500
GPU_HW = {"describe": "a 3060", "gpu": CARD, "has_gpu": True, "vram_total_bytes": 12288 * MIB,
          "vram_budget_bytes": 9700 * MIB}
FREE_BESIDE_DESKTOP_MIB = 12288 - DESKTOP_MIB


def measurement(label: str, model: Path, vram_peak_mib: int | None,
                baseline_mib: int | None = DESKTOP_MIB) -> ServerMeasurement:
    """An arm as the finish records it: the card's peak use (the desktop's share included) and, where the result
    keeps it, the growth over the sampler's first look (None: a result written before it was kept)."""
    growth = None if vram_peak_mib is None or baseline_mib is None else (vram_peak_mib - baseline_mib) * MIB
    return ServerMeasurement(label=label, config={"model": str(model)}, launch_line="", argv=[], gen_tok_s=10.0,
                             gen_samples_tok_s=[10.0], gen_cv_pct=None, prompt_tok_s=None, ttft_s=None,
                             aggregate_gen_tok_s=None,
                             vram_peak_bytes=None if vram_peak_mib is None else vram_peak_mib * MIB,
                             vram_growth_bytes=growth)


def found(tmp_path: Path, *, model: Path | None = None, hw: dict | None = None, engine: dict | None = None,
          peak_mib: int | None = 11000, baseline_mib: int | None = DESKTOP_MIB, name: str = "study"
          ) -> line_check.Found:
    model = model or tmp_path / "m.gguf"
    if not model.exists():
        model.write_bytes(b"GGUF")
        os.utime(model, (1_000_000, 1_000_000))  # well before the result
    arm = measurement("default", model, peak_mib, baseline_mib)
    res = StudyResult(study=name, model=str(model), finish=Finish((), (arm,)),
                      hardware=GPU_HW if hw is None else hw, engine=ENGINE if engine is None else engine)
    return line_check.found_at(write_result(res, tmp_path / "results" / name))


def now(free_mib: int, gpu: str = CARD, commit: str = "abc1234", backend: str = "cuda") -> line_check.Now:
    return line_check.Now(commit, backend, gpu, free_mib * MIB)


def judge(f: line_check.Found, n: line_check.Now) -> line_check.LineCheck:
    return line_check.check(f, {"model": f.result.model}, "default", n)


def test_a_line_that_fills_the_budget_beside_a_desktop_holds_while_the_desktop_is_as_it_was(tmp_path):
    """Free VRAM leaves the desktop out; the card's peak counts it in. The line is held to its own 9,500 MiB."""
    c = judge(found(tmp_path), now(FREE_BESIDE_DESKTOP_MIB))
    assert c.holds and c.notes == (), c.changes
    assert any("records no fingerprint" in u for u in c.unchecked)  # said, not hidden


def test_another_program_holding_vram_since_the_tune_is_named(tmp_path):
    c = judge(found(tmp_path), now(FREE_BESIDE_DESKTOP_MIB - 2000))  # a second app took 2,000 MiB
    assert not c.holds
    assert c.changes == ("8,788 MiB of VRAM is free now, the line itself took 9,500 MiB when measured (tuned with a "
                         "budget of 9,700 MiB): close what holds VRAM",)


def test_less_than_the_budget_but_room_for_the_line_is_a_note(tmp_path):
    c = judge(found(tmp_path), now(9600))
    assert c.holds and c.notes == ("9,600 MiB of VRAM is free now, below the budget it was tuned for (9,700 MiB); "
                                   "the line itself took 9,500 MiB, which fits",)


def test_without_the_lines_own_vram_the_budget_decides_and_says_so(tmp_path):
    assert not judge(found(tmp_path, peak_mib=None), now(7000)).holds
    assert judge(found(tmp_path, peak_mib=None, name="b"), now(9700)).holds
    older = found(tmp_path, baseline_mib=None, name="older")  # the card's peak only: not the line's own
    assert judge(older, now(FREE_BESIDE_DESKTOP_MIB)).holds
    assert not judge(older, now(9000)).holds
    assert any("records only the card's whole use" in u for u in judge(older, now(9000)).unchecked)


@pytest.mark.parametrize(("n", "words"), [
    (now(11000, gpu="NVIDIA GeForce RTX 4090"), "the card is NVIDIA GeForce RTX 4090 now; the line was measured on "
                                                f"{CARD}"),
    (now(0, gpu=""), f"the line was measured on {CARD}; no NVIDIA GPU is visible now"),
    (now(11000, commit="def5678"), "the engine is llama.cpp def5678 (cuda) now; the line was measured on llama.cpp "
                                   "abc1234 (cuda)"),
    (now(11000, backend="vulkan"), "the engine is llama.cpp abc1234 (vulkan) now"),
    (now(11000, commit="unknown"), "the engine is llama.cpp of unknown commit (cuda) now; the line was measured on "
                                   "llama.cpp abc1234 (cuda)"),
])
def test_another_card_or_engine_is_named(tmp_path, n, words):
    c = judge(found(tmp_path), n)
    assert not c.holds and words in c.changes[0]


def test_a_build_without_a_commit_cannot_be_tied_to_the_line_and_says_so(tmp_path):
    """Two builds that both report no commit may be any two builds: not a change, not checked either."""
    c = judge(found(tmp_path, engine={"commit": "unknown", "backend": "cuda"}), now(11000, commit="unknown"))
    assert c.holds and ("the engine: llama.cpp of unknown commit reports no commit, so the line cannot be tied to "
                        "the build it was measured on") in c.unchecked


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
