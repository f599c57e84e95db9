"""Fixtures the pool's tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.models import shape_model
from tuner.share import accounts


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A few-MB qwen3moe-shaped GGUF (zero weights) that lookups name by path and match by fingerprint."""
    out = tmp_path_factory.mktemp("model")
    return shape_model.write_shape_model(shape_model.small_spec("qwen3moe"), "Q8_0", out / "small-Q8_0.gguf").path


@pytest.fixture(autouse=True)
def accounts_cache_of_this_test(tmp_path, monkeypatch):
    """What the Hub said about commits is cached under the user's cache folder; a test's Hub is its own (a command
    run as a user has its own MOE_TUNE_CACHE: tests.share.test_pool.env_for)."""
    monkeypatch.setattr(accounts, "cache_file", lambda repo_id, options: tmp_path / "hub-accounts" / (
        repo_id.replace("/", "--") + ".json"))
