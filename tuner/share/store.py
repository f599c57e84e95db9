"""`moe-tune share`: a result.json as one record in a dataset repo, one file ``records/<id>.json`` per share.

How it reaches the pool (docs/sharing.md): to a repo of the user's own namespace (or an organization they belong
to) as one commit, the repo created if missing; to anyone else's repo as a pull request (huggingface_hub's
``create_pr``), so a sharer can add a record but never overwrite or delete another's: the pool's owner merges.

The model's Hub repo is named only when anyone can see it (asked without the user's token: not private, not
gated) or when the user names it (``hub_repo``); otherwise the record names the model by file name and
fingerprint alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.core.errors import UsageError
from tuner.hub import records as hub
from tuner.hub.repos import DEFAULT_OPTIONS, HubOptions, parse_hub_ref
from tuner.search.result import load_result
from tuner.share.pool import FOLDER
from tuner.share.record import build_record, checked, record_bytes, record_id, without_hub_repo
from tuner.share.sharer import sharer_id


@dataclass(frozen=True, slots=True)
class Shared:
    record: dict[str, Any]
    path: str  # in the repo
    url: str | None  # the commit or the pull request; None: --dry-run, nothing was sent
    pull_request: bool = False
    notes: tuple[str, ...] = ()  # what was left out of the record, and why


def share(result_path: Path, repo_id: str, *, dry_run: bool = False, hub_repo: str | None = None,
          options: HubOptions = DEFAULT_OPTIONS) -> Shared:
    """Build the record of a result.json and send it to ``repo_id`` (or only build it, with ``dry_run``).
    ``hub_repo``: the model's Hub repo, named by the user (then shared whether or not it is public)."""
    hub.check_repo_id(repo_id)
    result = load_result(result_path)
    record = build_record(result, sharer_id())
    notes: list[str] = []
    if hub_repo is not None:
        ref = parse_hub_ref(hub_repo)
        if ref is None or ref.quant is not None:
            raise UsageError(f"--hub-repo {hub_repo!r} is not OWNER/NAME: name the model's repo, e.g. "
                             "unsloth/Qwen3-30B-A3B-GGUF")
        record = checked(record | {"model": record["model"] | {"hub_repo": ref.repo_id}}, result.study)
    elif record["model"]["hub_repo"] and not hub.is_public(record["model"]["hub_repo"], options=options):
        notes.append(f"the model's repo {record['model']['hub_repo']} is not public (or could not be asked): the "
                     "record names the model by file name and fingerprint only (--hub-repo names it)")
        record = without_hub_repo(record)
    path = f"{FOLDER}/{record_id(record)}.json"
    if dry_run:
        return Shared(record, path, None, notes=tuple(notes))
    owned = repo_id.split("/")[0] in hub.namespaces(options)
    model = record["model"]["hub_repo"] or record["model"]["file_name"]
    pushed = hub.push(repo_id, path, record_bytes(record), f"moe-tune share: {model} on {record['card']['name']}",
                      options, create_pr=not owned)
    return Shared(record, path, pushed.url, pushed.pull_request, tuple(notes))
