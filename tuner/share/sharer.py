"""Who shared a record, without saying who: a random id made once per installation and kept in the tool's config
folder (``sharer-id``). Nothing of the host, the user or the card goes into it, so it links the records of one
installation to each other and to nothing else. Agreement in a look-up counts these ids, not files: one sharer's
copies of a line count once (docs/sharing.md). Delete the file to share under a new id.
"""

from __future__ import annotations

import secrets

from tuner.machine import paths
from tuner.machine.fileio import atomic_write
from tuner.share.gate import SHARER

FILE = "sharer-id"


def sharer_id() -> str:
    """This installation's sharer id, made (16 random hex digits) the first time it is asked for."""
    path = paths.config_root() / FILE
    try:
        known = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        known = ""
    if SHARER.fullmatch(known):
        return known
    new = secrets.token_hex(8)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, new + "\n")
    return new
