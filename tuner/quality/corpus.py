"""The bundled evaluation text: redistributable documents of four kinds, and the one text built from them.

The documents ship in ``tuner/quality/corpus_data`` (sources, licences and the exact extraction steps are in
PROVENANCE.md there). Perplexity runs read the first ``chunks × ctx`` tokens of a text, so the evaluation
text interleaves the documents in paragraph-aligned segments, kind after kind: even a few chunks see prose,
technical writing, code and dialogue. Its sha256 names the exact text in every result.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from dataclasses import dataclass
from enum import Enum
from functools import cache
from pathlib import Path

from tuner.core.errors import CorpusError
from tuner.machine import paths
from tuner.machine.fileio import atomic_write, sha256_file

MANIFEST_NAME = "manifest.json"
# About 500 tokens of English with a 150k-token vocabulary: one segment per kind in each 512-token chunk.
SEGMENT_CHARS = 2000
SEGMENT_SEPARATOR = "\n\n"


class DocumentKind(str, Enum):
    PROSE = "prose"
    TECHNICAL = "technical"
    CODE = "code"
    DIALOGUE = "dialogue"


@dataclass(frozen=True, slots=True)
class Document:
    name: str  # file name inside tuner/quality/corpus_data
    kind: DocumentKind
    title: str
    source: str
    licence: str
    text: str
    sha256: str

    @property
    def n_chars(self) -> int:
        return len(self.text)


@dataclass(frozen=True, slots=True)
class Corpus:
    documents: tuple[Document, ...]
    text: str  # the evaluation text: documents interleaved by kind
    sha256: str  # of ``text`` as UTF-8

    @property
    def n_bytes(self) -> int:
        return len(self.text.encode("utf-8"))

    def of_kind(self, kind: DocumentKind) -> tuple[Document, ...]:
        return tuple(d for d in self.documents if d.kind is kind)

    def document(self, name: str) -> Document:
        for doc in self.documents:
            if doc.name == name:
                return doc
        raise KeyError(name)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def split_segments(text: str, target_chars: int = SEGMENT_CHARS) -> list[str]:
    """Cut ``text`` into pieces of about ``target_chars``: at a blank line once the piece is long enough, or
    at any line end once it is twice that (scanned pages have no blank lines for pages on end)."""
    segments: list[str] = []
    current: list[str] = []
    size = 0
    for line in text.split("\n"):
        if (size >= target_chars and not line.strip()) or size >= 2 * target_chars:
            segments.append("\n".join(current).strip("\n"))
            current, size = [], 0
        current.append(line)
        size += len(line) + 1
    segments.append("\n".join(current).strip("\n"))
    return [s for s in segments if s.strip()]


def interleave(documents: tuple[Document, ...], target_chars: int = SEGMENT_CHARS) -> str:
    """One segment of each kind in turn (kinds in manifest order, documents of a kind one after another)."""
    queues: dict[DocumentKind, deque[str]] = {}
    for doc in documents:
        queues.setdefault(doc.kind, deque()).extend(split_segments(doc.text, target_chars))
    pieces: list[str] = []
    while any(queues.values()):
        for queue in queues.values():
            if queue:
                pieces.append(queue.popleft())
    return SEGMENT_SEPARATOR.join(pieces) + "\n"


def data_dir() -> Path:
    """Where the documents, their manifest and PROVENANCE.md are installed."""
    return Path(__file__).resolve().parent / "corpus_data"


@cache
def load() -> Corpus:
    """The bundled corpus, with every document checked against the sha256 its manifest records."""
    folder = data_dir()
    fix = "reinstall moe-tune (pip install --force-reinstall moe-tune)"
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CorpusError(f"the bundled corpus manifest is missing or unreadable ({exc}): {fix}") from exc
    documents = []
    for entry in manifest["documents"]:
        try:
            text = (folder / entry["file"]).read_text(encoding="utf-8")
        except OSError as exc:
            raise CorpusError(f"corpus document {entry['file']} is missing: {fix}") from exc
        digest = _sha256(text)
        if digest != entry["sha256"]:
            raise CorpusError(f"corpus document {entry['file']} does not match its recorded sha256: {fix}")
        documents.append(
            Document(
                name=entry["file"], kind=DocumentKind(entry["kind"]), title=entry["title"],
                source=entry["source"], licence=entry["licence"], text=text, sha256=digest,
            )
        )
    docs = tuple(documents)
    text = interleave(docs)
    return Corpus(docs, text, _sha256(text))


def documents(kind: DocumentKind | None = None) -> tuple[Document, ...]:
    """The bundled documents, all or of one kind (for workload prompts as well as evaluation)."""
    corpus = load()
    return corpus.documents if kind is None else corpus.of_kind(kind)


def text() -> str:
    return load().text


def sha256() -> str:
    return load().sha256


def text_file() -> Path:
    """The evaluation text as a file llama-perplexity can read, written once per corpus hash."""
    corpus = load()
    path = paths.cache_root() / "corpus" / f"moe-tune-corpus-{corpus.sha256[:16]}.txt"
    if path.is_file() and path.stat().st_size == corpus.n_bytes:
        return path
    return atomic_write(path, corpus.text)  # bytes: no newline translation


def file_sha256(path: Path) -> str:
    """sha256 of a user's own evaluation text, so results on it name it exactly."""
    return sha256_file(path)
