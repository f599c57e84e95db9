"""Shape-true models: GGUFs with a real model's header and a sparse hole where the weights would be.

The header carries the architecture keys, a vocabulary of the real size (synthetic token strings that
llama.cpp's BPE loader accepts), and every tensor's name, shape and quantization type; the data region is
left unwritten and the file is truncated to its full size. Gigabytes logical, a few MB on disk, written in
seconds, and ``llama-fit-params`` / ``tuner.models.gguf_reader`` read it exactly as they read the real file.

Shapes come from (a) the quant catalog's architecture facts plus a quantization recipe
(:func:`spec_from_catalog`, :func:`write_shape_model`), or (b) a real GGUF header, e.g. one fetched from
the Hub with a range request (:func:`copy_header`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from tuner.catalog import families
from tuner.core.errors import UsageError
from tuner.hub.remote_header import header_end
from tuner.models import recipes
from tuner.models.recipes import Q, TensorShape

SHAPE_ARCHS = ("qwen3moe", "qwen35moe", "qwen3next", "gpt-oss", "glm4moe")
ALIGNMENT = 32
_N_BYTE_TOKENS = 256
# Facts the catalog leaves null or does not carry, per catalog model; each is named in ShapeSpec.assumed.
_ASSUMED: dict[str, dict[str, object]] = {
    "qwen35moe": {"n_vocab": 248320, "rope_dim": 64, "rope_sections": (11, 11, 10, 0), "tied": False,
                  "rope_theta": 10_000_000.0},
    "qwen3next": {"rope_dim": 64, "tied": False},
    "glm4moe": {"n_ff_dense": 10944, "rope_dim": 64, "tied": False},
    "gpt-oss": {},
    "qwen3moe": {},
}
_TOKENIZER_PRE = {"qwen3moe": "qwen2", "qwen35moe": "qwen35", "qwen3next": "qwen2", "gpt-oss": "gpt-4o",
                  "glm4moe": "glm4"}


@dataclass(frozen=True, slots=True)
class ShapeSpec:
    arch: str
    name: str
    n_layer: int  # trunk layers (without NextN/MTP layers)
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int
    ctx_train: int
    n_expert_shared: int = 0
    n_ff_shexp: int = 0
    n_ff_dense: int = 0
    n_layer_dense_lead: int = 0
    n_layer_nextn: int = 0
    tied: bool = False
    rope_theta: float = 1_000_000.0
    rope_dim: int = 0  # 0: the whole head
    rope_sections: tuple[int, int, int, int] = (0, 0, 0, 0)
    n_swa: int = 0
    full_attention_interval: int = 0
    ssm_d_conv: int = 0
    ssm_d_state: int = 0
    ssm_n_group: int = 0
    ssm_dt_rank: int = 0
    assumed: tuple[str, ...] = field(default=())  # fields not taken from the catalog

    @property
    def n_layer_all(self) -> int:
        return self.n_layer + self.n_layer_nextn

    def is_recurrent(self, il: int) -> bool:
        return bool(self.full_attention_interval) and il < self.n_layer and (il + 1) % self.full_attention_interval != 0


@dataclass(frozen=True, slots=True)
class ShapeFile:
    path: Path
    spec: ShapeSpec | None
    recipe: str | None
    logical_bytes: int
    disk_bytes: int
    n_tensors: int


def known_models() -> list[str]:
    return [m.name for m in families.load_catalog() if m.gguf_arch in SHAPE_ARCHS]


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


def spec_from_catalog(m: families.CatalogModel) -> ShapeSpec:
    arch = m.gguf_arch
    if arch not in SHAPE_ARCHS:
        raise UsageError(f"{m.name} ({arch}) has no shape writer: use one of {', '.join(known_models())}")
    assumed = _ASSUMED[arch]
    used: list[str] = [k for k in ("rope_dim", "rope_sections", "n_ff_dense") if k in assumed]

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
    tied = m.arch("tied_embeddings")
    if tied is None:
        used.append("tied")
        tied = bool(assumed.get("tied", False))
    sections = assumed.get("rope_sections", (0, 0, 0, 0))
    return ShapeSpec(
        arch=arch, name=m.name, n_layer=_int(fact("n_layer")), n_embd=_int(fact("n_embd")),
        n_head=_int(fact("n_head")), n_head_kv=_int(fact("n_head_kv")), head_dim=_int(fact("head_dim")),
        n_expert=_int(fact("n_expert")), n_expert_used=_int(fact("n_expert_used")), n_ff_exp=n_ff_exp,
        n_vocab=_int(fact("n_vocab")), ctx_train=_int(fact("ctx_train")), n_expert_shared=n_expert_shared,
        n_ff_shexp=_int(fact("n_ff_shexp")) or n_ff_exp * n_expert_shared,
        n_ff_dense=_int(assumed.get("n_ff_dense", 0)), n_layer_dense_lead=_int(fact("n_layer_dense_lead")),
        n_layer_nextn=_int(fact("n_layer_nextn")), tied=bool(tied),
        rope_theta=float(str(fact("rope_theta", 1_000_000.0))), rope_dim=_int(assumed.get("rope_dim", 0)),
        rope_sections=tuple(int(x) for x in sections) if isinstance(sections, tuple) else (0, 0, 0, 0),  # type: ignore[arg-type]
        n_swa=_int(fact("swa_window")), full_attention_interval=_int(fact("full_attention_interval")),
        ssm_d_conv=_int(fact("ssm_d_conv")), ssm_d_state=_int(fact("ssm_d_state")),
        ssm_n_group=_int(fact("ssm_n_group")), ssm_dt_rank=_int(fact("ssm_dt_rank")),
        assumed=tuple(dict.fromkeys(used)),
    )


def _int(value: object) -> int:
    return int(value) if isinstance(value, (int, float)) else 0


# --- tensor plans: what each architecture's llama.cpp loader asks for, in ggml (ne) order ---------------


def tensor_plan(s: ShapeSpec) -> list[TensorShape]:
    e, v = s.n_embd, s.n_vocab
    plan = [TensorShape("token_embd.weight", (e, v))]
    for il in range(s.n_layer_all):
        plan += _layer_plan(s, il)
    plan.append(TensorShape("output_norm.weight", (e,)))
    if not s.tied:
        plan.append(TensorShape("output.weight", (e, v)))
    return plan


def _layer_plan(s: ShapeSpec, il: int) -> list[TensorShape]:
    b, e, hd = f"blk.{il}", s.n_embd, s.head_dim
    q_width, kv_width = hd * s.n_head, hd * s.n_head_kv
    t = [TensorShape(f"{b}.attn_norm.weight", (e,))]
    if s.is_recurrent(il):
        key_dim, value_dim = s.ssm_d_state * s.ssm_n_group, s.ssm_d_state * s.ssm_dt_rank
        conv_dim = 2 * key_dim + value_dim
        if s.arch == "qwen3next":  # one fused q/k/v/z input projection and one fused beta/alpha
            t.append(TensorShape(f"{b}.ssm_in.weight", (e, 2 * key_dim + 2 * value_dim)))
        else:
            t += [TensorShape(f"{b}.attn_qkv.weight", (e, conv_dim)),
                  TensorShape(f"{b}.attn_gate.weight", (e, value_dim))]
        t += [TensorShape(f"{b}.ssm_conv1d.weight", (s.ssm_d_conv, conv_dim)),
              TensorShape(f"{b}.ssm_dt.bias", (s.ssm_dt_rank,)), TensorShape(f"{b}.ssm_a", (s.ssm_dt_rank,))]
        if s.arch == "qwen3next":
            t.append(TensorShape(f"{b}.ssm_ba.weight", (e, 2 * s.ssm_dt_rank)))
        else:
            t += [TensorShape(f"{b}.ssm_beta.weight", (e, s.ssm_dt_rank)),
                  TensorShape(f"{b}.ssm_alpha.weight", (e, s.ssm_dt_rank))]
        t += [TensorShape(f"{b}.ssm_norm.weight", (s.ssm_d_state,)),
              TensorShape(f"{b}.ssm_out.weight", (value_dim, e))]
    else:
        gated = s.arch in ("qwen35moe", "qwen3next")  # a query and an output gate per head
        t += [TensorShape(f"{b}.attn_q.weight", (e, q_width * (2 if gated else 1))),
              TensorShape(f"{b}.attn_k.weight", (e, kv_width)), TensorShape(f"{b}.attn_v.weight", (e, kv_width))]
        if s.arch in ("gpt-oss", "glm4moe"):
            t += [TensorShape(f"{b}.attn_q.bias", (q_width,)), TensorShape(f"{b}.attn_k.bias", (kv_width,)),
                  TensorShape(f"{b}.attn_v.bias", (kv_width,))]
        t.append(TensorShape(f"{b}.attn_output.weight", (q_width, e)))
        if s.arch == "gpt-oss":
            t += [TensorShape(f"{b}.attn_output.bias", (e,)), TensorShape(f"{b}.attn_sinks.weight", (s.n_head,))]
        if s.arch != "gpt-oss" and s.arch != "glm4moe":
            t += [TensorShape(f"{b}.attn_q_norm.weight", (hd,)), TensorShape(f"{b}.attn_k_norm.weight", (hd,))]
    post = "ffn_norm" if s.arch == "qwen3moe" else "post_attention_norm"
    t.append(TensorShape(f"{b}.{post}.weight", (e,)))
    if il < s.n_layer_dense_lead:
        dense = s.n_ff_dense
        t += [TensorShape(f"{b}.ffn_gate.weight", (e, dense)), TensorShape(f"{b}.ffn_down.weight", (dense, e)),
              TensorShape(f"{b}.ffn_up.weight", (e, dense))]
    else:
        ff, ne = s.n_ff_exp, s.n_expert
        t += [TensorShape(f"{b}.ffn_gate_inp.weight", (e, ne))]
        if s.arch == "gpt-oss":
            t.append(TensorShape(f"{b}.ffn_gate_inp.bias", (ne,)))
        if s.arch == "glm4moe":
            t.append(TensorShape(f"{b}.exp_probs_b.bias", (ne,)))
        t += [TensorShape(f"{b}.ffn_gate_exps.weight", (e, ff, ne)),
              TensorShape(f"{b}.ffn_down_exps.weight", (ff, e, ne)),
              TensorShape(f"{b}.ffn_up_exps.weight", (e, ff, ne))]
        if s.arch == "gpt-oss":
            t += [TensorShape(f"{b}.ffn_gate_exps.bias", (ff, ne)), TensorShape(f"{b}.ffn_down_exps.bias", (e, ne)),
                  TensorShape(f"{b}.ffn_up_exps.bias", (ff, ne))]
        if s.n_ff_shexp and s.n_expert_shared:
            if s.arch in ("qwen35moe", "qwen3next"):
                t.append(TensorShape(f"{b}.ffn_gate_inp_shexp.weight", (e,)))
            sh = s.n_ff_shexp
            t += [TensorShape(f"{b}.ffn_gate_shexp.weight", (e, sh)),
                  TensorShape(f"{b}.ffn_down_shexp.weight", (sh, e)), TensorShape(f"{b}.ffn_up_shexp.weight", (e, sh))]
    if il >= s.n_layer:  # NextN / MTP block (GLM-4.5): predicts one more token; llama.cpp skips it by default
        t += [TensorShape(f"{b}.nextn.eh_proj.weight", (2 * e, e)), TensorShape(f"{b}.nextn.enorm.weight", (e,)),
              TensorShape(f"{b}.nextn.hnorm.weight", (e,)), TensorShape(f"{b}.nextn.shared_head_norm.weight", (e,))]
    return t


# --- writing ---------------------------------------------------------------------------------------------


def write_shape_model(spec: ShapeSpec, recipe: str, path: Path) -> ShapeFile:
    """Write ``spec`` quantized by ``recipe`` to ``path`` (atomically): real header, sparse data."""
    recipe = recipes.check_recipe(recipe)
    plan = tensor_plan(spec)
    types = recipes.assign_types(plan, recipe, spec.n_expert, spec.n_layer_all)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, spec.arch)
    data_bytes = 0
    try:
        _add_metadata(writer, spec, recipe)
        for t, typ in zip(plan, types, strict=True):
            nb = recipes.n_bytes(t.ne, typ)
            if typ in (Q.F32, Q.F16):
                dtype = np.dtype(np.float32 if typ is Q.F32 else np.float16)
                writer.add_tensor_info(t.name, tuple(reversed(t.ne)), dtype, nb)
            else:
                block, size = gguf.GGML_QUANT_SIZES[typ]
                byte_shape = (*reversed(t.ne[1:]), t.ne[0] // block * size)
                writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nb, raw_dtype=typ)
            data_bytes += -(-nb // ALIGNMENT) * ALIGNMENT
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        header = tmp.stat().st_size
        with open(tmp, "r+b") as f:  # the hole: tensor data is never written
            f.truncate(-(-header // ALIGNMENT) * ALIGNMENT + data_bytes)
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return ShapeFile(path, spec, recipe, path.stat().st_size, _disk_bytes(path), len(plan))


def write_catalog_model(target: str, path: Path) -> ShapeFile:
    """``moe-tune shape-model`` in Python: ``write_catalog_model("qwen3-30b-a3b:Q4_K_M", path)``."""
    model, recipe = parse_target(target)
    return write_shape_model(spec_from_catalog(model), recipe, path)


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


def _add_metadata(w: gguf.GGUFWriter, s: ShapeSpec, recipe: str) -> None:
    w.add_name(f"{s.name} (shape-true {recipe})")
    w.add_file_type(recipes.RECIPES[recipe][1])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(s.ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer_all)
    w.add_feed_forward_length(s.n_ff_dense or s.n_ff_exp)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(1e-6 if s.arch != "gpt-oss" else 1e-5)
    w.add_rope_freq_base(s.rope_theta)
    w.add_rope_dimension_count(s.rope_dim or s.head_dim)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_expert_feed_forward_length(s.n_ff_exp)
    if s.n_expert_shared:
        w.add_expert_shared_count(s.n_expert_shared)
        w.add_expert_shared_feed_forward_length(s.n_ff_shexp)
    if s.n_swa:
        w.add_sliding_window(s.n_swa)
    if s.arch == "glm4moe":
        w.add_leading_dense_block_count(s.n_layer_dense_lead)
        w.add_nextn_predict_layers(s.n_layer_nextn)
        w.add_expert_weights_scale(1.0)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if s.full_attention_interval:
        w.add_ssm_conv_kernel(s.ssm_d_conv)
        w.add_ssm_inner_size(s.ssm_d_state * s.ssm_dt_rank)
        w.add_ssm_state_size(s.ssm_d_state)
        w.add_ssm_time_step_rank(s.ssm_dt_rank)
        w.add_ssm_group_count(s.ssm_n_group)
        w.add_full_attention_interval(s.full_attention_interval)
    if any(s.rope_sections):
        w.add_rope_dimension_sections(list(s.rope_sections))
    _add_vocab(w, s)


def _add_vocab(w: gguf.GGUFWriter, s: ShapeSpec) -> None:
    """A BPE vocabulary of the real size: the 256 byte tokens, synthetic fillers, control tokens last."""
    from tuner.models.vocab import byte_to_unicode

    byte_tokens = [byte_to_unicode()[b] for b in range(_N_BYTE_TOKENS)]
    n_fill = s.n_vocab - _N_BYTE_TOKENS - 2
    tokens = byte_tokens + [f"t{i}" for i in range(n_fill)] + ["<|endoftext|>", "<|im_end|>"]
    types = [int(gguf.TokenType.NORMAL)] * (s.n_vocab - 2) + [int(gguf.TokenType.CONTROL)] * 2
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_TOKENIZER_PRE.get(s.arch, "default"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ Ġ"])  # the loader needs the key; an empty array is not written
    w.add_bos_token_id(s.n_vocab - 2)
    w.add_eos_token_id(s.n_vocab - 1)


# --- what `moe-tune plan` plans: a file, a Hub quant's header, or a catalog shape ------------------------


@dataclass(frozen=True, slots=True)
class PlannableModel:
    path: Path  # a GGUF (or stand-in / shape file) that tuner.models.gguf_reader and llama-fit-params read
    source: str  # where the header came from, in the user's words


def plannable_model(name: str, cache_dir: Path | None = None) -> PlannableModel:
    """A local .gguf; ``REPO[:QUANT]`` read header-only with range requests; or ``CATALOG-NAME[:RECIPE]``
    written as a shape-true file. Nothing is downloaded beyond a header."""
    path = Path(name).expanduser()
    if path.is_file():
        return PlannableModel(path, "file")
    from tuner.hub import repos

    ref = repos.parse_hub_ref(name)
    if ref is not None:
        from tuner.hub import remote_header

        listing = repos.list_quants(ref.repo_id)
        quant = listing.get(ref.quant)
        headers = remote_header.read_quant_headers(ref.repo_id, quant, commit=listing.commit or "main")
        return PlannableModel(headers.first_path, f"header of {ref.repo_id}:{quant.name} (range requests, no download)")
    if path.suffix == ".gguf":
        raise UsageError(f"model {name} not found: give a .gguf path, owner/name:QUANT, or a catalog name "
                         "like qwen3-30b-a3b:Q4_K_M")
    model, recipe = parse_target(name)
    from tuner.machine import paths

    folder = cache_dir or paths.cache_root() / "shape-models"
    made = write_shape_model(spec_from_catalog(model), recipe, folder / f"{model.name}-{recipe}.gguf")
    return PlannableModel(made.path, f"shape-true {model.name} {recipe} from the quant catalog")
