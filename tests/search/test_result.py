"""result.json's schema: typed values with one to/from-dict convention, a version, and clear refusals."""

from __future__ import annotations

import json

import pytest

from tuner.core.errors import ResultVersionError, UsageError
from tuner.search import result as study_result
from tuner.search.finish import Finish
from tuner.search.study import TrialRecord


def _result() -> study_result.StudyResult:
    trial = TrialRecord(0, "measured", {"model": "/m.gguf", "ctx": 4096}, seed="default", gen_tok_s=12.5,
                        prompt_tok_s=300.0, request_s=2.0, prompt_depth=512, gen_depth=1024)
    return study_result.StudyResult(study="s", model="/m.gguf", finish=Finish((), ()), trials=(trial,),
                                    pareto=(0,), workload={"kind": "agent", "depth_tokens": 1024},
                                    quality=study_result.QualitySummary(0.002, None, None, ({"k": "q8_0"},)))


def test_round_trip_through_json(tmp_path):
    res = _result()
    path = study_result.write_result(res, tmp_path)
    assert json.loads(path.read_text())["version"] == study_result.RESULT_VERSION
    assert study_result.load_result(tmp_path) == res
    assert study_result.StudyResult.from_dict(res.to_dict()) == res
    assert res.to_dict()["trials"][0]["gen_depth"] == 1024 and res.winner is None


def test_an_older_result_is_refused_with_the_fix(tmp_path):
    doc = _result().to_dict() | {"version": 1}
    (tmp_path / "result.json").write_text(json.dumps(doc))
    with pytest.raises(ResultVersionError, match=r"version 1.*run the same `moe-tune auto-tune`"):
        study_result.load_result(tmp_path / "result.json")


@pytest.mark.parametrize(("text", "words"), [("{", "cannot read"), ('{"a": 1}', "not an auto-tune result")])
def test_other_files_are_refused(tmp_path, text, words):
    (tmp_path / "x.json").write_text(text)
    with pytest.raises(UsageError, match=words):
        study_result.load_result(tmp_path / "x.json")


def test_report_md_has_no_python_reprs_and_no_none():
    from tuner.report import study_report

    trial = TrialRecord(0, "measured", {"model": "/m.gguf", "ctx": 4096, "n_cpu_moe": None, "ubatch": None,
                                        "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on",
                                        "threads": None}, gen_tok_s=12.5, prompt_tok_s=300.0, request_s=2.0,
                        kld=5e-05)
    res = study_result.StudyResult(study="s", model="/m.gguf", finish=Finish((), ()), trials=(trial,),
                                   workload={"kind": "chat", "prompt_tokens": 512, "gen_tokens": 128,
                                             "depth_tokens": 512, "concurrency": 1})
    text = study_report.markdown(res)
    assert "None" not in text and "{'" not in text and "{\"" not in text
    assert "- workload: chat: 512-token prompts, 128-token replies generated at depth 512, one request at a time" \
        in text
    assert "| default | q8_0/q8_0 | on | default | default |" in text and "| 5e-05 |" in text


def test_report_trials_name_the_offload_flag_of_each_model(tmp_path):
    """A dense model's trials carry -ngl (layers on the GPU), a MoE's --n-cpu-moe: the trials table names which,
    and the offload plot is drawn along the dense model's -ngl."""
    from tuner.report import study_report

    def trial(n: int, **offload: int) -> TrialRecord:
        return TrialRecord(n, "measured", {"model": "/m.gguf", "ctx": 4096, "cache_type_k": "f16",
                                           "cache_type_v": "f16", "flash_attn": "on", **offload},
                           gen_tok_s=10.0 + n, prompt_tok_s=100.0 + n, request_s=2.0)

    load = {"kind": "chat", "prompt_tokens": 512, "gen_tokens": 128, "depth_tokens": 512, "concurrency": 1}
    dense = study_result.StudyResult(study="d", model="/m.gguf", finish=Finish((), ()),
                                     trials=(trial(0, n_gpu_layers=28), trial(1, n_gpu_layers=25)), workload=load)
    text = study_report.markdown(dense)
    assert "| # | status | seed | offload |" in text
    assert "| 0 | measured |  | ngl 28 |" in text and "| 1 | measured |  | ngl 25 |" in text
    moe = study_result.StudyResult(study="m", model="/m.gguf", finish=Finish((), ()),
                                   trials=(trial(0, n_cpu_moe=4), trial(1)), workload=load)
    text = study_report.markdown(moe)
    assert "| 0 | measured |  | ncmoe 4 |" in text and "| 1 | measured |  | default |" in text
    assert [p.name for p in study_report.plots(dense, tmp_path)][0] == "tok_s_vs_n_gpu_layers.png"
