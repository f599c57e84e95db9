"""What a GGUF model is, read from its header alone: hyperparameters and bytes per tensor class.

The header is parsed straight from a memory map with ``struct``; tensor data is never touched, so a
multi-GB file costs the same as a small one. Split models (``name-00001-of-00003.gguf``) are one model:
every part's tensors are summed. Type sizes come from the ``gguf`` package.
"""

from __future__ import annotations

import functools
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from tuner.core.errors import GGUFFormatError
from tuner.core.model import ModelInfo, TensorClass, TensorInfo, is_routed_expert  # noqa: F401 - re-exported

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<idx>\d{5})-of-(?P<n>\d{5})\.gguf$", re.IGNORECASE)
# Architectures whose MTP head the pinned engine can draft with (--spec-type draft-mtp): src/models/*.cpp with
# an LLM_GRAPH_TYPE_DECODER_MTP graph, among the supported ones.
MTP_ARCHS = frozenset({"qwen35moe", "qwen35", "qwen3next", "glm4moe", "deepseek2"})
SUPPORTED_ARCHS = frozenset({
    "qwen3moe", "qwen35moe", "qwen35", "qwen3next", "qwen2moe", "gpt-oss", "glm4moe", "deepseek2", "mixtral",
    "llama", "llama4", "olmoe", "granitemoe", "bailingmoe", "ernie4_5-moe", "hunyuan-moe", "dots1",
    "gemma3", "gemma3n", "qwen3", "qwen2", "phimoe", "smallthinker", "grovemoe", "minimax-m2",
})

# GGUF value types: struct code for scalars; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _classify(name: str, recurrent_layer: bool) -> TensorClass:
    if name.startswith("token_embd"):
        return TensorClass.TOKEN_EMBD
    if not name.startswith("blk."):
        return TensorClass.OUTPUT
    if is_routed_expert(name) or "_exps." in name or "_chexps." in name:
        return TensorClass.ROUTED_EXPERTS
    if "shexp" in name:
        return TensorClass.SHARED_EXPERTS
    if ".ffn_gate_inp." in name or ".exp_probs_b" in name:
        return TensorClass.ROUTER
    if ".ffn_" in name and "_norm." not in name:
        return TensorClass.DENSE_FFN
    if recurrent_layer or ".ssm_" in name:
        return TensorClass.RECURRENT
    return TensorClass.ATTENTION


class _NeedMore(Exception):
    """A partial header ended before ``needed`` bytes (raised only by a cursor made with ``partial=True``)."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


class _Cursor:
    def __init__(self, buf: Any, path: Path, partial: bool = False) -> None:
        self.buf, self.pos, self.path, self.partial = buf, 0, path, partial

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            if self.partial:
                raise _NeedMore(self.pos + n)
            raise GGUFFormatError(self.path, "truncated header")

    def scalar(self, code: str) -> Any:
        size = struct.calcsize(code)
        self._need(size)
        (value,) = struct.unpack_from(code, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self._need(n)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            n = self.scalar("<Q")
            self._need(n)
            self.pos += n

    def value(self, vtype: int, keep_strings: bool) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type == _STRING:
                if keep_strings:
                    return [self.string() for _ in range(count)]
                self.skip_strings(count)  # vocabularies: skip, but remember the length
                return _Skipped(count)
            if item_type in _SCALARS:
                code = _SCALARS[item_type]
                size = struct.calcsize(code)
                self._need(size * count)
                if count > 4096:  # token types, scores: not needed
                    self.pos += size * count
                    return _Skipped(count)
                values = list(struct.unpack_from(f"<{count}{code[1]}", self.buf, self.pos))
                self.pos += size * count
                return values
            raise GGUFFormatError(self.path, f"unknown array item type {item_type}")
        raise GGUFFormatError(self.path, f"unknown value type {vtype}")


@dataclass(frozen=True, slots=True)
class _Skipped:
    count: int


@dataclass(frozen=True, slots=True)
class _Part:
    path: Path
    kv: dict[str, Any]
    tensors: list[tuple[str, int, tuple[int, ...], int]]  # name, type, shape, n_bytes


def _read_part(path: Path) -> _Part:
    try:
        with path.open("rb") as fh:
            size = path.stat().st_size
            if size < 24:
                raise GGUFFormatError(path, f"truncated: only {size} bytes")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, path, size)
    except OSError as exc:
        raise GGUFFormatError(path, exc.strerror or str(exc)) from exc


def _walk(cur: _Cursor) -> tuple[dict[str, Any], list[tuple[str, int, tuple[int, ...], int]], int]:
    """The one walk over a GGUF header: key/values, tensor infos, and where tensor data starts."""
    path = cur.path
    cur._need(4)
    if bytes(cur.buf[:4]) != GGUF_MAGIC:
        raise GGUFFormatError(path, "no GGUF magic")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise GGUFFormatError(path, f"GGUF version {version} is not supported")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    if n_tensors > 10_000_000 or n_kv > 10_000_000:
        raise GGUFFormatError(path, "corrupt header counts")
    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        kv[key] = cur.value(cur.scalar("<I"), keep_strings=not key.startswith("tokenizer."))
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        if n_dims > 8:
            raise GGUFFormatError(path, f"tensor {name} has {n_dims} dims")
        shape = tuple(cur.scalar("<Q") for _ in range(n_dims))
        ttype, offset = cur.scalar("<I"), cur.scalar("<Q")
        tensors.append((name, ttype, shape, offset))
    alignment = int(kv.get("general.alignment", DEFAULT_ALIGNMENT)) or DEFAULT_ALIGNMENT
    return kv, tensors, -(-cur.pos // alignment) * alignment


def header_end(buf: bytes) -> int | None:
    """Where tensor data starts in a header that may be cut short.

    A value above ``len(buf)`` means more bytes are needed (at least that many); None means ``buf`` is not
    a GGUF v2/v3 header. Lets a caller read a growing prefix (an HTTP range, a file) until the header is whole.
    """
    try:
        return _walk(_Cursor(buf, Path("<header>"), partial=True))[2]
    except _NeedMore as more:
        return max(more.needed, len(buf) + 1)
    except GGUFFormatError:
        return None


def local_header_bytes(path: Path, first_bytes: int = 256 * 1024, max_bytes: int = 256 * 2**20) -> int:
    """Header size of a local GGUF (a stand-in or a whole file); 0 when it holds no whole GGUF header."""
    size = path.stat().st_size
    want = min(first_bytes, size)
    with open(path, "rb") as f:
        while True:
            f.seek(0)
            buf = f.read(want)
            end = header_end(buf)
            if end is None:
                return 0
            if end <= len(buf):
                return end
            if want >= min(size, max_bytes):
                return 0
            want = min(max(want * 2, end), size, max_bytes)


def split_name(name: str) -> tuple[str, int, int] | None:
    """``("Model-Q8_0", 1, 3)`` for ``Model-Q8_0-00001-of-00003.gguf``; None for a single-file model."""
    m = SPLIT_RE.match(name)
    return (m["stem"], int(m["idx"]), int(m["n"])) if m else None


def _parse(buf: Any, path: Path, size: int) -> _Part:
    kv, tensors, data_start = _walk(_Cursor(buf, path))
    out, end = [], data_start
    for name, ttype, shape, offset in tensors:
        n_bytes = _n_bytes(path, name, ttype, shape)
        end = max(end, data_start + offset + n_bytes)
        out.append((name, ttype, shape, n_bytes))
    if end > size:
        raise GGUFFormatError(path, f"truncated: tensor data ends at byte {end}, file has {size}")
    return _Part(path, kv, out)


def _n_bytes(path: Path, name: str, ttype: int, shape: tuple[int, ...]) -> int:
    try:
        qtype = gguf.GGMLQuantizationType(ttype)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise GGUFFormatError(path, f"tensor {name} has unknown type {ttype}") from None
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size


def split_parts(path: Path) -> list[Path]:
    """All parts of a split model given any one part; a single-file model is its own only part."""
    split = split_name(path.name)
    if split is None:
        return [path]
    stem, _, n = split
    parts = [path.with_name(f"{stem}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFFormatError(path, f"split part {missing[0]} is missing; download every part")
    return parts


def inspect_model(path: Path) -> ModelInfo:
    """Read a (possibly split) GGUF model's header into a :class:`ModelInfo`.

    Read once per process: a file seen again (same path, size and modification time of every part) is served
    from memory, so the callers along one tune (search, quality, reference lookup) share one parse.
    """
    path = Path(path)
    if not path.is_file():
        raise GGUFFormatError(path, "file not found")
    parts = tuple(split_parts(path))
    stats = [(p, p.stat()) for p in parts]
    stamp = tuple((str(p.resolve()), st.st_size, st.st_mtime_ns) for p, st in stats)
    return _inspect_parts(path, parts, stamp)


@functools.lru_cache(maxsize=64)
def _inspect_parts(path: Path, part_paths: tuple[Path, ...], stamp: tuple[tuple[str, int, int], ...]) -> ModelInfo:
    del stamp  # the cache key: a rewritten file is read again
    parts = [_read_part(p) for p in part_paths]
    kv = parts[0].kv
    arch = kv.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFFormatError(path, "no general.architecture key")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFFormatError(path, f"architecture {arch!r} is not supported")
    raw = [t for p in parts for t in p.tensors]
    return _model_info(tuple(p.path for p in parts), arch, kv, raw)


def _model_info(paths: tuple[Path, ...], arch: str, kv: dict[str, Any],
                raw: list[tuple[str, int, tuple[int, ...], int]]) -> ModelInfo:
    def get(key: str, default: Any = 0) -> Any:
        return kv.get(f"{arch}.{key}", default)

    n_layer = int(get("block_count"))
    n_embd = int(get("embedding_length"))
    n_head = _first(get("attention.head_count"))
    head_dim_k = int(get("attention.key_length", n_embd // max(n_head, 1)))
    head_dim_v = int(get("attention.value_length", head_dim_k))
    fai = int(get("full_attention_interval", 0))
    ssm_state = int(get("ssm.state_size", 0))
    trunk = n_layer - int(get("nextn_predict_layers", 0))  # NextN/MTP blocks are full attention
    recurrent = tuple(il < trunk and _is_recurrent(arch, il, fai, ssm_state) for il in range(n_layer))
    head_kv = get("attention.head_count_kv", n_head)
    per_layer_kv = list(head_kv) if isinstance(head_kv, list) else [int(head_kv)] * n_layer
    n_head_kv = tuple(0 if recurrent[il] else int(per_layer_kv[il]) for il in range(n_layer))
    n_swa = int(get("attention.sliding_window", 0))
    swa_layers = _swa_layers(arch, kv, n_layer, n_swa)
    tokens = kv.get("tokenizer.ggml.tokens")
    n_vocab = tokens.count if isinstance(tokens, _Skipped) else len(tokens or [])
    tensors = tuple(
        TensorInfo(name, gguf.GGMLQuantizationType(t).name, shape, nb, _layer_of(name),
                   _classify(name, _layer_of(name) is not None and recurrent[_layer_of(name) or 0]))
        for name, t, shape, nb in raw
    )
    if not n_vocab:
        n_vocab = next((t.shape[1] for t in tensors if t.name == "token_embd.weight"), 0)
    file_type = kv.get("general.file_type")
    return ModelInfo(
        paths=paths, arch=arch, name=str(kv.get("general.name", paths[0].stem)),
        file_type=None if file_type is None else int(file_type),
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim_k=head_dim_k, head_dim_v=head_dim_v, n_vocab=n_vocab,
        ctx_train=int(get("context_length")), n_expert=int(get("expert_count")),
        n_expert_used=int(get("expert_used_count")), n_expert_shared=int(get("expert_shared_count", 0)),
        n_ff_exp=int(get("expert_feed_forward_length")),
        n_ff_shexp=int(get("expert_shared_feed_forward_length", 0)),
        n_swa=n_swa, swa_layers=swa_layers, full_attention_interval=fai, recurrent_layers=recurrent,
        ssm_d_conv=int(get("ssm.conv_kernel", 0)), ssm_d_inner=int(get("ssm.inner_size", 0)),
        ssm_d_state=ssm_state, ssm_n_group=int(get("ssm.group_count", 0)),
        ssm_dt_rank=int(get("ssm.time_step_rank", 0)),
        mla_kv_lora_rank=int(get("attention.kv_lora_rank", 0)),
        mla_rope_dim=int(get("rope.dimension_count", 0)) if get("attention.kv_lora_rank", 0) else 0,
        tensors=tensors, n_nextn_layers=int(get("nextn_predict_layers", 0)),
        tokenizer_ids=(str(kv.get("tokenizer.ggml.model", "")), int(kv.get("tokenizer.ggml.bos_token_id", -1)),
                       int(kv.get("tokenizer.ggml.eos_token_id", -1))),
    )


def has_mtp_head(info: ModelInfo) -> bool:
    """The file carries a NextN/MTP block the pinned engine can draft with (``--spec-type draft-mtp``)."""
    return (info.arch in MTP_ARCHS and info.n_nextn_layers > 0
            and any(t.name.endswith(".nextn.eh_proj.weight") for t in info.tensors))


def _first(value: Any) -> int:
    return int(value[0]) if isinstance(value, list) else int(value)


def _is_recurrent(arch: str, layer: int, interval: int, ssm_state: int) -> bool:
    if arch in ("qwen35moe", "qwen35", "qwen3next") and interval:  # qwen35: the dense hybrid (Qwen3.5-9B/27B)
        return (layer + 1) % interval != 0
    return False


def _swa_layers(arch: str, kv: dict[str, Any], n_layer: int, n_swa: int) -> tuple[bool, ...]:
    if not n_swa:
        return (False,) * n_layer
    pattern = kv.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return tuple(bool(p) for p in pattern[:n_layer])
    # gpt-oss alternates (even layers slide); Gemma 3 uses 5 sliding then 1 full.
    period = int(pattern) if isinstance(pattern, int) and pattern else (2 if arch == "gpt-oss" else 6)
    return tuple((il % period) < period - 1 for il in range(n_layer))


def _layer_of(name: str) -> int | None:
    if not name.startswith("blk."):
        return None
    return int(name.split(".", 2)[1])
