"""Shape-true models: GGUFs with a real model's header, and data that is a sparse hole or valid weights.

The header carries the architecture keys, a vocabulary of the real size (synthetic token strings that
llama.cpp's BPE loader accepts), and every tensor's name, shape and quantization type. The data region is
either left unwritten (``weights="zero"``: the file is truncated to its full size; gigabytes logical, a few
MB on disk, written in seconds, and ``llama-fit-params`` / ``tuner.models.gguf_reader`` read it exactly as
they read the real file) or filled with valid weights of each tensor's type (``weights="direct"``: the real
size on disk, drawn with no engine; llama.cpp computes finite logits and routes a batch's tokens over nearly
all experts in every layer, so speed at real scale is measured like a trained model's; ``weights="random"``
samples llama-quantize's blocks instead, and its routing collapses past the first layer).
tuner.models.gguf_writer writes them all.

Shapes come from (a) the quant catalog's architecture facts (MoE models and their dense comparators, such as
Qwen3.5-9B, arch ``qwen35``), or one of :data:`EXTRA_SHAPES` (real MoE models small enough for quick real-scale
runs), plus a quantization recipe and the catalog's per-tensor types of the GGUF publisher
(:func:`write_shape_model`, :func:`write_catalog_model`), or (b) a real GGUF header, e.g. one fetched from the Hub
with a range request (:func:`copy_header`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from tuner.catalog import families
from tuner.core.errors import UsageError
from tuner.engine.build import EngineLocation
from tuner.models import block_pool, gguf_writer, recipes
from tuner.models.gguf_reader import header_end
from tuner.models.gguf_writer import WriteTimes
from tuner.models.model_spec import ModelSpec
from tuner.models.vocab import synthetic_vocab

ShapeSpec = ModelSpec  # the name callers know
SHAPE_ARCHS = ("qwen3moe", "qwen35moe", "qwen35", "qwen3next", "gpt-oss", "glm4moe")
# Qwen3.5 (dense and MoE) rotate 64 of 256 head dims (partial_rotary_factor 0.25) in interleaved M-RoPE sections
# [11, 11, 10] (config.json's rope_parameters); convert_hf_to_gguf writes them as [11, 11, 10, 0]
# (conversion/qwen.py _Qwen35MRopeMixin) and the pinned llama_model_qwen35(moe)::load_arch_hparams requires the key.
_QWEN35_ROPE: dict[str, object] = {"rope_dim": 64, "rope_sections": (11, 11, 10, 0)}
# Facts the catalog leaves null or does not carry, per catalog model; each is named in ModelSpec.assumed.
_ASSUMED: dict[str, dict[str, object]] = {
    "qwen35moe": dict(_QWEN35_ROPE),
    "qwen35": dict(_QWEN35_ROPE),
    "qwen3next": {"rope_dim": 64, "tied": False},
    "glm4moe": {"rope_dim": 64, "tied": False},
    "gpt-oss": {},
    "qwen3moe": {},
}
# Real MoE models outside the catalog, small enough for quick real-scale runs on a laptop-class CPU.
EXTRA_SHAPES: dict[str, ModelSpec] = {
    # allenai/OLMoE-1B-7B-0924, config.json on the Hub (OlmoeForCausalLM): hidden_size 2048,
    # intermediate_size 1024, num_hidden_layers 16, num_attention_heads 16, num_key_value_heads 16,
    # num_experts 64, num_experts_per_tok 8, vocab_size 50304, max_position_embeddings 4096,
    # rope_theta 10000.0, rms_norm_eps 1e-05, tie_word_embeddings false. llama.cpp arch "olmoe"
    # (src/models/olmoe.cpp at the pinned commit). 6.9 B parameters, 1.3 B active; Q4_K_M is ~4 GiB.
    "olmoe-1b-7b": ModelSpec(
        arch="olmoe", name="OLMoE-1B-7B-0924", n_layer=16, n_embd=2048, n_head=16, n_head_kv=16, head_dim=128,
        n_expert=64, n_expert_used=8, n_ff_exp=1024, n_vocab=50304, ctx_train=4096, rope_theta=10_000.0,
        rms_eps=1e-5,
    ),
}
_EXTRA_ALIASES = {"olmoe-1b-7b-0924": "olmoe-1b-7b", "allenai/olmoe-1b-7b-0924": "olmoe-1b-7b"}


@dataclass(frozen=True, slots=True)
class ShapeFile:
    path: Path
    spec: ModelSpec | None
    recipe: str | None
    logical_bytes: int
    disk_bytes: int
    n_tensors: int
    weights: str = "zero"
    times: WriteTimes | None = None  # where the writing time went (None: a copied header)


def known_models() -> list[str]:
    return [m.name for m in families.load_catalog() if m.gguf_arch in SHAPE_ARCHS] + list(EXTRA_SHAPES)


def resolve_target(target: str) -> tuple[ModelSpec, str]:
    """``NAME:RECIPE`` (name, base repo or GGUF repo of a catalog model, or an extra shape; any case)."""
    name, _, recipe = target.partition(":")
    recipe = recipes.check_recipe(recipe or "Q4_K_M")
    key = name.strip().lower()
    extra = EXTRA_SHAPES.get(_EXTRA_ALIASES.get(key, key))
    if extra is not None:
        return extra, recipe
    model, _ = parse_target(f"{name}:{recipe}")
    return spec_from_catalog(model), recipe


def parse_target(target: str) -> tuple[families.CatalogModel, str]:
    """``NAME:RECIPE`` (name, base repo or GGUF repo of a catalog model, any case) → (model, recipe)."""
    name, _, recipe = target.partition(":")
    recipe = recipes.check_recipe(recipe or "Q4_K_M")
    key = name.strip().lower()
    for m in families.load_catalog():
        names = {m.name.lower(), m.base_repo.lower(), *(r.lower() for r in m.gguf_repos)}
        if m.gguf_arch in SHAPE_ARCHS and (key in names or key in {n.split("/")[-1] for n in names}):
            return m, recipe
    raise UsageError(f"unknown model {name!r} for a shape model: use one of {', '.join(known_models())} "
                     f"with :{'|'.join(recipes.recipe_names())}")


def spec_from_catalog(m: families.CatalogModel) -> ModelSpec:
    arch = m.gguf_arch
    if arch not in SHAPE_ARCHS:
        raise UsageError(f"{m.name} ({arch}) has no shape writer: use one of {', '.join(known_models())}")
    assumed = _ASSUMED[arch]
    used: list[str] = [k for k in ("rope_dim", "rope_sections") if k in assumed]

    def fact(key: str, default: object = 0) -> object:
        value = m.arch(key)
        if value is not None:
            return value
        if key in assumed:
            used.append(key)
            return assumed[key]
        return default

    n_expert_shared = _int(fact("n_expert_shared"))
    n_ff_exp = _int(fact("n_ff_exp"))
    n_ff_dense = _int(fact("n_ff_dense"))
    tied = m.arch("tied_embeddings")
    if tied is None:
        used.append("tied")
        tied = bool(assumed.get("tied", False))
    sections = assumed.get("rope_sections", (0, 0, 0, 0))
    return ModelSpec(
        arch=arch, name=m.name, n_layer=_int(fact("n_layer")), n_embd=_int(fact("n_embd")),
        n_head=_int(fact("n_head")), n_head_kv=_int(fact("n_head_kv")), head_dim=_int(fact("head_dim")),
        n_expert=_int(fact("n_expert")), n_expert_used=_int(fact("n_expert_used")), n_ff_exp=n_ff_exp,
        n_vocab=_int(fact("n_vocab")), ctx_train=_int(fact("ctx_train")), n_expert_shared=n_expert_shared,
        n_ff_shexp=_int(fact("n_ff_shexp")) or n_ff_exp * n_expert_shared,
        n_ff_dense=n_ff_dense, n_layer_dense_lead=_int(fact("n_layer_dense_lead")),
        n_layer_nextn=_int(fact("n_layer_nextn")), tied=bool(tied), rms_eps=1e-5 if arch == "gpt-oss" else 1e-6,
        rope_theta=float(str(fact("rope_theta", 1_000_000.0))), rope_dim=_int(assumed.get("rope_dim", 0)),
        rope_sections=tuple(int(x) for x in sections) if isinstance(sections, tuple) else (0, 0, 0, 0),  # type: ignore[arg-type]
        n_swa=_int(fact("swa_window")), full_attention_interval=_int(fact("full_attention_interval")),
        ssm_d_conv=_int(fact("ssm_d_conv")), ssm_d_state=_int(fact("ssm_d_state")),
        ssm_n_group=_int(fact("ssm_n_group")), ssm_dt_rank=_int(fact("ssm_dt_rank")),
        tensor_types=m.tensor_types(), assumed=tuple(dict.fromkeys(used)),
    )


def _int(value: object) -> int:
    return int(value) if isinstance(value, (int, float)) else 0


SMALL_EMBD, SMALL_FF, SMALL_VOCAB = 512, 256, 8192


def small_spec(arch: str) -> ModelSpec:
    """A few-MB stand-in for ``arch``'s first catalog model (or extra shape) that keeps its layout: the head width,
    the query/KV head ratio, the attention pattern (full-attention interval, sliding window, dense lead layers,
    the NextN block), shared experts, biases, gating and tied embeddings; widths, layer count, expert count and
    vocabulary shrink. For sweeps over ubatches against the engine (tests/plan/test_compute_sweep.py)."""
    if arch == "olmoe":
        spec = EXTRA_SHAPES["olmoe-1b-7b"]
    else:
        spec = spec_from_catalog(next(m for m in families.load_catalog() if m.gguf_arch == arch))
    n_head = min(spec.n_head, 8)
    n_head_kv = max(1, n_head * spec.n_head_kv // spec.n_head)
    period = spec.full_attention_interval or 1
    n_layer = max(4, 2 * period, spec.n_layer_dense_lead + 3)
    n_expert = min(spec.n_expert, 16)
    # Loaders that derive the head from the width (OLMoE: n_embd / n_head) need the width to stay heads x head.
    n_embd = n_head * spec.head_dim if spec.n_embd == spec.n_head * spec.head_dim else SMALL_EMBD
    shrink: dict[str, object] = dict(
        name=f"{spec.name} (small)", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        n_expert=n_expert, n_expert_used=min(spec.n_expert_used, n_expert // 2), n_vocab=SMALL_VOCAB,
        n_ff_exp=SMALL_FF if spec.n_expert else 0, n_ff_shexp=SMALL_FF if spec.n_expert_shared else 0,
        n_ff_dense=4 * SMALL_FF if spec.n_ff_dense else 0, tensor_types=(),
    )
    if spec.full_attention_interval:  # delta-net heads: keep twice as many value heads as key heads
        shrink.update(ssm_d_state=64, ssm_n_group=4, ssm_dt_rank=8)
    return replace(spec, **shrink)  # type: ignore[arg-type]


# --- writing ---------------------------------------------------------------------------------------------


def write_shape_model(spec: ModelSpec, recipe: str, path: Path, *, weights: str = "zero", seed: int = 0,
                      engine: EngineLocation | None = None) -> ShapeFile:
    """Write ``spec`` quantized by ``recipe`` to ``path`` (atomically): real header; the data a sparse hole
    (``weights="zero"``) or valid weights (``"direct"``, drawn here; ``"random"``, which needs ``engine``'s
    llama-quantize once per ggml type to make the block pools)."""
    recipe = recipes.check_recipe(recipe)
    weights = gguf_writer.check_weights(weights)
    pools = {}
    if weights == "random":
        pools = block_pool.block_pools({t.typ for t in gguf_writer.planned_tensors(spec, recipe)}, engine)
    made = gguf_writer.write_model(Path(path), spec, recipe, synthetic_vocab(spec.n_vocab),
                                   title=f"{spec.name} (shape-true {recipe}, {weights} weights)", weights=weights,
                                   seed=seed, pools=pools)
    return ShapeFile(made.path, spec, recipe, made.logical_bytes, made.disk_bytes, made.n_tensors, weights, made.times)


def write_catalog_model(target: str, path: Path, *, weights: str = "zero", seed: int = 0,
                        engine: EngineLocation | None = None) -> ShapeFile:
    """``moe-tune shape-model`` in Python: ``write_catalog_model("qwen3-30b-a3b:Q4_K_M", path)``."""
    spec, recipe = resolve_target(target)
    return write_shape_model(spec, recipe, path, weights=weights, seed=seed, engine=engine)


def logical_bytes(spec: ModelSpec, recipe: str) -> int:
    """Tensor bytes of ``spec`` under ``recipe`` with alignment (the file adds its header, a few MB)."""
    return sum(-(-t.n_bytes // gguf_writer.ALIGNMENT) * gguf_writer.ALIGNMENT
               for t in gguf_writer.planned_tensors(spec, recipe))


def copy_header(src: Path, path: Path) -> ShapeFile:
    """A shape file from a real GGUF's header (a full file or a Hub stand-in): same header, sparse data."""
    src = Path(src)
    size = src.stat().st_size
    want, limit = min(size, 4 * 2**20), min(size, 256 * 2**20)
    with open(src, "rb") as f:
        while True:  # grow the read until the header's own length fields say it is whole
            f.seek(0)
            buf = f.read(want)
            end = header_end(buf)
            if end is None or end <= len(buf) or want >= limit:
                break
            want = min(max(2 * want, end), limit)
    if end is None or end > len(buf):
        raise UsageError(f"{src} has no complete GGUF header: pass a .gguf file or a Hub header stand-in")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(buf[:end])
        f.truncate(size)
    return ShapeFile(path, None, None, size, _disk_bytes(path), 0)


def _disk_bytes(path: Path) -> int:
    return path.stat().st_blocks * 512
