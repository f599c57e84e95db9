"""Valid quantized blocks drawn directly in numpy: no llama-quantize, no cached or carried pools.

The ``direct`` weights of the GGUF writer (tuner.models.gguf_writer) need, per ggml type, a pool of blocks that
llama.cpp decodes to finite, trained-looking numbers; the writer then gathers pool blocks at random for every
tensor, exactly as it does with the pools llama-quantize makes (tuner.models.block_pool), so rows and experts
differ and a random router spreads a batch's tokens over the experts. Here each block is assembled field by field
from the struct in the pinned engine's ``ggml/src/ggml-common.h`` (``block_q4_K`` etc.), read back the way
``dequantize_row_*`` in ``ggml/src/ggml-quants.c`` reads it:

- the quants are uniform random codes, every one in its type's range (4, 5, 6 or 8 bits; Q8_0 in -127..127, the
  range ``quantize_row_q8_0_ref`` writes);
- the scales are finite, normal halves (what ``ggml_validate_row_data`` checks), with a per-block jitter; the
  K-quants' 6-bit sub-block scales are drawn too, and their mins set so each sub-block's mean is about zero
  (types without a min get scales of either sign, so their one-sided code range averages out);
- the scales are sized so the decoded values have std :data:`TARGET_STD` (0.02, a trained checkpoint's, the
  std of the demo weights llama-quantize's pools come from) and mean about 0.

Drawing 65,536 blocks takes milliseconds; a pool depends only on the seed, so the same seed writes the same file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import gguf
import numpy as np

from tuner.core.errors import UsageError

Q = gguf.GGMLQuantizationType
TARGET_STD = 0.02
POOL_BLOCKS = 65536  # as many as a llama-quantize pool keeps (block_pool.MAX_BLOCKS)
JITTER = (0.8, 1.2)  # each block's scale times a uniform draw from this range
_FLOAT = frozenset({Q.F32, Q.F16, Q.BF16})


def _uniform_std(levels: int) -> float:
    """Std of a code drawn uniformly from ``levels`` consecutive integers."""
    return float(np.sqrt((levels**2 - 1) / 12))


def _half(x: np.ndarray) -> np.ndarray:
    """(n,) float → (n, 2) bytes of the IEEE half ggml stores (``ggml_half``, little-endian)."""
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(-1, 2)


def _codes(rng: np.random.Generator, n: int, nbytes: int) -> np.ndarray:
    """Packed codes: every bit pattern of a 4/5/6-bit quant's nibbles and high bits is a code in range."""
    return rng.integers(0, 256, (n, nbytes), dtype=np.uint8)


def _scale(rng: np.random.Generator, n: int, unit_std: float) -> np.ndarray:
    """Per-block scale (a half) that takes codes of std ``unit_std`` to values of std TARGET_STD, jittered."""
    jitter = rng.uniform(*JITTER, n) / np.sqrt((JITTER[0]**2 + JITTER[0] * JITTER[1] + JITTER[1]**2) / 3)
    return (TARGET_STD / unit_std * jitter).astype(np.float32)


def _q8_0(rng: np.random.Generator, n: int) -> np.ndarray:
    # block_q8_0 {ggml_half d; int8_t qs[32]}: x = d * qs
    d = _scale(rng, n, _uniform_std(255))
    qs = rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([_half(d), qs], axis=1)


def _signs(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random ±1: codes that run one step further below zero than above (-8..7) average to zero over blocks whose
    scale has either sign (``quantize_row_q4_0_ref`` writes d = max / -8 of the signed extreme, either sign too)."""
    return rng.integers(0, 2, shape).astype(np.float32) * 2 - 1


def _q4_0(rng: np.random.Generator, n: int) -> np.ndarray:
    # block_q4_0 {ggml_half d; uint8_t qs[16]}: x = d * (nibble - 8)
    d = _scale(rng, n, _uniform_std(16)) * _signs(rng, (n,))
    return np.concatenate([_half(d), _codes(rng, n, 16)], axis=1)


def _q5_0(rng: np.random.Generator, n: int) -> np.ndarray:
    # block_q5_0 {ggml_half d; uint8_t qh[4]; uint8_t qs[16]}: x = d * (5-bit code - 16)
    d = _scale(rng, n, _uniform_std(32)) * _signs(rng, (n,))
    return np.concatenate([_half(d), _codes(rng, n, 20)], axis=1)


def _with_min(levels: int, nbytes: int) -> Callable[[np.random.Generator, int], np.ndarray]:
    # block_q4_1 / block_q5_1 {ggml_half d; ggml_half m; [qh[4];] qs[16]}: x = d * code + m, m centres the codes
    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        d = _scale(rng, n, _uniform_std(levels))
        return np.concatenate([_half(d), _half(-d * (levels - 1) / 2), _codes(rng, n, nbytes)], axis=1)
    return draw


def _k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block packed into ``scales[12]`` as ``get_scale_min_k4`` unpacks them:
    j < 4: sc = q[j] & 63, m = q[j+4] & 63; j >= 4: sc = (q[j+4] & 0xF) | (q[j-4] >> 6) << 4,
    m = (q[j+4] >> 4) | (q[j] >> 6) << 4."""
    lo_sc, hi_sc, lo_m, hi_m = sc[:, :4], sc[:, 4:], m[:, :4], m[:, 4:]
    return np.concatenate([lo_sc | (hi_sc >> 4) << 6, lo_m | (hi_m >> 4) << 6, (hi_sc & 0xF) | (hi_m & 0xF) << 4],
                          axis=1).astype(np.uint8)


def _k_quant(levels: int, sc_range: tuple[int, int], code_bytes: int
             ) -> Callable[[np.random.Generator, int], np.ndarray]:
    # block_q4_K {half d; half dmin; uint8_t scales[12]; qs[128]} and block_q5_K {...; scales[12]; qh[32]; qs[128]}:
    # sub-block j of 32 values: x = d * sc_j * code - dmin * m_j. dmin = ratio * d keeps m_j within 6 bits.
    ratio = 2 ** int(np.ceil(np.log2(sc_range[1] * (levels - 1) / 2 / 63)))

    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        sc = rng.integers(sc_range[0], sc_range[1] + 1, (n, 8), dtype=np.int64)
        m = np.rint(sc * (levels - 1) / 2 / ratio).astype(np.int64)
        rms_sc = float(np.sqrt(np.mean(np.arange(sc_range[0], sc_range[1] + 1) ** 2)))
        d = _scale(rng, n, _uniform_std(levels) * rms_sc)
        return np.concatenate([_half(d), _half(d * ratio), _k_scales(sc, m), _codes(rng, n, code_bytes)], axis=1)
    return draw


def _q6_k(rng: np.random.Generator, n: int) -> np.ndarray:
    # block_q6_K {uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d}: x = d * sc_j * (6-bit code - 32)
    lo, hi = 8, 15
    sc = (rng.integers(lo, hi + 1, (n, 16)) * _signs(rng, (n, 16))).astype(np.int8).view(np.uint8)
    d = _scale(rng, n, _uniform_std(64) * float(np.sqrt(np.mean(np.arange(lo, hi + 1) ** 2))))
    return np.concatenate([_codes(rng, n, 192), sc, _half(d)], axis=1)


def _mxfp4(rng: np.random.Generator, n: int) -> np.ndarray:
    # block_mxfp4 {uint8_t e; uint8_t qs[16]}: x = kvalues_mxfp4[nibble] * GGML_E8M0_TO_FP32_HALF(e), where the
    # e2m1 values are doubled (0, ±1, ±2, ±3, ±4, ±6, ±8, ±12) and e8m0 e >= 2 halves to 2**(e - 128). The
    # scale is a power of two: half the blocks get the one nearest the target, half the one below it.
    kv_rms = float(np.sqrt(np.mean(np.square(gguf.quants.MXFP4.kvalues, dtype=np.float64))))
    e = np.rint(np.log2(TARGET_STD / kv_rms)) + 128 - rng.integers(0, 2, (n, 1))
    return np.concatenate([e.astype(np.uint8), _codes(rng, n, 16)], axis=1)


DRAW: dict[Q, Callable[[np.random.Generator, int], np.ndarray]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _with_min(16, 16), Q.Q5_0: _q5_0, Q.Q5_1: _with_min(32, 20), Q.Q8_0: _q8_0,
    Q.Q4_K: _k_quant(16, (32, 63), 128), Q.Q5_K: _k_quant(32, (16, 31), 160), Q.Q6_K: _q6_k, Q.MXFP4: _mxfp4,
}


def draw_blocks(typ: Q, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` valid blocks of ``typ`` as an (n, type_size) uint8 array."""
    if typ not in DRAW:
        raise UsageError(f"--weights direct cannot draw {typ.name} blocks (it draws "
                         f"{', '.join(t.name for t in DRAW)}): use --weights random")
    blocks = DRAW[typ](rng, n)
    assert blocks.shape == (n, gguf.GGML_QUANT_SIZES[typ][1]), (typ.name, blocks.shape)
    return blocks


def direct_pools(types: Iterable[Q], seed: int, n_blocks: int = POOL_BLOCKS) -> dict[Q, np.ndarray]:
    """One pool of ``n_blocks`` drawn blocks per quantized type in ``types``, from ``seed`` alone."""
    pools = {}
    for typ in sorted(set(types) - _FLOAT):
        pools[typ] = draw_blocks(typ, n_blocks, np.random.default_rng([seed, int(typ)]))
    return pools
