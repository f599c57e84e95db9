"""auto-tune's speculation stage: which arms a model gets, what they cost in memory, and the stage end to end on
the real engine (synthetic acceptance): the kept arm joins the finish and its launch line carries the exact
--spec-* flags that were measured."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.measure.test_speculation import write_mtp_demo
from tuner.core.config import LaunchConfig, SpecType
from tuner.core.errors import UsageError
from tuner.core.machine_spec import Hardware
from tuner.core.model import TensorClass, TensorInfo
from tuner.engine import flags
from tuner.measure.workload import Workload, WorkloadKind, preset
from tuner.models.gguf_reader import has_mtp_head, inspect_model
from tuner.plan import memory
from tuner.search import speculation
from tuner.search.finish import Finish, ServerMeasurement
from tuner.search.speculation import SpeculationRequest
from tuner.search.study import config_from_dict, config_to_dict

CPU = Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, 64 * 2**30, 0, 20e9, 8, "none")
GPU = Hardware("RTX 3060", 12 * 2**30, 12 * 2**30, 360e9, 31.5e9, 64 * 2**30, 60 * 2**30, 0, 40e9, 8, "catalog")


def _with_mtp_head(info):
    """The hybrid demo with a NextN block on its last layer, as Qwen3.5/3.6 files carry one."""
    last = info.n_layer - 1
    head = TensorInfo(f"blk.{last}.nextn.eh_proj.weight", "F16", (2 * info.n_embd, info.n_embd),
                      4 * info.n_embd * info.n_embd, last, TensorClass.ATTENTION)
    return replace(info, n_nextn_layers=1, tensors=(*info.tensors, head))


def test_arms_follow_what_the_model_and_user_offer(demo_models):
    hybrid = inspect_model(demo_models[("qwen35moe", "Q8_0")])
    assert not has_mtp_head(hybrid)
    base = LaunchConfig(model=hybrid.paths[0], ctx=4096, parallel=1, spec_types=(SpecType.NGRAM_MOD,))
    plain = speculation.arms_for(base, hybrid, SpeculationRequest())
    assert [a.label for a in plain] == ["none", "ngram-simple", "ngram-map-k", "ngram-mod"]
    assert plain[0].config.spec_types == ()  # the reference is the winner without any speculation
    mtp = _with_mtp_head(hybrid)
    assert has_mtp_head(mtp) and not has_mtp_head(replace(mtp, arch="qwen3moe"))  # the engine has no qwen3moe MTP
    draft = demo_models[("qwen3moe", "Q4_K_M")]
    arms = speculation.arms_for(base, mtp, SpeculationRequest(draft_model=draft, ngram_types=()))
    assert [a.label for a in arms] == [
        "none", "draft-mtp", "draft-mtp n-max 2", "draft-mtp n-max 6 p-min 0.75", f"draft-simple {draft.name}",
        f"draft-simple {draft.name} n-max 2", f"draft-simple {draft.name} n-max 6 p-min 0.75"]
    assert flags.launch_line(arms[3].config).endswith("--spec-type draft-mtp --spec-draft-n-max 6 "
                                                      "--spec-draft-p-min 0.75")


def test_memory_model_counts_what_speculation_adds(demo_models):
    target = inspect_model(demo_models[("qwen35moe", "Q8_0")])
    draft = inspect_model(demo_models[("qwen3moe", "Q4_K_M")])
    cfg = LaunchConfig(model=target.paths[0], ctx=4096, parallel=1)
    plain = memory.estimate(target, cfg, CPU)
    ngram = memory.estimate(target, replace(cfg, spec_types=(SpecType.NGRAM_MOD,)), CPU)
    assert ngram.host.overhead_bytes - plain.host.overhead_bytes == memory.NGRAM_MOD_TABLE_BYTES
    # llama-server reserves logits for one token per slot plus the most a mode drafts (server_output_limits):
    # ngram-mod's n_max, 64 (common/common.h), so 65 rows of the ubatch's 512 instead of 1.
    from tuner.plan import outputs

    assert outputs.reserved_outputs(replace(cfg, spec_types=(SpecType.NGRAM_MOD,)), 512, 1) == 65
    assert outputs.reserved_outputs(cfg, 512, 1) == 1 and outputs.reserved_outputs(cfg, 512, 1, fit_params=True) == 512
    assert ngram.host.compute_bytes > plain.host.compute_bytes
    with_draft = memory.estimate(target, replace(cfg, spec_types=(SpecType.DRAFT_SIMPLE,), draft_model=draft.paths[0]),
                                 GPU, draft)
    on_gpu = memory.estimate(target, cfg, GPU)
    # The draft's weights (all on the GPU by default), its f16 KV over the same cells, and its compute buffer.
    alone = memory.estimate(draft, LaunchConfig(model=draft.paths[0], ctx=4096, parallel=1), GPU)
    assert with_draft.gpu.weights_bytes - on_gpu.gpu.weights_bytes == alone.gpu.weights_bytes > 0
    assert with_draft.gpu.kv_bytes - on_gpu.gpu.kv_bytes == alone.gpu.kv_bytes > 0
    mtp = _with_mtp_head(target)
    head_bytes = 4 * target.n_embd * target.n_embd
    with_mtp = memory.estimate(mtp, replace(cfg, spec_types=(SpecType.DRAFT_MTP,)), GPU)
    without = memory.estimate(mtp, cfg, GPU)  # the head is skipped unless draft-mtp asks for it
    assert with_mtp.gpu.weights_bytes - without.gpu.weights_bytes >= head_bytes
    assert with_mtp.gpu.kv_bytes > without.gpu.kv_bytes and with_mtp.gpu.compute_bytes > without.gpu.compute_bytes


def test_a_draft_with_another_vocabulary_is_refused_before_launch(engine_loc, demo_models, tmp_path):
    target = demo_models[("qwen3moe", "Q8_0")]
    data = bytearray(demo_models[("qwen3moe", "Q4_K_M")].read_bytes())
    key = data.index(b"tokenizer.ggml.model")
    value = data.index(b"gpt2", key)  # the string value right after the key (type, length)
    data[value:value + 4] = b"bert"
    other = tmp_path / "other-vocab.gguf"
    other.write_bytes(bytes(data))
    info = inspect_model(target)
    with pytest.raises(UsageError, match="tokenizer 'bert' is not the target's 'gpt2'"):
        speculation.run_stage(engine_loc, LaunchConfig(model=target, ctx=1024, parallel=1), info, CPU,
                              SpeculationRequest(draft_model=other), Workload(WorkloadKind.CUSTOM, 16, 16),
                              log_dir=tmp_path)


@pytest.fixture(scope="module")
def mtp_demo(tmp_path_factory) -> Path:
    return write_mtp_demo(tmp_path_factory.mktemp("mtp"))


class _Study:
    """Stands in for an Optuna study: the stage only records a user attribute."""

    def __init__(self) -> None:
        self.user_attrs: dict[str, object] = {}

    def set_user_attr(self, key: str, value: object) -> None:
        self.user_attrs[key] = json.loads(json.dumps(value))  # what Optuna storage would keep


def test_stage_measures_every_arm_with_its_acceptance(engine_loc, mtp_demo, tmp_path):
    info = inspect_model(mtp_demo)
    base = LaunchConfig(model=mtp_demo, ctx=1024, parallel=1, threads=1)
    req = SpeculationRequest(ngram_types=(SpecType.NGRAM_MOD,), draft_variants=((3, None),), rounds=2, requests=2,
                             synth_len=4.0)
    steps: list[str] = []
    verdicts = speculation.run_stage(engine_loc, base, info, CPU, req, Workload(WorkloadKind.CUSTOM, 32, 48),
                                     log_dir=tmp_path, on_step=steps.append)
    assert [v.result.arm.label for v in verdicts] == ["none", "ngram-mod", "draft-mtp n-max 3"]
    none, ngram, mtp = verdicts
    assert all(v.result.ok and len(v.result.requests) == 4 for v in verdicts)
    assert mtp.result.acceptance_rate > 0.95 and mtp.gain is not None and mtp.gain.pairs == 4
    assert none.result.acceptance_rate is None and not none.kept
    assert mtp.kept == (mtp.gain.gain_pct > 0 and mtp.gain.beyond_noise)  # kept only beyond the noise
    assert any(s.startswith("draft-mtp n-max 3: ") and "100 % of drafts accepted" in s for s in steps)
    # The selected arm's confirmation goes to the finish; here the selection's own two rounds stand in for it: two
    # rounds decide nothing (a verdict needs three), so llama.cpp's line without speculation stays printed.
    won = ServerMeasurement(label="default", config=config_to_dict(base), launch_line=flags.launch_line(base),
                            argv=[], gen_tok_s=5.0, gen_samples_tok_s=[5.0], gen_cv_pct=None, prompt_tok_s=50.0,
                            ttft_s=0.5, aggregate_gen_tok_s=5.0)
    st = _Study()
    load = Workload(WorkloadKind.CUSTOM, 32, 48)
    out = speculation.join(st, Finish((), (won,), 32, 48), [none, ngram, replace(mtp, kept=True)], req, load,
                           result_dir=tmp_path / "study", confirmed=(none.result, mtp.result))
    record = st.user_attrs["speculation"]
    assert record["selected"] == "draft-mtp n-max 3" and record["kept"] is None and record["base"] == "default"
    assert record["confirmation"]["outcome"] == "undecided" and record["confirmation"]["rounds"] == 2
    assert json.loads((tmp_path / "study" / "speculation.json").read_text()) == record
    assert out.winner.label == "default"
    none_m, spec_m = out.speculation
    assert spec_m.label.startswith("speculation draft-mtp n-max 3, 10") and spec_m.label.endswith("% accepted")
    assert spec_m.launch_line == flags.launch_line(mtp.result.arm.config)
    assert spec_m.launch_line.endswith("-t 1 --spec-type draft-mtp --spec-draft-n-max 3 --spec-synth-len 4")
    assert spec_m.argv[spec_m.argv.index("--spec-type"):][:2] == ["--spec-type", "draft-mtp"]  # as measured
    assert len(spec_m.scores) == 2 and all(x > 0 for x in spec_m.scores)  # requests per second in each round
    # The stored config rebuilds the same launch line (what `moe-tune launch-line` prints).
    assert flags.launch_line(config_from_dict(spec_m.config)) == spec_m.launch_line
    assert none_m.config == won.config  # the confirmation's reference is the printed line itself


def test_a_speculation_arm_is_printed_only_when_its_fresh_rounds_decide_it():
    def arm(label: str, scores: list[float], spec: bool = False) -> ServerMeasurement:
        cfg = {"model": "m.gguf", "spec_types": ["ngram-mod"] if spec else []}
        return ServerMeasurement(label, cfg, f"llama-server -m m.gguf{' --spec-type ngram-mod' if spec else ''}", [],
                                 max(scores), [], None, None, None, None, scores=scores)

    default = arm("default", [1.0, 1.01, 0.99])
    base = Finish((), (default,), 32, 48)
    none = arm("speculation none", [1.0, 1.02, 0.99, 1.0])
    fast = arm("speculation ngram-mod", [1.4, 1.42, 1.39, 1.41], spec=True)
    none = replace(none, config=default.config)
    assert replace(base, speculation=(none, fast)).winner is fast
    close = arm("speculation ngram-mod", [1.05, 0.97, 1.08, 1.0], spec=True)
    fin = replace(base, speculation=(none, close))
    assert fin.winner is default and fin.verdicts[-1].outcome == "undecided"
    # A confirmation measured on another line than the printed one never swaps it.
    assert replace(base, speculation=(replace(none, config={"model": "other.gguf"}), fast)).winner is default


def test_a_speculation_round_on_a_busy_machine_decides_nothing():
    """Speculation's confirmation rounds are watched as the finish's are: a 1.4x arm whose every winning round was
    measured beside other work is not printed (it was, before the rounds were watched)."""
    from tuner.measure.speculation import Arm, ArmResult, SpecRequest
    from tuner.search.speculation import as_measurement

    load = preset(WorkloadKind.CUSTOM, 32, 48)
    cfg = LaunchConfig(model=Path("m.gguf"))

    def result(label: str, secs: float, noise: dict[int, str]) -> ArmResult:
        reqs = tuple(SpecRequest(r, 0, secs, 0.1, 32, 48, 320.0 / secs, 48 / secs, 0, 0) for r in range(2, 6))
        return ArmResult(Arm(label, cfg), reqs, round_noise=tuple((r, noise.get(r)) for r in range(2, 6)))

    none = as_measurement(result("none", 1.0, {}), load)
    quiet_fast = as_measurement(result("ngram-mod", 1.0 / 1.4, {}), load)
    busy = {r: "2 other processes used 1.9 cores" for r in range(2, 6)}
    busy_fast = as_measurement(result("ngram-mod", 1.0 / 1.4, busy), load)
    assert busy_fast.interference == [busy[r] for r in range(2, 6)] and busy_fast.quiet_scores() == [None] * 4
    assert none.interference == [None] * 4 and none.quiet_scores() == none.scores
    default = replace(none, label="default")
    base = Finish((), (default,), 32, 48)
    assert replace(base, speculation=(none, quiet_fast)).winner is quiet_fast
    fin = replace(base, speculation=(none, busy_fast))
    assert fin.winner is default and fin.verdicts[-1].outcome != "better"
