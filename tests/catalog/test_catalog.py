"""The quant catalog: every family file passes the schema, figures name their sources, errors are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuner.catalog import families
from tuner.core.errors import CatalogError

REQUIRED_MODELS = ("Qwen3.5-35B-A3B", "Qwen3.6-35B-A3B", "Qwen3-30B-A3B", "Qwen3-Coder-30B-A3B-Instruct",
                   "gpt-oss-20b", "gpt-oss-120b", "GLM-4.5-Air")
FIELD_REPORTS = Path("/work/shared/field-reports")


@pytest.fixture(scope="module")
def models() -> tuple[families.CatalogModel, ...]:
    return families.load_catalog()


def test_every_family_file_passes_the_schema(models):
    files = families.family_files()
    assert len(files) >= 5 and all(f.name != "cards.json" for f in files)
    assert len(models) >= 8
    names = {m.name for m in models}
    assert set(REQUIRED_MODELS) <= names


def test_figures_resolve_to_sources_and_are_consistent(models):
    for m in models:
        for key, fig in m.architecture.items():
            assert fig.source in m.sources, (m.name, key)
        assert all(r.endswith("-GGUF") or r.endswith("-gguf") for r in m.gguf_repos), m.name
        n_expert, used = m.arch("n_expert"), m.arch("n_expert_used")
        assert isinstance(n_expert, int) and isinstance(used, int) and 0 < used <= n_expert, m.name
        for s in m.sampling:
            assert 0 <= s.params.get("temperature", 0) <= 2 and s.source in m.sources
        for q in m.quality:
            assert q.source in m.sources and q.figures


def test_field_report_figures_cite_existing_files(models):
    cited = {src for m in models for src in m.sources.values() if "/field-reports/" in src}
    assert cited, "the catalog should carry the field reports' per-quant tables"
    for description in cited:
        name = description.split("/field-reports/")[1].split(":")[0]
        assert name.endswith(".txt")
        if FIELD_REPORTS.is_dir():
            assert (FIELD_REPORTS / name).is_file(), name


def test_qwen35_table_from_the_3090_report():
    model = families.find_model("unsloth/Qwen3.5-35B-A3B-GGUF:Q4_K_M")
    assert model is not None and model.gguf_arch == "qwen35moe"
    at_10k = {q.quant: q.figures for q in model.quality if q.ctx == 10240 and q.gpu == "GeForce RTX 3090"}
    assert len(at_10k) == 9
    assert at_10k["Q4_K_M"] == {"file_size_gb": 22.0, "vram_gb": 23, "gen_tok_s": 121, "ppl": 6.559}
    assert at_10k["UD-Q3_K_XL"]["ppl"] == 6.692
    assert model.arch("n_layer") == 40 and model.arch("attention") == "hybrid-deltanet"
    assert "llama.cpp source" in (model.source_of("n_layer") or "")


def test_lookup_by_name_base_repo_and_gguf_repo():
    assert families.find_model("gpt-oss-20b").arch("swa_window") == 128
    assert families.find_model("Qwen/Qwen3-30B-A3B").arch("n_layer") == 48
    assert families.find_model("ggml-org/gpt-oss-120b-GGUF").arch("n_expert") == 128
    assert families.find_model("nobody/unknown") is None


def _write(tmp_path: Path, data: dict) -> Path:
    (tmp_path / "broken.json").write_text(json.dumps(data))
    return tmp_path


def _valid() -> dict:
    fig = lambda v: {"value": v, "source": "s"}  # noqa: E731
    arch = {k: fig(8) for k in families.REQUIRED_ARCH}
    arch["attention"] = fig("full")
    arch["n_expert_used"] = fig(2)
    return {"schema": 1, "family": "x", "gguf_arch": "x", "sources": {"s": "a source"},
            "models": [{"name": "M", "base_repo": "o/M", "gguf_repos": ["o/M-GGUF"], "params_total_b": fig(1),
                        "params_active_b": fig(1), "architecture": arch}]}


@pytest.mark.parametrize(("edit", "words"), [
    (lambda d: d["models"][0]["architecture"].pop("n_head_kv"), "missing ['n_head_kv']"),
    (lambda d: d["models"][0]["architecture"].update(n_layer={"value": 40, "source": "nowhere"}), "'nowhere'"),
    (lambda d: d["models"][0]["architecture"].update(attention={"value": "sparse", "source": "s"}), "attention"),
    (lambda d: d["models"][0]["architecture"].update(n_expert_used={"value": 99, "source": "s"}), "exceeds"),
    (lambda d: d["models"][0].update(quality=[{"quant": "Q4_K_M", "figures": {"ppl": "low"}, "source": "s"}]),
     "figures"),
    (lambda d: d.update(schema=7), "schema"),
])
def test_schema_errors_are_one_line_naming_file_and_field(tmp_path, edit, words):
    assert families.load_catalog(_write(tmp_path, _valid()))[0].name == "M"
    data = _valid()
    edit(data)
    with pytest.raises(CatalogError) as info:
        families.load_catalog(_write(tmp_path, data))
    message = str(info.value)
    assert "\n" not in message and message.startswith("broken.json: ") and words in message
