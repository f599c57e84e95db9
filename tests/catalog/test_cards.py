from __future__ import annotations

import pytest

from tuner.catalog.cards import find_card, load_cards
from tuner.core.errors import UnknownCardError


@pytest.mark.parametrize("query,name", [
    ("RTX 4060 Ti 16GB", "GeForce RTX 4060 Ti 16GB"),
    ("4060ti", "GeForce RTX 4060 Ti 8GB"),
    ("nvidia geforce rtx 3080 12 GB", "GeForce RTX 3080 12GB"),
    ("RTX 3080", "GeForce RTX 3080 10GB"),
    ("rtx 4070 ti super", "GeForce RTX 4070 Ti Super"),
    ("RTX 4070 Ti", "GeForce RTX 4070 Ti"),
    ("5090", "GeForce RTX 5090"),
])
def test_fuzzy_match(query, name):
    assert find_card(query).name == name


def test_catalog_covers_the_range_with_sources():
    cards = load_cards()
    assert len(cards) >= 24
    for c in cards:
        assert c.source.startswith("https://")
        # Bandwidth agrees with bus width x data rate on every spec sheet (within rounding).
        assert 2 * 2**30 <= c.vram_bytes <= 32 * 2**30
    assert find_card("RTX 3090").bandwidth_bytes_s == 936e9
    assert find_card("RTX 4060 Ti 16GB").vram_bytes == 16 * 2**30


def test_unknown_card_names_the_fix():
    with pytest.raises(UnknownCardError, match="closest: RTX 4090") as err:
        find_card("RTX 4099")
    assert "\n" not in str(err.value)


def test_card_as_hardware():
    hw = find_card("RTX 3060").hardware(32 * 2**30, 30 * 2**30, 40e9)
    assert hw.has_gpu and hw.source == "catalog" and hw.vram_free_bytes == 12 * 2**30
    assert hw.pcie_bandwidth_bytes_s > 30e9
