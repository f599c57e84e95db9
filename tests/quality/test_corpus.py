"""The bundled evaluation corpus: varied, redistributable, recorded, hashed and hard to damage unnoticed."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from tuner.core.errors import CorpusError
from tuner.quality import corpus
from tuner.quality.corpus import DocumentKind


def test_every_kind_is_there_with_recorded_sources():
    docs = corpus.documents()
    assert {d.kind for d in docs} == set(DocumentKind)
    provenance = (corpus.data_dir() / "PROVENANCE.md").read_text(encoding="utf-8")
    for doc in docs:
        assert doc.text.strip() and doc.source and doc.licence
        assert doc.sha256 == hashlib.sha256(doc.text.encode()).hexdigest()
        stem = doc.name.split(".")[0]
        assert stem in provenance, f"{doc.name} has no provenance entry"
    assert (corpus.data_dir() / "LICENSE-PSF.txt").is_file()
    assert len(corpus.documents(DocumentKind.CODE)) >= 1 and all(
        d.kind is DocumentKind.CODE for d in corpus.documents(DocumentKind.CODE)
    )


def test_enough_text_for_a_hundred_chunks_at_a_large_vocabulary():
    # A 150k-token vocabulary averages well over 4 bytes per token on English and ~3.5 on code; 100 chunks
    # of 512 tokens need 51,200 tokens. scripts/bench_quality.py counts them with the real Qwen2 vocabulary.
    loaded = corpus.load()
    assert loaded.n_bytes >= 4.5 * 100 * 512
    assert loaded.n_bytes < 2 * 2**20  # stays a small package


def test_the_hash_names_the_exact_text():
    loaded = corpus.load()
    assert loaded.sha256 == hashlib.sha256(loaded.text.encode("utf-8")).hexdigest()
    assert corpus.sha256() == loaded.sha256 and corpus.text() == loaded.text


def test_the_first_chunks_already_mix_every_kind():
    loaded = corpus.load()
    head = loaded.text[: 4 * corpus.SEGMENT_CHARS * 2]
    for kind in DocumentKind:
        first_segment = corpus.split_segments(loaded.of_kind(kind)[0].text)[0]
        assert first_segment in head, kind
    # Nothing is lost or repeated by the interleaving.
    assert sum(len(d.text.strip()) for d in loaded.documents) <= len(loaded.text)
    assert len(loaded.text) - sum(len(d.text) for d in loaded.documents) < 4 * len(loaded.text) // 1000


def test_split_segments_cuts_at_blank_lines_and_long_runs():
    text = "\n\n".join(["a" * 30] * 10)
    pieces = corpus.split_segments(text, target_chars=100)
    assert "\n\n".join(pieces) == text
    assert all(len(p) >= 90 for p in pieces[:-1])
    no_blank = "\n".join(["b" * 30] * 40)
    pieces = corpus.split_segments(no_blank, target_chars=100)
    assert len(pieces) > 3 and max(len(p) for p in pieces) <= 2 * 100 + 31


def test_text_file_is_written_once_with_the_exact_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path))
    path = corpus.text_file()
    assert path.read_bytes() == corpus.text().encode("utf-8")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == corpus.sha256()
    mtime = path.stat().st_mtime_ns
    assert corpus.text_file() == path and path.stat().st_mtime_ns == mtime


def test_a_damaged_document_is_refused(tmp_path, monkeypatch):
    copy = tmp_path / "corpus"
    shutil.copytree(corpus.data_dir(), copy)
    manifest = json.loads((copy / corpus.MANIFEST_NAME).read_text())
    victim = copy / manifest["documents"][0]["file"]
    victim.write_text(victim.read_text() + "tampered\n")
    monkeypatch.setattr(corpus, "data_dir", lambda: copy)
    corpus.load.cache_clear()
    try:
        with pytest.raises(CorpusError, match="does not match its recorded sha256"):
            corpus.load()
    finally:
        corpus.load.cache_clear()
