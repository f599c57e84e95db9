"""The shared record's gate (tuner/share/record.py): what is read back from a dataset repo is data, checked field
by field; every refusal is one line naming the record."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tuner.core.errors import RecordError
from tuner.share import lookup
from tuner.share.record import MAX_RECORD_BYTES, SCHEMA, SCHEMA_VERSION, read_record

LINE = "llama-server -m demo-Q4_K_M.gguf -c 4096 -np 1"
CANDIDATE = "llama-server -m demo-Q4_K_M.gguf -ctk q8_0 -fa on -c 4096 -np 1 -t 2"


def good() -> dict[str, Any]:
    measured = {"slots": 1, "gen_tok_s": 100.0, "gen_cv_pct": 2.0, "prompt_tok_s": 900.0, "ttft_s": 0.1,
                "loaded_gen_tok_s": 100.0, "end_to_end_gen_tok_s": 80.0, "vram_peak_bytes": None, "spill": "none",
                "kld_mean": None, "failure": None}
    return {
        "schema": SCHEMA, "version": SCHEMA_VERSION, "tool": "moe-tune 0",
        "card": {"name": "NVIDIA GeForce RTX 3060", "vram_total_bytes": 12 * 2**30, "vram_budget_bytes": 11 * 2**30,
                 "driver": None, "pcie_link": None},
        "host": {"ram_total_bytes": 2**35, "physical_cores": 8, "cpu_model": None},
        "engine": {"version": "b1", "commit": "0c1e570", "backend": "cuda", "fa_quants": None},
        "model": {"hub_repo": "o/m-GGUF", "hub_file": "m-Q4_K_M.gguf", "file_name": "m-Q4_K_M.gguf",
                  "quant": "Q4_K_M", "size_bytes": 10, "head_sha256": None, "tail_sha256": None},
        "workload": {"kind": "chat", "prompt_tokens": 512, "gen_tokens": 128, "depth_tokens": 512, "concurrency": 1},
        "lines": [{"label": "default", "round": "selection", "line": LINE, **measured},
                  {"label": "candidate-1", "round": "selection", "line": CANDIDATE, **measured, "gen_tok_s": 120.0}],
        "verdicts": [{"a": "candidate-1", "b": "default", "rounds": 4, "ratio": 1.02, "low": 0.97, "high": 1.08,
                      "noise_pct": 2.0, "outcome": "undecided"}],
        "printed": {"label": "default", "line": LINE, "why": "not shown faster"},
        "speedup_vs_default": None, "speedup_vs_fit": None,
    }


def raw(d: dict[str, Any]) -> bytes:
    return json.dumps(d).encode()


def test_a_good_record_passes_and_unknown_fields_are_dropped():
    d = good()
    d["secret"] = "x"
    d["card"]["serial"] = "1324"
    rec = read_record(raw(d), "abc")
    assert "secret" not in rec.data and "serial" not in rec.data["card"]
    assert rec.printed.ctx == 4096 and rec.engine_commit == "0c1e570"


def hostile(change) -> dict[str, Any]:
    d = copy.deepcopy(good())
    change(d)
    return d


@pytest.mark.parametrize(("change", "why"), [
    (lambda d: d["lines"][1].update(line=CANDIDATE + " --rpc 10.0.0.1:50052"), "--rpc in the pasted command"),
    (lambda d: d["printed"].update(line="llama-server -m m.gguf -ot exps=CPU"), "-ot in the pasted command"),
    (lambda d: d["printed"].update(line="rm -rf ~"), "must start with llama-server"),
    (lambda d: d["card"].update(vram_total_bytes="12GB"), "card.vram_total_bytes must be a int"),
    (lambda d: d["lines"][0].update(gen_tok_s=float("nan")), "lines[0].gen_tok_s must be a num"),
    (lambda d: d.update(lines=[d["lines"][0]] * 40), "lines must be a list of at most 32"),
    (lambda d: d["printed"].update(why="x" * 700), "printed.why must be a str of at most 600"),
    (lambda d: d["model"].pop("file_name"), "model.file_name is missing"),
    (lambda d: d.update(version=SCHEMA_VERSION + 1), "newer than this moe-tune reads"),
    (lambda d: d.update(schema="other"), "not a moe-tune/shared-result record"),
])
def test_hostile_records_are_refused_in_one_line(change, why):
    with pytest.raises(RecordError) as exc:
        read_record(raw(hostile(change)), "bad1")
    assert why in str(exc.value) and "\n" not in str(exc.value)
    assert str(exc.value).startswith("shared record bad1 skipped: ")


def test_oversized_and_non_json_records_are_refused():
    with pytest.raises(RecordError, match="more than the 65,536 a record may hold"):
        read_record(b" " * (MAX_RECORD_BYTES + 1), "big")
    with pytest.raises(RecordError, match="not JSON"):
        read_record(b"{" * 5000, "deep")


def test_lookup_matches_the_card_and_its_vram_siblings_and_counts_agreement():
    recs = [read_record(raw(good()), f"r{i}") for i in range(2)]
    other = hostile(lambda d: d["printed"].update(label="candidate-1", line=CANDIDATE))
    other["card"] |= {"name": "NVIDIA GeForce RTX 4060 Ti", "vram_total_bytes": 16 * 2**30}
    recs.append(read_record(raw(other), "r16"))
    model = lookup.ModelQuery.parse("o/m-GGUF:Q4_K_M")
    on_3060 = lookup.matching(recs, model, lookup.CardQuery.parse("RTX 3060 12GB"))
    assert [m.relation for m in on_3060] == ["same card", "same card"]
    on_4070 = lookup.matching(recs, model, lookup.CardQuery.parse("RTX 4070 12GB"))
    assert [m.relation for m in on_4070] == ["sibling", "sibling"]  # same 12 GiB class, another card
    [group] = lookup.group(on_3060)["0c1e570"]
    assert group.to_dict()["records"] == 2 and group.to_dict()["median_gen_tok_s"] == 100.0
    assert group.to_dict()["verdicts"] == ["candidate-1 vs default: undecided (1.02x, 0.97-1.08 over 4 rounds)"]
    assert lookup.matching(recs, lookup.ModelQuery.parse("o/m-GGUF:Q8_0"), lookup.CardQuery.parse("cpu")) == []
    # A record that printed llama.cpp's own choice proposes its best candidate: the default is a seed anyway.
    [seed] = lookup.proposals(on_3060[:1], "o/shared")
    assert seed.label == "shared-r0" and seed.config.cache_type_k.value == "q8_0" and "best candidate" in seed.origin
