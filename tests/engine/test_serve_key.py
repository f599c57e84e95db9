"""`serve --api-key-file` (tuner/engine/serve.py): the key file is the user's alone or it is refused in one line:
a regular file (a link is not followed, a FIFO not waited on), owned by the user, that others may not read."""

from __future__ import annotations

import os
import threading

import pytest

from tuner.core.errors import UsageError
from tuner.engine import serve


def key_of(path) -> str:
    got = serve.api_key({}, path)
    assert got is not None
    return got.env[serve.API_KEY_FILE_ENV]


def refused(path) -> str:
    done: dict[str, str] = {}

    def attempt() -> None:
        try:
            serve.api_key({}, path)
        except UsageError as exc:
            done["why"] = str(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout=5)  # a FIFO must not block the reader
    assert not worker.is_alive(), "reading the key file blocked"
    assert "\n" not in done["why"]
    return done["why"]


def test_a_new_key_file_is_made_the_users_alone_and_read_back(tmp_path):
    path = tmp_path / "key"
    assert key_of(path) == str(path)
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_text().strip()) == 32
    assert key_of(path) == str(path)  # read again: it holds a key and is the user's alone


def test_a_key_file_others_may_read_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "key"
    path.write_text("sesame\n")
    for mode in (0o644, 0o640, 0o602):
        path.chmod(mode)
        assert refused(path) == (f"--api-key-file {path} can be read or written by others (mode {mode:o}): run "
                                 f"`chmod 600 {path}`")
    path.chmod(0o600)
    assert key_of(path) == str(path)


def test_links_fifos_folders_and_other_users_files_are_refused(tmp_path):
    real = tmp_path / "real"
    real.write_text("sesame\n")
    real.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(real)
    assert refused(link) == f"--api-key-file {link} is a symbolic link: give the key file itself"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    assert refused(fifo) == f"--api-key-file {fifo} is not a regular file: give a file holding one key per line"
    folder = tmp_path / "folder"
    folder.mkdir(mode=0o700)
    assert refused(folder) == f"--api-key-file {folder} is not a regular file: give a file holding one key per line"
    if os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(real, 4242, -1)
    assert refused(real) == f"--api-key-file {real} belongs to another user (uid 4242): use a key file of your own"
