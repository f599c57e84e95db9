"""Standard evaluation texts fetched from the Hugging Face Hub (where it is reachable).

wikitext-2 is the text llama.cpp's own perplexity figures use: the raw test split, shipped by llama.cpp's CI
dataset repo as a zip holding ``wikitext-2-raw/wiki.test.raw``. The zip goes into the standard Hugging Face
cache (so ``HF_ENDPOINT``, ``HF_HUB_CACHE`` and offline mode apply as usual); the extracted text is kept once
under the tool's cache, named by the zip's hash.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

from tuner.core.errors import HubError, UsageError
from tuner.hub.repos import DEFAULT_OPTIONS, HubOptions, hub_errors
from tuner.machine import paths
from tuner.machine.fileio import atomic_write, sha256_file


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    name: str
    repo_id: str  # a dataset repo
    filename: str
    member: str  # the text inside the zip
    about: str


DATASETS = {
    "wikitext-2": DatasetSpec(
        name="wikitext-2",
        repo_id="ggml-org/ci",
        filename="wikitext-2-raw-v1.zip",
        member="wikitext-2-raw/wiki.test.raw",
        about="WikiText-2 raw, test split (CC BY-SA 3.0), as llama.cpp's perplexity figures use it",
    ),
}


def spec(name: str) -> DatasetSpec:
    try:
        return DATASETS[name]
    except KeyError:
        raise UsageError(
            f"unknown dataset {name!r}: use one of {', '.join(sorted(DATASETS))}, or -f FILE for your own text"
        ) from None


def fetch(name: str, options: HubOptions = DEFAULT_OPTIONS) -> Path:
    """The dataset's text as a local file: downloaded once into the HF cache, extracted once."""
    from huggingface_hub import hf_hub_download

    ds = spec(name)
    with hub_errors(ds.repo_id, options):
        archive = Path(hf_hub_download(
            repo_id=ds.repo_id, repo_type="dataset", filename=ds.filename, endpoint=options.endpoint,
            token=options.token, cache_dir=options.cache_dir, local_files_only=options.is_offline,
        ))
    out = paths.cache_root() / "datasets" / f"{ds.name}-{sha256_file(archive)[:16]}.txt"
    if out.is_file():
        return out
    try:
        with zipfile.ZipFile(archive) as zf:
            data = zf.read(ds.member)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise HubError(
            f"{ds.repo_id}/{ds.filename} does not hold {ds.member} ({exc}): delete it from the Hugging Face cache "
            "and run again, or pass -f FILE"
        ) from None
    return atomic_write(out, data)
