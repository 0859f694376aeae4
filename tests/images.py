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
