"""The one model resolver: whatever the user typed for MODEL, as a local GGUF path and where it came from.

A local ``.gguf``; ``REPO[:QUANT]`` from the Hugging Face Hub (downloaded, or for planning only its header,
fetched with range requests into a sparse stand-in); or, for planning only, a catalog shape such as
``qwen3-30b-a3b:Q4_K_M`` written as a shape-true file. Every command resolves its model here, once, at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tuner.core.errors import UsageError

if TYPE_CHECKING:  # the Hub client costs a noticeable share of CLI start-up: imported only when a name needs it
    from tuner.hub.download import ProgressFn
    from tuner.hub.repos import HubOptions

NOT_FOUND_FIX = "give a .gguf path or a Hugging Face name like unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M"


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: Path  # a GGUF (for header-only names: a stand-in or shape file that readers and llama-fit-params open)
    source: str  # where it came from, in the user's words


def resolve_model(name: str, *, header_only: bool = False, revision: str = "main",
                  options: HubOptions | None = None, on_progress: ProgressFn | None = None,
                  cache_dir: Path | None = None) -> ResolvedModel:
    """``name`` as a local GGUF. ``header_only``: nothing beyond a header is fetched, and catalog shapes are
    accepted (planning needs shapes, not weights)."""
    path = Path(name).expanduser()
    if path.is_file():
        return ResolvedModel(path, "file")
    from tuner.hub.repos import DEFAULT_OPTIONS, parse_hub_ref

    options = options or DEFAULT_OPTIONS
    ref = parse_hub_ref(name)
    if ref is not None and header_only:
        from tuner.hub import remote_header, repos  # noqa: F811 - repos: the module, for its listing

        listing = repos.list_quants(ref.repo_id, revision=revision, options=options)
        quant = listing.get(ref.quant)
        headers = remote_header.read_quant_headers(ref.repo_id, quant, commit=listing.commit or revision,
                                                   options=options)
        return ResolvedModel(headers.first_path,
                             f"header of {ref.repo_id}:{quant.name} (range requests, no download)")
    if ref is not None:
        from tuner.hub.download import download_quant

        got = download_quant(ref.repo_id, ref.quant, revision=revision, options=options, on_progress=on_progress)
        return ResolvedModel(got.first_path, f"{ref.repo_id}:{got.quant} (Hugging Face cache)")
    if path.suffix == ".gguf" or not header_only:
        extra = ", or a catalog name like qwen3-30b-a3b:Q4_K_M" if header_only else ""
        raise UsageError(f"model {name} not found: {NOT_FOUND_FIX}{extra}")
    return _catalog_shape(name, cache_dir)


def _catalog_shape(name: str, cache_dir: Path | None) -> ResolvedModel:
    from tuner.machine import paths
    from tuner.models import shape_model

    spec, recipe = shape_model.resolve_target(name)
    folder = cache_dir or paths.cache_root() / "shape-models"
    made = shape_model.write_shape_model(spec, recipe, folder / f"{spec.name}-{recipe}.gguf")
    published = spec.name in {s.name for s in shape_model.EXTRA_SHAPES.values()}
    return ResolvedModel(made.path, f"shape-true {spec.name} {recipe} from "
                                    f"{'its published config' if published else 'the quant catalog'}")
