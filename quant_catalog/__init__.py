"""The quant catalog's data files: published facts about MoE models (one ``<family>.json`` per model family) and
consumer NVIDIA cards (``cards.json``). Data only: ``tuner.catalog.families`` and ``tuner.catalog.cards`` read
them. A package so that an editable and a regular install find the files the same way, by import."""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).resolve().parent
