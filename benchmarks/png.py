"""A tiny dependency-free PNG writer for benchmark plots: a canvas of filled rectangles.

PNG layout (RFC 2083): the 8-byte signature, then chunks of ``length (u32, big-endian) |
type (4 ASCII bytes) | data | CRC-32 of type + data``. We write three chunks: IHDR (width,
height, bit depth 8, colour type 2 = RGB, no interlace), one IDAT holding the zlib stream of
the rows, each row prefixed by filter byte 0 (none), and an empty IEND.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

SIGNATURE = b"\x89PNG\r\n\x1a\n"
Color = tuple[int, int, int]


def chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk; the CRC covers the type and the data, not the length."""
    assert len(kind) == 4, "chunk types are 4 bytes"
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def encode_png(width: int, height: int, rows: list[bytes]) -> bytes:
    """The PNG file for ``rows``: ``height`` rows of ``3 * width`` bytes (R, G, B per pixel)."""
    if width < 1 or height < 1:
        raise ValueError(f"a PNG needs at least one pixel (got {width}x{height})")
    if len(rows) != height or any(len(row) != 3 * width for row in rows):
        raise ValueError(f"expected {height} rows of {3 * width} bytes (RGB x width {width})")
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    raw = b"".join(b"\x00" + bytes(row) for row in rows)  # filter type 0 on every row
    return (SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b""))


class Canvas:
    """An RGB image filled with ``background`` that rectangles are painted on."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)) -> None:
        self.width, self.height = width, height
        self.rows = [bytearray(bytes(background) * width) for _ in range(height)]

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill pixels ``x0 <= x < x1``, ``y0 <= y < y1`` (clipped to the canvas)."""
        x0, x1 = max(0, x0), min(self.width, x1)
        y0, y1 = max(0, y0), min(self.height, y1)
        if x0 >= x1:
            return
        span = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            self.rows[y][3 * x0:3 * x1] = span

    def to_png(self) -> bytes:
        return encode_png(self.width, self.height, [bytes(row) for row in self.rows])

    def save(self, path: Path) -> None:
        path.write_bytes(self.to_png())
