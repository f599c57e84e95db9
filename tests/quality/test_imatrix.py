"""The importance matrix: llama-imatrix over the bundled corpus, cached per source, and quants made with it."""

from __future__ import annotations

import pytest

from tuner.core.errors import QuantizeError
from tuner.engine import flags
from tuner.models import quantize
from tuner.quality import imatrix


def test_very_low_bit_types_name_the_imatrix_fix(engine_loc, demo_models, tmp_path):
    src = demo_models[("qwen3moe", "F16")]
    with pytest.raises(QuantizeError, match="IQ2_XXS needs an importance matrix: add --imatrix"):
        quantize.make(engine_loc, src, tmp_path, quantize.Recipe("IQ2_XXS"))
    assert not list(tmp_path.glob("*.part")) and not list(tmp_path.glob("*.gguf"))


def test_imatrix_is_made_once_per_source_and_used_by_llama_quantize(engine_loc, demo_models, tmp_path,
                                                                     monkeypatch):
    if not engine_loc.has(flags.IMATRIX):
        pytest.skip("this engine was built before llama-imatrix joined the build: moe-tune engine install --force")
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "mt"))
    src = demo_models[("qwen3moe", "F16")]
    first = imatrix.importance_matrix(engine_loc, src, ctx=128, chunks=2)
    assert first.is_file() and first.stat().st_size > 0 and first.parent == imatrix.imatrix_dir()
    mtime = first.stat().st_mtime_ns
    assert imatrix.importance_matrix(engine_loc, src, ctx=128, chunks=2) == first
    assert first.stat().st_mtime_ns == mtime  # cached, not made again
    made = quantize.make(engine_loc, src, tmp_path / "q", quantize.Recipe("IQ2_XXS"), imatrix=first)
    assert made.path.name.endswith("-IQ2_XXS-imat.gguf") and f"--imatrix {first}" in made.command
    assert made.size_bytes < src.stat().st_size / 3
