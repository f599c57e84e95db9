"""share → lookup → auto-tune --seed-from through the local Hub server (a real HTTP server speaking the Hub's
protocol to huggingface_hub), on a real auto-tune result of the demo model: what a record holds and never holds,
how it reaches a pool (a commit to one's own repo, a pull request to anyone else's), and a shared line measured
again as a seed."""

from __future__ import annotations

import getpass
import io
import json
import socket
from pathlib import Path

import pytest
from rich.console import Console

from tests.conftest import run_cli
from tests.demo_result import tune_demo, variant
from tests.hub_server import HubServer
from tuner.cli import tune_out
from tuner.hub.repos import HubOptions
from tuner.machine import hardware
from tuner.measure import workload
from tuner.measure.workload import WorkloadKind
from tuner.report import study_report
from tuner.search import autotune, finish, study
from tuner.search.result import load_result
from tuner.share import pool, seeds
from tuner.share.gate import MAX_TEXT, read_record
from tuner.share.match import CardQuery, ModelQuery, matching
from tuner.share.record import build_record, record_bytes, record_id

REPO = "alice/moe-tune-results"  # the test token hf_test is alice's
POOL = "moe-tune/shared-results"  # someone else's pool


@pytest.fixture(scope="module")
def tuned(engine_loc, tmp_path_factory) -> Path:
    return tune_demo(engine_loc, tmp_path_factory.mktemp("tuned"))


@pytest.fixture()
def hub(tmp_path):
    with HubServer() as srv:
        yield srv


def env_for(hub: HubServer, tmp_path: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "hf_test", "HF_HUB_CACHE": str(tmp_path / "hf"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "MOE_TUNE_CONFIG": str(tmp_path / "config")}


def test_a_record_holds_none_of_the_identifying_strings_of_its_result(tuned):
    result = load_result(tuned)
    record = build_record(result, "0123456789abcdef")
    text = record_bytes(record).decode()
    model = Path(str(result.model))
    identifying = {str(model), str(model.parent), str(tuned.parent), str(Path.home()), socket.gethostname(),
                   getpass.getuser(), *(t.worker for t in result.trials if t.worker)}
    assert str(model) in tuned.read_text()  # the result holds them, the record does not
    leaked = [s for s in identifying if s and s in text]
    assert leaked == []
    assert record["model"]["file_name"] == model.name and record["model"]["head_sha256"]
    assert read_record(text.encode(), record_id(record)).data == record  # what is shared passes the reader's gate
    assert record["printed"]["line"].startswith(f"llama-server -m {model.name} ")
    assert {ln["label"] for ln in record["lines"]} >= {"default", record["printed"]["label"]}
    assert record["sharer"] == "0123456789abcdef"


def test_a_625_character_reason_is_cut_not_refused(tuned, tmp_path):
    evidence = "read 4.0 MiB per token from disk while generating; RSS fell from 7.06 to 3.80 GiB; " * 7

    def paging(d):
        d["finish"]["selected"] = "candidate-1"
        for arm in [*d["finish"]["candidates"], *d["finish"].get("confirmation", [])]:
            if arm["label"] == "candidate-1":
                arm["host_paging"], arm["host_paging_evidence"] = "host_paging", evidence
    long_reason = variant(tuned, tmp_path / "results" / "paging", paging)
    reason = load_result(long_reason).finish.decision.reason
    assert len(reason) > 625 and reason.startswith("candidate-1 paged host RAM (read 4.0 MiB")
    res = run_cli("share", str(long_reason), "--repo", REPO, "--dry-run",
                  env={"MOE_TUNE_CONFIG": str(tmp_path / "config"), "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    why = json.loads(res.stdout)["printed"]["why"]
    assert len(why) == MAX_TEXT and why == reason[:MAX_TEXT - 1] + "…"


def test_share_commits_to_its_own_repo_and_opens_a_pull_request_on_anyone_elses(tuned, hub, tmp_path):
    env = env_for(hub, tmp_path)
    dry = run_cli("share", str(tuned), "--repo", REPO, "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["schema"] == "moe-tune/shared-result"
    assert not [r for r in hub.requests if r.method == "POST"]  # nothing sent

    shared = run_cli("share", str(tuned), "--repo", REPO, "--json", env=env)
    assert shared.returncode == 0, shared.stderr
    pushed = json.loads(shared.stdout)
    repo = hub.repos[("dataset", REPO)]
    assert repo.commits == [f"moe-tune share: {Path(str(load_result(tuned).model)).name} on cpu"]  # one commit
    assert json.loads(repo.files[pushed["path"]].data) == pushed["record"] and pushed["pull_request"] is False
    assert all(r.authorization == "Bearer hf_test" for r in hub.requests if r.method == "POST")
    sharer = (tmp_path / "config" / "sharer-id").read_text().strip()
    assert pushed["record"]["sharer"] == sharer and len(sharer) == 16  # made once, kept, carried in the record

    # Someone else's pool: a pull request; main is untouched, so nothing a sharer sends overwrites another's.
    theirs = hub.add_repo(POOL, {"README.md": b"pool"}, repo_type="dataset")
    before = dict(theirs.files)
    pr = run_cli("share", str(tuned), "--repo", POOL, env=env)
    assert pr.returncode == 0, pr.stderr
    assert pr.stdout.startswith(f"opened a pull request for records/{pushed['path'].split('/')[1]} to {POOL}: "
                                f"{hub.endpoint}/datasets/{POOL}/discussions/1")
    assert theirs.files == before and theirs.commits == [] and list(theirs.pulls[0]) == [pushed["path"]]
    assert json.loads(theirs.pulls[0][pushed["path"]] or b"")["sharer"] == sharer


def test_a_private_model_repo_is_never_named(tuned, hub, tmp_path):
    result = load_result(tuned)
    model = Path(str(result.model))
    snapshot = tmp_path / "hf" / "models--bob--secret-GGUF" / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    cached = snapshot / model.name
    cached.write_bytes(model.read_bytes())
    moved = variant(tuned, tmp_path / "results" / "cached", model=cached)
    env = env_for(hub, tmp_path)
    hub.add_repo("bob/secret-GGUF", {model.name: model}, private=True)
    res = run_cli("share", str(moved), "--repo", REPO, "--dry-run", env=env)
    assert res.returncode == 0, res.stderr
    assert "bob" not in res.stdout and "secret" not in res.stdout
    assert json.loads(res.stdout)["model"]["hub_repo"] is None
    assert ("note: the model's repo bob/secret-GGUF is not public (or could not be asked): the record names the "
            "model by file name and fingerprint only (--hub-repo names it)") in res.stderr
    named = run_cli("share", str(moved), "--repo", REPO, "--dry-run", "--hub-repo", "bob/secret-GGUF", env=env)
    assert json.loads(named.stdout)["model"]["hub_repo"] == "bob/secret-GGUF"  # the user named it
    hub.repos[("model", "bob/secret-GGUF")].private = False
    public = run_cli("share", str(moved), "--repo", REPO, "--dry-run", env=env)
    assert json.loads(public.stdout)["model"] | {"head_sha256": None} == {
        "hub_repo": "bob/secret-GGUF", "hub_file": model.name, "file_name": model.name, "quant": "Q4_K_M",
        "size_bytes": model.stat().st_size, "head_sha256": None,
        "tail_sha256": json.loads(public.stdout)["model"]["tail_sha256"]}


def test_a_shared_line_is_measured_again_as_a_seed(tuned, hub, engine_loc, tmp_path, monkeypatch):
    env = env_for(hub, tmp_path)
    shared = run_cli("share", str(tuned), "--repo", REPO, "--json", env=env)
    assert shared.returncode == 0, shared.stderr
    pushed = json.loads(shared.stdout)
    model = Path(str(load_result(tuned).model))
    found = run_cli("lookup", str(model), "--gpu", "cpu", "--repo", REPO, "--json", env=env)
    assert found.returncode == 0, found.stderr
    [group] = json.loads(found.stdout)["by_engine_commit"][pushed["record"]["engine"]["commit"] or "unknown"]
    assert (group["accounts"], group["records"], group["line"]) == (1, 1, pushed["record"]["printed"]["line"])
    options = HubOptions(endpoint=hub.endpoint, token="hf_test", cache_dir=tmp_path / "hf")
    got = pool.fetch(REPO, options)
    assert matching(got.records, ModelQuery.parse(str(model)), CardQuery.parse("RTX 3060 12GB")) == []  # CPU only

    # auto-tune --seed-from: the shared line is a seed of a new search, measured here and named in the report.
    hw = hardware.probe_hardware(host_bandwidth_s=0)
    steps: list[str] = []
    [seed] = seeds.seeds_from(REPO, model, hw, options, on_step=steps.append)
    assert seed.label == f"shared-{pushed['path'].split('/')[-1][:16]}" and REPO in seed.origin
    load = workload.preset(WorkloadKind.CHAT, 16, 16, rounds=1)
    req = autotune.TuneRequest(model=model, workload=load, min_ctx=512, max_kld=None,
                               budget=study.Budget(trials=2), top_candidates=1, results_dir=tmp_path / "results",
                               measure=study.Measure.for_workload(load, repetitions=1),
                               rounds=finish.Rounds(min=1, max=1, select=1), proposals=(seed,))
    res = autotune.auto_tune(req, engine_loc, hw, on_step=steps.append)
    trial = next(t for t in res.result.trials if t.seed == seed.label)
    assert trial.status == "measured" and trial.gen_tok_s
    assert res.result.seed_origins == {seed.label: seed.origin}
    story = res.result.seed_story()
    assert story is not None and (seed.label in story or "not from a shared line" in story)
    printed = io.StringIO()
    monkeypatch.setattr(tune_out, "out", Console(file=printed, width=200))
    tune_out.summary(res)
    assert f"seed: {story}" in " ".join(printed.getvalue().split())  # wrapped to the console's width: as words
    assert json.loads((res.result_dir / "result.json").read_text())["seed_origins"] == {seed.label: seed.origin}
    study_report.write(res.result, res.result_dir)
    assert f"- seed: {story}" in (res.result_dir / "report.md").read_text()


def test_share_and_lookup_refuse_bad_input_in_one_line(tmp_path):
    bad = run_cli("share", str(tmp_path / "missing.json"), "--repo", "noslash")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "OWNER/DATASET" in bad.stderr
    frontier = run_cli("auto-tune", "--frontier", "--seed-from", REPO)
    assert frontier.returncode == 1 and "drop --frontier" in frontier.stderr and "Traceback" not in frontier.stderr
    card = run_cli("lookup", "o/m-GGUF:Q4_K_M", "--gpu", "Totally Real GPU 12GB")
    assert card.returncode == 1 and card.stderr.startswith("error: no card matches 'Totally Real GPU 12GB'")
    offline = run_cli("lookup", "o/m-GGUF:Q4_K_M", "--gpu", "RTX 3060 12GB", "--repo", REPO,
                      env={"HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 1 and offline.stderr == (f"error: {REPO} is on the Hub and offline mode is on: unset "
                                                          "HF_HUB_OFFLINE to share or look up\n")
