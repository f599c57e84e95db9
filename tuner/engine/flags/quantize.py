"""argv for llama-quantize and llama-imatrix, and the two things read back from llama-quantize's output: the
quant types its ``--help`` lists and the size a ``--dry-run`` reports.

Modelled on the pinned tools/quantize/quantize.cpp (``usage``, ``parse_tensor_type``, ``QUANT_OPTIONS``) and
src/llama-quant.cpp (``llama_tensor_get_type``: a ``--tensor-type NAME=TYPE`` pattern is a regex searched in the
tensor's name and overrides the mixture's choice; ``--output-tensor-type``/``--token-embedding-type`` set those
two tensors).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

QUANTIZE = "llama-quantize"
IMATRIX = "llama-imatrix"

# `  15  or  Q4_K_M  :  4.58G, +0.1754 ppl @ Llama-3-8B` in the "allowed quantization types" list.
_TYPE_LINE = re.compile(r"^\s*\d+\s+or\s+([A-Z0-9_]+)\s*:", re.MULTILINE)
# llama_model_quantize_impl: `quant size  =    12.34 MiB (4.89 BPW)`
_QUANT_SIZE = re.compile(r"quant size\s*=\s*([0-9.]+)\s*MiB")
# llama-quantize's usage (tools/quantize/quantize.cpp QUANT_OPTIONS) sizes each type either as "4.58G, +0.1754 ppl @
# Llama-3-8B" (GiB of the whole 8B model) or as "4.25 bpw"; the models' parameter counts (Meta's Llama-3-8B card:
# 8.03 B; Mistral's 7B paper: 7.24 B) turn the first kind into bits per weight.
_SIZE_LINE = re.compile(r"^\s*\d+\s+or\s+([A-Z0-9_]+)\s*:\s*([0-9.]+)(G,.*@\s*(\S+)|\s*bpw)", re.MULTILINE)
_REFERENCE_PARAMS = {"Llama-3-8B": 8.03e9, "Mistral-7B": 7.24e9}


def quantize_argv(
    binary: Path,
    source: Path,
    dest: Path,
    ftype: str,
    *,
    tensor_types: Sequence[tuple[str, str]] = (),
    output_tensor_type: str | None = None,
    token_embedding_type: str | None = None,
    imatrix: Path | None = None,
    dry_run: bool = False,
    allow_requantize: bool = False,
    threads: int | None = None,
) -> list[str]:
    """``llama-quantize [options] SOURCE [DEST] FTYPE [THREADS]``; a dry run writes nothing and names no DEST.

    ``tensor_types`` are (regex searched in the tensor name, ggml type) pairs, applied in order.
    """
    argv = [str(binary)]
    if allow_requantize:  # a Q8_0 source: its tensors are quantized already
        argv.append("--allow-requantize")
    if imatrix is not None:
        argv += ["--imatrix", str(imatrix)]
    for pattern, ggml_type in tensor_types:
        argv += ["--tensor-type", f"{pattern}={ggml_type.lower()}"]
    if output_tensor_type is not None:
        argv += ["--output-tensor-type", output_tensor_type.lower()]
    if token_embedding_type is not None:
        argv += ["--token-embedding-type", token_embedding_type.lower()]
    if dry_run:
        argv += ["--dry-run", str(source), ftype]
    else:
        argv += [str(source), str(dest), ftype]
    if threads is not None:
        argv.append(str(threads))
    return argv


def help_argv(binary: Path) -> list[str]:
    """Any llama.cpp tool's usage (its flags; llama-quantize's quant types)."""
    return [str(binary), "--help"]


def parse_quant_types(help_text: str) -> tuple[str, ...]:
    """The quant types llama-quantize's ``--help`` lists (COPY, which quantizes nothing, left out)."""
    return tuple(dict.fromkeys(m.group(1) for m in _TYPE_LINE.finditer(help_text)))


def parse_quant_bpw(help_text: str) -> dict[str, float]:
    """Bits per weight of each quant type llama-quantize's ``--help`` sizes (a type it does not size is absent)."""
    out: dict[str, float] = {}
    for m in _SIZE_LINE.finditer(help_text):
        name, figure, gib_tail, model = m.group(1), float(m.group(2)), m.group(3), m.group(4)
        if gib_tail.strip() == "bpw":
            out[name] = figure
        elif model in _REFERENCE_PARAMS:
            out[name] = figure * 2**30 * 8 / _REFERENCE_PARAMS[model]
    return out


def parse_quant_size_bytes(output: str) -> int | None:
    """Tensor bytes a ``--dry-run`` (or a real run) reports; None when the line is missing."""
    m = _QUANT_SIZE.search(output)
    return round(float(m.group(1)) * 2**20) if m else None


def imatrix_argv(binary: Path, model: Path, *, text_file: Path, out: Path, ctx: int, chunks: int,
                 threads: int | None = None, check_tensors: bool = False) -> list[str]:
    """llama-imatrix over ``chunks`` chunks of ``ctx`` tokens of ``text_file``, written as GGUF to ``out``
    (tools/imatrix/imatrix.cpp; ``--no-ppl`` skips the perplexity it would also compute). ``check_tensors``: the
    loader first checks every tensor's data (``--check-tensors``, common/arg.cpp: ``ggml_validate_row_data`` on
    each row: finite scales and values) and refuses the model otherwise."""
    argv = [str(binary), "-m", str(model), "-f", str(text_file), "-o", str(out), "-c", str(ctx),
            "--chunks", str(chunks), "--no-ppl", "--output-format", "gguf"]
    if threads is not None:
        argv += ["-t", str(threads)]
    if check_tensors:
        argv.append("--check-tensors")
    return argv
