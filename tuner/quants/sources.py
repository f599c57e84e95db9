"""What a comparison measures and needs, sized before anything is fetched: the quants (published in a repo,
local files, or made here), the reference its KL-divergence is measured against, and the full-precision source
``--make`` quantizes from.

Sizes come from the Hub's file listing (every shard of a split file), from the local files, or from
llama-quantize's own ``--dry-run``; a vocabulary size (for the logits files) from the GGUF header, read with
range requests for a remote file. Nothing here downloads model data until a ``fetch`` is called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tuner.core.errors import UsageError
from tuner.engine import build
from tuner.hub import download, remote_header, repos
from tuner.models import gguf_reader, quantize
from tuner.quality import imatrix, perplexity
from tuner.quants import disk as quant_disk

# Reference quants, best first, when the repo holds one; otherwise the largest quant is the reference.
REFERENCE_QUANTS = ("F32", "BF16", "F16", "Q8_0")
MADE, PUBLISHED, LOCAL = "made here", "published", "local file"
StepFn = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Fetched:
    paths: tuple[Path, ...]  # every part, in order
    command: str | None = None  # a quant made here: the exact llama-quantize command
    owned: bool = False  # fetched or made by the comparison: counted against the budget, droppable

    @property
    def path(self) -> Path:
        return self.paths[0]


class FixedFile:
    """A file the comparison needs throughout (the reference, the --make source): fetched once, never dropped.
    ``counted_bytes``: what it adds to the disk (every shard of a Hub file; 0 for a local file of the user's)."""

    def __init__(self, label: str, name: str, counted_bytes: int, fetch: Callable[[], tuple[Path, ...]],
                 header: Callable[[], gguf_reader.ModelInfo]) -> None:
        self.label = label
        self.name = name  # in the user's words: a path, or REPO:QUANT
        self.counted_bytes = counted_bytes
        self._fetch = fetch
        self._header = header
        self._paths: tuple[Path, ...] | None = None
        self._info: gguf_reader.ModelInfo | None = None

    def fetch(self) -> tuple[Path, ...]:
        if self._paths is None:
            self._paths = self._fetch()
        return self._paths

    @property
    def fetched(self) -> bool:
        return self._paths is not None

    @property
    def path(self) -> Path:
        return self.fetch()[0]

    def info(self) -> gguf_reader.ModelInfo:
        """The file's header: from disk once fetched, before that from the Hub with range requests."""
        if self._info is None:
            self._info = gguf_reader.inspect_model(self._paths[0]) if self._paths else self._header()
        return self._info


def local_fixed(label: str, path: Path) -> FixedFile:
    parts = tuple(gguf_reader.split_parts(path))
    return FixedFile(label, str(path), 0, lambda: parts, lambda: gguf_reader.inspect_model(path))


def repo_fixed(label: str, repo_id: str, q: repos.Quant, commit: str | None, options: repos.HubOptions,
               on_step: StepFn) -> FixedFile:
    def fetch() -> tuple[Path, ...]:
        on_step(f"fetching {label} {repo_id}:{q.name} ({q.total_bytes / 2**20:,.1f} MiB in {q.n_parts} file(s))")
        return download.download_quant(repo_id, q.name, options=options).paths

    def header() -> gguf_reader.ModelInfo:
        return remote_header.read_quant_headers(repo_id, q, commit=commit or "main", options=options).model_info()
    return FixedFile(f"{label} {q.name}", f"{repo_id}:{q.name}", q.total_bytes, fetch, header)


@dataclass(frozen=True, slots=True)
class Target:
    """One quant to measure; ``fetch`` puts its file on disk (download or make) only when its turn comes."""

    name: str
    origin: str
    estimate_bytes: Callable[[], int]  # what fetching adds to the disk (0: on disk already)
    fetch: Callable[[], Fetched]
    sized_now: bool = True  # estimate_bytes needs nothing fetched (False: a made quant's dry run needs the source)
    n_parts: int = 1
    # A made quant's size from the source's header alone (approximate, taken low); None: not sized before fetching.
    header_estimate: Callable[[], int | None] = lambda: None


@dataclass(frozen=True, slots=True)
class Plan:
    title: str
    targets: tuple[Target, ...]
    reference: FixedFile | None
    source: FixedFile | None  # the --make source (may be the reference itself)
    catalog: str | None
    imatrix: Callable[[], Path | None]


def reference_quant(listing: repos.RepoQuants) -> repos.Quant:
    for name in REFERENCE_QUANTS:
        for q in listing.quants:
            if q.name.upper() == name:
                return q
    return max(listing.quants, key=lambda q: q.total_bytes)


def _published(repo_id: str, q: repos.Quant, options: repos.HubOptions, fixed: FixedFile | None,
               owned: Callable[[str], bool], on_step: StepFn) -> Target:
    if fixed is not None:  # the reference itself: fetched once as the fixed part, never dropped
        return Target(q.name, PUBLISHED, lambda: 0, lambda: Fetched(fixed.fetch()), True, q.n_parts)
    snapshot_of = options.storage_folder(repo_id) / "snapshots"

    def cached() -> bool:
        return all(any((s / f.path).is_file() and (s / f.path).stat().st_size == f.size_bytes
                       for s in snapshot_of.glob("*")) for f in q.files)

    def fetch() -> Fetched:
        on_step(f"fetching {repo_id}:{q.name} ({q.total_bytes / 2**20:,.1f} MiB in {q.n_parts} file(s))")
        got = download.download_quant(repo_id, q.name, options=options)
        # Ours to drop when this comparison fetched any of it (now or in a run it resumes); a quant that was
        # cached already is the user's.
        return Fetched(got.paths, None, got.downloaded_bytes + got.resumed_from_bytes > 0 or owned(q.name))
    return Target(q.name, PUBLISHED, lambda: 0 if cached() else q.total_bytes, fetch, True, q.n_parts)


def _local(p: Path) -> Target:
    parts = tuple(gguf_reader.split_parts(p))
    command = quantize.made_command(p)
    return Target(repos.quant_name(p.name), MADE if command else LOCAL, lambda: 0,
                  lambda: Fetched(parts, command, False), True, len(parts))


def _made(loc: build.EngineLocation, source: FixedFile, recipe: quantize.Recipe, out_dir: Path,
          imat: Callable[[], Path | None], on_step: StepFn) -> Target:
    def fetch() -> Fetched:
        made = quantize.make(loc, source.path, out_dir, recipe, imatrix=imat(), on_step=on_step)
        return Fetched((made.path,), made.command, True)

    def estimate() -> int:
        dest = quantize.made_path(source.path, out_dir, recipe, imat())
        return 0 if quantize.made_command(dest) and dest.is_file() else quantize.estimate_bytes(
            loc, source.path, recipe, imat())
    def from_header() -> int | None:
        dest = quantize.made_path(source.path, out_dir, recipe, None) if source.fetched else None
        if dest is not None and quantize.made_command(dest) and dest.is_file():
            return 0
        return quantize.header_estimate_bytes(loc, source.info(), recipe)
    return Target(recipe.name, MADE, estimate, fetch, sized_now=False, header_estimate=from_header)


def normalize(req_sources: tuple[str, ...], quants: tuple[str, ...], make: tuple[str, ...], make_from: str | None,
              ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], str | None, str | None]:
    """``compare-quants model-F16.gguf --quants Q4_K_M,...`` means "make these from my F16": the same request as
    ``--make Q4_K_M,... --from model-F16.gguf``, and a line saying so. (sources, quants, make, from, note)."""
    if not quants or not req_sources or any(repos.parse_hub_ref(s) for s in req_sources):
        return req_sources, quants, make, make_from, None
    names = ",".join(quants)
    if make or make_from or len(req_sources) != 1:
        raise UsageError(f"--quants picks the quants of a Hub repo; to make {names} from a local file use "
                         f"--make {names} --from MODEL-F16.gguf")
    path = Path(req_sources[0]).expanduser()
    if not path.is_file():
        raise UsageError(f"model {path} not found: give .gguf paths or one Hugging Face repo (owner/name)")
    if gguf_reader.inspect_model(path).file_type not in quantize.FULL_PRECISION_FILE_TYPES:
        raise UsageError(f"{path.name} is already quantized, so --quants cannot make {names} from it: make them "
                         f"with --make {names} --from MODEL-F16.gguf, or list the .gguf files to compare")
    note = f"{path.name} is unquantized: making {names} from it (as --make {names} --from {path.name} does)"
    return (), (), quants, str(path), note


def plan(sources: tuple[str, ...], quants: tuple[str, ...], make: tuple[str, ...], make_from: str | None,
         reference: Path | None, use_imatrix: bool, options: repos.HubOptions, loc: build.EngineLocation,
         out_dir: Path, owned: Callable[[str], bool], on_step: StepFn) -> Plan:
    """Targets, reference and source of a request, sized; only headers are read (remote ones by range)."""
    refs = [repos.parse_hub_ref(s) for s in sources]
    targets: list[Target] = []
    title, catalog = "", None
    ref: FixedFile | None = local_fixed("the reference", reference) if reference else None
    source: FixedFile | None = None
    cache: dict[str, Path | None] = {}

    def imat() -> Path | None:  # the importance matrix of the source, made once when first asked for
        if "m" not in cache:
            cache["m"] = imatrix.importance_matrix(loc, source.path, on_step=on_step) if (
                use_imatrix and source is not None) else None
        return cache["m"]
    if sources and all(r is None for r in refs):
        paths = [Path(s).expanduser() for s in sources]
        for p in paths:
            if not p.is_file():
                raise UsageError(f"model {p} not found: give .gguf paths or one Hugging Face repo (owner/name)")
        targets = [_local(p) for p in paths]
        title = ", ".join(p.name for p in paths)
        if ref is None and (found := perplexity.find_reference(paths[0])) is not None:
            ref = local_fixed("the reference", found)
    elif sources:
        if len(refs) != 1 or refs[0] is None:
            raise UsageError("compare-quants takes one Hugging Face repo or several .gguf files, not a mix")
        repo = refs[0]
        listing = repos.list_quants(repo.repo_id, options=options)
        if not listing.quants:
            raise repos.HubError(f"{repo.repo_id} holds no GGUF files: pick a GGUF repo (names often end in -GGUF)")
        wanted = quants or ((repo.quant,) if repo.quant else () if make else listing.names)
        rq = reference_quant(listing)
        if ref is None and not make:
            ref = repo_fixed("the reference", repo.repo_id, rq, listing.commit, options, on_step)
        chosen = [listing.get(n) for n in wanted]
        targets = [_published(repo.repo_id, q, options, ref if ref and q.name == rq.name and reference is None
                              else None, owned, on_step) for q in chosen]
        title, catalog = repo.repo_id, repo.repo_id
    if make:
        source = _make_source(sources, make_from, options, on_step)
        ref = ref or source
        recipes = quantize.parse_recipes(",".join(make), quantize.available_types(loc))
        targets += [_made(loc, source, r, out_dir / "quants", imat, on_step) for r in recipes]
        title = title or (make_from or "made quants")
    if not targets:
        raise UsageError("nothing to compare: give a repo or .gguf files, or --make TYPES --from SOURCE")
    return Plan(title, tuple(targets), ref, source, catalog, imat)


def _make_source(sources: tuple[str, ...], make_from: str | None, options: repos.HubOptions,
                 on_step: StepFn) -> FixedFile:
    """Where --make quantizes from: --from (a file or a repo), else the repo's or the files' full-precision
    copy. A repo's copy is sized from the listing now and fetched when the fixed part is."""
    spec = make_from
    if spec is None:
        if len(sources) == 1 and repos.parse_hub_ref(sources[0]):
            spec = sources[0]
        elif sources:
            found = perplexity.find_reference(Path(sources[0]).expanduser())
            if found is None:
                raise UsageError("--make needs a full-precision source: add --from MODEL-F16.gguf (or BF16/Q8_0)")
            spec = str(found)
        else:
            raise UsageError("--make needs a source: add --from MODEL-F16.gguf or --from owner/repo")
    path = Path(spec).expanduser()
    ref = repos.parse_hub_ref(spec) if not path.is_file() else None
    if ref is None:
        if not path.is_file():
            raise UsageError(f"--from {path} not found: give an F16/BF16/Q8_0 .gguf or a Hugging Face repo")
        return local_fixed("the source", path)
    listing = repos.list_quants(ref.repo_id, options=options)
    q = listing.get(ref.quant) if ref.quant else reference_quant(listing)
    return repo_fixed("the source", ref.repo_id, q, listing.commit, options, on_step)


def imatrix_bound(source: FixedFile | None) -> int:
    return quant_disk.imatrix_bytes_bound(source.info()) if source is not None else 0
