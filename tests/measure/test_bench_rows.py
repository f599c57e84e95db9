"""llama-bench's rows from either engine: llama.cpp's jsonl, ik_llama.cpp's json (booleans, ``tg16@pp256`` labels),
and ik's prompt at depth taken from two prompts' times."""

from __future__ import annotations

import pytest

from tuner.measure.bench_rows import BenchRow, parse_rows, prompt_at_depth

# Two tests as ik_llama.cpp's llama-bench -o json printed them here (ik-llama-cpp-python 0.1.5, the tiny demo model;
# fields cut to the ones read), the second one a -gp test.
IK_JSON = """[
  {
    "build_commit": "ik-llama-cpp-python-0.1.5",
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": 0,
    "flash_attn": true,
    "n_prompt": 64,
    "n_gen": 0,
    "avg_ts": 1835.409085,
    "stddev_ts": 2252.285041,
    "test": "pp64",
    "samples_ns": [ 18669696, 263588112 ],
    "samples_ts": [ 3428.02, 242.803 ]
  },
  {
    "build_commit": "ik-llama-cpp-python-0.1.5",
    "n_threads": 2,
    "type_k": "f16",
    "type_v": "f16",
    "flash_attn": false,
    "n_prompt": 256,
    "n_gen": 16,
    "avg_ts": 607.0,
    "stddev_ts": 1.0,
    "test": "tg16@pp256",
    "samples_ts": [ 606.0, 608.0 ]
  }
]
"""


def test_ik_json_reads_as_llama_cpp_rows():
    pp, gp = parse_rows(IK_JSON)
    assert (pp.kind, pp.n_prompt, pp.n_depth, pp.samples_tok_s) == ("pp", 64, 0, (3428.02, 242.803))
    assert dict(pp.params)["flash_attn"] == "1"  # json true, as llama.cpp's jsonl writes 1
    assert (gp.kind, gp.n_prompt, gp.n_gen, gp.n_depth) == ("tg", 0, 16, 256)  # generation at depth 256
    assert dict(gp.params)["flash_attn"] == "0"


def test_a_sweep_cut_short_keeps_the_tests_it_finished():
    cut = IK_JSON[:IK_JSON.index('"test": "tg16@pp256"') - 40]
    assert [r.n_prompt for r in parse_rows(cut)] == [64]


def test_llama_cpp_jsonl_still_reads():
    line = ('{"n_prompt": 512, "n_gen": 0, "n_depth": 4096, "avg_ts": 100.5, "stddev_ts": 1.0, "samples_ts": '
            '[100.0, 101.0], "build_commit": "0c1e57098", "flash_attn": 1, "type_k": "q8_0"}')
    (row,) = parse_rows("noise\n" + line + "\n")
    assert (row.n_prompt, row.n_depth, row.avg_tok_s) == (512, 4096, 100.5)
    assert dict(row.params) == {"type_k": "q8_0", "flash_attn": "1"}


def _pp(n: int, seconds: tuple[float, ...]) -> BenchRow:
    ts = tuple(n / s for s in seconds)
    return BenchRow(n, 0, 0, sum(ts) / len(ts), 0.0, ts, "x", (("type_k", "f16"),))


def test_prompt_at_depth_is_the_difference_of_two_prompts():
    # 256 tokens in 1.0 s and 320 in 1.5 s: the 64 tokens after the first 256 took 0.5 s, 128 tok/s; per repetition
    rows = (_pp(64, (0.1, 0.1)), _pp(256, (1.0, 2.0)), _pp(320, (1.5, 2.4)))
    out = prompt_at_depth(rows, 64, [0, 256])
    at0 = next(r for r in out if r.n_depth == 0)
    at256 = next(r for r in out if r.n_depth == 256)
    assert at0.avg_tok_s == pytest.approx(640.0)
    assert at256.samples_tok_s == pytest.approx((128.0, 160.0))
    assert at256.avg_tok_s == pytest.approx(144.0)
    assert len(out) == 2  # the 256- and 320-token helpers are not rows of their own


def test_a_depth_whose_longer_prompt_ran_no_slower_gives_no_figure():
    # Timing noise can make t(D + N) <= t(D): no positive time is left for the N tokens, so no sample is invented.
    rows = (_pp(256, (1.0,)), _pp(320, (0.9,)))
    assert prompt_at_depth(rows, 64, [256]) == ()
