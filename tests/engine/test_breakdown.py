from __future__ import annotations

import pytest

from tuner.core.errors import BreakdownParseError
from tuner.engine import breakdown
from tuner.engine.breakdown import actual_breakdown, parse_fit_params, parse_log_jsonl

LOG = "\n".join([
    '{"type":"log","time":1,"level":"info","msg":"fitting"}',
    '{"type":"fit_memory_breakdown","data":{"unit":"MiB","rows":[{"kind":"device","name":"CUDA0","total":24000,'
    '"free":23000,"self":900,"model":700,"context":128,"compute":72,"unaccounted":10},'
    '{"kind":"host","name":"Host","self":41,"model":16,"context":16,"compute":9}]}}',
    "not json",
    '{"type":"fit_memory_breakdown","data":{"unit":"MiB","rows":[{"kind":"host","name":"Host","self":34,'
    '"model":9,"context":16,"compute":9},{"kind":"buffer_type","name":"CPU_REPACK","self":5,"model":5,'
    '"context":0,"compute":0}]}}',
])


def test_log_jsonl_records_in_order():
    found = parse_log_jsonl(LOG)
    assert len(found) == 2
    cuda = found[0].row("CUDA0")
    assert cuda is not None
    assert (cuda.model_mib, cuda.context_mib, cuda.compute_mib, cuda.total_mib) == (700, 128, 72, 24000)
    assert found[0].device_total("model") == 700
    last = actual_breakdown(LOG)
    assert last.host_total("model") == 14 and last.host_total("context") == 16
    assert [r.name for r in last.host_side] == ["Host", "CPU_REPACK"]


def test_fit_params_table():
    bd = parse_fit_params("some log\nCUDA0 700 128 72 \nHost 16 16 9 \n")
    assert bd.row("CUDA0").kind == "device" and bd.row("Host").self_mib == 41


def test_no_breakdown_is_an_error():
    with pytest.raises(BreakdownParseError, match="--log-jsonl"):
        actual_breakdown('{"type":"log"}')
    with pytest.raises(BreakdownParseError, match="-fitp on"):
        parse_fit_params("nothing here")


def test_a_projection_whose_record_was_lost_is_asked_again(engine_loc, demo_models):
    """llama.cpp's logger may drop the --log-jsonl record at exit (about 1 run in 6 of the pin on the tiny demo):
    the projection comes from the record every time, with its CPU_REPACK row, never from the plain table."""
    from tuner.core.config import LaunchConfig

    cfg = LaunchConfig(model=demo_models[("qwen3moe", "Q4_K_M")], ctx=8192, parallel=1, ubatch=512)
    seen = [breakdown.fit_params_breakdown(engine_loc, cfg) for _ in range(30)]
    assert all(b.from_record and b.row("CPU_REPACK") is not None for b in seen)
    assert len({b.rows for b in seen}) == 1
