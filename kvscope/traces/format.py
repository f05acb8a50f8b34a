"""Byte layout of .kvtrace files (docs/TRACE_FORMAT.md). All integers little-endian."""

from __future__ import annotations

import struct

MAGIC = b"KVTRACE\0"
FORMAT_VERSION = 1

# magic, format version (u16), flags (u16), hello length (u32), crc32 of hello (u32)
HEADER = struct.Struct("<8sHHII")

# tag, body length (u32), crc32 (u32) of everything after the crc field up to the
# end of the body; for chunks the meta below follows before the compressed body.
RECORD = struct.Struct("<4sII")
CHUNK_TAG = b"CHNK"
INDEX_TAG = b"INDX"
# chunk meta: first step (the opening snapshot's step, i64), last step (i64),
# event count (u32), uncompressed length (u32)
CHUNK_META = struct.Struct("<qqII")

# footer: magic, offset of the index record (u64)
FOOTER = struct.Struct("<8sQ")
FOOTER_MAGIC = b"KVTREND\0"

# each event inside an uncompressed chunk: u32 length + encoded event
EVENT_LEN = struct.Struct("<I")

# Bounds on every length a reader trusts. The writer keeps to them (it splits a chunk at a
# snapshot rather than exceed them), so a reader never refuses what a writer wrote; a
# recorded chunk is typically well under 1 MiB raw.
MAX_HELLO_BYTES = 1 << 20
MAX_CHUNK_RAW_BYTES = 64 << 20  # uncompressed: also the most a zlib bomb can make a reader allocate
MAX_CHUNK_BYTES = MAX_CHUNK_RAW_BYTES + (1 << 20)  # compressed (zlib can expand incompressible data a little)
MAX_CHUNK_EVENTS = 1 << 17
MAX_INDEX_BYTES = 64 << 20
# The first piece of a chunk inflated before the rest: garbage is refused before a bomb expands.
FIRST_PIECE_BYTES = 64 << 10
