"""The engine's own memory figures first: ``llama-fit-params`` (header only, nothing allocated) projects each config
the way the build that will run it allocates, and where that differs from the replay of the pinned commit
(tuner.plan.memory) the engine's figure decides (:mod:`tuner.plan.pricing`).

:class:`EngineMemory` is the price a command installs while it has an engine: the replay, corrected by what the
engine says for the same config (its :class:`~tuner.plan.pricing.Drift`). A projection is asked once per
(engine build, model file, memory-relevant flags) and kept on disk beside the capabilities cache, so a search pays
each distinct config once and a second plan none. Drift beyond the one tolerance
(:func:`tuner.plan.placement.engine_tolerance_mib`) is said once per component, with both figures.

:func:`engine_check` is ``plan --engine-check``: the same comparison, component by component.

A search prices configs in many places (the space's ``--n-cpu-moe`` range, the gate before each trial, the seeds):
``auto-tune`` puts its engine's projection in force for the whole run (:func:`deciding`), and those places ask
:func:`in_force` (or :func:`price`) instead of each taking the engine as an argument.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from tuner.core.config import LaunchConfig
from tuner.core.errors import BreakdownParseError, EngineNotFoundError, TunerError
from tuner.core.machine_spec import Hardware
from tuner.core.model import ModelInfo
from tuner.core.units import MIB
from tuner.engine import breakdown, build, flags
from tuner.engine.breakdown import BufferRow, MemoryBreakdown
from tuner.engine.identity import REPLAY_COMMIT, EngineIdentity
from tuner.engine.kinds import EngineKind, kind_by_name
from tuner.machine import paths
from tuner.machine.fileio import atomic_write
from tuner.measure import projection_load
from tuner.measure.projection_load import ProjectionLoad
from tuner.models import fingerprint
from tuner.plan.memory import FIT_MARGIN_BYTES, MemoryEstimate, estimate
from tuner.plan.placement import EngineCheckRow, engine_check_rows
from tuner.plan.pricing import Drift, Price, corrected, decided_mib

CACHE_VERSION = 1
T = TypeVar("T")


def projectable(cfg: LaunchConfig, hw: Hardware) -> LaunchConfig:
    """``cfg`` as llama-fit-params can project it, with only what changes memory: one slot unless ``-np`` says
    otherwise and no ``--kv-unified`` (it takes none), no threads, prompt reuse or speculation (the replay prices
    those); without a GPU the offload flags place nothing, so they are dropped too."""
    cfg = replace(cfg, parallel=cfg.parallel or 1, kv_unified=None, threads=None, threads_batch=None,
                  cache_reuse=None, ctx_checkpoints=None, checkpoint_min_step=None, cache_ram_mib=None,
                  spec_types=(), draft_model=None, spec_draft_n_max=None, spec_draft_n_min=None,
                  spec_draft_p_min=None, spec_synth_len=None, spec_synth_rates=None)
    return replace(cfg, n_cpu_moe=None, n_gpu_layers=None) if not hw.has_gpu else cfg


@dataclass(frozen=True, slots=True)
class Projection:
    """One config beside the engine: the rows of :func:`engine_check`, and whether the engine could project the
    side planned for (a build without a GPU backend projects only the CPU)."""

    rows: tuple[EngineCheckRow, ...]
    cpu_fallback: bool


def compare_with(info: ModelInfo, cfg: LaunchConfig, hw: Hardware, truth: MemoryBreakdown) -> Projection:
    host = {part: truth.host_total(part) for part in ("model", "context", "compute")}
    gpu = {part: truth.device_total(part) for part in ("model", "context", "compute")} if truth.devices else None
    cpu_fallback = gpu is None and hw.has_gpu
    est = estimate(info, cfg, hw.cpu_only() if cpu_fallback else hw, fit_params=True)
    return Projection(engine_check_rows(est, cfg.mmap, host, gpu, info.tensor_bytes), cpu_fallback)


def _config_words(cfg: LaunchConfig) -> str:
    ub = f" -ub {cfg.ubatch}" if cfg.ubatch else ""
    return f"-c {cfg.ctx} -ctk {cfg.cache_type_k.value} -ctv {cfg.cache_type_v.value}{ub}"


@dataclass(slots=True)
class EngineMemory:
    """The engine's projection as the price that decides: passed to ``make_plan``, or put in force for a tune
    (:func:`deciding`). Where the engine cannot project a config, the replay decides it and that is said once."""

    loc: build.EngineLocation
    engine: EngineIdentity
    calls: int = 0  # projections run (a cache hit costs none)
    seconds: float = 0.0  # spent running them
    notes: list[str] = field(default_factory=list)  # drift beyond the tolerance, said once per component
    drifted: dict[str, tuple[int, int]] = field(default_factory=dict)  # "host compute" → (configs, largest MiB)
    priced: int = 0  # distinct configs the engine decided
    load: ProjectionLoad | None = None  # how the last prefetch ran its projections (None: none was prefetched)
    _said: set[str] = field(default_factory=set)
    _drifts: dict[str, Drift] = field(default_factory=dict)
    _prints: dict[Path, str] = field(default_factory=dict)
    _counting: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of(cls, loc: build.EngineLocation) -> EngineMemory:
        return cls(loc, build.capabilities(loc).identity)

    @classmethod
    def find(cls, llama_cpp_dir: Path | None = None) -> EngineMemory | None:
        """The engine moe-tune would run (``--llama-cpp-dir`` > LLAMA_CPP_DIR > PATH > the managed build), or None
        when there is none: the replay then decides alone."""
        try:
            return cls.of(build.locate_engine(llama_cpp_dir))
        except EngineNotFoundError:
            return None

    def __call__(self, model: ModelInfo, cfg: LaunchConfig, hw: Hardware) -> MemoryEstimate:
        return corrected(estimate(model, cfg, hw), self.drift(model, cfg, hw), hw)

    def drift(self, model: ModelInfo, cfg: LaunchConfig, hw: Hardware) -> Drift:
        """The engine's figures less the replay's for ``cfg`` (nothing where the engine cannot project the side
        planned for: a CPU build asked about a card)."""
        asked = self._request(model, cfg, hw)
        if asked is None:
            return Drift()
        fp, key = asked
        if key not in self._drifts:
            try:
                truth = self.projection(model, fp, key)
            except TunerError as exc:  # a flag this build refuses, a model it cannot load: the replay decides
                self._say_once("failed", f"{self.engine.name} could not project {_config_words(fp)} ({exc}): the "
                                         f"replay of llama.cpp {REPLAY_COMMIT} decides where it cannot")
                self._drifts[key] = Drift()
                return self._drifts[key]
            self._drifts[key] = self.drift_of(compare_with(model, fp, hw, truth), fp)
            self.priced += 1
        return self._drifts[key]

    def _request(self, model: ModelInfo, cfg: LaunchConfig, hw: Hardware) -> tuple[LaunchConfig, str] | None:
        """What this engine is asked for ``cfg``: its projectable form and cache key; None where it cannot say."""
        if hw.has_gpu and self.engine.backend == "cpu":
            self._say_once("cpu", f"{self.engine.name} is a CPU build: it projects no GPU, so the figures for the "
                                  f"card are the replay's (llama.cpp {REPLAY_COMMIT})")
            return None
        if not self.loc.has("llama-fit-params"):
            if not self._kind.projects_memory:  # ik_llama.cpp has no such tool at all: said at the start of a tune
                return None
            self._say_once("tool", f"{self.engine.name} at {self.loc.bin_dir} has no llama-fit-params: the replay of "
                                   f"llama.cpp {REPLAY_COMMIT} decides (build that target to let the engine decide)")
            return None
        fp = projectable(cfg, hw)
        if not hw.has_gpu and self.engine.backend != "cpu":
            fp = replace(fp, device="none")  # a GPU build asked about the CPU alone: as llama.cpp spells it
        return fp, self._key(model, fp)

    def prefetched(self, run: Callable[[Price], T], jobs: int | None = None,
                   margin_bytes: int = FIT_MARGIN_BYTES) -> T:
        """``run(price)`` as it would run with this engine deciding, its projections made several at a time first: a
        dry run on the replay notes the configs it asks (the ones the engine settles from, when the replay is right),
        those are projected in parallel into the cache, then the real run finds them there and asks one by one only
        where the engine moved an end. At most ``jobs`` at once (default: the cores); on a card, as many as their
        CUDA contexts fit in the VRAM free less ``margin_bytes`` (:mod:`tuner.measure.projection_load`)."""
        notes = Recorder()
        run(notes)
        todo: dict[str, tuple[ModelInfo, LaunchConfig, Hardware]] = {}
        for model, cfg, hw in notes.asked:
            asked = self._request(model, cfg, hw)
            if asked is not None and asked[1] not in self._drifts and not self._path(asked[1]).is_file():
                todo[asked[1]] = (model, asked[0], hw)

        def project(item: tuple[str, tuple[ModelInfo, LaunchConfig, Hardware]]) -> None:
            key, (model, fp, _) = item
            with contextlib.suppress(TunerError):  # the real run asks again, and says what went wrong
                self.projection(model, fp, key)

        items = list(todo.items())
        if items:
            cards = [hw for _, (_, fp, hw) in items if hw.has_gpu and fp.device != "none"]

            def first() -> int | None:  # the first projection alone, its process's VRAM read while it runs
                return projection_load.watched(lambda: project(items.pop(0)))[1]

            self.load = projection_load.plan_load(self.engine.backend, self.engine.backend != "cpu" and bool(cards),
                                                  cards[0] if cards else None, margin_bytes,
                                                  max(1, jobs or os.cpu_count() or 1), first)
            with ThreadPoolExecutor(max_workers=self.load.jobs) as pool:
                list(pool.map(project, items))
        return run(self)

    def _path(self, key: str) -> Path:
        return paths.cache_root() / "projections" / f"{key}.json"

    def projection(self, model: ModelInfo, cfg: LaunchConfig, key: str | None = None) -> MemoryBreakdown:
        """llama-fit-params' breakdown of ``cfg`` (already :func:`projectable`), from the disk cache when this
        build projected it for this file before."""
        key = key or self._key(model, cfg)
        path = self._path(key)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            raw = json.loads(path.read_text())
            return MemoryBreakdown(tuple(BufferRow(**r) for r in raw["rows"]))
        t0 = time.monotonic()
        truth = breakdown.fit_params_breakdown(self.loc, cfg)
        with self._counting:  # prefetch projects from several threads
            self.seconds += time.monotonic() - t0
            self.calls += 1
        if not truth.from_record:  # the plain table leaves buffer types out: no figure to decide by
            raise BreakdownParseError(f"{self.engine.name}'s llama-fit-params lost its memory record "
                                      f"{breakdown.FIT_PARAMS_ATTEMPTS} times")
        with contextlib.suppress(OSError):
            atomic_write(path, json.dumps({"version": CACHE_VERSION, "rows": [asdict(r) for r in truth.rows]}))
        return truth

    def _key(self, model: ModelInfo, cfg: LaunchConfig) -> str:
        """Engine build (its commit and its binary, for builds that report none), model file, and the argv the
        projection runs (the model path stands for the file's fingerprint)."""
        tool = self.loc.tool("llama-fit-params")
        st = tool.stat()
        if model.paths[0] not in self._prints:
            self._prints[model.paths[0]] = json.dumps(fingerprint.fingerprint(model.paths[0]), sort_keys=True)
        argv = flags.fit_params_argv(tool, cfg)[1:]
        argv = [a if a != str(cfg.model) else "MODEL" for a in argv]
        parts = [CACHE_VERSION, self.engine.commit, self.engine.build_number, str(tool), st.st_size,
                 st.st_mtime_ns, self._prints[model.paths[0]], argv]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]

    def drift_of(self, got: Projection, cfg: LaunchConfig) -> Drift:
        """The drift of one projection beside the replay; each component beyond the tolerance said once."""
        if got.cpu_fallback:
            self._say_once("cpu", f"{self.engine.name} projected no GPU: the figures for the card are the replay's "
                                  f"(llama.cpp {REPLAY_COMMIT})")
            return Drift()
        parts = []
        for r in got.rows:
            decided = decided_mib(r.model_mib, r.engine_mib)
            if decided == r.model_mib:
                continue
            parts.append((r.where, r.component, (decided - r.model_mib) * MIB))
            if not r.agrees:
                what = f"{r.where} {r.component}"
                n, worst = self.drifted.get(what, (0, 0))
                self.drifted[what] = (n + 1, max(worst, abs(r.error_mib)))
                self._say_once(what, f"{self.engine.name}'s own projection puts the {r.where} {r.component} at "
                                     f"{r.engine_mib:,} MiB where the replay of llama.cpp {REPLAY_COMMIT} says "
                                     f"{r.model_mib:,} MiB ({_config_words(cfg)}): the engine's figure decides")
        return Drift(tuple(parts))

    def _say_once(self, what: str, note: str) -> None:
        if what not in self._said:
            self._said.add(what)
            self.notes.append(note)

    def summary(self, cost: bool = True) -> dict[str, Any]:
        """What decided the memory verdicts, for result.json and ``plan --json`` (``cost``: with the projections
        this run paid for and their seconds, which a second run served from the cache does not repeat)."""
        paid = {"projections_run": self.calls, "projection_s": round(self.seconds, 2),
                "prefetch": self.load.to_dict() if self.load is not None else None} if cost else {}
        decided = "engine" if self._kind.projects_memory else "replay"  # ik_llama.cpp has no projection of its own
        return {"decided_by": decided, "engine": self.engine.to_dict(), "replay_commit": REPLAY_COMMIT,
                "configs": self.priced, **paid,
                "drift": {k: {"configs": n, "largest_mib": m} for k, (n, m) in self.drifted.items()},
                "notes": list(self.notes)}

    @property
    def _kind(self) -> EngineKind:
        return kind_by_name(self.engine.engine)

    def describe(self) -> str:
        """One line: whose figures decided and what it cost."""
        if not self._kind.projects_memory:
            return (f"memory verdicts: the replay of llama.cpp {REPLAY_COMMIT} ({self.engine.name} has no projection "
                    "of its own)")
        cost = f"{self.calls} projections run in {self.seconds:.1f} s" if self.calls else "every one cached"
        load = f"; {self.load.describe()}" if self.load is not None and self.load.on_card else ""
        return (f"memory verdicts: {self.engine.name}'s own projection (llama-fit-params) for {self.priced} "
                f"distinct configs ({cost}); the replay of llama.cpp {REPLAY_COMMIT} made the first guesses{load}")


def engine_check(mem: EngineMemory, info: ModelInfo, base: LaunchConfig, hw: Hardware) -> Projection:
    """``plan --engine-check``: the replay beside the engine's projection of ``base`` (one slot unless -np says
    otherwise), component by component, judged by the one tolerance."""
    cfg = projectable(base, hw)
    return compare_with(info, cfg, hw, mem.projection(info, cfg))


class Recorder:
    """The replay as a price, noting each config it is asked about: what an engine would be asked next."""

    def __init__(self) -> None:
        self.asked: list[tuple[ModelInfo, LaunchConfig, Hardware]] = []

    def __call__(self, model: ModelInfo, cfg: LaunchConfig, hw: Hardware) -> MemoryEstimate:
        self.asked.append((model, cfg, hw))
        return estimate(model, cfg, hw)


_IN_FORCE: ContextVar[Price | None] = ContextVar("moe_tune_engine_memory", default=None)


def in_force() -> Price | None:
    """The engine's projection a running command put in force (:func:`deciding`); None: the replay decides."""
    return _IN_FORCE.get()


def price(model: ModelInfo, cfg: LaunchConfig, hw: Hardware) -> MemoryEstimate:
    """What ``cfg`` costs by the figures in force: the engine's projection during a tune, else the replay."""
    mem = _IN_FORCE.get()
    return mem(model, cfg, hw) if mem is not None else estimate(model, cfg, hw)


@contextlib.contextmanager
def deciding(mem: Price | None) -> Iterator[Price | None]:
    """Put ``mem`` (an :class:`EngineMemory`, or any price) in force for the span of the block (a tune, a
    frontier run)."""
    token = _IN_FORCE.set(mem)
    try:
        yield mem
    finally:
        _IN_FORCE.reset(token)
