"""The quant catalog: published facts about MoE models people run on 8–24 GB cards, and their dense comparators.

One JSON file per model family in ``quant_catalog/`` (``cards.json`` holds GPU cards and is read
elsewhere). Every architecture figure carries the id of its source, every quality figure names where it
was published, so a report can print catalog numbers beside measured ones, labelled as such. The
loader checks the schema and raises one-line errors naming the file and the field.

Schema (version 1)::

    {"schema": 1, "family": str, "gguf_arch": str, "sources": {id: description},
     "models": [{"name", "base_repo", "gguf_repos": [str], "params_total_b": fig, "params_active_b": fig,
                 "architecture": {field: fig}, "gguf_tensor_types": fig (optional),
                 "files": [{"quant", "repo", "bytes", "source"}] (optional: published GGUF sizes),
                 "sampling": [{"mode", "temperature", ..., "source"}],
                 "quality": [{"quant", "gpu", "ctx", "settings", "figures": {name: number}, "source"}],
                 "notes": str}]}

where ``fig`` is ``{"value": number | bool | str | null, "source": id}``; ``null`` means not known.
A dense model has ``n_expert`` and ``n_expert_used`` 0 and its FFN width in ``n_ff_dense``.
``gguf_tensor_types`` is what the first GGUF repo publishes over llama-quantize's own recipe, spelt as
llama-quantize's ``--tensor-type`` arguments (``PATTERN=type``, space-separated; first match wins).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import quant_catalog
from tuner.core.errors import CatalogError

SCHEMA_VERSION = 1
CATALOG_DIR = quant_catalog.FOLDER
NOT_FAMILY_FILES = frozenset({"cards.json"})

ArchValue = int | float | bool | str | None

# Architecture fields a model may carry; the first group is required for every model.
REQUIRED_ARCH = ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_expert", "n_expert_used", "ctx_train",
                 "attention")
OPTIONAL_ARCH = (
    "head_dim_v", "n_expert_shared", "n_ff_exp", "n_ff_shexp", "n_ff_dense", "n_layer_dense_lead", "n_layer_nextn",
    "n_vocab", "rope_theta", "tied_embeddings", "swa_window", "swa_every", "full_attention_interval", "ssm_d_conv",
    "ssm_d_state", "ssm_n_group", "ssm_dt_rank", "kv_lora_rank", "ctx_max",
)
ATTENTION_KINDS = ("full", "swa-alternating", "hybrid-deltanet", "mla")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "repeat_penalty")
QUALITY_FIGURES = ("file_size_gb", "vram_gb", "vram_gib", "gen_tok_s", "prompt_tok_s", "ppl", "ppl_increase_pct", "kld",
                   "same_top_pct")
# ggml types a --tensor-type override may name (llama-quantize spells them in lower case).
TENSOR_TYPE_NAMES = ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k", "q4_k", "q5_0", "q4_0", "mxfp4")


@dataclass(frozen=True, slots=True)
class Figure:
    value: ArchValue
    source: str


@dataclass(frozen=True, slots=True)
class Sampling:
    mode: str
    params: Mapping[str, float]
    source: str


@dataclass(frozen=True, slots=True)
class QualityFigure:
    quant: str
    gpu: str | None
    ctx: int | None
    settings: str
    figures: Mapping[str, float]
    source: str


@dataclass(frozen=True, slots=True)
class PublishedFile:
    """A published GGUF's exact size: what a shape-true file of the same quant is checked against."""

    quant: str
    repo: str
    n_bytes: int
    source: str


@dataclass(frozen=True, slots=True)
class CatalogModel:
    name: str
    family: str
    gguf_arch: str
    base_repo: str
    gguf_repos: tuple[str, ...]
    params_total_b: Figure
    params_active_b: Figure
    architecture: Mapping[str, Figure]
    sampling: tuple[Sampling, ...]
    quality: tuple[QualityFigure, ...]
    sources: Mapping[str, str]
    notes: str
    gguf_tensor_types: Figure | None = None  # the GGUF publisher's --tensor-type overrides, when known
    files: tuple[PublishedFile, ...] = ()

    def published_bytes(self, quant: str) -> int | None:
        """The exact size of the first GGUF repo's file of ``quant`` (names compared without case), when known."""
        return next((f.n_bytes for f in self.files if f.quant.upper() == quant.upper()), None)

    @property
    def is_dense(self) -> bool:
        return self.arch("n_expert") == 0

    def tensor_types(self) -> tuple[tuple[str, str], ...]:
        """``gguf_tensor_types`` as (regex, ggml type name) pairs, in order; () when none are published."""
        fig = self.gguf_tensor_types
        if fig is None or not isinstance(fig.value, str):
            return ()
        return tuple(_split_override(item) for item in fig.value.split())

    def arch(self, name: str) -> ArchValue:
        fig = self.architecture.get(name)
        return fig.value if fig is not None else None

    def figures_for(self, quant: str) -> list[QualityFigure]:
        """Published figures for one quant (names compared without case)."""
        return [f for f in self.quality if f.quant.upper() == quant.upper()]

    def source_of(self, name: str) -> str | None:
        fig = self.architecture.get(name)
        return self.sources.get(fig.source) if fig is not None else None


def family_files(folder: Path = CATALOG_DIR) -> list[Path]:
    return sorted(p for p in folder.glob("*.json") if p.name not in NOT_FAMILY_FILES)


def load_catalog(folder: Path = CATALOG_DIR) -> tuple[CatalogModel, ...]:
    models: list[CatalogModel] = []
    seen: dict[str, Path] = {}
    for path in family_files(folder):
        for model in load_family(path):
            if model.name.lower() in seen:
                raise CatalogError(path, model.name, f"also defined in {seen[model.name.lower()].name}")
            seen[model.name.lower()] = path
            models.append(model)
    return tuple(models)


def find_model(name_or_repo: str, folder: Path = CATALOG_DIR) -> CatalogModel | None:
    """The catalog entry for a model name, base repo, or GGUF repo (``:QUANT`` ignored), case-insensitive."""
    key = name_or_repo.split(":", 1)[0].strip().lower()
    for model in load_catalog(folder):
        names = {model.name.lower(), model.base_repo.lower(), *(r.lower() for r in model.gguf_repos)}
        if key in names:
            return model
    return None


def load_family(path: Path) -> list[CatalogModel]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CatalogError(path, f"line {exc.lineno}", f"not valid JSON ({exc.msg})") from None
    _expect(path, "top level", data, dict)
    if data.get("schema") != SCHEMA_VERSION:
        raise CatalogError(path, "schema", f"must be {SCHEMA_VERSION}")
    family = _str(path, "family", data.get("family"))
    arch = _str(path, "gguf_arch", data.get("gguf_arch"))
    sources = data.get("sources")
    _expect(path, "sources", sources, dict)
    if not sources or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in sources.items()):
        raise CatalogError(path, "sources", "must map ids to non-empty descriptions")
    models = data.get("models")
    _expect(path, "models", models, list)
    if not models:
        raise CatalogError(path, "models", "is empty")
    return [_model(path, family, arch, sources, m) for m in models]


def _model(path: Path, family: str, arch: str, sources: dict[str, str], m: Any) -> CatalogModel:
    _expect(path, "model", m, dict)
    name = _str(path, "model name", m.get("name"))
    repos = m.get("gguf_repos")
    if not isinstance(repos, list) or not repos or not all(isinstance(r, str) and r.count("/") == 1 for r in repos):
        raise CatalogError(path, f"{name}.gguf_repos", "must list owner/name repos")
    architecture = m.get("architecture")
    _expect(path, f"{name}.architecture", architecture, dict)
    unknown = set(architecture) - set(REQUIRED_ARCH) - set(OPTIONAL_ARCH)
    if unknown:
        raise CatalogError(path, f"{name}.architecture", f"unknown fields {sorted(unknown)}")
    missing = [f for f in REQUIRED_ARCH if f not in architecture]
    if missing:
        raise CatalogError(path, f"{name}.architecture", f"missing {missing}")
    figures = {k: _figure(path, f"{name}.architecture.{k}", v, sources) for k, v in architecture.items()}
    if figures["attention"].value not in ATTENTION_KINDS:
        raise CatalogError(path, f"{name}.architecture.attention", f"must be one of {ATTENTION_KINDS}")
    dense = figures["n_expert"].value == 0  # a dense comparator: no experts, one FFN per layer
    for key, fig in figures.items():
        zero_ok = dense and key in ("n_expert", "n_expert_used")
        if key != "attention" and key != "tied_embeddings" and fig.value is not None and (
                isinstance(fig.value, (bool, str)) or fig.value < 0 or (fig.value == 0 and not zero_ok)):
            raise CatalogError(path, f"{name}.architecture.{key}", "must be a positive number or null")
    dense_ff = figures.get("n_ff_dense")
    if dense and (figures["n_expert_used"].value != 0 or dense_ff is None or not dense_ff.value):
        raise CatalogError(path, f"{name}.architecture", "a dense model (n_expert 0) needs n_expert_used 0, n_ff_dense")
    if isinstance(figures["n_expert_used"].value, int) and isinstance(figures["n_expert"].value, int) and (
            figures["n_expert_used"].value > figures["n_expert"].value):
        raise CatalogError(path, f"{name}.architecture", "n_expert_used exceeds n_expert")
    overrides = m.get("gguf_tensor_types")
    tensor_types = None if overrides is None else _tensor_types(path, name, overrides, sources)
    return CatalogModel(
        name=name, family=family, gguf_arch=arch, base_repo=_str(path, f"{name}.base_repo", m.get("base_repo")),
        gguf_repos=tuple(repos),
        params_total_b=_figure(path, f"{name}.params_total_b", m.get("params_total_b"), sources),
        params_active_b=_figure(path, f"{name}.params_active_b", m.get("params_active_b"), sources),
        architecture=figures,
        sampling=tuple(_sampling(path, name, s, sources) for s in m.get("sampling", [])),
        quality=tuple(_quality(path, name, q, sources) for q in m.get("quality", [])),
        sources=sources, notes=str(m.get("notes", "")), gguf_tensor_types=tensor_types,
        files=tuple(_file(path, name, f, sources) for f in m.get("files", [])),
    )


def _figure(path: Path, where: str, raw: Any, sources: Mapping[str, str]) -> Figure:
    if not isinstance(raw, dict) or set(raw) != {"value", "source"}:
        raise CatalogError(path, where, 'must be {"value": ..., "source": id}')
    if raw["source"] not in sources:
        raise CatalogError(path, where, f"source {raw['source']!r} is not in sources")
    if not (raw["value"] is None or isinstance(raw["value"], (int, float, bool, str))):
        raise CatalogError(path, where, "value must be a number, bool, string or null")
    return Figure(raw["value"], raw["source"])


def _split_override(item: str) -> tuple[str, str]:
    pattern, _, typ = item.rpartition("=")
    return pattern, typ


def _tensor_types(path: Path, name: str, raw: Any, sources: Mapping[str, str]) -> Figure:
    where = f"{name}.gguf_tensor_types"
    fig = _figure(path, where, raw, sources)
    if not isinstance(fig.value, str) or not fig.value.split():
        raise CatalogError(path, where, "must be a string of PATTERN=type items")
    for item in fig.value.split():
        pattern, typ = _split_override(item)
        if not pattern or typ not in TENSOR_TYPE_NAMES:
            raise CatalogError(path, where, f"{item!r} is not PATTERN=type with a type among {TENSOR_TYPE_NAMES}")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise CatalogError(path, where, f"{pattern!r} is not a regular expression ({exc})") from None
    return fig


def _file(path: Path, name: str, raw: Any, sources: Mapping[str, str]) -> PublishedFile:
    where = f"{name}.files"
    _expect(path, where, raw, dict)
    quant, repo, n_bytes = raw.get("quant"), raw.get("repo"), raw.get("bytes")
    if not (isinstance(quant, str) and isinstance(repo, str) and repo.count("/") == 1 and isinstance(n_bytes, int)
            and not isinstance(n_bytes, bool) and n_bytes > 0):
        raise CatalogError(path, where, 'entries are {"quant", "repo": "owner/name", "bytes": int > 0, "source"}')
    if raw.get("source") not in sources:
        raise CatalogError(path, f"{where}[{quant}]", "needs a source id from sources")
    return PublishedFile(quant, repo, n_bytes, raw["source"])


def _sampling(path: Path, name: str, raw: Any, sources: Mapping[str, str]) -> Sampling:
    where = f"{name}.sampling"
    _expect(path, where, raw, dict)
    mode = _str(path, f"{where}.mode", raw.get("mode"))
    params = {k: v for k, v in raw.items() if k not in ("mode", "source")}
    bad = [k for k, v in params.items() if k not in SAMPLING_KEYS or not isinstance(v, (int, float))]
    if bad or not params:
        raise CatalogError(path, f"{where}[{mode}]", f"keys must be numbers among {SAMPLING_KEYS} (bad: {bad})")
    if raw.get("source") not in sources:
        raise CatalogError(path, f"{where}[{mode}]", "needs a source id from sources")
    return Sampling(mode, params, raw["source"])


def _quality(path: Path, name: str, raw: Any, sources: Mapping[str, str]) -> QualityFigure:
    where = f"{name}.quality"
    _expect(path, where, raw, dict)
    quant = _str(path, f"{where}.quant", raw.get("quant"))
    figures = raw.get("figures")
    if not isinstance(figures, dict) or not figures or not all(
            k in QUALITY_FIGURES and isinstance(v, (int, float)) and v >= 0 for k, v in figures.items()):
        raise CatalogError(path, f"{where}[{quant}].figures", f"must map names among {QUALITY_FIGURES} to numbers")
    if raw.get("source") not in sources:
        raise CatalogError(path, f"{where}[{quant}]", "needs a source id from sources")
    ctx = raw.get("ctx")
    if ctx is not None and (not isinstance(ctx, int) or ctx <= 0):
        raise CatalogError(path, f"{where}[{quant}].ctx", "must be a positive integer or null")
    return QualityFigure(quant, raw.get("gpu"), ctx, str(raw.get("settings", "")), figures, raw["source"])


def _expect(path: Path, where: str, value: Any, kind: type) -> None:
    if not isinstance(value, kind):
        raise CatalogError(path, where, f"must be a JSON {'object' if kind is dict else 'array'}")


def _str(path: Path, where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise CatalogError(path, where, "must be a non-empty string")
    return value
