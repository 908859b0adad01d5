"""A tiny PNG line-plot writer (standard library only: zlib and struct).

The example must not depend on matplotlib, so this draws what a training run needs: stacked panels, each
with axes, ticks, tick labels, grid lines, one line series on a linear or log2 y axis, and optional
marker positions (e.g. skipped steps). Text uses a built-in 5x7 bitmap font (lower case, digits and a
few symbols; upper case is drawn as lower case).

    from plot_png import Panel, Series, plot_panels
    plot_panels("loss.png", [Panel("loss", [Series(steps, losses, (31, 119, 180))])], x_label="step")
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Sequence

Color = tuple[int, int, int]

WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GRID: Color = (225, 225, 225)
MARKER: Color = (214, 39, 40)
MARKER_LINE: Color = (250, 200, 200)

# 5x7 glyphs, one string of 7 rows per character ('#' = ink).
_FONT_ROWS = {
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.",
    "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####",
    "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.",
    "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.",
    "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.",
    "9": ".###. #...# #...# .#### ....# ...#. .##..",
    ".": "..... ..... ..... ..... ..... .##.. .##..",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    "-": "..... ..... ..... .###. ..... ..... .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    "=": "..... ..... ##### ..... ##### ..... .....",
    "^": "..#.. .#.#. #...# ..... ..... ..... .....",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    "/": "..... ....# ...#. ..#.. .#... #.... .....",
    "_": "..... ..... ..... ..... ..... ..... #####",
    " ": "..... ..... ..... ..... ..... ..... .....",
    "a": "..... ..... .###. ....# .#### #...# .####",
    "b": "#.... #.... #.##. ##..# #...# #...# ####.",
    "c": "..... ..... .###. #.... #.... #...# .###.",
    "d": "....# ....# .##.# #..## #...# #...# .####",
    "e": "..... ..... .###. #...# ##### #.... .###.",
    "f": "..##. .#..# .#... ###.. .#... .#... .#...",
    "g": "..... .#### #...# #...# .#### ....# ####.",
    "h": "#.... #.... #.##. ##..# #...# #...# #...#",
    "i": "..#.. ..... .##.. ..#.. ..#.. ..#.. .###.",
    "j": "...#. ..... ..##. ...#. ...#. #..#. .##..",
    "k": "#.... #.... #..#. #.#.. ##... #.#.. #..#.",
    "l": ".##.. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "m": "..... ..... ##.#. #.#.# #.#.# #...# #...#",
    "n": "..... ..... #.##. ##..# #...# #...# #...#",
    "o": "..... ..... .###. #...# #...# #...# .###.",
    "p": "..... ..... ####. #...# ####. #.... #....",
    "q": "..... ..... .##.# #..## .#### ....# ....#",
    "r": "..... ..... #.##. ##..# #.... #.... #....",
    "s": "..... ..... .###. #.... .###. ....# ####.",
    "t": ".#... .#... ###.. .#... .#... .#..# ..##.",
    "u": "..... ..... #...# #...# #...# #..## .##.#",
    "v": "..... ..... #...# #...# #...# .#.#. ..#..",
    "w": "..... ..... #...# #...# #.#.# #.#.# .#.#.",
    "x": "..... ..... #...# .#.#. ..#.. .#.#. #...#",
    "y": "..... ..... #...# #...# .#### ....# .###.",
    "z": "..... ..... ##### ...#. ..#.. .#... #####",
}
FONT = {char: [row for row in rows.split()] for char, rows in _FONT_ROWS.items()}
GLYPH_W, GLYPH_H = 5, 7
TEXT_SCALE = 2  # each font pixel is drawn as a TEXT_SCALE x TEXT_SCALE square
LEFT_MARGIN, RIGHT_MARGIN = 110, 30


class Canvas:
    """An RGB raster with the few drawing primitives a line plot needs."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            offset = 3 * (y * self.width + x)
            self.pixels[offset:offset + 3] = bytes(color)

    def fill_rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(max(0, y0), min(self.height, y1 + 1)):
            for x in range(max(0, x0), min(self.width, x1 + 1)):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
        """Bresenham line; `width` > 1 stamps a square brush of that size."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        half = (width - 1) // 2
        while True:
            if width == 1:
                self.set(x0, y0, color)
            else:
                self.fill_rect(x0 - half, y0 - half, x0 - half + width - 1, y0 - half + width - 1, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: Color = BLACK, scale: int = TEXT_SCALE) -> None:
        """Draw `text` with its top-left corner at (x, y); unknown characters are drawn as blanks."""
        for index, char in enumerate(text.lower()):
            rows = FONT.get(char, FONT[" "])
            left = x + index * (GLYPH_W + 1) * scale
            for row, bits in enumerate(rows):
                for col, bit in enumerate(bits):
                    if bit == "#":
                        self.fill_rect(left + col * scale, y + row * scale, left + col * scale + scale - 1,
                                       y + row * scale + scale - 1, color)

    @staticmethod
    def text_width(text: str, scale: int = TEXT_SCALE) -> int:
        return len(text) * (GLYPH_W + 1) * scale - scale if text else 0

    def to_png(self) -> bytes:
        """Encode as an 8-bit RGB PNG (filter type 0 on every row)."""
        stride = 3 * self.width
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride]) for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) +
                chunk(b"IEND", b""))


@dataclass
class Series:
    """One line: y values at x positions, drawn in `color`."""

    xs: Sequence[float]
    ys: Sequence[float]
    color: Color
    steps: bool = False  # draw as a step function (hold each value until the next x)


@dataclass
class Panel:
    """One plot area: a title, line series, a y axis (linear or log2) and optional x markers."""

    title: str
    series: list[Series]
    log2_y: bool = False
    markers: Sequence[float] = field(default_factory=list)
    marker_color: Color = MARKER


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, target - 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    count = int(math.floor((hi - first) / step + 1e-9)) + 1
    return [round(first + i * step, 12) for i in range(count)]


def format_tick(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e5 or abs(value) < 1e-3:
        return f"{value:.0e}".replace("e+0", "e").replace("e-0", "e-")
    return f"{value:g}"


def _finite(values: Sequence[float], log2: bool) -> list[float]:
    return [v for v in values if math.isfinite(v) and (v > 0 or not log2)]


def _panel_range(panel: Panel) -> tuple[float, float]:
    values = [v for s in panel.series for v in _finite(s.ys, panel.log2_y)]
    if not values:
        return (0.0, 1.0)
    if panel.log2_y:
        return math.floor(math.log2(min(values))) - 0.5, math.ceil(math.log2(max(values))) + 0.5
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
    return lo - pad, hi + pad


def _y_ticks(panel: Panel, lo: float, hi: float) -> list[tuple[float, str]]:
    if not panel.log2_y:
        return [(t, format_tick(t)) for t in nice_ticks(lo, hi)]
    stride = max(1, math.ceil((hi - lo) / 6))
    return [(float(k), f"2^{k}") for k in range(math.ceil(lo), math.floor(hi) + 1, stride)]


def plot_panels(path: str, panels: list[Panel], x_label: str = "step", title: str = "", width: int = 960,
                panel_height: int = 320) -> None:
    """Draw `panels` stacked vertically, sharing one x axis, and write a PNG to `path`.

    Args:
        path: output file.
        panels: panels from top to bottom.
        x_label: label under the bottom axis.
        title: a line of text above the first panel ("" for none).
        width: image width in pixels.
        panel_height: height of each panel, including its title and tick labels.
    """
    line_h = (GLYPH_H + 3) * TEXT_SCALE
    top_pad = line_h + 10 if title else 10
    canvas = Canvas(width, top_pad + panel_height * len(panels) + line_h + 10)
    if title:
        canvas.text((width - canvas.text_width(title)) // 2, 8, title)
    all_x = [x for p in panels for s in p.series for x in s.xs] or [0.0, 1.0]
    # Start the axis at 0 for step counts (ticks 0, 50, 100, ... rather than 1, 51, ...).
    x_lo, x_hi = min(0.0, min(all_x)), max(all_x)
    if x_hi == x_lo:
        x_hi = x_lo + 1
    for index, panel in enumerate(panels):
        y0 = top_pad + index * panel_height
        canvas.text(LEFT_MARGIN, y0 + 2, panel.title)
        box = Box(LEFT_MARGIN, y0 + line_h + 4, width - RIGHT_MARGIN, y0 + panel_height - line_h - 8)
        _draw_panel(canvas, panel, box, x_lo, x_hi)
    bottom = top_pad + panel_height * len(panels)
    canvas.text((width - canvas.text_width(x_label)) // 2, bottom, x_label)
    with open(path, "wb") as f:
        f.write(canvas.to_png())


@dataclass(frozen=True)
class Box:
    """A plot area in pixels (inclusive edges)."""

    left: int
    top: int
    right: int
    bottom: int


def _draw_panel(canvas: Canvas, panel: Panel, box: Box, x_lo: float, x_hi: float) -> None:
    """Grid, ticks and labels, markers, the series, then the frame of one panel."""
    lo, hi = _panel_range(panel)

    def px(x: float) -> int:
        return round(box.left + (x - x_lo) / (x_hi - x_lo) * (box.right - box.left))

    def py(axis_value: float) -> int:
        return round(box.bottom - (axis_value - lo) / (hi - lo) * (box.bottom - box.top))

    for tick, label in _y_ticks(panel, lo, hi):
        y = py(tick)
        canvas.line(box.left, y, box.right, y, GRID)
        canvas.line(box.left - 6, y, box.left, y, BLACK)
        canvas.text(box.left - 10 - canvas.text_width(label), y - GLYPH_H, label)
    for tick in nice_ticks(x_lo, x_hi, target=8):
        x = px(tick)
        canvas.line(x, box.top, x, box.bottom, GRID)
        canvas.line(x, box.bottom, x, box.bottom + 6, BLACK)
        label = format_tick(tick)
        canvas.text(x - canvas.text_width(label) // 2, box.bottom + 10, label)
    for marker in panel.markers:
        canvas.line(px(marker), box.top + 1, px(marker), box.bottom - 1, MARKER_LINE)
        canvas.line(px(marker), box.top + 1, px(marker), box.top + 12, panel.marker_color, width=3)
    for series in panel.series:
        points = [(px(x), py(math.log2(y) if panel.log2_y else y)) for x, y in zip(series.xs, series.ys)
                  if math.isfinite(y) and (y > 0 or not panel.log2_y)]
        for (xa, ya), (xb, yb) in zip(points, points[1:]):
            if series.steps:
                canvas.line(xa, ya, xb, ya, series.color, width=2)
                canvas.line(xb, ya, xb, yb, series.color, width=2)
            else:
                canvas.line(xa, ya, xb, yb, series.color, width=2)
        if len(points) == 1:
            x, y = points[0]
            canvas.fill_rect(x - 2, y - 2, x + 2, y + 2, series.color)
    for x0, y0, x1, y1 in ((box.left, box.top, box.right, box.top), (box.left, box.bottom, box.right, box.bottom),
                           (box.left, box.top, box.left, box.bottom), (box.right, box.top, box.right, box.bottom)):
        canvas.line(x0, y0, x1, y1, BLACK)
