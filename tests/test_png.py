"""benchmarks/png.py writes PNGs a decoder accepts: signature, IHDR fields, CRCs, the rows."""

from __future__ import annotations

import struct
import zlib

import pytest

from benchmarks.png import SIGNATURE, Canvas, encode_png


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, data) of every chunk, checking each CRC on the way."""
    assert data[:8] == SIGNATURE == b"\x89PNG\r\n\x1a\n"
    out, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC on {kind!r}"
        out.append((kind, body))
        pos += 12 + length
    assert pos == len(data), "trailing bytes after the last chunk"
    return out


def _decode(data: bytes) -> tuple[int, int, list[bytes]]:
    chunks = _chunks(data)
    assert [kind for kind, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    assert chunks[2][1] == b""
    width, height, depth, color_type, compression, filt, interlace = struct.unpack(
        ">IIBBBBB", chunks[0][1])
    assert (depth, color_type, compression, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(chunks[1][1])
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    lines = [raw[y * stride:(y + 1) * stride] for y in range(height)]
    assert all(line[0] == 0 for line in lines), "every row uses filter type 0"
    return width, height, [line[1:] for line in lines]


def test_encode_round_trips_rows():
    width, height = 5, 3
    rows = [bytes(v for x in range(width) for v in (x * 40 + y, 255 - x, y * 100))
            for y in range(height)]
    assert _decode(encode_png(width, height, rows)) == (width, height, rows)


def test_canvas_rectangles_are_clipped_and_placed():
    canvas = Canvas(4, 3, background=(1, 2, 3))
    canvas.rect(1, 1, 10, 2, (200, 100, 50))  # runs off the right edge
    canvas.rect(2, 0, 2, 3, (9, 9, 9))  # empty: nothing painted
    width, height, rows = _decode(canvas.to_png())
    assert (width, height) == (4, 3)
    bg, red = bytes((1, 2, 3)), bytes((200, 100, 50))
    assert rows == [bg * 4, bg + red * 3, bg * 4]


@pytest.mark.parametrize(("width", "height", "rows"), [
    (0, 1, [b""]),
    (2, 1, [b"\x00" * 5]),
    (1, 2, [b"\x00" * 3]),
])
def test_encode_rejects_bad_shapes(width, height, rows):
    with pytest.raises(ValueError):
        encode_png(width, height, rows)
