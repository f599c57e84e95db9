"""Matching, agreement and the physics bound of a look-up (tuner/share/match.py, lookup.py, physics.py, seeds.py):
cards the catalog knows, Hub accounts counted once (a record's own sharer id never), figures bounded by the roofline
of the model on the card and nothing a record says."""

from __future__ import annotations

import json

import pytest

from tests.share.test_gate import CANDIDATE, LINE, good, raw
from tuner.models import shape_model
from tuner.models.gguf_reader import inspect_model
from tuner.share import lookup, physics, seeds
from tuner.share.gate import read_record
from tuner.share.match import CardQuery, ModelQuery, matching

# Published: Qwen3-30B-A3B Q4_K_M generates at most ~490 tok/s on an RTX 3090's 936 GB/s with every weight on
# the card (DESIGN.md §6), so a token reads about 936e9 / 490 = 1.91 GB.
QWEN3_30B_BYTES_PER_TOKEN = 936e9 / 490
SHARER_A, SHARER_B, SHARER_C = "a" * 16, "b" * 16, "c" * 16


def rec(i: int, sharer: str, *, line: str = LINE, card: str = "NVIDIA GeForce RTX 3060", vram_gib: int = 12,
        gen: float = 100.0):
    d = good(sharer, line)
    d["card"] |= {"name": card, "vram_total_bytes": vram_gib * 2**30}
    d["lines"][0]["gen_tok_s"] = gen
    if line != LINE:
        d["printed"]["label"], d["lines"][1]["line"], d["lines"][1]["gen_tok_s"] = "candidate-1", line, gen
    return read_record(raw(d), f"{i:016x}")


MODEL = ModelQuery.parse("o/m-GGUF:Q4_K_M")
BOUND = physics.ModelBound(exact_bytes=QWEN3_30B_BYTES_PER_TOKEN, exact_quant="Q4_K_M")


def test_a_card_is_a_sibling_only_when_the_catalog_knows_it():
    recs = [rec(0, SHARER_A), rec(1, SHARER_B, card="NVIDIA GeForce RTX 4070", vram_gib=12),
            rec(2, SHARER_C, card="Totally Real GPU 12GB", vram_gib=12),
            rec(3, SHARER_C, card="NVIDIA GeForce RTX 3060", vram_gib=24),  # no 24 GB 3060 exists
            rec(4, SHARER_C, card="NVIDIA GeForce RTX 4060 Ti", vram_gib=16)]
    on_3060 = matching(recs, MODEL, CardQuery.parse("RTX 3060 12GB"))
    assert [(m.record.record_id[-1], m.relation, m.bandwidth_bytes_s) for m in on_3060] == [
        ("0", "same card", 360e9), ("1", "sibling", 504e9)]  # the catalog's bandwidths (cards.json)
    assert matching(recs, ModelQuery.parse("o/m-GGUF:Q8_0"), CardQuery.parse("RTX 3060 12GB")) == []
    assert matching(recs, MODEL, CardQuery.parse("cpu")) == []


def test_agreement_counts_accounts_not_files_nor_sharer_ids_and_a_single_accounts_line_comes_last():
    # alice: fifty copies of the candidate under fifty made-up sharer ids, and two of the default; bob: one default.
    recs = [rec(i, f"{i:016x}", line=CANDIDATE, gen=150.0) for i in range(50)]
    recs += [rec(100, SHARER_A, gen=90.0), rec(101, SHARER_B, gen=92.0), rec(102, SHARER_C, gen=110.0)]
    who = {r.record_id: "alice" for r in recs} | {recs[-1].record_id: "bob"}
    matched = matching(recs, MODEL, CardQuery.parse("RTX 3060 12GB"), who)
    [confirmed, single] = lookup.group(matched)["0c1e570"]
    c, s = confirmed.to_dict(), single.to_dict()
    assert (c["line"], c["accounts"], c["records"], c["single_account"]) == (LINE, 2, 3, False)
    assert c["account_names"] == ["alice", "bob"] and c["sharer_ids"] == [SHARER_A, SHARER_B, SHARER_C]
    # Each account's median (91 for alice's two records, 110 for bob), then the median of those.
    assert c["median_gen_tok_s"] == pytest.approx((91.0 + 110.0) / 2)
    assert (s["line"], s["accounts"], s["records"], s["single_account"]) == (CANDIDATE, 1, 50, True)
    assert lookup.agreement(s["accounts"], s["unverified"]) == "1 account (unconfirmed)"
    # Seeds: distinct lines by accounts. The records printing the default propose their best candidate, the line
    # the fifty copies print: one seed, two accounts.
    [seed] = seeds.proposals(matched, "o/pool")
    assert seed.config.cache_type_k.value == "q8_0" and seed.origin.endswith("chat workload; 2 accounts agree")


def test_records_whose_uploader_is_unknown_count_together_as_one_unverified_account():
    recs = [rec(i, f"{i:016x}") for i in range(5)] + [rec(9, SHARER_A)]
    matched = matching(recs, MODEL, CardQuery.parse("RTX 3060 12GB"), {recs[-1].record_id: "alice"})
    [g] = lookup.group(matched)["0c1e570"]
    d = g.to_dict()
    assert (d["accounts"], d["unverified"], d["account_names"]) == (2, True, ["alice"])
    assert lookup.agreement(d["accounts"], d["unverified"]) == "2 accounts agree (1 of them unverified)"
    [alone] = lookup.group(matched[:5])["0c1e570"]
    assert lookup.agreement(alone.n_accounts, True) == "1 unverified account (unconfirmed)"


def test_a_record_printing_a_baseline_proposes_its_best_candidate():
    [seed] = seeds.proposals(matching([rec(7, SHARER_A)], MODEL, CardQuery.parse("RTX 3060 12GB")), "o/shared")
    assert seed.label == "shared-0000000000000007" and seed.config.cache_type_k.value == "q8_0"
    assert seed.origin.startswith("best candidate (it printed default) of shared record 0000000000000007 in o/shared")
    assert seed.origin.endswith("1 unverified account (unconfirmed)")


def test_figures_above_the_roofline_of_the_model_on_the_card_are_refused():
    ceiling_3060 = physics.MARGIN * 360e9 / QWEN3_30B_BYTES_PER_TOKEN  # 207 tok/s
    recs = [rec(0, SHARER_A, gen=120.0), rec(1, SHARER_B, gen=1e9),
            rec(2, SHARER_C, gen=250.0),  # above a 3060's ceiling, below a 4070's (504 GB/s: 290 tok/s)
            rec(3, SHARER_C, gen=250.0, card="NVIDIA GeForce RTX 4070")]
    matched = matching(recs, MODEL, CardQuery.parse("RTX 3060 12GB"))
    why = {m.record.record_id[-1]: physics.refused(m, BOUND) for m in matched}
    assert why["0"] is None and why["3"] is None
    assert why["1"] is not None and why["1"].startswith("default claims gen_tok_s 1e+09, above the 207.3 tok/s")
    assert f"{ceiling_3060:,.4g}" == "207.3" and "250" in (why["2"] or "")
    # Another quant of the repo: its listed size times the active share; a quant the repo does not have: refused.
    loose = physics.ModelBound(share=8 / 128, quant_sizes={"Q4_K_M": 18_556_685_088})
    assert physics.refused(matched[0], loose) is None
    assert physics.refused(matched[1], loose) is not None
    other = physics.ModelBound(share=8 / 128, quant_sizes={"Q8_0": 32 * 2**30})
    assert physics.refused(matched[0], other) == "quant Q4_K_M is not in the model's repo"


def test_the_least_bytes_a_token_reads_match_the_published_ceiling(tmp_path):
    made = shape_model.write_catalog_model("qwen3-30b-a3b:Q4_K_M", tmp_path / "qwen3-30b-a3b-Q4_K_M.gguf")
    info = inspect_model(made.path)
    assert physics.bytes_per_token(info) == pytest.approx(QWEN3_30B_BYTES_PER_TOKEN, rel=0.1)
    assert physics.active_share(info) == 8 / 128


def test_json_of_a_group_holds_only_escaped_text():
    d = good(SHARER_A)
    d["printed"]["why"] = "faster [link=https://evil.example]click[/link]"
    d["card"]["name"] = "NVIDIA GeForce RTX 3060"
    r = read_record(raw(d), "00000000000000aa")
    [g] = lookup.group(matching([r], MODEL, CardQuery.parse("RTX 3060 12GB")))["0c1e570"]
    text = json.dumps(g.to_dict())
    assert "\\u001b" not in text and g.to_dict()["why"] == ["faster [link=https://evil.example]click[/link]"]


def test_seeds_are_few_the_lines_more_accounts_agree_on_come_first_and_labels_are_unique():
    confirmed = LINE + " -ub 512"
    singles = [f"{LINE} -t {t}" for t in range(1, 6)]  # sort before it by text, one account each
    recs = [rec(i, f"{i:016x}", line=s) for i, s in enumerate(singles)]
    recs += [rec(10, SHARER_A, line=confirmed), rec(11, SHARER_B, line=confirmed)]
    who = {r.record_id: f"user{i}" for i, r in enumerate(recs)}
    props = seeds.proposals(matching(recs, MODEL, CardQuery.parse("RTX 3060 12GB"), who), "o/pool")
    assert len(props) == seeds.MAX_SEEDS == 4
    assert props[0].config.ubatch == 512 and props[0].origin.endswith("2 accounts agree")
    assert [p.config.threads for p in props[1:]] == [1, 2, 3]
    # Record ids that share their first 8 hex digits (issue 57: four seeds were all shared-00000000).
    assert [p.label for p in props] == ["shared-000000000000000a", "shared-0000000000000000",
                                        "shared-0000000000000001", "shared-0000000000000002"]
