"""Horizontal bar charts as PNG with the standard library alone (zlib, struct): no plotting package needed.

The GPU machine has no matplotlib, so the benchmark draws its own chart: rectangles, whiskers and text
in a built-in 5 x 7 pixel font (upper-case; lower-case letters are drawn upper-case).
"""

import math
import struct
import zlib

_FONT_ROWS = {
    "A": "01110 10001 10001 11111 10001 10001 10001", "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110", "D": "11100 10010 10001 10001 10001 10010 11100",
    "E": "11111 10000 10000 11110 10000 10000 11111", "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111", "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110", "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001", "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001", "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110", "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101", "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110", "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110", "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010", "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 10001 01010 00100 00100 00100", "Z": "11111 00001 00010 00100 01000 10000 11111",
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11111 00010 00100 00010 00001 10001 01110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    " ": "00000 00000 00000 00000 00000 00000 00000", "-": "00000 00000 00000 11111 00000 00000 00000",
    ".": "00000 00000 00000 00000 00000 01100 01100", "_": "00000 00000 00000 00000 00000 00000 11111",
    "/": "00000 00001 00010 00100 01000 10000 00000", ":": "00000 01100 01100 00000 01100 01100 00000",
    "(": "00010 00100 01000 01000 01000 00100 00010", ")": "01000 00100 00010 00010 00010 00100 01000",
    "%": "11000 11001 00010 00100 01000 10011 00011", "[": "01110 01000 01000 01000 01000 01000 01110",
    "]": "01110 00010 00010 00010 00010 00010 01110", ",": "00000 00000 00000 00000 01100 00100 01000",
    "+": "00000 00100 00100 11111 00100 00100 00000", "=": "00000 00000 11111 00000 11111 00000 00000",
    "<": "00010 00100 01000 10000 01000 00100 00010", ">": "01000 00100 00010 00001 00010 00100 01000",
    "?": "01110 10001 00001 00010 00100 00000 00100",
}
FONT = {char: [int(row, 2) for row in rows.split()] for char, rows in _FONT_ROWS.items()}
GLYPH_W, GLYPH_H = 5, 7

WHITE = (255, 255, 255)
BLACK = (20, 20, 20)
GREY = (200, 200, 200)


class Canvas:
    """An RGB raster with rectangle and text drawing, saved as PNG."""

    def __init__(self, width: int, height: int, background=WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        """Fill [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, int(x0)), min(self.width, int(x1))
        y0, y1 = max(0, int(y0)), min(self.height, int(y1))
        if x0 >= x1 or y0 >= y1:
            return
        run = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            start = (y * self.width + x0) * 3
            self.pixels[start:start + len(run)] = run

    def text(self, x: int, y: int, string: str, color=BLACK, scale: int = 2) -> int:
        """Draw `string` with its top-left corner at (x, y); returns the x after the last glyph."""
        for char in string:
            rows = FONT.get(char.upper(), FONT["?"])
            for dy, bits in enumerate(rows):
                for dx in range(GLYPH_W):
                    if bits & (1 << (GLYPH_W - 1 - dx)):
                        self.rect(x + dx * scale, y + dy * scale, x + (dx + 1) * scale, y + (dy + 1) * scale, color)
            x += (GLYPH_W + 1) * scale
        return x

    def save_png(self, path) -> None:
        raw = b"".join(b"\x00" + bytes(self.pixels[y * self.width * 3:(y + 1) * self.width * 3])
                       for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        with open(path, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                    + chunk(b"IEND", b""))


def text_width(string: str, scale: int = 2) -> int:
    return len(string) * (GLYPH_W + 1) * scale


def _nice_step(maximum: float) -> float:
    """A 1/2/5 x 10^k tick step giving about five ticks up to `maximum`."""
    if maximum <= 0:
        return 1.0
    raw = maximum / 5
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * power:
            return factor * power
    return 10 * power


def bar_chart(panels: list, legend: list, title: str, path, width: int = 1200) -> None:
    """Draw stacked panels of horizontal bars.

    Args:
        panels: dicts with "title" and "rows"; each row has "label", "value", optional "lo"/"hi"
            (a whisker) and "color".
        legend: (text, color) pairs shown under the title.
        title: the chart's title.
        path: where to write the PNG.
        width: image width in pixels.
    """
    row_h, scale = 26, 2
    label_w = max((text_width(r["label"], scale) for p in panels for r in p["rows"]), default=100) + 20
    left, right = label_w + 10, width - 150
    height = 70 + sum(30 + row_h * len(p["rows"]) + 30 for p in panels)
    canvas = Canvas(width, height)
    canvas.text(10, 10, title, scale=scale)
    x = 10
    for text, color in legend:
        canvas.rect(x, 38, x + 14, 52, color)
        x = canvas.text(x + 20, 40, text, scale=scale) + 24
    y = 70
    for panel in panels:
        canvas.text(10, y, panel["title"], scale=scale)
        y += 30
        rows = panel["rows"]
        maximum = max((max(r["value"], r.get("hi") or 0) for r in rows), default=1.0) or 1.0
        step = _nice_step(maximum)
        top_tick = step * (int(maximum / step) + 1)
        span = right - left

        def to_x(value: float, span=span, top_tick=top_tick) -> int:
            return left + int(span * value / top_tick)

        tick = 0.0
        while tick <= top_tick + 1e-9:
            canvas.rect(to_x(tick), y - 4, to_x(tick) + 1, y + row_h * len(rows), GREY)
            label = f"{tick:g}"
            canvas.text(to_x(tick) - text_width(label, 1) // 2, y + row_h * len(rows) + 4, label, scale=1)
            tick += step
        for index, row in enumerate(rows):
            top = y + index * row_h
            canvas.text(10, top + 5, row["label"], scale=scale)
            color = row.get("color", (90, 90, 90))
            canvas.rect(left, top + 3, to_x(row["value"]), top + row_h - 3, color)
            if row.get("lo") is not None and row.get("hi") is not None:
                middle = top + row_h // 2
                canvas.rect(to_x(row["lo"]), middle - 1, to_x(row["hi"]) + 1, middle + 1, BLACK)
                for end in (row["lo"], row["hi"]):
                    canvas.rect(to_x(end), middle - 6, to_x(end) + 2, middle + 6, BLACK)
            value_x = max(to_x(row["value"]), to_x(row.get("hi") or 0)) + 8
            canvas.text(value_x, top + 5, f"{row['value']:.4g}", scale=scale)
        y += row_h * len(rows) + 30
    canvas.save_png(path)
