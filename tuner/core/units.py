"""Byte units, defined once."""

from __future__ import annotations

MIB = 2**20
GIB = 2**30
