"""Records in a dataset repo: one JSON file per share under ``records/``, one commit per share, read back through
the gate of :mod:`tuner.share.record` (a file that fails it is skipped with its one-line reason)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.core.errors import RecordError
from tuner.hub import records as hub_records
from tuner.hub.repos import DEFAULT_OPTIONS, HubOptions
from tuner.search.result import load_result
from tuner.share.record import (
    MAX_RECORD_BYTES,
    SharedRecord,
    build_record,
    read_record,
    record_bytes,
    record_id,
)

FOLDER = "records"
MAX_RECORDS = 500  # files read from one repo (the newest-named first would need dates: the first by name)


@dataclass(frozen=True, slots=True)
class Shared:
    record: dict[str, Any]
    path: str  # in the repo
    commit_url: str | None  # None: --dry-run, nothing was sent


def share(result_path: Path, repo_id: str, *, dry_run: bool = False, options: HubOptions = DEFAULT_OPTIONS
          ) -> Shared:
    """Build the record of a result.json and push it to ``repo_id`` as one commit (or only build it)."""
    hub_records.check_repo_id(repo_id)
    record = build_record(load_result(result_path))
    path = f"{FOLDER}/{record_id(record)}.json"
    if dry_run:
        return Shared(record, path, None)
    model = record["model"]["hub_repo"] or record["model"]["file_name"]
    pushed = hub_records.push(repo_id, path, record_bytes(record),
                              f"moe-tune share: {model} on {record['card']['name']}", options)
    return Shared(record, path, pushed.commit_url)


@dataclass(frozen=True, slots=True)
class Fetched:
    repo_id: str
    commit: str
    records: tuple[SharedRecord, ...]
    skipped: tuple[str, ...]  # one line per file that failed the gate


def fetch(repo_id: str, options: HubOptions = DEFAULT_OPTIONS) -> Fetched:
    """Every record of the repo that passes the gate; the others named in ``skipped``."""
    hub_records.check_repo_id(repo_id)
    commit, files = hub_records.list_records(repo_id, FOLDER, options)
    good: list[SharedRecord] = []
    skipped: list[str] = []
    if len(files) > MAX_RECORDS:
        skipped.append(f"{len(files) - MAX_RECORDS} records beyond the first {MAX_RECORDS} were not read")
    for f in files[:MAX_RECORDS]:
        rid = f.path.rsplit("/", 1)[-1].removesuffix(".json")
        if f.size_bytes > MAX_RECORD_BYTES:  # never downloaded
            skipped.append(str(RecordError(f"shared record {rid[:40]} skipped: {f.size_bytes:,} bytes, more than "
                                           f"the {MAX_RECORD_BYTES:,} a record may hold")))
            continue
        local = hub_records.download(repo_id, f.path, commit, options)
        try:
            good.append(read_record(local.read_bytes()[:MAX_RECORD_BYTES + 1], rid))
        except RecordError as exc:
            skipped.append(str(exc))
    return Fetched(repo_id, commit, tuple(good), tuple(skipped))
