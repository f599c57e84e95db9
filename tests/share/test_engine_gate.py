"""A second engine in the pool (issue 62): a shared ik_llama.cpp line carries only the levers moe-tune's search
measures (tuner/engine/kinds.py ``measured_levers``, tuner/search/engine_axes.py), nothing only another engine
reads, and the speed ceiling comes from the card, the looked-up model and the workload, never from a record's own
size (tuner/share/gate.py, physics.py, pool.py, lookup.py). Every record read is kept or counted."""

from __future__ import annotations

import json
import math
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli
from tests.hub_server import HubServer
from tests.share.test_gate import LINE, RID, good, raw
from tests.share.test_lookup import BOUND, MODEL, rec
from tests.share.test_pool import REPO, A, agreeing, data, env_for, line, pooled, record
from tuner.core.config import LaunchConfig
from tuner.core.errors import RecordError
from tuner.engine import flags
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP
from tuner.machine.hardware import Hardware
from tuner.models.gguf_reader import inspect_model
from tuner.search.engine_axes import engine_axes
from tuner.share import lookup, physics
from tuner.share.gate import OTHER_ENGINE, UNMEASURED, read_record
from tuner.share.match import CardQuery, matching
from tuner.share.refusals import Refusals

IK = {"engine": IK_LLAMA.name, "commit": "ik-llama-cpp-python-0.1.5", "backend": "cpu"}
IK_LABEL = f"{IK_LLAMA.name} ik-llama-cpp-python-0.1.5"
_DEFAULTS = {f.name: f.default for f in fields(LaunchConfig)}


def messages(stderr: str) -> list[str]:
    """The CLI's warnings, each whole (the CLI wraps a long one, its further lines indented)."""
    out: list[str] = []
    for ln in stderr.splitlines():
        if ln.startswith("    ") and out:
            out[-1] += " " + ln.strip()
        else:
            out.append(ln)
    return out


def ik_record(printed: str, **model: Any) -> dict[str, Any]:
    d = good(line=printed)
    d["engine"] |= IK
    d["lines"][1]["line"] = LINE  # ik's default launch
    d["model"] |= model
    return d


def lever_on(name: str) -> Any:
    """A value of an ik lever that is not its default."""
    return {"attn_max_batch": 64, "smart_experts": (1, math.inf)}.get(name, not _DEFAULTS[name])


def ik_line(name: str) -> str:
    cfg = replace(LaunchConfig(model=Path("m-Q4_K_M.gguf"), ctx=4096, parallel=1, engine=IK_LLAMA.name),
                  **{name: lever_on(name)})
    return flags.launch_line(cfg)


@pytest.mark.parametrize("name", IK_LLAMA.levers)
def test_an_ik_line_keeps_the_levers_its_search_measures_and_no_other(name):
    text = ik_line(name)
    if IK_LLAMA.measures(name):
        assert read_record(raw(ik_record(text)), RID).data["printed"]["line"] == text
        return
    with pytest.raises(RecordError) as refused:
        read_record(raw(ik_record(text)), RID)
    assert refused.value.reason == UNMEASURED
    assert f"a line sets {text.split(LINE + ' ', 1)[1]}, which moe-tune never measures on ik_llama.cpp" in str(
        refused.value) and "\n" not in str(refused.value)


def test_the_levers_the_gate_accepts_are_the_axes_ik_s_search_has(model):
    info = inspect_model(model)  # a qwen3moe shape: experts, so every MoE lever applies
    gpu = Hardware(gpu_name="RTX 3060", vram_total_bytes=12 << 30, vram_free_bytes=11 << 30,
                   gpu_bandwidth_bytes_s=360e9, pcie_bandwidth_bytes_s=16e9, ram_total_bytes=64 << 30,
                   ram_available_bytes=60 << 30, swap_total_bytes=0, host_bandwidth_bytes_s=50e9, physical_cores=8,
                   source="fake")
    axes, [note] = engine_axes(IK_LLAMA, info, gpu, None, host_experts=True)
    assert [name for name, _ in axes] == list(IK_LLAMA.measured_levers) == [
        "run_time_repack", "fused_moe", "merge_up_gate", "only_active_experts"]
    assert set(IK_LLAMA.levers) - set(IK_LLAMA.measured_levers) == {"attn_max_batch", "graph_reuse", "smart_experts"}
    assert "left at their defaults: -amb" in note
    assert engine_axes(LLAMA_CPP, info, gpu, None, host_experts=True) == ((), ())


def test_a_flag_only_the_other_engine_reads_is_refused_both_ways():
    with pytest.raises(RecordError) as ik_with_llama:
        read_record(raw(ik_record(LINE + " --no-repack")), RID)
    assert ik_with_llama.value.reason == OTHER_ENGINE
    assert str(ik_with_llama.value).endswith("a line for ik_llama.cpp: ik_llama.cpp does not read --no-repack: it is "
                                             "llama.cpp's")
    with pytest.raises(RecordError) as llama_with_ik:
        read_record(raw(good(line=LINE + " -ser 1,inf")), RID)
    assert llama_with_ik.value.reason == OTHER_ENGINE
    assert str(llama_with_ik.value).endswith("a line for llama.cpp sets -ser 1,inf, which only ik_llama.cpp reads")


def test_a_record_of_an_empty_model_is_refused():
    with pytest.raises(RecordError, match="model.size_bytes is 0: a model file holds at least its header") as got:
        read_record(raw(ik_record(LINE, size_bytes=0)), RID)
    assert got.value.reason == "absurd figures"


def test_the_ceiling_never_reads_a_records_own_size():
    [small, huge] = matching([_sized(1, 1e9), _sized(10**15, 1e9)], MODEL, CardQuery.parse("RTX 3060 12GB"))
    # The model's header bounds both the same way, whatever each says of itself.
    assert physics.refused(small, BOUND) == physics.refused(huge, BOUND) is not None
    assert physics.unbounded(small, BOUND) is None
    # No header, no listing: nothing bounds them; neither is refused nor bounded by its claim, and no figure shows.
    unknown = physics.ModelBound(unknown="the Hub did not answer")
    assert physics.refused(small, unknown) is None and physics.refused(huge, unknown) is None
    assert physics.unbounded(huge, unknown) == "the model could not be read (the Hub did not answer)"
    [g] = lookup.group([small, huge], unbounded={small.record.record_id, huge.record.record_id})["0c1e570"]
    assert g.to_dict()["median_gen_tok_s"] is None and g.to_dict()["records"] == 2
    # A card whose bandwidth is not known bounds nothing either.
    blind = replace(small, bandwidth_bytes_s=0.0)
    assert physics.refused(blind, BOUND) is None
    assert physics.unbounded(blind, BOUND) == "the memory bandwidth of NVIDIA GeForce RTX 3060 is not known"


def _sized(size_bytes: int, gen: float):
    r = rec(size_bytes % 2**16, A, gen=gen)
    d = dict(r.data) | {"model": r.data["model"] | {"size_bytes": size_bytes}}
    return read_record(json.dumps(d).encode(), f"{size_bytes % 2**16:016x}")


def test_a_record_passed_over_is_counted_without_a_line():
    r = Refusals()
    r.pass_over("for another model or card")
    r.pass_over("for another model or card")
    assert (r.count, r.first, r.unread) == (2, [], 0)
    assert r.lines() == ("2 shared records skipped in all (2 for another model or card)",)


def test_lookup_over_ik_records_offers_only_measured_lines_and_counts_every_record_read(model, tmp_path):
    """The issue's attack: ik records whose lines carry -ser (drops experts) and -amb (never searched), one that
    claims a model of 0 bytes, one with a flag only llama.cpp reads; none is offered, each is one line, and every
    record read is kept or counted."""
    def ik(printed: str, **model_fields: Any) -> dict[str, Any]:
        d = record(model, A, printed=printed, engine=good()["engine"] | IK)
        d["model"] |= model_fields
        return d

    rtr = line(model, " --run-time-repack")
    by = {"alice": {"records/0000000000000001.json": data(ik(rtr)),
                    "records/0000000000000002.json": data(ik(line(model, " -ser 1,inf")))},
          "bob": {"records/0000000000000003.json": data(ik(rtr)),
                  "records/0000000000000004.json": data(ik(line(model, " -amb 64")))},
          "eve": {"records/0000000000000005.json": data(ik(rtr, size_bytes=0)),
                  "records/0000000000000006.json": data(ik(line(model, " --no-repack"))),
                  "records/0000000000000007.json": data(ik(rtr, head_sha256="0" * 64))}}  # another model's
    with HubServer() as hub:
        pooled(hub, REPO, by)
        env = env_for(hub, tmp_path)
        text = run_cli("lookup", str(model), "--gpu", "RTX 3060 12GB", "--repo", REPO, env=env)
        as_json = json.loads(run_cli("lookup", str(model), "--gpu", "RTX 3060 12GB", "--repo", REPO, "--json",
                                     env=env).stdout)
    assert text.returncode == 0 and "Traceback" not in text.stderr, text.stderr
    # Offered: the one measured line, two accounts behind it; none of -ser, -amb, --no-repack anywhere on stdout.
    assert agreeing(text.stdout) == [("2 accounts agree", rtr)]
    assert not {"-ser", "-amb", "--no-repack"} & set(text.stdout.split())
    [group] = as_json["by_engine_commit"][IK_LABEL]
    assert group["record_ids"] == ["0000000000000001", "0000000000000003"]
    # Each refusal one line, escaped and whole; then one line of counts (the other model's record among them).
    warnings = messages(text.stderr)
    assert len(warnings) == 5 and all(w.startswith("warning: shared record ") for w in warnings[:4]), warnings
    assert any(w.startswith("warning: shared record 0000000000000002 skipped: a line sets -ser 1,inf, which moe-tune "
                            "never measures on ik_llama.cpp") for w in warnings)
    assert any(w.startswith("warning: shared record 0000000000000004 skipped: a line sets -amb 64, which moe-tune "
                            "never measures on ik_llama.cpp") for w in warnings)
    assert any(w.startswith("warning: shared record 0000000000000005 skipped: model.size_bytes is 0") for w in warnings)
    assert "warning: shared record 0000000000000006 skipped: a line for ik_llama.cpp: ik_llama.cpp does not read " \
           "--no-repack: it is llama.cpp's" in warnings
    assert warnings[-1] == ("warning: 5 shared records skipped in all (2 unmeasured lever, 1 absurd figures, 1 for "
                            "another model or card, 1 other engine's flag); the first 4 are above")
    assert as_json["refused"] == {"unmeasured lever": 2, "absurd figures": 1, "other engine's flag": 1,
                                  "for another model or card": 1}
    # Read = kept + every refusal: nothing dropped uncounted.
    assert as_json["records_read"] == 7 == as_json["records_kept"] + sum(as_json["refused"].values())
    assert as_json["records_kept"] == 2
