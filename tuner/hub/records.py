"""Small JSON files in a Hugging Face dataset repo, through huggingface_hub's own API: create the repo, push one
file as one commit, list the files under a folder with their sizes, download one into the standard cache.

Bytes only: what the files mean (a shared auto-tune record) and whether they are to be trusted is
:mod:`tuner.share`'s to say. A file listed larger than the caller's bound is never downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tuner.core.errors import UsageError
from tuner.hub.repos import DEFAULT_OPTIONS, HubOptions, hub_errors

DATASET = "dataset"


@dataclass(frozen=True, slots=True)
class RemoteRecord:
    path: str  # inside the repo, e.g. "records/3f…json"
    size_bytes: int


@dataclass(frozen=True, slots=True)
class Pushed:
    path: str
    commit_url: str
    commit: str


def check_repo_id(repo_id: str) -> str:
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
        raise UsageError(f"--repo {repo_id!r} is not OWNER/DATASET: name a dataset repo like you/moe-tune-results")
    return repo_id


def push(repo_id: str, path_in_repo: str, data: bytes, message: str, options: HubOptions = DEFAULT_OPTIONS
         ) -> Pushed:
    """Create the dataset repo if it is missing, then commit ``data`` at ``path_in_repo`` (one commit)."""
    from huggingface_hub import HfApi, get_token

    if options.token is False or (options.token is None and get_token() is None):
        raise UsageError("sharing writes to the Hub and needs a token with write access: run `hf auth login` "
                         "or set HF_TOKEN (--dry-run prints the record without one)")
    api = HfApi(endpoint=options.endpoint, token=options.token)
    with hub_errors(repo_id, options):
        api.create_repo(repo_id, repo_type=DATASET, exist_ok=True)
        info = api.upload_file(path_or_fileobj=data, path_in_repo=path_in_repo, repo_id=repo_id, repo_type=DATASET,
                               commit_message=message)
    return Pushed(path_in_repo, str(info.commit_url), str(info.oid))


def list_records(repo_id: str, folder: str, options: HubOptions = DEFAULT_OPTIONS) -> tuple[str, list[RemoteRecord]]:
    """The repo's commit and its ``*.json`` files under ``folder`` (an empty list when the folder is missing)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=options.endpoint, token=options.token)
    with hub_errors(repo_id, options):
        info = api.dataset_info(repo_id)
        commit = info.sha or "main"
        names = {s.rfilename for s in info.siblings or ()}
        if not any(n.startswith(f"{folder}/") for n in names):
            return commit, []
        tree = api.list_repo_tree(repo_id, path_in_repo=folder, repo_type=DATASET, revision=commit, recursive=True)
        files = [RemoteRecord(e.path, int(e.size)) for e in tree
                 if isinstance(e, RepoFile) and e.path.endswith(".json")]
    return commit, sorted(files, key=lambda f: f.path)


def download(repo_id: str, path_in_repo: str, commit: str, options: HubOptions = DEFAULT_OPTIONS) -> Path:
    """One file of the repo at ``commit``, through the standard Hugging Face cache."""
    from huggingface_hub import hf_hub_download

    with hub_errors(repo_id, options):
        return Path(hf_hub_download(repo_id=repo_id, filename=path_in_repo, repo_type=DATASET, revision=commit,
                                    endpoint=options.endpoint, token=options.token, cache_dir=options.cache_dir,
                                    local_files_only=options.is_offline))
