"""Small test images drawn with Pillow (shapes and gradients), encoded as PNG or JPEG bytes; never downloaded.

Shared by the engine's vision tests and the service's image tests.
"""

from __future__ import annotations

import io


def draw_image(width: int = 64, height: int = 64, seed: int = 0, fmt: str = "png") -> bytes:
    """An RGB image of `width` x `height`: a diagonal colour gradient with a rectangle and an ellipse whose
    colours and places depend on `seed`, encoded as `fmt` ("png" or "jpeg")."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height))
    pixels = image.load()
    for x in range(width):
        for y in range(height):
            pixels[x, y] = ((x * 255 // max(1, width - 1) + 40 * seed) % 256,
                            (y * 255 // max(1, height - 1) + 70 * seed) % 256,
                            ((x + y) * 127 // max(1, width + height - 2) + 90 * seed) % 256)
    draw = ImageDraw.Draw(image)
    a, b = (7 * seed) % max(1, width // 2), (5 * seed) % max(1, height // 2)
    draw.rectangle([a, b, a + width // 3, b + height // 4], fill=((50 * seed) % 256, 200, 30))
    draw.ellipse([width // 2, height // 2, width - 2, height - 2], fill=(230, (90 * seed) % 256, 160))
    out = io.BytesIO()
    image.save(out, format="PNG" if fmt == "png" else "JPEG", quality=90)
    return out.getvalue()


def progressive_jpeg(width: int = 64, height: int = 64, repeat_last_scan: int = 0) -> bytes:
    """A progressive JPEG (Pillow's: 10 scans), its last scan repeated `repeat_last_scan` more times: the shape
    of a JPEG whose decoding costs a pass over the whole image per scan, however small the file."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", progressive=True, quality=80)
    data = out.getvalue()
    last = data.rfind(b"\xff\xda")  # the last scan: its header and data, up to the end-of-image marker
    return data[:-2] + data[last:-2] * repeat_last_scan + b"\xff\xd9"


def png_with_chunks(chunks: int) -> bytes:
    """A small valid PNG (16 x 16) whose image data is split into `chunks` IDAT chunks (most of them empty)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    data = zlib.compress(b"".join(b"\0" + b"\x80" * 48 for _ in range(16)))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 16, 16, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IDAT", b"") * (chunks - 1) + chunk(b"IEND", b""))
