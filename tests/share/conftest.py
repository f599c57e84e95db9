"""Fixtures the pool's tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.models import shape_model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A few-MB qwen3moe-shaped GGUF (zero weights) that lookups name by path and match by fingerprint."""
    out = tmp_path_factory.mktemp("model")
    return shape_model.write_shape_model(shape_model.small_spec("qwen3moe"), "Q8_0", out / "small-Q8_0.gguf").path
