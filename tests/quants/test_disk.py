"""The disk ledger of compare-quants on real files: every part counted, reservations before a byte is fetched,
an over-budget quant refused before any kept file is deleted, the largest dropped first otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.core.errors import OverBudgetError
from tuner.quants import disk as quant_disk
from tuner.quants.disk import DiskLedger, Need

MiB = 2**20
RESERVE = quant_disk.WORK_RESERVE_BYTES


def _file(path: Path, mib: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * round(mib * MiB))
    return path


def _dropper(paths: tuple[Path, ...], log: list[str], name: str):
    def drop() -> None:
        log.append(name)
        quant_disk.drop_files(paths)
    return drop


def test_every_shard_of_a_split_file_outside_the_folder_is_counted(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    shards = tuple(_file(tmp_path / "hf" / f"M-F16-0000{i}-of-00003.gguf", 2) for i in (1, 2, 3))
    ledger = DiskLedger(out, None)
    ledger.keep("the reference F16", shards)
    assert ledger.used_bytes() == 6 * MiB  # all three shards, not the first alone
    ledger.reserve("the reference logits", 3 * MiB)
    assert ledger.used_bytes() == 9 * MiB
    ledger.keep("the reference logits", (_file(tmp_path / "cache" / "x.logits", 1),))  # the reservation ends
    assert ledger.used_bytes() == 7 * MiB


def test_an_over_budget_quant_is_refused_before_any_kept_file_is_deleted(tmp_path):
    out = tmp_path / "out"
    dropped: list[str] = []
    ledger = DiskLedger(out, 30 * MiB + RESERVE)
    ledger.reserve("the reference logits", 4 * MiB)
    small = (_file(out / "quants" / "Q2_K.gguf", 5),)
    winner = (_file(out / "quants" / "Q4_K_M.gguf", 8),)
    ledger.keep("Q2_K", small, _dropper(small, dropped, "Q2_K"))
    ledger.keep("Q4_K_M", winner, _dropper(winner, dropped, "Q4_K_M"))
    # 4 (logits) + 8 (the winner) cannot be dropped: 19 more does not fit 30 even with Q2_K gone.
    with pytest.raises(OverBudgetError) as exc:
        ledger.make_room(Need((("the quant Q8_0", 15 * MiB), ("its KV-pricing logits", 4 * MiB))), {"Q4_K_M"}, "Q8_0")
    assert dropped == [] and small[0].is_file() and winner[0].is_file()
    msg = str(exc.value)
    assert "\n" not in msg and "Q8_0 needs 0.019 GiB (the quant Q8_0 0.015 GiB, its KV-pricing logits 0.004 GiB)" in msg
    assert "keeps 0.012 GiB it cannot drop (Q4_K_M 0.008 GiB, the reference logits 0.004 GiB)" in msg
    assert msg.endswith("raise --disk-budget to at least 0.034")  # (12 + 19 + 4 MiB reserve) / 1024
    # 18 fits once Q2_K is gone (4 + 8 + 18 = 30): it is dropped, its file deleted, the winner kept.
    assert ledger.make_room(Need((("the quant Q6_K", 14 * MiB), ("its KV-pricing logits", 4 * MiB))), {"Q4_K_M"},
                            "Q6_K") == ["Q2_K"]
    assert dropped == ["Q2_K"] and not small[0].exists() and winner[0].is_file()
    assert ledger.used_bytes() == 12 * MiB


def test_make_room_drops_the_largest_first_and_only_as_many_as_needed(tmp_path):
    out = tmp_path / "out"
    dropped: list[str] = []
    ledger = DiskLedger(out, 24 * MiB + RESERVE)
    for name, mib in (("A", 4), ("B", 9), ("C", 6)):
        paths = (_file(tmp_path / "hf" / f"{name}.gguf", mib),)
        ledger.keep(name, paths, _dropper(paths, dropped, name))
    assert ledger.used_bytes() == 19 * MiB
    assert ledger.make_room(Need((("the quant D", 10 * MiB),)), set(), "D") == ["B"]  # 10 + 10 <= 24
    assert dropped == ["B"]
    with pytest.raises(OverBudgetError, match="raise --disk-budget to at least 0.033"):  # 30 + 4 MiB reserve
        ledger.make_room(Need((("the quant E", 30 * MiB),)), set(), "E")
    assert dropped == ["B"]  # A and C stay: E could not fit even without them


def test_a_downloaded_quant_is_dropped_with_its_blob(tmp_path):
    blob = _file(tmp_path / "blobs" / "abc123", 1)
    link = tmp_path / "snapshots" / "c0ffee" / "M-Q8_0.gguf"
    link.parent.mkdir(parents=True)
    link.symlink_to(blob)
    assert quant_disk.tree_bytes(link) == MiB
    assert quant_disk.drop_files((link,)) == MiB
    assert not blob.exists() and not link.is_symlink()


def test_the_importance_matrix_bound_holds_the_matrix_llama_imatrix_writes(engine_loc, demo_models, tmp_path,
                                                                          monkeypatch):
    from tuner.models import gguf_reader
    from tuner.quality import imatrix

    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "mt"))
    for arch in ("qwen3moe", "qwen35moe"):
        src = demo_models[(arch, "F16")]
        written = imatrix.importance_matrix(engine_loc, src, chunks=2).stat().st_size
        bound = quant_disk.imatrix_bytes_bound(gguf_reader.inspect_model(src))
        assert written <= bound < 2 * written + 256 * 2**10, (arch, written, bound)  # an upper bound, a close one


def test_a_quants_kv_pricing_logits_are_removed_and_its_prices_stay_cached(engine_loc, demo_models, tmp_path,
                                                                          monkeypatch):
    """What each quant's auto-tune writes to price its KV types (f16-KV logits under the cache's quality/logits,
    16 MiB for the demo vocabulary, ~0.6 GB at 152K) is removed once the quant is measured; the prices stay."""
    from tuner.core.config import CacheType
    from tuner.quality import kv_price, perplexity
    from tuner.quants import compare

    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "mt"))
    model = demo_models[("qwen3moe", "Q4_K_M")]
    price = kv_price.price(engine_loc, model, CacheType.Q8_0, CacheType.Q8_0, chunks=2)
    written = perplexity.cached_logits_path(engine_loc, model, ctx=kv_price.PRICE_CTX, chunks=2)
    assert written is not None and written.stat().st_size > 0 and not price.from_cache
    monkeypatch.setattr(kv_price, "PRICE_CHUNKS", 2)  # the chunks this test priced with
    compare._drop_kv_logits(model, engine_loc, None, None, compare.CompareRequest(sources=()))
    assert not written.exists() and not list((tmp_path / "mt" / "quality" / "logits").glob("*.logits"))
    again = kv_price.price(engine_loc, model, CacheType.Q8_0, CacheType.Q8_0, chunks=2)
    assert again.from_cache and again.kld_mean == price.kld_mean  # the price itself is kept
    assert not list((tmp_path / "mt" / "quality" / "logits").glob("*.logits"))
