"""An engine's source from the package index: the sdist that vendors its tree, fetched with pip (never built as a
wheel), checked against its pin's sha256, and its engine folder extracted for the managed build.

ik-llama-cpp-python's sdist lacks one file its tree's build runs: ``common/cmake/build-info-gen-cpp.cmake``, which
common/CMakeLists.txt calls to write ``common/build-info.cpp`` from ``build-info.cpp.in`` ("Generating build
details from Git"; without it the build stops there). :func:`supply_build_info` writes one that states the pin
instead of asking git (the sdist has no git data), so the tools print which source they came from.
"""

from __future__ import annotations

import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

from tuner.core.errors import BuildFailedError
from tuner.engine import runner
from tuner.engine.kinds import EngineKind
from tuner.machine.fileio import sha256_file


def fetch(kind: EngineKind, src_dir: Path, on_line: Callable[[str], None] | None) -> Path:
    """The pin's sdist in ``src_dir`` (downloaded once, verified every time)."""
    pin = kind.pin
    tarball = src_dir / pin.sdist_name
    if tarball.is_file() and sha256_file(tarball) == pin.sdist_sha256:
        return tarball
    src_dir.mkdir(parents=True, exist_ok=True)
    runner.run_process(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", pin.package,
         f"{pin.package}=={pin.version}", "-d", str(src_dir)],
        timeout_s=600, what=f"pip download of the {kind.name} source",
        fix="check that PyPI is reachable (pip config, proxy) and retry", on_line=on_line,
    )
    if not tarball.is_file():
        raise BuildFailedError("download", ["pip", "download"], 1, f"{tarball.name} missing after download", tarball)
    if sha256_file(tarball) != pin.sdist_sha256:
        tarball.unlink()
        raise BuildFailedError("verify", ["sha256"], 1, f"{kind.pin.package} sdist checksum does not match the pin",
                               tarball)
    return tarball


def extract(kind: EngineKind, tarball: Path, dest: Path) -> Path:
    """The engine's tree (``vendor/<engine>`` inside the sdist) at ``dest``, with the sdist's own modification times
    (older than any object built before: an interrupted build resumes)."""
    import shutil

    prefix = f"{kind.pin.package.replace('-', '_')}-{kind.pin.version}/{kind.vendored}/"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(prefix) and len(member.name) > len(prefix):
                member.name = member.name[len(prefix):]
                members.append(member)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # Python < 3.10.12
            tar.extractall(dest, members=members)  # noqa: S202 - the sdist's checksum was verified
    supply_build_info(kind, dest)
    return dest


# common/CMakeLists.txt runs this script with cmake -P from the tree's root; it fills build-info.cpp.in's four
# values (LLAMA_BUILD_NUMBER, LLAMA_COMMIT, LLAMA_COMPILER, LLAMA_BUILD_TARGET) as its git-reading original would.
_BUILD_INFO_SCRIPT = """# Written by moe-tune: the {package} {version} sdist ships no git data and not this script.
set(BUILD_NUMBER 0)
set(BUILD_COMMIT "{commit}")
set(BUILD_COMPILER "${{CMAKE_C_COMPILER_ID}} ${{CMAKE_C_COMPILER_VERSION}}")
set(BUILD_TARGET "unknown")
if(CMAKE_C_COMPILER)
    execute_process(COMMAND ${{CMAKE_C_COMPILER}} -dumpmachine OUTPUT_VARIABLE OUT
                    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(OUT)
        set(BUILD_TARGET ${{OUT}})
    endif()
endif()
configure_file("${{CMAKE_CURRENT_SOURCE_DIR}}/common/build-info.cpp.in"
               "${{CMAKE_CURRENT_SOURCE_DIR}}/common/build-info.cpp")
"""


def supply_build_info(kind: EngineKind, tree: Path) -> Path | None:
    """Write ``common/cmake/build-info-gen-cpp.cmake`` where the tree's build calls it and the sdist left it out;
    None when the tree has its own (llama.cpp's sdist) or takes none."""
    script = tree / "common" / "cmake" / "build-info-gen-cpp.cmake"
    calls = (tree / "common" / "CMakeLists.txt").is_file() and \
        "build-info-gen-cpp.cmake" in (tree / "common" / "CMakeLists.txt").read_text(errors="replace")
    if script.is_file() or not calls or not (tree / "common" / "build-info.cpp.in").is_file():
        return None
    script.parent.mkdir(parents=True, exist_ok=True)
    pin = kind.pin
    script.write_text(_BUILD_INFO_SCRIPT.format(package=pin.package, version=pin.version, commit=pin.commit))
    return script
