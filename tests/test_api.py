"""The public API: every name `tuner` exports resolves, `import tuner` stays light, and a Python user can plan
a card without the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tuner


@pytest.mark.parametrize("name", [n for n in tuner.__all__ if n != "__version__"])
def test_every_exported_name_resolves(name):
    assert getattr(tuner, name) is not None


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tuner.nope  # noqa: B018


def test_import_is_light():
    heavy = "('optuna', 'psutil', 'huggingface_hub', 'typer')"
    code = f"import sys, tuner; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_plan_a_card_from_python(tmp_path):
    model = tuner.resolve_model("qwen3-30b-a3b:Q4_K_M", header_only=True, cache_dir=tmp_path)
    info = tuner.inspect_model(model.path)
    hw = tuner.card_hardware("RTX 4060 Ti 16GB", ram_bytes=64 * 2**30)
    plan = tuner.make_plan(info, tuner.LaunchConfig(model=info.paths[0], ctx=32768, parallel=1), hw)
    verdicts = [r.estimate.verdict.value for r in plan.rows]
    assert len(plan.rows) == info.n_layer + 1
    assert verdicts[-1] == "fits" and verdicts[0] != "fits"  # 17 GiB of weights do not fit 16 GB; all experts out do
