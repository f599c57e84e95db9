"""Reading llama-perplexity: its printed results, checked, and the reference logits file it writes.

llama-perplexity exits 0 when it measured nothing (text too short, too few tokens for statistics, a
reference of another vocabulary), so every figure is parsed from its output and checked before use.

The engine's "Mean KLD: x ± y" treats every scored token as independent, but the tokens of one chunk share
their context and err together, so that ± is too small (on SmolLM2-135M's q8_0 cache several times too small:
results/benchmarks/kv-kld-trained.md). The ± kept here comes from the per-chunk values instead: the engine
prints running means after each chunk, each chunk's own mean is recovered from two of them, and the standard
error is their spread over the square root of their number (never below the engine's per-token figure).
"""

from __future__ import annotations

import math
import re
import statistics
import struct
from dataclasses import dataclass
from pathlib import Path

from tuner.core.errors import OutputCutError, QualityError, TextTooShortError

LOGITS_MAGIC = b"_logits_"
# Statistics need at least this many scored tokens; below it llama-perplexity prints none (perplexity.cpp).
MIN_SCORED_TOKENS = 100


@dataclass(frozen=True, slots=True)
class PerplexityFigures:
    ppl: float
    ppl_error: float
    n_chunks: int  # chunks the engine actually evaluated


@dataclass(frozen=True, slots=True)
class KldFigures:
    ppl: float
    ppl_error: float
    ppl_base: float
    ppl_base_error: float
    kld_mean: float
    kld_mean_error: float  # standard error from the per-chunk means (see the module docstring)
    kld_p99: float | None  # None: a run stopped before its summary (:func:`parse_kld_rows`)
    kld_max: float | None
    same_top_pct: float
    same_top_pct_error: float  # likewise, in percentage points
    n_chunks: int
    kld_token_error: float = 0.0  # the engine's per-token standard error, for comparison
    kld_chunks: tuple[float, ...] = ()  # each chunk's own mean KLD (empty: the engine printed no chunk rows)


_NUM = r"([-+]?(?:nan|inf|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?))"
_PM = r"\s*(?:±|\+/-)\s*"
# ik_llama.cpp prints "Final estimate: PPL over 2 chunks for n_ctx=512 = 4290.4085 +/- 61.86890".
_FINAL = re.compile(rf"Final estimate: PPL(?: over \d+ chunks for n_ctx=\d+)? = {_NUM}{_PM}{_NUM}", re.IGNORECASE)
_NEED = re.compile(r"you need at least (\d+) tokens to evaluate perplexity with a context of (\d+)")
_ONLY = re.compile(r"tokenizes to only (\d+) tokens")
_CHUNKS = re.compile(r"(?:calculating perplexity|computing) over (\d+) chunks, n_ctx=(\d+)")
_KLD_LINES = {
    "ppl": re.compile(rf"Mean PPL\(Q\)\s*:\s*{_NUM}{_PM}{_NUM}", re.IGNORECASE),
    "ppl_base": re.compile(rf"Mean PPL\(base\)\s*:\s*{_NUM}{_PM}{_NUM}", re.IGNORECASE),
    "kld_mean": re.compile(rf"Mean\s+KLD:\s*{_NUM}{_PM}{_NUM}", re.IGNORECASE),
    "kld_p99": re.compile(rf"99\.0%\s+KLD:\s*{_NUM}", re.IGNORECASE),
    "kld_max": re.compile(rf"Maximum KLD:\s*{_NUM}", re.IGNORECASE),
    "same_top": re.compile(rf"Same top p:\s*{_NUM}{_PM}{_NUM}\s*%", re.IGNORECASE),
}
# A chunk row of a --kl-divergence run: chunk number, then running PPL, ln(PPL(Q)/PPL(base)), KLD, Δp RMS and
# same-top, each "value ± error" over every chunk so far (perplexity.cpp prints KLD with 5 decimals).
_CHUNK_ROW = re.compile(
    rf"^\s*(\d+)\s+{_NUM}{_PM}{_NUM}\s+{_NUM}{_PM}{_NUM}\s+{_NUM}{_PM}{_NUM}\s+{_NUM}{_PM}{_NUM}\s*%"
    rf"\s+{_NUM}{_PM}{_NUM}\s*%", re.IGNORECASE | re.MULTILINE)
# A reference run's chunk row with --ppl-output-type 1 (perplexity.cpp ``perplexity``; ik_llama.cpp's the same): the
# chunk's first token, then over every chunk so far the running PPL, the mean negative log-likelihood per scored token
# and the engine's per-token standard error of that mean.
_PPL_ROW = re.compile(rf"^\s*(\d+)\s+{_NUM}\s+{_NUM}\s+{_NUM}\s*$", re.IGNORECASE)
_ENGINE_COMPLAINTS = (
    ("inconsistent vocabulary", "the reference is another model (its vocabulary differs): name one with --reference"),
    ("does not look like a file containing log-probabilities", "the reference logits file is damaged: delete it"),
    ("failed reading", "the reference logits file is truncated: delete it and measure again"),
    ("failed to decode", "the engine could not evaluate a batch: check memory and flags"),
    ("failed to open", "the logits file could not be opened: check the cache folder, or set MOE_TUNE_CACHE to "
                       "another"),
)


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise QualityError(f"llama-perplexity reported {name} = {value}: the model produces non-finite logits; "
                           "check the model file or try another quant")
    return value


def _check_engine_complaints(text: str) -> None:
    for needle, fix in _ENGINE_COMPLAINTS:
        if needle in text:
            raise QualityError(f"llama-perplexity: {needle}; {fix}")
    need = _NEED.search(text)
    if need:
        only = _ONLY.search(text)
        raise TextTooShortError(int(only.group(1)) if only else None, int(need.group(1)), int(need.group(2)))


def _chunks_done(text: str, want_chunks: int | None, ctx: int = 0) -> tuple[int, int]:
    """(chunks evaluated, tokens per chunk) as the engine announced them; where it announced nothing (ik_llama.cpp's
    kl_divergence), the chunk rows it printed and the ``ctx`` it was run with."""
    match = _CHUNKS.search(text)
    rows = len({m.group(1) for m in _CHUNK_ROW.finditer(text)})
    if not match and rows:  # ik_llama.cpp's kl_divergence announces nothing: its chunk rows count
        if want_chunks is not None and rows < want_chunks:
            raise TextTooShortError(None, want_chunks * ctx, ctx)
        return rows, ctx
    if not match:
        raise OutputCutError("llama-perplexity stopped before measuring (or its output was lost at exit): the "
                             "text may be too short (it needs 2 x ctx tokens); try a longer text or a smaller -c")
    done, ctx = int(match.group(1)), int(match.group(2))
    if want_chunks is not None and done < want_chunks:
        raise TextTooShortError(None, want_chunks * ctx, ctx)
    return done, ctx


def parse_perplexity(text: str, want_chunks: int | None = None) -> PerplexityFigures:
    """Figures of a plain (or reference-writing) run; ``text`` is stdout and stderr together."""
    _check_engine_complaints(text)
    n_chunks, _ = _chunks_done(text, want_chunks)
    final = _FINAL.search(text)
    if not final:
        raise OutputCutError("llama-perplexity printed no final estimate: its output was cut short; "
                             "rerun with MOE_TUNE_DEBUG=1 to see its output")
    ppl = _finite("PPL", float(final.group(1)))
    err = _finite("PPL error", float(final.group(2)))
    if ppl < 1.0:
        raise QualityError(f"llama-perplexity reported PPL {ppl} < 1, which cannot be: check the engine build")
    return PerplexityFigures(ppl, err, n_chunks)


def per_chunk_means(running: list[float]) -> list[float]:
    """Each chunk's own mean from the running means after chunks 1..n (every chunk scores as many tokens)."""
    return [i * m - (i - 1) * prev for i, (m, prev) in enumerate(zip(running, [0.0, *running[:-1]]), start=1)]


def chunk_standard_error(values: list[float]) -> float | None:
    """Standard error of the mean of per-chunk values; None below two chunks (no spread to measure)."""
    if len(values) < 2:
        return None
    return statistics.stdev(values) / math.sqrt(len(values))


def _chunk_rows(text: str, n_chunks: int) -> tuple[list[float], list[float]] | None:
    """(running mean KLD, running same-top fraction) after each chunk 1..n, or None when a row is missing."""
    rows = {int(m.group(1)): (float(m.group(6)), float(m.group(10)) / 100.0) for m in _CHUNK_ROW.finditer(text)}
    if any(i not in rows for i in range(1, n_chunks + 1)):
        return None
    return [rows[i][0] for i in range(1, n_chunks + 1)], [rows[i][1] for i in range(1, n_chunks + 1)]


def parse_kld(text: str, want_chunks: int | None = None, ctx: int = 0) -> KldFigures:
    """Figures of a ``--kl-divergence`` run against a reference logits file (``ctx``: the context it ran with, for
    an engine that does not announce it)."""
    _check_engine_complaints(text)
    n_chunks, ctx = _chunks_done(text, want_chunks, ctx)
    found = {key: rx.search(text) for key, rx in _KLD_LINES.items()}
    missing = [key for key, m in found.items() if m is None]
    if n_chunks * (ctx - 1 - ctx // 2) < MIN_SCORED_TOKENS:
        raise QualityError(
            f"{n_chunks} chunks of {ctx} tokens score too few tokens for KL-divergence statistics "
            f"(llama-perplexity prints them from {MIN_SCORED_TOKENS}): raise --chunks or -c"
        )
    if missing:
        raise OutputCutError(f"llama-perplexity printed no KL-divergence figures (missing {', '.join(missing)}): "
                             "its output was cut short; run it again")

    def pair(key: str) -> tuple[float, float]:
        m = found[key]
        assert m is not None
        return _finite(key, float(m.group(1))), _finite(key, float(m.group(2)))

    def one(key: str) -> float:
        m = found[key]
        assert m is not None
        return _finite(key, float(m.group(1)))

    ppl, ppl_err = pair("ppl")
    base, base_err = pair("ppl_base")
    kld, kld_err = pair("kld_mean")
    top, top_err = pair("same_top")
    if kld < -1e-6 or not 0.0 <= top <= 100.0:
        raise QualityError(f"llama-perplexity reported impossible figures (KLD {kld}, same top {top} %): "
                           "check the engine build")
    kld_chunks: list[float] = []
    kld_se, top_se = kld_err, top_err
    rows = _chunk_rows(text, n_chunks)
    if rows is not None:
        kld_chunks = per_chunk_means(rows[0])
        kld_se = max(kld_err, chunk_standard_error(kld_chunks) or 0.0)
        top_se = max(top_err, 100.0 * (chunk_standard_error(per_chunk_means(rows[1])) or 0.0))
    return KldFigures(ppl, ppl_err, base, base_err, max(kld, 0.0), kld_se, one("kld_p99"), one("kld_max"),
                      top, top_se, n_chunks, kld_err, tuple(kld_chunks))


@dataclass(frozen=True, slots=True)
class PplRow:
    """A reference run after some chunks (--ppl-output-type 1): running figures over every chunk so far."""

    ppl: float
    nll_mean: float  # mean negative log-likelihood per scored token: ln(ppl)
    nll_error: float  # the engine's per-token standard error of that mean (0 or less: not yet known)


def ppl_row(line: str) -> PplRow | None:
    """A reference run's chunk row, or None for any other line."""
    m = _PPL_ROW.match(line)
    return PplRow(float(m.group(2)), float(m.group(3)), float(m.group(4))) if m else None


def parse_ppl_rows(text: str) -> PerplexityFigures:
    """Figures of a reference run (--ppl-output-type 1) stopped after some chunks: its last chunk row's running PPL,
    with the engine's own ± (the final estimate's formula, perplexity.cpp: per-token error of ln PPL, times PPL)."""
    _check_engine_complaints(text)
    rows = [row for line in text.splitlines() if (row := ppl_row(line)) is not None]
    if not rows:
        raise QualityError("the reference run stopped before its first chunk ended: run it again")
    last = rows[-1]
    ppl = _finite("PPL", last.ppl)
    return PerplexityFigures(ppl, ppl * max(last.nll_error, 0.0), len(rows))


def kld_row(line: str) -> tuple[int, float] | None:
    """A KL-divergence run's chunk row as (chunk number, running mean KLD over chunks 1..it), or None."""
    m = _CHUNK_ROW.match(line)
    return (int(m.group(1)), float(m.group(6))) if m else None


def parse_kld_rows(text: str, ctx: int) -> KldFigures:
    """Figures of a ``--kl-divergence`` run stopped after some chunks, from its chunk rows alone (the summary, with
    the percentiles, is printed only at the end): the running figures of the last row, the ± from the per-chunk
    means as :func:`parse_kld` has it."""
    _check_engine_complaints(text)
    rows = {int(m.group(1)): m for m in _CHUNK_ROW.finditer(text)}
    n_chunks = max(rows, default=0)
    if not n_chunks or any(i not in rows for i in range(1, n_chunks + 1)) or n_chunks * (ctx - 1 - ctx // 2) < \
            MIN_SCORED_TOKENS:
        raise QualityError(f"the KL-divergence run stopped after {n_chunks} chunks without a row for each: run it "
                           "again without the early stop (--max-kld off prices every chunk)")
    last = rows[n_chunks]
    ppl, ppl_err = _finite("PPL", float(last.group(2))), _finite("PPL error", float(last.group(3)))
    base = ppl / math.exp(_finite("ln(PPL(Q)/PPL(base))", float(last.group(4))))
    running_kld, running_top = _chunk_rows(text, n_chunks) or ([], [])
    chunk_kld = per_chunk_means(running_kld)
    kld, kld_token_err = _finite("KLD", float(last.group(6))), float(last.group(7))
    top, top_token_err = float(last.group(10)), float(last.group(11))
    kld_se = max(kld_token_err, chunk_standard_error(chunk_kld) or 0.0)
    top_se = max(top_token_err, 100.0 * (chunk_standard_error(per_chunk_means(running_top)) or 0.0))
    # The rows give the reference's PPL only through the ratio, not its ±: 0 here (no caller reads it).
    return KldFigures(ppl, ppl_err, base, 0.0, max(kld, 0.0), kld_se, None, None, top, top_se, n_chunks,
                      kld_token_err, tuple(chunk_kld))


# ------------------------------------------------------------------------------------ reference logits


@dataclass(frozen=True, slots=True)
class LogitsHeader:
    ctx: int
    n_vocab: int
    n_chunks: int


def logits_bytes(n_vocab: int, ctx: int, n_chunks: int) -> int:
    """Size of the reference logits file llama-perplexity writes (layout in perplexity.cpp).

    Header (magic, n_ctx, n_vocab, n_chunk), the tokens, then per chunk the scored second half of the
    window: (ctx - 1 - ctx/2) rows of nv uint16, nv = 2*ceil(n_vocab/2) + 4.
    """
    nv = 2 * ((n_vocab + 1) // 2) + 4
    scored = ctx - 1 - ctx // 2
    return len(LOGITS_MAGIC) + 4 * 3 + 4 * ctx * n_chunks + n_chunks * scored * nv * 2


def read_logits_header(path: Path) -> LogitsHeader:
    with path.open("rb") as fh:
        head = fh.read(len(LOGITS_MAGIC) + 12)
    if len(head) < len(LOGITS_MAGIC) + 12 or not head.startswith(LOGITS_MAGIC):
        raise QualityError(f"{path} is not a llama-perplexity logits file: delete it and measure again")
    ctx, n_vocab, n_chunks = struct.unpack("<Iii", head[len(LOGITS_MAGIC):])
    return LogitsHeader(ctx, n_vocab, n_chunks)


def check_logits_file(path: Path, *, ctx: int, n_chunks: int, n_vocab: int) -> int:
    """Size of a complete reference file for these settings, or raise naming what is wrong."""
    header = read_logits_header(path)
    if (header.ctx, header.n_chunks, header.n_vocab) != (ctx, n_chunks, n_vocab):
        raise QualityError(
            f"{path} holds ctx {header.ctx}, {header.n_chunks} chunks, vocab {header.n_vocab}; expected ctx {ctx}, "
            f"{n_chunks} chunks, vocab {n_vocab}: delete it and measure again"
        )
    size = path.stat().st_size
    expected = logits_bytes(n_vocab, ctx, n_chunks)
    if size != expected:
        raise QualityError(f"{path} has {size} bytes, expected {expected}: delete it and measure again")
    return size
