"""Reading a pool: the gated records of a dataset repo that may speak of one model on one card, read within bounds
however the repo is stuffed, each with the Hub account that brought it. Fetching only; which records match, and
what they agree on, is :mod:`tuner.share.match` and :mod:`tuner.share.lookup`'s.

Two sources, both through the gate (:mod:`tuner.share.gate`):

- ``shards/``: consolidated Parquet files (:mod:`tuner.share.shards`), only the card's VRAM class folder, only
  the row groups that hold the model; at most :data:`MAX_SHARDS` files and :data:`MAX_SHARD_BYTES` fetched, every
  column chunk's pages checked before it is decoded.
- ``records/``: one file per share, not yet consolidated. A file's name says nothing of its model, so the files
  are read in a random sample of at most :data:`MAX_FILES` (never in name order, which whoever names files
  would choose), a name that is not 16 hex digits or a file listed above the gate's size never fetched.

What is kept is bounded too: a record the caller does not want (``keep``) is dropped as soon as it is read, and the
records kept hold at most :data:`MAX_KEPT_BYTES` of text; at most :data:`MAX_SHARD_ROWS` rows are taken in. Every
record read is kept or counted: refused by the gate, or passed over (:data:`OTHER`, :data:`TWICE`, :data:`PAST`).
Everything within :data:`DEADLINE_S` seconds, each request within :data:`REQUEST_S` and :data:`MAX_RESPONSE_BYTES`
(:func:`tuner.hub.client.bounded`), whatever the server does. What is not read is said in one line; refusals are
counted (:mod:`tuner.share.refusals`); who uploaded each record is read from the Hub (:mod:`tuner.share.accounts`).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tuner.core.errors import RecordError, TunerError
from tuner.hub import client
from tuner.hub import records as hub
from tuner.hub.repos import DEFAULT_OPTIONS, HubOptions
from tuner.share import accounts, shards
from tuner.share.gate import MAX_RECORD_BYTES, SharedRecord, read_record, refusal, shown
from tuner.share.refusals import Refusals

FOLDER = "records"
RECORD_PATH = re.compile(r"records/(?P<id>[0-9a-f]{16})\.json")
MAX_LISTED = 20_000  # names listed from records/ (the Hub lists 1,000 a page)
MAX_FILES = 1_000  # record files read by one look-up
MAX_SHARDS = 64
MAX_SHARD_BYTES = 256 * 2**20  # fetched from shards by one look-up, all shards together
MAX_SHARD_ROWS = 20_000  # rows of one look-up's model taken in from shards
MAX_KEPT_BYTES = 16 * 2**20  # record text kept by one look-up (as Python objects, about 3.5 times that)
DEADLINE_S = 60.0
REQUEST_S = 30.0  # one request, start to end
MAX_RESPONSE_BYTES = 48 * 2**20  # one response (a shard's record column of one row group is the largest)
WORKERS = 8
# Why a record read is passed over without fault (counted, never a line of its own: tuner.share.refusals).
OTHER = "for another model or card"
TWICE = "read twice"
PAST = "past the look-up's bound"


@dataclass(frozen=True, slots=True)
class PoolQuery:
    """What a look-up wants, so shards can be read in part (record files are read whole, and matched after)."""

    vram_class_gib: int | None = None  # None: every class
    keys: frozenset[str] = frozenset()  # model keys (tuner.share.match.model_key); empty: every model
    sha_head: str | None = None  # a local file's fingerprint head


@dataclass(frozen=True, slots=True)
class Bounds:
    """How much one read of a pool may take (a look-up's; consolidating a pool takes more)."""

    files: int = MAX_FILES
    listed: int = MAX_LISTED
    shard_rows: int = MAX_SHARD_ROWS
    shard_bytes: int = MAX_SHARD_BYTES
    seconds: float = DEADLINE_S
    kept_bytes: int = MAX_KEPT_BYTES
    request_s: float = REQUEST_S
    response_bytes: int = MAX_RESPONSE_BYTES


@dataclass(frozen=True, slots=True)
class Fetched:
    repo_id: str
    commit: str
    records: tuple[SharedRecord, ...]
    refusals: Refusals  # every record, name, shard or download that failed, counted; and what was not read
    bytes_read: int = 0
    files_read: int = 0
    shard_rows_read: int = 0
    from_files: tuple[str, ...] = ()  # ids of the records read from records/ files (not yet in a shard)
    accounts: Mapping[str, str | None] = field(default_factory=dict)  # record id → uploader (None: unverified)

    @property
    def skipped(self) -> tuple[str, ...]:
        """What to tell the user: notes, the first refusals, then one line of counts (a bounded number of lines)."""
        return self.refusals.lines()

    @property
    def records_read(self) -> int:
        """Records read (files downloaded and shard rows taken): each kept, or counted among the refusals, so this
        is ``len(records) + refusals.count - refusals.unread``."""
        return self.files_read + self.shard_rows_read


@dataclass
class _Reading:
    repo_id: str
    commit: str
    options: HubOptions
    deadline: float
    bounds: Bounds
    keep: Callable[[SharedRecord], bool]
    clock: Callable[[], float]
    records: dict[str, SharedRecord] = field(default_factory=dict)
    sources: dict[str, accounts.Source] = field(default_factory=dict)
    refusals: Refusals = field(default_factory=Refusals)
    bytes_read: int = 0
    files_read: int = 0
    shard_rows: int = 0
    kept_bytes: int = 0
    full: bool = False  # the kept records reached their bound
    from_files: list[str] = field(default_factory=list)

    def late(self) -> bool:
        return self.clock() > self.deadline

    def gate(self, raw: bytes, record_id: str, source: accounts.Source) -> bool:
        """Keep the record read as ``raw``, or count why not."""
        if record_id in self.records:  # a shard's row twice (a records/ file already kept is never fetched)
            self.refusals.pass_over(TWICE)
            return False
        try:
            record = read_record(raw, record_id)
        except RecordError as exc:
            self.refusals.refuse(exc)
            return False
        if not self.keep(record):
            self.refusals.pass_over(OTHER)
            return False
        if self.kept_bytes + len(raw) > self.bounds.kept_bytes:
            if not self.full:
                self.refusals.note(f"records past the first {self.bounds.kept_bytes / 2**20:,.0f} MiB kept for this "
                                   "look-up were read and not kept")
            self.full = True
            self.refusals.pass_over(PAST)
            return False
        self.kept_bytes += len(raw)
        self.records[record_id] = record
        self.sources[record_id] = source
        return True


def fetch(repo_id: str, options: HubOptions = DEFAULT_OPTIONS, query: PoolQuery = PoolQuery(), *,
          rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic,
          bounds: Bounds | None = None, keep: Callable[[SharedRecord], bool] = lambda r: True) -> Fetched:
    """The gated records of ``repo_id`` that ``query`` may want and ``keep`` keeps, each with its uploader; the
    rest counted in ``refusals``."""
    hub.check_repo_id(repo_id)
    b = bounds or Bounds(MAX_FILES, MAX_LISTED, MAX_SHARD_ROWS, MAX_SHARD_BYTES, DEADLINE_S, MAX_KEPT_BYTES,
                         REQUEST_S, MAX_RESPONSE_BYTES)  # read when called (a test may lower one)
    with client.bounded(b.seconds, request_s=b.request_s, max_bytes=b.response_bytes,
                        what=f"the look-up's {b.seconds:.0f} s"):
        reading = _Reading(repo_id, hub.repo_commit(repo_id, options), options, clock() + b.seconds, b, keep, clock)
        _from_shards(reading, query)
        _from_files(reading, rng or random.Random())
        who = _uploaders(reading)
    return Fetched(repo_id, reading.commit, tuple(sorted(reading.records.values(), key=lambda r: r.record_id)),
                   reading.refusals, reading.bytes_read, reading.files_read, reading.shard_rows,
                   tuple(sorted(reading.from_files)), who)


def _uploaders(reading: _Reading) -> dict[str, str | None]:
    got = accounts.resolve(reading.repo_id, reading.commit, reading.sources, reading.options, late=reading.late)
    for note in got.notes:
        reading.refusals.note(note)
    return got.accounts


def _listed_in_part(reading: _Reading, folder: str, listing: hub.Listing) -> None:
    reading.refusals.note(f"{folder}/ was listed in part ({len(listing.files):,} files): the server sent no "
                          f"further page in time (a page may wait {client.STALL_S:.0f} s, the look-up "
                          f"{reading.bounds.seconds:.0f} s)")


def _from_shards(reading: _Reading, query: PoolQuery) -> None:
    b = reading.bounds
    listing = hub.list_files(reading.repo_id, reading.commit, shards.FOLDER, ".parquet", reading.options,
                             max_entries=b.listed, late=reading.late)
    if listing.stalled:
        _listed_in_part(reading, shards.FOLDER, listing)
    wanted = []
    for f in listing.files:
        m = shards.PATH.fullmatch(f.path)
        if m is None:
            reading.refusals.add(f"shard {shown(f.path, 80)} skipped: a shard is shards/vram-<GiB>/<name>.parquet",
                                 "bad name", read=False)
        elif query.vram_class_gib is None or int(m["gib"]) == query.vram_class_gib:
            wanted.append(f)
    if len(wanted) > MAX_SHARDS:
        reading.refusals.note(f"{len(wanted) - MAX_SHARDS} of {len(wanted)} shards for this card were not read "
                              f"(at most {MAX_SHARDS} a look-up)")
    spent = 0
    for f in wanted[:MAX_SHARDS]:
        if reading.late() or reading.full or reading.shard_rows >= b.shard_rows:
            reading.refusals.note(f"shard {shown(f.path, 80)} and those after it were not read: the look-up's "
                                  + (f"{b.seconds:.0f} s were spent" if reading.late() else "bounds were reached"))
            break
        source = hub.RangeReader(reading.repo_id, f.path, reading.commit, f.size_bytes, b.shard_bytes - spent,
                                 reading.options)

        def take(row: shards.ShardRow, path: str = f.path) -> bool:
            reading.shard_rows += 1
            reading.gate(row.raw, row.record_id, accounts.Source(path, row.account, shard=True))
            return reading.shard_rows < b.shard_rows and not reading.full

        try:
            got = shards.read_rows(source, f.size_bytes, query.keys, query.sha_head, take, reading.late)
        except TunerError as exc:  # ShardError, and the Hub's errors
            reading.refusals.add(f"shard {shown(f.path, 80)} skipped: {shown(exc, 200)}", "bad shard", read=False)
            continue
        finally:
            spent += source.bytes_read
            reading.bytes_read += source.bytes_read
        if got.left:
            reading.refusals.note(f"{got.left:,} rows of {shown(f.path, 80)} were not read (at most "
                                  f"{b.shard_rows:,} rows and {b.kept_bytes / 2**20:,.0f} MiB a look-up, within "
                                  f"{b.seconds:.0f} s)")


def _from_files(reading: _Reading, rng: random.Random) -> None:
    b = reading.bounds
    listing = hub.list_files(reading.repo_id, reading.commit, FOLDER, "", reading.options, max_entries=b.listed,
                             late=reading.late)
    if listing.stalled:
        _listed_in_part(reading, FOLDER, listing)
    elif listing.cut:
        reading.refusals.note(f"records/ holds more than the {len(listing.files):,} files listed (at most "
                              f"{b.listed:,}, within {b.seconds:.0f} s): the pool needs consolidating")
    todo = []
    for f in listing.files:
        m = RECORD_PATH.fullmatch(f.path)
        name = f.path.removeprefix(f"{FOLDER}/")
        if m is None:
            reading.refusals.refuse(refusal(name, "a record file is records/<16 hex digits>.json", "bad name"),
                                    read=False)
        elif f.size_bytes > MAX_RECORD_BYTES:  # never downloaded
            reading.refusals.refuse(refusal(m["id"], f"{f.size_bytes:,} bytes, more than the {MAX_RECORD_BYTES:,} a "
                                                     "record may hold", "too large"), read=False)
        elif m["id"] not in reading.records:
            todo.append(m["id"])
    rng.shuffle(todo)
    if len(todo) > b.files:
        reading.refusals.note(f"{len(todo) - b.files:,} of {len(todo):,} record files were not read: a random "
                              f"{b.files:,} were (the pool needs consolidating)")
        todo = todo[:b.files]

    def download(rid: str) -> tuple[str, bytes | str]:
        try:
            return rid, hub.read_file(reading.repo_id, f"{FOLDER}/{rid}.json", reading.commit, MAX_RECORD_BYTES,
                                      reading.options)
        except TunerError as exc:
            return rid, f"download failed ({exc})"

    with ThreadPoolExecutor(WORKERS) as pool:
        for start in range(0, len(todo), WORKERS * 4):
            if reading.late() or reading.full:
                reading.refusals.note(f"{len(todo) - start:,} record files were not read: the look-up's "
                                      + (f"{b.seconds:.0f} s were spent" if reading.late() else "bounds were reached"))
                break
            for rid, got in pool.map(client.carried(download), todo[start:start + WORKERS * 4]):
                _gate_file(reading, rid, got)


def _gate_file(reading: _Reading, rid: str, got: bytes | str) -> None:
    if isinstance(got, str):
        reading.refusals.refuse(refusal(rid, shown(got, 200), "download failed"), read=False)
        return
    reading.files_read += 1
    reading.bytes_read += len(got)
    if reading.gate(got, rid, accounts.Source(f"{FOLDER}/{rid}.json")):
        reading.from_files.append(rid)
