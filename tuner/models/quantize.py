"""Make the quants nobody published: the engine's own llama-quantize on a full-precision source.

A :class:`Recipe` is one llama-quantize file type (``Q4_K_M``, ``IQ4_XS``, the names its ``--help`` lists), or a
MoE-aware mix written ``EXPERTS/REST``: the routed experts at the file type ``EXPERTS`` (with its own
mixture rules), and every other weight — attention, shared experts, dense FFN layers, token embeddings and
output — at the ggml type ``REST``, expressed with llama-quantize's own per-tensor options (see
:mod:`tuner.engine.flags.quantize`). Each made file keeps, beside it, the exact command that made it and the
source's identity, so a second run reuses it and a report can say "made here" with the command.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf

from tuner.core.errors import ProcessFailedError, QuantizeError, UsageError
from tuner.core.model import ModelInfo, TensorClass
from tuner.engine import flags, runner
from tuner.engine.build import EngineLocation
from tuner.machine.fileio import atomic_write
from tuner.models import gguf_reader, recipes

# Regexes searched in tensor names (llama_tensor_get_type in src/llama-quant.cpp, std::regex_search, ECMAScript):
# what a MoE mix keeps at the higher type besides the embeddings and output (their own options). One pattern,
# "every tensor but the routed experts": a list of what to keep high missed families' own weights (the ssm_*
# linear-attention tensors of qwen35moe and qwen3next, attn_qkv/attn_gate), so it names what to leave out
# instead. Routed experts are `*_exps` (and `*_chexps`, ERNIE's) in llm_tensor names (src/llama-arch.cpp).
# Tensors llama-quantize never quantizes (1-D norms and biases, ffn_gate_inp, ssm_conv1d) stay as they are:
# tensor_allows_quantization() is checked before any pattern.
MIX_HIGH_PATTERNS = (r"^(?!.*_(ch)?exps\.)",)
# ggml tensor types a `--tensor-type` may name (ggml_type_name, matched case-insensitively by llama-quantize).
GGML_TYPES = frozenset(t.name for t in gguf.GGMLQuantizationType)
MADE_SUFFIX = ".made.json"
# general.file_type (llama_ftype) of sources quantized from without --allow-requantize: F32, F16, BF16.
FULL_PRECISION_FILE_TYPES = (0, 1, 32)
QUANTIZE_TIMEOUT_S = 6 * 3600.0
# Alignment padding GGUF puts after each tensor (general.alignment defaults to 32): a bound for the estimate.
_TENSOR_PAD_BYTES = 32


@dataclass(frozen=True, slots=True)
class Recipe:
    ftype: str  # a llama-quantize file type, e.g. Q4_K_M
    rest: str | None = None  # MoE mix: the ggml type of every non-expert weight, e.g. Q8_0

    @property
    def name(self) -> str:
        return f"{self.ftype}/{self.rest}" if self.rest else self.ftype

    @property
    def file_label(self) -> str:
        return f"{self.ftype}-moe-{self.rest}" if self.rest else self.ftype

    def describe(self) -> str:
        if not self.rest:
            return self.ftype
        return f"{self.ftype} experts, {self.rest} attention/shared/embeddings/output"


@dataclass(frozen=True, slots=True)
class MadeQuant:
    recipe: str
    path: Path
    size_bytes: int
    command: str  # the exact llama-quantize command line that wrote the file
    source: str
    reused: bool


@functools.cache
def _help_types(binary: str) -> tuple[str, ...]:
    # llama-quantize prints its usage and exits 1 (tools/quantize/quantize.cpp `usage`).
    res = runner.run_process(flags.help_argv(Path(binary)), timeout_s=60, what="llama-quantize --help",
                             fix="reinstall the engine: moe-tune engine install --force", check=False)
    return flags.parse_quant_types(res.stdout + "\n" + res.stderr_tail)


def available_types(loc: EngineLocation) -> tuple[str, ...]:
    """The quant types this engine's llama-quantize lists in its ``--help``."""
    types = _help_types(str(loc.tool(flags.QUANTIZE)))
    if not types:
        raise QuantizeError("llama-quantize --help listed no quant types: reinstall the engine "
                            "(moe-tune engine install --force)")
    return types


def parse_recipes(text: str, available: Sequence[str]) -> tuple[Recipe, ...]:
    """``Q4_K_M,IQ4_XS,Q3_K_M/Q8_0`` → recipes, checked against llama-quantize's own list of types."""
    known = {t.upper(): t for t in available}
    recipes = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        experts, _, rest = item.partition("/")
        ftype = known.get(experts.strip().upper())
        if ftype is None:
            raise UsageError(f"llama-quantize here has no quant type {experts.strip()!r}: pick from "
                             f"{', '.join(available)} (a MoE mix is EXPERTS/REST, e.g. Q3_K_M/Q8_0)")
        if rest:
            rest = rest.strip().upper()
            if rest not in GGML_TYPES:
                raise UsageError(f"{rest!r} is not a ggml tensor type for the non-expert weights of {item}: use "
                                 "one like Q8_0, Q6_K, Q5_K, F16 or BF16")
        recipes.append(Recipe(ftype, rest or None))
    if not recipes:
        raise UsageError("--make names no quant types: e.g. --make Q4_K_M,IQ4_XS,Q3_K_M/Q8_0")
    return tuple(dict.fromkeys(recipes))


def _argv(loc: EngineLocation, recipe: Recipe, source: Path, dest: Path, imatrix: Path | None,
          dry_run: bool = False) -> list[str]:
    mix = recipe.rest
    return flags.quantize_argv(
        loc.tool(flags.QUANTIZE), source, dest, recipe.ftype,
        tensor_types=[(p, mix) for p in MIX_HIGH_PATTERNS] if mix else (),
        output_tensor_type=mix, token_embedding_type=mix, imatrix=imatrix, dry_run=dry_run,
        allow_requantize=gguf_reader.inspect_model(source).file_type not in FULL_PRECISION_FILE_TYPES)


def made_path(source: Path, out_dir: Path, recipe: Recipe, imatrix: Path | None) -> Path:
    """``<source name without its quant>-<recipe>[-imat].gguf`` in ``out_dir``."""
    split = gguf_reader.split_name(source.name)
    stem = split[0] if split else source.stem
    for tag in ("-F32", "-BF16", "-F16", "-Q8_0"):
        if stem.upper().endswith(tag):
            stem = stem[: -len(tag)]
            break
    return out_dir / f"{stem}-{recipe.file_label}{'-imat' if imatrix else ''}.gguf"


def source_identity(source: Path) -> str:
    """Size and mtime of every part: cheap, and a re-converted source differs in both."""
    parts = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in gguf_reader.split_parts(source)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def estimate_bytes(loc: EngineLocation, source: Path, recipe: Recipe, imatrix: Path | None = None) -> int:
    """The made file's size before making it: llama-quantize's own ``--dry-run`` tensor bytes, plus the
    source's header and the per-tensor alignment padding (an upper bound, so a disk budget holds)."""
    argv = _argv(loc, recipe, source, source, imatrix, dry_run=True)
    res = runner.run_process(argv, timeout_s=600, what=f"llama-quantize --dry-run {recipe.ftype}",
                             fix="check the source model", check=False)
    tensor_bytes = flags.parse_quant_size_bytes(res.stdout + "\n" + res.stderr_tail)
    info = gguf_reader.inspect_model(source)
    if tensor_bytes is None:  # no dry run in this engine: the source's size bounds every quant of it
        return sum(p.stat().st_size for p in info.paths)
    header = gguf_reader.local_header_bytes(source)
    # The dry run rounds to 0.01 MiB; the margin covers that and the header's growth (quantization metadata).
    return tensor_bytes + header + _TENSOR_PAD_BYTES * len(info.tensors) + 2**16


def header_estimate_bytes(loc: EngineLocation, source: ModelInfo, recipe: Recipe) -> int | None:
    """The made file's size from the source's header alone (nothing fetched): every weight llama-quantize touches
    at the bits per weight its ``--help`` gives the type (the non-expert weights of a MoE mix at the ``rest`` type),
    the rest as the source holds it. An approximation (the type's mix on the engine's reference model), taken 5 %
    low so that a refusal on it is never wrong; :func:`estimate_bytes` (a dry run on the fetched source) is the
    exact figure. None when the engine does not size the type."""
    bpw = _help_bpw(str(loc.tool(flags.QUANTIZE))).get(recipe.ftype.upper())
    if bpw is None:
        return None
    total = 0.0
    for t in source.tensors:
        if not recipes.quantized_name(t.name, t.shape):
            total += t.n_bytes
            continue
        n = 1
        for d in t.shape:
            n *= d
        if recipe.rest and t.klass is not TensorClass.ROUTED_EXPERTS:
            total += recipes.n_bytes(t.shape, gguf.GGMLQuantizationType[recipe.rest.upper()])
        else:
            total += n * bpw / 8
    return int(0.95 * total)


@functools.cache
def _help_bpw(binary: str) -> dict[str, float]:
    res = runner.run_process(flags.help_argv(Path(binary)), timeout_s=60, what="llama-quantize --help",
                             fix="reinstall the engine: moe-tune engine install --force", check=False)
    return flags.parse_quant_bpw(res.stdout + "\n" + res.stderr_tail)


def make(loc: EngineLocation, source: Path, out_dir: Path, recipe: Recipe, *, imatrix: Path | None = None,
         on_step: Callable[[str], None] | None = None, on_log: Callable[[str], None] | None = None) -> MadeQuant:
    """Make ``recipe`` from ``source`` into ``out_dir`` (or reuse the file an identical command made before).
    ``on_log`` gets llama-quantize's output line by line (its per-tensor log says which type each tensor got)."""
    dest = made_path(source, out_dir, recipe, imatrix)
    argv = _argv(loc, recipe, source, dest, imatrix)
    command = shlex.join([Path(argv[0]).name, *argv[1:]])
    sidecar = dest.with_name(dest.name + MADE_SUFFIX)
    ident = source_identity(source)
    try:
        saved = json.loads(sidecar.read_text())
        if dest.is_file() and saved.get("command") == command and saved.get("source_identity") == ident:
            return MadeQuant(recipe.name, dest, dest.stat().st_size, command, str(source), True)
    except (OSError, ValueError):
        pass
    if on_step:
        on_step(f"making {recipe.describe()} from {source.name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    part_argv = _argv(loc, recipe, source, part, imatrix)
    try:
        runner.run_process(part_argv, timeout_s=QUANTIZE_TIMEOUT_S, what=f"llama-quantize {recipe.name}",
                           fix="check the source and the quant type", on_line=on_log)
    except ProcessFailedError as exc:
        part.unlink(missing_ok=True)
        if "requires an importance matrix" in (exc.stderr_tail or "") + str(exc):
            raise QuantizeError(f"{recipe.name} needs an importance matrix: add --imatrix") from None
        raise
    part.replace(dest)
    made = MadeQuant(recipe.name, dest, dest.stat().st_size, command, str(source), False)
    atomic_write(sidecar, json.dumps({**asdict(made), "path": str(dest), "source_identity": ident}, indent=1))
    return made


def made_command(path: Path) -> str | None:
    """The command that made ``path`` here, or None for a file this tool did not make."""
    try:
        return str(json.loads(path.with_name(path.name + MADE_SUFFIX).read_text())["command"])
    except (OSError, ValueError, KeyError):
        return None


def drop(path: Path) -> int:
    """Delete a made or downloaded file and its sidecar; the bytes freed."""
    freed = 0
    for p in (path, path.with_name(path.name + MADE_SUFFIX)):
        if p.is_file():
            freed += p.stat().st_size
            p.unlink()
    return freed
