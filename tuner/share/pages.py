"""A Parquet column chunk's page headers, read before pyarrow decodes a byte of it.

A shard is bytes a stranger may have written, and its footer is their word: pyarrow sizes what it allocates by each
page's own header (``uncompressed_page_size``), and a value encoding such as ``DELTA_BYTE_ARRAY`` rebuilds strings
from shared prefixes, so a few KiB can decode to GiB. This module walks a chunk's headers (Thrift compact protocol,
``parquet.thrift``'s ``PageHeader``) and says what decoding it would cost, or why it must not be decoded: a header
that does not parse, a page larger than the caller allows, an encoding whose output is not bounded by its input, a
page count or value count beyond the row group's. Pure: bytes in, figures or :class:`ValueError` out.
"""

from __future__ import annotations

from dataclasses import dataclass

# parquet.thrift: PageType and Encoding.
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3
# Encodings whose decoded values are no larger than the page's bytes (a dictionary's indices point into a dictionary
# page that is itself bounded); DELTA_BYTE_ARRAY (prefix sharing) is not, nor are the others needed by a shard.
PLAIN, PLAIN_DICTIONARY, RLE_DICTIONARY = 0, 2, 8
BOUNDED_ENCODINGS = frozenset({PLAIN, PLAIN_DICTIONARY, RLE_DICTIONARY})
MAX_PAGES = 4096  # in one column chunk of one row group
_MAX_DEPTH = 8  # nested Thrift structs in a page header (statistics sit two deep)

# Thrift compact protocol field types.
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)


@dataclass(frozen=True, slots=True)
class ChunkCost:
    pages: int
    uncompressed_bytes: int  # what decompressing every page allocates
    values: int  # data values (rows, for a flat column) the data pages hold


class _Reader:
    def __init__(self, data: bytes, pos: int) -> None:
        self.data, self.pos = data, pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise ValueError("a page header runs past its column chunk")
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        out = shift = 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7
            if shift > 63:
                raise ValueError("a page header holds a number longer than 64 bits")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError("a page header runs past its column chunk")
        self.pos += n

    def struct(self, depth: int = 0) -> dict[int, object]:
        """A struct's fields: id → int for integer and bool fields, a nested dict for structs (others skipped)."""
        if depth > _MAX_DEPTH:
            raise ValueError("a page header nests deeper than any Parquet writer does")
        fields: dict[int, object] = {}
        last = 0
        while True:
            head = self.byte()
            kind = head & 0x0F
            if kind == 0:
                return fields
            delta = head >> 4
            last = last + delta if delta else self.zigzag()
            fields[last] = self.value(kind, depth)

    def value(self, kind: int, depth: int) -> object:
        if kind in (_TRUE, _FALSE):
            return kind == _TRUE
        if kind == _BYTE:
            return self.byte()
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _DOUBLE:
            self.skip(8)
            return None
        if kind == _BINARY:
            self.skip(self.varint())
            return None
        if kind in (_LIST, _SET):
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            elem = head & 0x0F
            for _ in range(size):  # every element takes at least one byte: the chunk's end stops a lying size
                if elem in (_TRUE, _FALSE):
                    self.byte()
                else:
                    self.value(elem, depth + 1)
            return None
        if kind == _MAP:
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.value(types >> 4, depth + 1)
                    self.value(types & 0x0F, depth + 1)
            return None
        if kind == _STRUCT:
            return self.struct(depth + 1)
        raise ValueError(f"a page header holds Thrift type {kind}, which no Parquet writer writes")


def _int(fields: dict[int, object], key: int, what: str) -> int:
    value = fields.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"a page header without a valid {what}")
    return value


def chunk_cost(chunk: bytes, *, rows: int, max_page_bytes: int) -> ChunkCost:
    """What decoding one column chunk (its bytes from its first page header to its end) costs; ValueError where a
    header does not parse or a page or encoding could decode to more than its bytes allow."""
    r = _Reader(chunk, 0)
    pages = uncompressed = values = 0
    while r.pos < len(chunk):
        pages += 1
        if pages > MAX_PAGES:
            raise ValueError(f"a column chunk of more than {MAX_PAGES} pages")
        header = r.struct()
        kind = _int(header, 1, "page type")
        size = _int(header, 2, "uncompressed size")
        stored = _int(header, 3, "compressed size")
        if size > max_page_bytes:
            raise ValueError(f"a page that decompresses to {size:,} bytes (at most {max_page_bytes:,})")
        body = {DATA_PAGE: 5, DICTIONARY_PAGE: 7, DATA_PAGE_V2: 8}.get(kind)
        if body is None:
            raise ValueError(f"a page of type {kind}, which a shard does not hold")
        sub = header.get(body)
        if not isinstance(sub, dict):
            raise ValueError(f"a page of type {kind} without its header")
        encoding = _int(sub, 4 if kind == DATA_PAGE_V2 else 2, "encoding")
        if encoding not in BOUNDED_ENCODINGS:
            raise ValueError(f"a page in encoding {encoding}, whose values may decode to more than its bytes")
        count = _int(sub, 1, "value count")
        if kind != DICTIONARY_PAGE:
            values += count
        elif count * 4 > size:  # PLAIN strings: a 4-byte length each; more values are offsets allocated for nothing
            raise ValueError(f"a dictionary page of {count:,} values in {size:,} bytes")
        uncompressed += size
        r.skip(stored)
    if values > rows:
        raise ValueError(f"pages of {values:,} values in a row group of {rows:,} rows")
    return ChunkCost(pages, uncompressed, values)
