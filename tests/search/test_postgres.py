"""Several tuners share one study through `--storage URL`: two `moe-tune auto-tune` processes at once against a
real PostgreSQL server (started here from the `pgserver` wheel of the dev extra), then a third run resumes it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from tests.conftest import run_cli
from tuner.core.errors import StudyError
from tuner.search import dedup, study

pytestmark = pytest.mark.slow  # a real PostgreSQL server and several tuner processes
TRIALS_EACH = 3


@pytest.fixture(scope="module")
def postgres() -> Iterator[Any]:
    """A PostgreSQL server of its own in a fresh data folder; stopped and the folder removed afterwards."""
    # A short folder: the server's Unix socket lives in it, and socket paths are limited to ~100 bytes.
    with warnings.catch_warnings():  # pgserver asks platformdirs for XDG_RUNTIME_DIR, unset in CI containers
        warnings.simplefilter("ignore")
        import pgserver
    data = Path(tempfile.mkdtemp(prefix="moe-pg-"))
    srv = pgserver.get_server(data, cleanup_mode="stop")
    postmaster = int((data / "postmaster.pid").read_text().split()[0])
    try:
        yield srv
    finally:
        srv.cleanup()
        shutil.rmtree(data, ignore_errors=True)
    assert not data.exists()
    assert not psutil.pid_exists(postmaster) or psutil.Process(postmaster).status() == psutil.STATUS_ZOMBIE


def _database(srv: Any, name: str) -> str:
    """A new empty database on the server, as the SQLAlchemy URL Optuna takes."""
    srv.psql(f"CREATE DATABASE {name};")
    uri = srv.get_uri(name)
    assert uri.startswith("postgresql://")
    return str(uri).replace("postgresql://", "postgresql+psycopg2://", 1)


@pytest.fixture
def postgres_url(postgres: Any, request: pytest.FixtureRequest) -> str:
    return _database(postgres, re.sub(r"\W", "_", request.node.name)[:60].lower())


_OPEN = ("import sys; from tuner.search import study; "
         "print(study.create_or_load('s', sys.argv[1], study.Objective())[1])")


def test_processes_opening_a_new_shared_study_at_once_all_succeed_and_one_creates_it(postgres_url):
    # On a fresh database they also race on creating Optuna's tables; the loser must retry, not fail.
    procs = [subprocess.Popen([sys.executable, "-c", _OPEN, postgres_url], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outs]
    assert sorted(out.strip() for out, _ in outs) == ["False", "False", "True"]
    bad = postgres_url.replace("/test_", "/missing_")
    with pytest.raises(StudyError, match="check the URL"):
        study.open_study("s", bad, study.Objective())


def _tune(model: Path, url: str, out: Path, trials: int, seed: int):
    return run_cli("auto-tune", str(model), "-p", "16", "-n", "16", "--min-ctx", "512", "--trials", str(trials),
                   "--storage", url, "--results-dir", str(out), "--seed", str(seed), timeout=300)


def _copy(model: Path, folder: Path) -> Path:
    """The same model file in another folder, as a second machine would hold it."""
    folder.mkdir()
    os.link(model, folder / model.name)
    return folder / model.name


def test_two_tuners_share_one_postgres_study_and_a_third_resumes_it(demo_models, tmp_path, postgres_url):
    src = demo_models[("qwen3moe", "Q4_K_M")]
    # Each worker holds the model in a folder of its own: the study (named by the model's name and size) and the
    # dedup (configs compared by the model's file name) are still one.
    models = {i: _copy(src, tmp_path / f"models{i}") for i in (1, 2, 3)}
    with ThreadPoolExecutor(2) as pool:  # both processes start together and work on the study at the same time
        runs = list(pool.map(lambda i: _tune(models[i], postgres_url, tmp_path / f"r{i}", TRIALS_EACH, i), (1, 2)))
    for run in runs:
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
        # prose is wrapped to the terminal's width: read it as words
        assert f"trials stored ({TRIALS_EACH} this run) in postgresql+psycopg2://" in " ".join(run.stdout.split())
        assert run.stdout.strip().splitlines()[-2:][0] == "launch line:"
        assert run.stdout.strip().splitlines()[-1].startswith("llama-server -m ")

    [summary] = optuna.get_all_study_summaries(postgres_url)
    # Both printed the same study name, the one the storage holds.
    assert all(f"study {summary.study_name}: " in run.stdout for run in runs)
    st = optuna.load_study(study_name=summary.study_name, storage=postgres_url)
    recs = study.records(st)
    assert len(recs) == 2 * TRIALS_EACH
    # The configs measured across both workers are distinct (settings alike, model folders aside).
    assert len({dedup.key(study.config_from_dict(r.config)) for r in recs}) == len(recs)
    assert {Path(r.config["model"]).parent.name for r in recs} == {"models1", "models2"}
    numbers = {r.number for r in recs}
    # A number missing from the records is a sampler's repeat, skipped unmeasured (tuner.search.dedup).
    skipped = [t for t in st.trials if t.number not in numbers]
    assert all(t.user_attrs.get("status") == "duplicate" and t.user_attrs["duplicate_of"] in numbers
               for t in skipped)
    workers = Counter(r.worker for r in recs)
    assert len(workers) == 2 and set(workers.values()) == {TRIALS_EACH}  # both contributed their budget
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in st.trials  # nothing left RUNNING
               if t.number in numbers)
    seeds = Counter(r.seed for r in recs if r.seed)
    assert seeds and set(seeds.values()) == {1}  # the known-good configs were enqueued once, not once per process
    assert recs[0].seed == "default" and all(r.status == "measured" and r.gen_tok_s for r in recs)
    # Each run re-measured the study's best trials, whichever process had measured them.
    for i in (1, 2):
        [result_file] = (tmp_path / f"r{i}").glob("*/result.json")
        result = json.loads(result_file.read_text())
        assert result["study"] == summary.study_name and len(result["trials"]) >= TRIALS_EACH
        assert {c["trial_number"] for c in result["finish"]["candidates"]} <= numbers  # measured by either

    # A third run resumes the shared study: the trial count continues from both.
    third = _tune(models[3], postgres_url, tmp_path / "r3", 2, 3)
    assert third.returncode == 0, third.stderr
    assert f"{2 * TRIALS_EACH + 2} trials stored (2 this run)" in third.stdout
    recs = study.records(optuna.load_study(study_name=summary.study_name, storage=postgres_url))
    assert len(recs) == 2 * TRIALS_EACH + 2
    assert len({dedup.key(study.config_from_dict(r.config)) for r in recs}) == len(recs)  # none measured twice
    assert len({r.worker for r in recs}) == 3 and len(optuna.get_all_study_summaries(postgres_url)) == 1

