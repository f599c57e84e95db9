"""Consolidate a shared pool you keep: every record of records/ and of the old shards, through the reading gate,
written again as Parquet shards in one commit that deletes the record files it took in (tuner/share/consolidate.py).

    .venv/bin/python scripts/consolidate_pool.py you/moe-tune-results [--dry-run]

Uses your Hugging Face token (write access to the repo). Prints what it wrote and every record it refused.
"""

from __future__ import annotations

import argparse
import sys

from tuner.core.errors import TunerError
from tuner.share.consolidate import consolidate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo", help="the pool, OWNER/DATASET")
    parser.add_argument("--dry-run", action="store_true", help="read and build the shards; commit nothing")
    args = parser.parse_args()
    try:
        done = consolidate(args.repo, dry_run=args.dry_run)
    except TunerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for line in done.skipped:
        print(f"warning: {line}", file=sys.stderr)
    for path, size in done.shards.items():
        print(f"{path}: {size:,} bytes")
    print(f"{done.records:,} records in {len(done.shards)} shard(s); {len(done.files_taken):,} record files taken in"
          + (f"; committed: {done.commit_url}" if done.commit_url else " (dry run: nothing committed)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
