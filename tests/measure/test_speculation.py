"""Speculative decoding on llama-server: the flags as measured and pasted, the draft/vocabulary check, prompts
files, acceptance from the server's log and timings, and the mechanics on the real engine with synthetic
acceptance (random weights accept almost nothing, so ``--spec-synth-len`` stands in for a good drafter)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tuner.core.config import LaunchConfig, SpecType
from tuner.core.errors import UsageError
from tuner.engine import flags
from tuner.measure import speculation
from tuner.measure.speculation import Arm, ArmResult, SpecRequest
from tuner.measure.workload import Workload, WorkloadKind
from tuner.models import demo_model, gguf_writer
from tuner.models.gguf_reader import has_mtp_head, inspect_model
from tuner.models.vocab import train_vocab

DRAFT = LaunchConfig(model=Path("big.gguf"), ctx=1024, parallel=1, spec_types=(SpecType.DRAFT_SIMPLE,),
                     draft_model=Path("small.gguf"), spec_draft_n_max=6, spec_draft_n_min=1, spec_draft_p_min=0.75,
                     spec_synth_len=2.5)


def test_speculation_flags_render_exactly_and_parse_back():
    line = flags.launch_line(DRAFT)
    assert line.endswith("--spec-type draft-simple -md small.gguf --spec-draft-n-max 6 --spec-draft-n-min 1 "
                         "--spec-draft-p-min 0.75 --spec-synth-len 2.5")
    assert flags.parse_command(line).config == DRAFT
    rates = LaunchConfig(model=Path("m.gguf"), spec_types=(SpecType.NGRAM_MOD, SpecType.DRAFT_MTP),
                         spec_synth_rates=(0.8, 0.5))
    assert "--spec-type ngram-mod,draft-mtp --spec-synth-rates 0.8,0.5" in flags.launch_line(rates)
    assert flags.parse_command(flags.launch_line(rates)).config == rates
    # The engine's other spellings are read too; `none` is no speculation.
    pasted = flags.parse_command("llama-server -m m.gguf --spec-type none --draft-p-min 0.5").config
    assert pasted.spec_types == () and pasted.spec_draft_p_min == 0.5
    # llama-bench has no speculation: its argv never carries it; a plain config renders no --spec-* flag.
    bench = flags.bench_argv(Path("llama-bench"), DRAFT, n_prompt=8, n_gen=8, repetitions=1)
    assert not any(a.startswith("--spec") or a == "-md" for a in bench)
    assert "--spec" not in flags.launch_line(speculation.without_speculation(DRAFT))


@pytest.mark.parametrize(("changes", "match"), [
    ({"draft_model": None}, "add -md DRAFT.gguf"),
    ({"spec_types": ()}, "add --spec-type draft-simple"),  # -md alone: the engine loads it and never drafts
    ({"spec_types": (SpecType.NGRAM_MOD,)}, "add --spec-type draft-simple"),
    ({"spec_synth_rates": (0.5,)}, "exclude each other"),
    ({"spec_synth_len": 0.5}, ">= 1"),
    ({"spec_synth_len": None, "spec_synth_rates": (0.4, 0.6)}, "never rise"),
    ({"spec_draft_p_min": 1.5}, "probability"),
    ({"spec_draft_n_min": 7}, "--spec-draft-n-max must be >= 1"),
])
def test_speculation_flags_the_engine_would_refuse_or_ignore(changes, match):
    with pytest.raises(UsageError, match=match):
        flags.validate(replace(DRAFT, **changes))


def test_pasted_unknown_spec_type_is_one_line_error():
    with pytest.raises(UsageError, match="unknown --spec-type"):
        flags.parse_command("llama-server -m m.gguf --spec-type lookahead")


def test_demo_models_share_a_vocabulary_and_can_draft_for_each_other(demo_models):
    big = inspect_model(demo_models[("qwen35moe", "Q8_0")])
    small = inspect_model(demo_models[("qwen3moe", "Q4_K_M")])
    assert big.tokenizer_ids[0] == "gpt2" and speculation.draft_mismatch(big, small) is None
    assert "BOS/EOS" in speculation.draft_mismatch(big, replace(small, tokenizer_ids=("gpt2", 7, 8)))
    assert "vocabulary has" in speculation.draft_mismatch(big, replace(small, n_vocab=big.n_vocab + 500))
    assert "tokenizer 'llama'" in speculation.draft_mismatch(big, replace(small, tokenizer_ids=("llama", -1, -1)))


def test_prompts_file_jsonl_and_separated_text(tmp_path):
    jl = tmp_path / "agent.jsonl"
    jl.write_text(json.dumps({"prompt": "tool output\nline 2"}) + "\n\n" + json.dumps("plain string") + "\n")
    assert speculation.load_prompts(jl) == ["tool output\nline 2", "plain string"]
    txt = tmp_path / "requests.txt"
    txt.write_text("first request\n---\nsecond\nrequest\n----\nthird")
    assert speculation.load_prompts(txt) == ["first request", "second\nrequest", "third"]
    (tmp_path / "empty.txt").write_text("\n---\n")
    with pytest.raises(UsageError, match="holds no prompts"):
        speculation.load_prompts(tmp_path / "empty.txt")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(UsageError, match="line 1 is not JSON"):
        speculation.load_prompts(tmp_path / "bad.jsonl")


def test_acceptance_from_the_server_log():
    log = ("0.00.405 I slot print_timing: id  0 | task 4 | draft acceptance = 0.32258 (   30 accepted /    93 "
           "generated), mean len =  1.94\n"
           "0.00.863 I slot print_timing: id  0 | task 39 | draft acceptance = 0.50000 (   10 accepted /    20 "
           "generated), mean len =  2.00\n")
    acc = speculation.acceptance_from_log(log)
    assert (acc.requests, acc.drafted_n, acc.accepted_n) == (2, 113, 40)
    # 30 / 0.94 + 10 / 1.0 verification steps carried the 40 accepted tokens.
    assert acc.rate == pytest.approx(40 / 113) and acc.mean_len == pytest.approx(1 + 40 / (30 / 0.94 + 10))
    assert speculation.acceptance_from_log("no speculation here") is None


def test_a_prompts_file_is_what_the_arms_are_measured_on(engine_loc, demo_models, tmp_path):
    base = LaunchConfig(model=demo_models[("qwen3moe", "Q8_0")], ctx=256, parallel=1, threads=1)
    texts = ["def f(x):\n    return x + 1\n" * 60, "short request"]
    r = speculation.measure_arm(engine_loc, Arm("none", base), Workload(WorkloadKind.CUSTOM, 32, 8), requests=2,
                                texts=texts, log_dir=tmp_path)
    assert r.ok, r.failure
    long, short = r.requests
    # A long request keeps its last tokens, as many as the slot holds beside the generated ones.
    assert long.prompt_n == 256 - 8 - 1 and 1 < short.prompt_n < 8 and long.gen_n == short.gen_n == 8


def _req(rnd: int, i: int, elapsed: float, drafted: int = 0, accepted: int = 0) -> SpecRequest:
    return SpecRequest(rnd, i, elapsed, 0.01, 32, 32, 1000.0, 32 / elapsed, drafted, accepted)


def test_paired_gain_cancels_the_prompt_and_reports_noise():
    base = ArmResult(Arm("none", DRAFT), tuple(_req(r, i, 1.0 + i) for r in range(2) for i in range(3)))
    faster = ArmResult(Arm("x", DRAFT), tuple(_req(r, i, (1.0 + i) / (1.25 + 0.01 * (r - i)), 10, 6)
                                              for r in range(2) for i in range(3)))
    g = speculation.paired_gain(base, faster)
    assert g.pairs == 6 and g.gain_pct == pytest.approx(25.0, abs=1.0) and 0 < g.noise_pct < 3 and g.beyond_noise
    assert faster.acceptance_rate == pytest.approx(0.6)
    noisy = ArmResult(Arm("y", DRAFT), tuple(_req(r, i, (1.0 + i) * (0.7 if (r + i) % 2 else 1.4))
                                             for r in range(2) for i in range(3)))
    assert not speculation.paired_gain(base, noisy).beyond_noise


# ------------------------------------------------------------------------------ mechanics on the real engine


def write_mtp_demo(out: Path) -> Path:
    """The tiny hybrid demo with one NextN/MTP block, as Qwen3.5/3.6 files carry it (the engine drafts with it)."""
    spec = replace(demo_model.demo_spec("qwen35moe", "tiny"), n_layer_nextn=1, name="moe-tune demo qwen35moe mtp")
    return gguf_writer.write_model(out / "demo-qwen35moe-mtp-F16.gguf", spec, "F16", train_vocab(spec.n_vocab),
                                   title=spec.name, weights="random").path


@pytest.fixture(scope="session")
def mtp_demo(tmp_path_factory) -> Path:
    return write_mtp_demo(tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def synthetic_arms(engine_loc, mtp_demo, tmp_path_factory):
    """none and the model's own MTP head at synthetic acceptance lengths 1 (nothing), 2.5 and 4 (all of 3
    drafted tokens), alternating over two rounds. One thread: the machine is shared."""
    base = LaunchConfig(model=mtp_demo, ctx=1024, parallel=1, threads=1)
    arms = [Arm("none", base)] + [
        Arm(f"L{length:g}", replace(base, spec_types=(SpecType.DRAFT_MTP,), spec_draft_n_max=3,
                                   spec_synth_len=length)) for length in (1.0, 2.5, 4.0)]
    load = Workload(WorkloadKind.CUSTOM, 32, 48)
    return speculation.measure_arms(engine_loc, arms, load, rounds=2, requests=2,
                                    log_dir=tmp_path_factory.mktemp("spec-logs"))


def test_the_hybrid_demo_can_carry_an_mtp_head_the_engine_drafts_with(mtp_demo, synthetic_arms):
    info = inspect_model(mtp_demo)
    assert has_mtp_head(info) and info.n_nextn_layers == 1
    assert not info.recurrent_layers[-1] and info.n_head_kv[-1] > 0  # the MTP block is full attention, with KV
    assert synthetic_arms[3].ok and synthetic_arms[3].acceptance_rate > 0.95


def test_higher_synthetic_acceptance_raises_measured_speed(synthetic_arms):
    none, low, mid, high = synthetic_arms
    assert all(r.ok and len(r.requests) == 4 for r in synthetic_arms), [r.failure for r in synthetic_arms]
    assert none.acceptance_rate is None  # no drafting without speculation
    assert low.acceptance_rate == 0.0 and high.acceptance_rate > 0.95 and 0.2 < mid.acceptance_rate < 0.8
    # Server-side generation speed, median per request: about 2x per step from 1 to 2.5 to 4 tokens per step.
    assert low.gen_tok_s < mid.gen_tok_s < high.gen_tok_s, [r.gen_tok_s for r in synthetic_arms]
    assert speculation.paired_gain(none, low).gain_pct < speculation.paired_gain(none, high).gain_pct


def test_too_low_acceptance_loses_to_none(synthetic_arms):
    none, low = synthetic_arms[0], synthetic_arms[1]
    gain = speculation.paired_gain(none, low)
    assert none.gen_tok_s > low.gen_tok_s and gain.gain_pct < 0 and not (gain.gain_pct > 0 and gain.beyond_noise)


def test_bench_measures_speculation_on_the_server_and_reports_acceptance(engine_loc, mtp_demo):
    common = ("bench", str(mtp_demo), "-c", "1024", "-np", "1", "-t", "1", "-p", "16", "-n", "24", "-r", "1")
    proc = run_cli(*common, "--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "--spec-synth-len", "4", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["launch_line"].endswith("--spec-type draft-mtp --spec-draft-n-max 3 --spec-synth-len 4")
    assert "--spec-type" in report["server"]["argv"] and not any("spec" in a for a in report["argv"])  # not bench
    spec = report["server"]["speculation"]
    assert spec["drafted_n"] > 0 and spec["acceptance_rate"] > 0.95 and spec["mean_len"] > 3.5
    bad = run_cli(*common, "--spec-type", "draft-simple")
    assert bad.returncode == 1 and "add -md DRAFT.gguf" in bad.stderr and "Traceback" not in bad.stderr
    no_server = run_cli(*common, "--spec-type", "ngram-mod", "--no-server")
    assert no_server.returncode == 1 and "llama-server only" in no_server.stderr


def test_ngram_drafts_are_accepted_when_a_trained_model_copies_real_text(engine_loc, trained_model, demo_models,
                                                                         tmp_path):
    """n-gram speculation on real text: a passage of the bundled corpus, then its start again, continued by the
    trained SmolLM2-135M, which copies it on (in-context copying), so the drafts ngram-simple takes from the prompt
    are accepted; the random-weight demo continues with noise, so no 12-gram of its output is in the prompt and
    nothing is drafted. How many are accepted depends on the server's default sampling (temperature 0.8, a random
    seed: llama-server takes no seed from the environment): 25 and 5 of 46, 10 of 67 in runs here, and once none
    drafted at all in 48 tokens, so the test sends the passage three times and asserts acceptance, not a rate."""
    from tuner.quality import corpus

    passage = corpus.text_file().read_text()[20_000:20_700]
    text = passage + "\n\n" + passage[:300]
    load = Workload(WorkloadKind.CUSTOM, 400, 48)

    def measured(model: Path) -> speculation.ArmResult:
        cfg = LaunchConfig(model=model, ctx=1024, parallel=1, threads=2, spec_types=(SpecType.NGRAM_SIMPLE,))
        r = speculation.measure_arm(engine_loc, Arm("ngram-simple", cfg), load, requests=3, texts=[text] * 3,
                                    log_dir=tmp_path)
        assert r.ok, r.failure
        return sum(q.draft_n for q in r.requests), sum(q.draft_accepted_n for q in r.requests)

    trained = measured(trained_model)
    random = measured(demo_models[("qwen3moe", "Q8_0")])
    print(f"drafted/accepted over 3 requests: trained {trained}, random weights {random}")
    assert trained[0] > 0 and trained[1] > 0, trained  # the prompt's 12-grams drafted, kept
    assert random[1] <= random[0] // 10, random
