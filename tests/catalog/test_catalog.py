"""The quant catalog: every family file passes the schema, figures name their sources, errors are one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tuner.catalog import families
from tuner.core.errors import CatalogError

REQUIRED_MODELS = ("Qwen3.5-35B-A3B", "Qwen3.6-35B-A3B", "Qwen3-30B-A3B", "Qwen3-Coder-30B-A3B-Instruct",
                   "gpt-oss-20b", "gpt-oss-120b", "GLM-4.5-Air", "Qwen3.5-9B", "Qwen3.5-27B")
# Sources that are a recollection or a guess, not a published figure: no figure of a checked model may cite one.
UNVERIFIED_WORDS = ("recalled", "assumed", "not known")
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
        assert isinstance(n_expert, int) and isinstance(used, int), m.name
        if m.is_dense:  # a dense comparator: no experts, one FFN width for every layer
            assert used == 0 and isinstance(m.arch("n_ff_dense"), int) and m.arch("n_ff_dense") > 0, m.name
        else:
            assert 0 < used <= n_expert, m.name
        for s in m.sampling:
            assert 0 <= s.params.get("temperature", 0) <= 2 and s.source in m.sources
        for q in m.quality:
            assert q.source in m.sources and q.figures


def test_field_report_figures_cite_existing_files(models):
    cited = {src for m in models for src in m.sources.values() if src.startswith("field report ")}
    assert cited, "the catalog should carry the field reports' per-quant tables"
    for description in cited:
        name = description.removeprefix("field report ").split()[0]
        assert name.endswith(".txt")
        if FIELD_REPORTS.is_dir():
            assert (FIELD_REPORTS / name).is_file(), name


# An absolute path: a slash that starts a token (not a URL's, not "tok/s"), then at least two path parts; or a home.
ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])(/[\w.-]+){2,}|(?<![\w])~/")


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def test_the_catalog_cites_no_path_of_one_machine():
    """Issue 67: sources are cited by repo-relative paths or public addresses; a path of one machine (a developer's
    /work/shared/...) means nothing to a reader of the repository."""
    found = [(f.name, m.group(0)) for f in [*families.family_files(), families.family_files()[0].parent / "cards.json"]
             for s in _strings(json.loads(f.read_text())) for m in ABSOLUTE_PATH.finditer(s)]
    assert found == []
    assert ABSOLUTE_PATH.search("/work/shared/field-reports/002.txt: a benchmark")  # the check sees such a path
    assert not ABSOLUTE_PATH.search("https://github.com/x/y 120 tok/s K/V q8_0/q4_0 and/or")


def test_qwen35_table_from_the_3090_report():
    model = families.find_model("unsloth/Qwen3.5-35B-A3B-GGUF:Q4_K_M")
    assert model is not None and model.gguf_arch == "qwen35moe"
    at_10k = {q.quant: q.figures for q in model.quality if q.ctx == 10240 and q.gpu == "GeForce RTX 3090"}
    assert len(at_10k) == 9
    assert at_10k["Q4_K_M"] == {"file_size_gb": 22.0, "vram_gb": 23, "gen_tok_s": 121, "ppl": 6.559}
    assert at_10k["UD-Q3_K_XL"]["ppl"] == 6.692
    assert model.arch("n_layer") == 40 and model.arch("attention") == "hybrid-deltanet"
    assert "llama.cpp source" in (model.source_of("n_layer") or "")


def test_dense_comparators_carry_the_published_shapes():
    """Issue 35's comparators, each figure as the public configs give it (the sources name them)."""
    nine, big = families.find_model("qwen3.5-9b"), families.find_model("unsloth/Qwen3.5-27B-GGUF")
    assert nine is not None and big is not None and nine.gguf_arch == big.gguf_arch == "qwen35"
    keys = ("n_layer", "full_attention_interval", "n_embd", "n_ff_dense", "n_head", "n_head_kv", "head_dim", "n_vocab",
            "ssm_n_group", "ssm_dt_rank", "ssm_d_state", "tied_embeddings", "n_expert")
    assert [big.arch(k) for k in keys] == [64, 4, 5120, 17408, 24, 4, 256, 248320, 16, 48, 128, False, 0]
    assert [nine.arch(k) for k in keys] == [32, 4, 4096, 12288, 16, 4, 256, 248320, 16, 32, 128, False, 0]
    # 16 and 8 full-attention layers: every 4th of 64 and 32
    assert big.arch("n_layer") // big.arch("full_attention_interval") == 16  # type: ignore[operator]
    published = {m.name: m.published_bytes("q4_k_m") for m in (nine, big, families.find_model("qwen3.5-35b-a3b"))}
    assert published == {"Qwen3.5-9B": 5_680_522_464, "Qwen3.5-27B": 16_740_812_704, "Qwen3.5-35B-A3B": 22_016_023_168}
    assert all(f.repo.startswith("unsloth/") and "http" in m.sources[f.source] for m in (nine, big) for f in m.files)


@pytest.mark.parametrize("name", ["Qwen3.5-35B-A3B", "Qwen3.6-35B-A3B", "Qwen3.5-9B", "Qwen3.5-27B", "GLM-4.5-Air",
                                  "ERNIE-4.5-21B-A3B-PT"])
def test_checked_models_cite_a_published_source_for_every_shape_figure(name):
    """The models issue 35 checked: no shape figure is null or rests on a recollection or a guess."""
    model = families.find_model(name)
    assert model is not None
    for key, fig in model.architecture.items():
        assert fig.value is not None, (name, key)
        source = model.sources[fig.source]
        assert not any(w in source for w in UNVERIFIED_WORDS), (name, key, source)
        assert any(w in source for w in ("http", "llama.cpp source at the pinned commit", "field report ")), (
            name, key, source)


def test_glm_ernie_and_qwen35_moe_facts_the_engine_needs():
    """GLM-4.5-Air: 46 trunk layers in n_layer() (the pinned glm4-moe.cpp sizes it on case 46 and subtracts the
    NextN layer from block_count 47); ERNIE-4.5: dense first layer, tied output, a 3072-wide shared expert;
    Qwen3.5/3.6-35B-A3B: the 248,320-token vocabulary, and unsloth's higher-precision hybrid tensors."""
    glm = families.find_model("GLM-4.5-Air")
    assert glm.arch("n_layer") == 46 and glm.arch("n_layer_nextn") == 1 and glm.arch("n_ff_dense") == 10944
    assert "case 46" in (glm.source_of("n_layer") or "") and "does not count" in glm.notes
    ernie = families.find_model("ERNIE-4.5-21B-A3B-PT")
    assert [ernie.arch(k) for k in ("n_layer_dense_lead", "n_ff_dense", "tied_embeddings", "n_ff_shexp")] == [
        1, 12288, True, 3072]
    for name in ("Qwen3.5-35B-A3B", "Qwen3.6-35B-A3B"):
        assert families.find_model(name).arch("n_vocab") == 248320
    overrides = families.find_model("qwen3.5-35b-a3b").tensor_types()
    assert overrides == (("attn_(qkv|gate|q|k|v|output)\\.weight", "q8_0"), ("ssm_out\\.weight", "q8_0"))
    assert families.find_model("qwen3.6-35b-a3b").tensor_types() == ()  # not published: not modelled


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
    (lambda d: d["models"][0]["architecture"].update(n_expert={"value": 0, "source": "s"},
                                                     n_expert_used={"value": 0, "source": "s"}), "n_ff_dense"),
    (lambda d: d["models"][0]["architecture"].update(n_head={"value": 0, "source": "s"}), "n_head"),
    (lambda d: d["models"][0].update(gguf_tensor_types={"value": "attn_v=q9_9", "source": "s"}), "gguf_tensor_types"),
    (lambda d: d["models"][0].update(gguf_tensor_types={"value": "attn_(v=q8_0", "source": "s"}), "regular expression"),
    (lambda d: d["models"][0].update(files=[{"quant": "Q4_K_M", "repo": "o/M-GGUF", "bytes": "20 GB", "source": "s"}]),
     "files"),
])
def test_schema_errors_are_one_line_naming_file_and_field(tmp_path, edit, words):
    assert families.load_catalog(_write(tmp_path, _valid()))[0].name == "M"
    data = _valid()
    edit(data)
    with pytest.raises(CatalogError) as info:
        families.load_catalog(_write(tmp_path, data))
    message = str(info.value)
    assert "\n" not in message and message.startswith("broken.json: ") and words in message
