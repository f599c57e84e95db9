"""share → lookup → auto-tune --seed-from through the local Hub server (a real HTTP server speaking the Hub's
protocol to huggingface_hub), on a real auto-tune result of the demo model."""

from __future__ import annotations

import getpass
import io
import json
import socket
from pathlib import Path

import pytest
from rich.console import Console

from tests.conftest import run_cli
from tests.demo_result import tune_demo
from tests.hub_server import HubServer
from tuner.cli import cmd_tune
from tuner.hub.repos import HubOptions
from tuner.machine import hardware
from tuner.measure import workload
from tuner.measure.workload import WorkloadKind
from tuner.report import study_report
from tuner.search import autotune, finish, study
from tuner.search.result import load_result
from tuner.share import lookup, store
from tuner.share.record import build_record, read_record, record_bytes

REPO = "alice/moe-tune-results"


@pytest.fixture(scope="module")
def tuned(engine_loc, tmp_path_factory) -> Path:
    return tune_demo(engine_loc, tmp_path_factory.mktemp("tuned"))


@pytest.fixture()
def hub(tmp_path):
    with HubServer() as srv:
        yield srv


def env_for(hub: HubServer, tmp_path: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "hf_test", "HF_HUB_CACHE": str(tmp_path / "hf"),
            "HF_HUB_DISABLE_TELEMETRY": "1"}


def test_a_record_holds_none_of_the_identifying_strings_of_its_result(tuned):
    result = load_result(tuned)
    record = build_record(result)
    text = record_bytes(record).decode()
    model = Path(str(result.model))
    identifying = {str(model), str(model.parent), str(tuned.parent), str(Path.home()), socket.gethostname(),
                   getpass.getuser(), *(t.worker for t in result.trials if t.worker)}
    assert str(model) in tuned.read_text()  # the result holds them, the record does not
    leaked = [s for s in identifying if s and s in text]
    assert leaked == []
    assert record["model"]["file_name"] == model.name and record["model"]["head_sha256"]
    assert read_record(text.encode(), "x").data == record  # what is shared passes the reader's gate whole
    assert record["printed"]["line"].startswith(f"llama-server -m {model.name} ")
    assert {ln["label"] for ln in record["lines"]} >= {"default", record["printed"]["label"]}


def test_share_lookup_and_seed_from_round_trip_through_the_hub(tuned, hub, engine_loc, tmp_path, monkeypatch):
    env = env_for(hub, tmp_path)
    dry = run_cli("share", str(tuned), "--repo", REPO, "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["schema"] == "moe-tune/shared-result" and hub.requests == []  # nothing sent

    shared = run_cli("share", str(tuned), "--repo", REPO, "--json", env=env)
    assert shared.returncode == 0, shared.stderr
    pushed = json.loads(shared.stdout)
    repo = hub.repos[("dataset", REPO)]
    assert repo.commits == [f"moe-tune share: {Path(str(load_result(tuned).model)).name} on cpu"]  # one commit
    assert json.loads(repo.files[pushed["path"]].data) == pushed["record"]
    assert all(r.authorization == "Bearer hf_test" for r in hub.requests if r.method == "POST")

    model = Path(str(load_result(tuned).model))
    found = run_cli("lookup", str(model), "--gpu", "cpu", "--repo", REPO, "--json", env=env)
    assert found.returncode == 0, found.stderr
    answer = json.loads(found.stdout)
    [group] = answer["by_engine_commit"][pushed["record"]["engine"]["commit"] or "unknown"]
    assert group["records"] == 1 and group["line"] == pushed["record"]["printed"]["line"]
    got = store.fetch(REPO, HubOptions(endpoint=hub.endpoint, token=False, cache_dir=tmp_path / "hf"))
    card = lookup.CardQuery.parse("RTX 3060 12GB")
    assert lookup.matching(got.records, lookup.ModelQuery.parse(str(model)), card) == []  # CPU: no answer for a card

    # auto-tune --seed-from: the shared line is a seed of a new search, measured here and named in the report.
    options = HubOptions(endpoint=hub.endpoint, token="hf_test", cache_dir=tmp_path / "hf")
    hw = hardware.probe_hardware(host_bandwidth_s=0)
    steps: list[str] = []
    seeds = lookup.seeds_from(REPO, model, hw, options, on_step=steps.append)
    [seed] = seeds
    assert seed.label == f"shared-{pushed['path'].split('/')[-1][:8]}" and REPO in seed.origin
    load = workload.preset(WorkloadKind.CHAT, 16, 16, rounds=1)
    req = autotune.TuneRequest(model=model, workload=load, min_ctx=512, max_kld=None,
                               budget=study.Budget(trials=2), top_candidates=1, results_dir=tmp_path / "results",
                               measure=study.Measure.for_workload(load, repetitions=1),
                               rounds=finish.Rounds(min=1, max=1, select=1), proposals=tuple(seeds))
    res = autotune.auto_tune(req, engine_loc, hw, on_step=steps.append)
    trial = next(t for t in res.result.trials if t.seed == seed.label)
    assert trial.status == "measured" and trial.gen_tok_s
    assert res.result.seed_origins == {seed.label: seed.origin}
    story = res.result.seed_story()
    assert story is not None and (seed.label in story or "not from a shared line" in story)
    printed = io.StringIO()
    monkeypatch.setattr(cmd_tune, "out", Console(file=printed, width=200))
    cmd_tune._summary(res)
    assert f"seed: {story}" in printed.getvalue()
    assert json.loads((res.result_dir / "result.json").read_text())["seed_origins"] == {seed.label: seed.origin}
    study_report.write(res.result, res.result_dir)
    assert f"- seed: {story}" in (res.result_dir / "report.md").read_text()


def test_records_from_a_newer_schema_or_hostile_are_skipped_in_one_line_each(tuned, hub, tmp_path):
    record = build_record(load_result(tuned))
    newer = record | {"version": record["version"] + 1}
    rpc = json.loads(json.dumps(record))
    rpc["printed"]["line"] += " --rpc 10.0.0.1:50052"
    typed = record | {"lines": "all of them"}
    hub.add_repo(REPO, {"records/good.json": record_bytes(record), "records/newer.json": record_bytes(newer),
                        "records/rpc.json": record_bytes(rpc), "records/typed.json": record_bytes(typed),
                        "records/huge.json": b" " * 70_000, "README.md": b"shared results"}, repo_type="dataset")
    got = store.fetch(REPO, HubOptions(endpoint=hub.endpoint, token=False, cache_dir=tmp_path / "hf"))
    assert [r.record_id for r in got.records] == ["good"]
    assert len(got.skipped) == 4 and all("\n" not in s for s in got.skipped)
    why = dict(s.split(" skipped: ", 1) for s in got.skipped)
    assert "newer than this moe-tune reads" in why["shared record newer"]
    assert "--rpc" in why["shared record rpc"] and "lines must be a list" in why["shared record typed"]
    assert "70,000 bytes" in why["shared record huge"]
    assert not any("huge.json" in r.path for r in hub.requests if r.method == "GET")  # never downloaded


def test_share_and_lookup_refuse_bad_input_in_one_line(tmp_path):
    bad = run_cli("share", str(tmp_path / "missing.json"), "--repo", "noslash")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "OWNER/DATASET" in bad.stderr
    frontier = run_cli("auto-tune", "--frontier", "--seed-from", REPO)
    assert frontier.returncode == 1 and "drop --frontier" in frontier.stderr and "Traceback" not in frontier.stderr
