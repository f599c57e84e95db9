"""The kinds of engine moe-tune knows: llama.cpp and its fork ik_llama.cpp, each with the source its managed build
compiles, the tools it runs of it, how a build of it is known, and the levers only it has.

A build is known by what it is, never by its folder name: ik_llama.cpp's ``llama-server --help`` lists flags that
llama.cpp's does not (``-rtr`` run-time repacking, ``-ser`` smart expert reduction, ``-amb``; read from
examples/server and common/common.cpp of the vendored tree). Everything else that differs between the two (how
each tool spells a setting, which settings it reads) is the flag layer's (:mod:`tuner.engine.flags.dialect`); the
search, the measurements and the reports ask this module what an engine has and never test its name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tuner.core.errors import UsageError


@dataclass(frozen=True, slots=True)
class EnginePin:
    """A source the managed build compiles: a package index sdist that vendors the engine's whole tree."""

    package: str
    version: str
    commit: str
    sdist_sha256: str

    @property
    def sdist_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}.tar.gz"


# The one place the llama.cpp version is stated: the managed build compiles it, and the memory model's replay of the
# compute graph (tuner.plan.graph_arch) was read from its source.
PIN = EnginePin(
    package="llama-cpp-python",
    version="0.3.36",
    commit="0c1e57098",
    sdist_sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
)
# ik_llama.cpp as the ik-llama-cpp-python sdist vendors it (vendor/ik_llama.cpp). The sdist carries no git data and
# does not name the upstream commit it froze, so the build is labelled by the sdist it came from: its tools print
# ``version: 0 (ik-llama-cpp-python-0.1.5)`` (tuner.engine.sdist writes the build-info file the sdist lacks).
IK_PIN = EnginePin(
    package="ik-llama-cpp-python",
    version="0.1.5",
    commit="ik-llama-cpp-python-0.1.5",
    sdist_sha256="33c67eb99e4dcab5e611050433243815709b8b3067753f9ce18375013cf002ad",
)

# The tools moe-tune runs. llama-imatrix: compare-quants --imatrix; llama-tokenize: a model's token counts from its
# header (input checks); llama-fit-params: llama.cpp's own memory projection.
LLAMA_TOOLS = ("llama-server", "llama-bench", "llama-perplexity", "llama-quantize", "llama-fit-params",
               "llama-batched-bench", "llama-imatrix", "llama-tokenize")
# ik_llama.cpp has no llama-fit-params; quantizing and the quality tools stay llama.cpp's (the reference), but its
# llama-perplexity prices its own numerics (the KL-divergence of its logits against llama.cpp's).
IK_TOOLS = ("llama-server", "llama-bench", "llama-perplexity")


@dataclass(frozen=True, slots=True)
class EngineKind:
    name: str  # what every output calls it: "llama.cpp", "ik_llama.cpp"
    key: str  # what --engines takes: "llama.cpp", "ik"
    pin: EnginePin
    vendored: str  # the engine's tree inside the pin's sdist
    tools: tuple[str, ...]  # what the managed build compiles and the tool runs
    # Flags only this kind's llama-server lists in its --help: any one of them tells a build of this kind.
    marks: tuple[str, ...] = ()
    # LaunchConfig fields only this kind reads (its own levers: search axes where they apply).
    levers: tuple[str, ...] = ()
    # Those of its levers moe-tune's search measures (tuner.search.engine_axes makes them axes); the others stay at
    # their defaults in every line it measures, and a shared line that sets one is refused (tuner.share.gate).
    measured_levers: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    # Whether its llama-bench takes a depth (-d): ik's times a prompt at depth as the difference of two prompts.
    bench_has_depth: bool = True
    # Whether its server offloads layers to a GPU unless told how many (llama.cpp: what fits; ik: none).
    offloads_by_default: bool = True
    # How its server places a line that leaves the placement open (no -ngl, no --n-cpu-moe): by fitting the card
    # itself, leaving -fitt MiB of each device's free VRAM (llama.cpp: common.h ``fit_params = true``, common/fit.cpp
    # ``common_params_fit_impl``), or not (ik_llama.cpp: its --fit is a switch, off unless given, common.cpp; left
    # alone it keeps what ``offloads_by_default`` says). Only an engine that fits by default takes -fitt.
    fits_by_default: bool = True
    # Whether its server reads its API key from the environment (llama.cpp: LLAMA_API_KEY; ik: only from argv).
    reads_key_env: bool = True
    # Whether its tools write a log file of their own unless told where (ik's common log: llama.log in the current
    # folder, common/log.h), which moe-tune then points beside its own logs.
    writes_file_log: bool = False
    # Its levers that load the weights into the engine's own buffers, never a file mapping: ik's -rtr (its
    # common.cpp sets ``use_mmap = false`` with ``repack_tensors``). A line with one on keeps its model resident.
    unmapping_levers: tuple[str, ...] = ()
    # Whether its logits are the reference every other engine's are priced against (llama.cpp's, the pin's).
    numerics_reference: bool = False
    # Whether its server reads ``--load-mode none|mmap|…`` (llama.cpp; ik_llama.cpp reads --no-mmap, and its -rtr
    # loads without a mapping on its own): the search's load-mode axis.
    reads_load_mode: bool = False
    # Whether it reads llama.cpp's prompt-side levers for host experts beside a GPU: ``--no-op-offload`` and
    # ``--no-host`` (tuner.search.levers); ik_llama.cpp's own (-no-ooae) is one of its levers.
    host_buffer_levers: bool = False
    # Whether users run its server as plain ``llama-server`` (on PATH, in its container images, behind its router): a
    # printed line names it so; another engine's line names its server by the path of the build that was measured.
    server_on_path: bool = False
    # The stages beyond the single winner measured with it (auto-tune --frontier, --speculation).
    stages: tuple[str, ...] = ()

    def maps_model(self, cfg: object) -> bool:
        """Whether a line (a LaunchConfig) runs its model from a file mapping: mmap on, and none of this kind's
        unmapping levers set. Every rendering, parsing and search rule about mmap asks this."""
        return bool(getattr(cfg, "mmap", True)) and not self.unmaps(cfg)

    def unmaps(self, cfg: object) -> bool:
        """Whether one of this kind's levers set on ``cfg`` loads the model without a mapping on its own (so a line
        with it needs no no-mmap flag of its own)."""
        return any(getattr(cfg, lever, False) for lever in self.unmapping_levers)

    @property
    def projects_memory(self) -> bool:
        """Whether it has its own memory projection (llama-fit-params) to ask before a load."""
        return "llama-fit-params" in self.tools

    def has_lever(self, name: str) -> bool:
        return name in self.levers

    def measures(self, lever: str) -> bool:
        """Whether moe-tune's search measures this lever of the kind's (a lever it never sets is no measured line's)."""
        return lever in self.measured_levers


LLAMA_CPP = EngineKind("llama.cpp", "llama.cpp", PIN, "vendor/llama.cpp", LLAMA_TOOLS,
                       aliases=("llama", "llamacpp", "mainline"), numerics_reference=True,
                       reads_load_mode=True, host_buffer_levers=True, server_on_path=True,
                       stages=("frontier", "speculation"))
IK_LLAMA = EngineKind(
    "ik_llama.cpp", "ik", IK_PIN, "vendor/ik_llama.cpp", IK_TOOLS,
    marks=("-rtr", "--run-time-repack", "-ser", "--smart-expert-reduction", "-amb", "--attention-max-batch"),
    levers=("run_time_repack", "fused_moe", "merge_up_gate", "attn_max_batch", "graph_reuse", "smart_experts",
            "only_active_experts"),
    # -amb bounds attention's batch only without flash attention, -gr off only costs, -ser drops experts (it changes
    # outputs): none is searched (tuner.search.engine_axes).
    measured_levers=("run_time_repack", "fused_moe", "merge_up_gate", "only_active_experts"),
    aliases=("ik_llama.cpp", "ik-llama.cpp", "ik_llama", "ikllama"),
    bench_has_depth=False,
    offloads_by_default=False,
    fits_by_default=False,
    reads_key_env=False,
    writes_file_log=True,
    unmapping_levers=("run_time_repack",),
)
KINDS = (LLAMA_CPP, IK_LLAMA)
DEFAULT_KIND = LLAMA_CPP  # the engine a line, a space or a result runs on when it names none


def kind_named(name: str) -> EngineKind:
    """The kind a user names (``llama.cpp``, ``ik``, ``ik_llama.cpp``); a one-line error naming the choices."""
    want = name.strip().lower()
    for kind in KINDS:
        if want in (kind.key.lower(), kind.name.lower(), *kind.aliases):
            return kind
    raise UsageError(f"unknown engine {name!r}: use {' or '.join(k.key for k in KINDS)}")


def kinds_named(names: str | Sequence[str]) -> tuple[EngineKind, ...]:
    """``--engines llama.cpp,ik``: each kind once, in the order given."""
    parts = names.split(",") if isinstance(names, str) else list(names)
    found = [kind_named(p) for p in parts if p.strip()]
    if not found:
        raise UsageError("--engines names no engine: use llama.cpp, ik or llama.cpp,ik")
    return tuple(dict.fromkeys(found))


def kind_by_name(name: str | None) -> EngineKind:
    """The kind a config or a result names (``LaunchConfig.engine``, an ``engine`` block); llama.cpp when absent (a
    result written before a second engine existed)."""
    return kind_named(name) if name else DEFAULT_KIND


def kind_of_flags(flags: Mapping[str, Sequence[str]]) -> EngineKind:
    """Which kind a build is, from the flags its tools list (:attr:`tuner.engine.caps.Capabilities.flags`)."""
    server = set(flags.get("llama-server", ())) | set(flags.get("llama-bench", ()))
    for kind in KINDS:
        if kind.marks and server & set(kind.marks):
            return kind
    return LLAMA_CPP
