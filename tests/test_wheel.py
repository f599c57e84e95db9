"""A regular (non-editable) install works: the wheel carries the catalog (top-level ``quant_catalog/``) and the
corpus, and `moe-tune plan` runs from another directory with nothing of the repository on the path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tuner.catalog import cards, families

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # builds a wheel and a venv: ~10 s


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the project venv's setuptools builds it, so no network is needed.
    res = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                "-w", str(out), str(REPO)], cwd=out)
    assert res.returncode == 0, res.stderr[-3000:]
    return next(out.glob("moe_tune-*.whl"))


def test_wheel_carries_package_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"quant_catalog/__init__.py", "quant_catalog/cards.json", "quant_catalog/qwen3moe.json",
            "quant_catalog/README.md"} <= names
    assert not any(n.startswith("tuner/catalog/data/") for n in names)  # one copy, where the design card puts it
    assert "tuner/quality/corpus_data/manifest.json" in names
    assert not any(n.startswith("tests/") for n in names)


def test_installed_wheel_plans_from_another_directory(wheel, tmp_path):
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    bin_dir = venv / "bin"
    res = _run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)])
    assert res.returncode == 0, res.stderr[-3000:]
    # Dependencies come from the project venv's site-packages as a plain path entry: its .pth files (the
    # editable install of this repository among them) are not processed, so `tuner` can only be the wheel's.
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"], "MOE_TUNE_CACHE": str(tmp_path / "cache")}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([str(bin_dir / "python"), "-c", "import tuner; print(tuner.__file__)"], cwd=elsewhere, env=env)
    assert where.stdout.strip().startswith(str(venv)), where.stdout + where.stderr
    # The catalog is read from the wheel's own top-level quant_catalog/, not from this checkout.
    probe = ("from tuner.catalog import cards, families; print(cards.CATALOG); "
             "print(len(cards.load_cards()), len(families.load_catalog()))")
    found = _run([str(bin_dir / "python"), "-c", probe], cwd=elsewhere, env=env)
    assert found.returncode == 0, found.stderr[-3000:]
    catalog_file, counts = found.stdout.split("\n")[:2]
    assert Path(catalog_file).parent.name == "quant_catalog" and catalog_file.startswith(str(venv)), catalog_file
    n_cards, n_models = map(int, counts.split())
    assert (n_cards, n_models) == (len(cards.load_cards()), len(families.load_catalog())) and n_cards and n_models
    check = _run([str(bin_dir / "python"), "-m", "pip", "check"], cwd=elsewhere, env=env)
    assert "moe-tune" not in check.stdout, check.stdout  # every declared dependency is met by its range
    res = _run([str(bin_dir / "moe-tune"), "plan", "qwen3-30b-a3b:Q4_K_M", "--gpu", "RTX 4060 Ti 16GB", "--json"],
               cwd=elsewhere, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert doc["rows"] and any(r["verdict"] == "fits" for r in doc["rows"])
