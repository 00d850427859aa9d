"""A line plot written as a PNG with numpy and zlib alone: axes, ticks, labelled lines, a legend.

    line_plot("loss.png", [("1 node", xs, ys), ("3 nodes", xs3, ys3)], x_label="samples", y_label="loss")

Text is drawn with a built-in 5x7 bitmap font (digits, lowercase letters, a few signs; capitals are drawn as
lowercase). `encode_png` is the whole file format: an RGB image as 8-bit samples, each row after filter byte 0.
"""
from __future__ import annotations

import math
import struct
import zlib
from typing import Sequence

import numpy as np

# each glyph is 7 rows of 5 pixels, a row one base-32 digit whose 5 bits are the pixels left to right
_FONT = {
    "0": "ehjlphe", "1": "4c4444e", "2": "eh1248v", "3": "v2421he", "4": "26aiv22", "5": "vgu11he", "6": "68guhhe",
    "7": "v124888", "8": "ehhehhe", "9": "ehhf12c", ".": "00000cc", "-": "000v000", " ": "0000000", "(": "2488842",
    ")": "8422248", ",": "0000c48", "/": "01248g0", ":": "0cc0cc0", "=": "00v0v00", "%": "op248j3", "a": "00e1fhf",
    "b": "ggmphhu", "c": "00egghe", "d": "11djhhf", "e": "00ehvge", "f": "698s888", "g": "0fhhf1e", "h": "ggmphhh",
    "i": "40c444e", "j": "20622ic", "k": "ggikoki", "l": "c44444e", "m": "00qllhh", "n": "00mphhh", "o": "00ehhhe",
    "p": "00uhugg", "q": "00djf11", "r": "00mpggg", "s": "00ege1u", "t": "88s8896", "u": "00hhhjd", "v": "00hhha4",
    "w": "00hhlla", "x": "00ha4ah", "y": "00hhf1e", "z": "00v248v",
}
COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]  # one per line, in order
BLACK, GREY, WHITE = (0, 0, 0), (225, 225, 225), (255, 255, 255)


def encode_png(rgb: np.ndarray) -> bytes:
    """The PNG file of an (H, W, 3) uint8 image."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an (H, W, 3) uint8 array, got {rgb.dtype} {rgb.shape}")
    h, w, _ = rgb.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, 3 * w)], axis=1)  # filter 0 before each row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8 bits per sample, colour type 2 (RGB), no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw.tobytes(), 9))
            + chunk(b"IEND", b""))


def text_mask(text: str) -> np.ndarray:
    """(7, 6 * len(text)) booleans: the text in the 5x7 font, one blank column after each glyph."""
    cols = []
    for ch in text.lower():
        if ch not in _FONT:
            raise ValueError(f"no glyph for {ch!r} in {text!r}")
        bits = np.array([[(int(d, 32) >> (4 - i)) & 1 for i in range(5)] for d in _FONT[ch]], dtype=bool)
        cols.append(np.concatenate([bits, np.zeros((7, 1), bool)], axis=1))
    return np.concatenate(cols, axis=1) if cols else np.zeros((7, 0), bool)


def draw_text(img: np.ndarray, text: str, x: int, y: int, color=BLACK, anchor: str = "left", vertical=False):
    """Text with its top left at (x, y); anchor "center" or "right" moves it left by half or all of its width;
    `vertical` turns it a quarter to the left (read bottom to top), centred on y."""
    mask = text_mask(text)
    if vertical:
        mask = np.rot90(mask)
        y -= mask.shape[0] // 2
    elif anchor != "left":
        x -= mask.shape[1] // (2 if anchor == "center" else 1)
    region = img[y:y + mask.shape[0], x:x + mask.shape[1]]
    region[mask[:region.shape[0], :region.shape[1]]] = color


def draw_line(img: np.ndarray, x0: float, y0: float, x1: float, y1: float, color, width: int = 2):
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    xs = np.rint(np.linspace(x0, x1, n)).astype(int)
    ys = np.rint(np.linspace(y0, y1, n)).astype(int)
    for dx in range(width):
        for dy in range(width):
            ok = (ys + dy < img.shape[0]) & (xs + dx < img.shape[1])
            img[ys[ok] + dy, xs[ok] + dx] = color


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [i * step for i in range(math.floor(lo / step), math.ceil(hi / step) + 1)]


def line_plot(path, series: Sequence[tuple[str, Sequence[float], Sequence[float]]], x_label: str, y_label: str,
              title: str = "", size: tuple[int, int] = (720, 440)) -> np.ndarray:
    """Write the plot to `path` (None: write nothing); returns the image drawn."""
    w, h = size
    left, right, top, bottom = 70, 20, 30, 50
    img = np.full((h, w, 3), WHITE, np.uint8)
    xs_all = [x for _, xs, _ in series for x in xs]
    ys_all = [y for _, _, ys in series for y in ys]
    xt, yt = nice_ticks(min(xs_all), max(xs_all)), nice_ticks(min(ys_all), max(ys_all))
    px = lambda x: left + (x - xt[0]) / (xt[-1] - xt[0]) * (w - left - right - 1)  # noqa: E731
    py = lambda y: h - bottom - 1 - (y - yt[0]) / (yt[-1] - yt[0]) * (h - top - bottom - 1)  # noqa: E731
    for t in xt:
        draw_line(img, px(t), top, px(t), h - bottom - 1, GREY, 1)
        draw_text(img, f"{t:g}", int(px(t)), h - bottom + 8, anchor="center")
    for t in yt:
        draw_line(img, left, py(t), w - right - 1, py(t), GREY, 1)
        draw_text(img, f"{t:g}", left - 6, int(py(t)) - 3, anchor="right")
    draw_line(img, left, top, left, h - bottom - 1, BLACK, 1)
    draw_line(img, left, h - bottom - 1, w - right - 1, h - bottom - 1, BLACK, 1)
    draw_text(img, x_label, (left + w - right) // 2, h - 20, anchor="center")
    draw_text(img, y_label, 12, (top + h - bottom) // 2, vertical=True)
    draw_text(img, title, (left + w - right) // 2, 10, anchor="center")
    for i, (label, xs, ys) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        pts = [(px(x), py(y)) for x, y in zip(xs, ys)]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            draw_line(img, x0, y0, x1, y1, color)
        for x, y in pts:
            img[int(y) - 2:int(y) + 3, int(x) - 2:int(x) + 3] = color
        ly = top + 12 + 14 * i  # legend, top right
        draw_line(img, w - right - 130, ly + 3, w - right - 110, ly + 3, color)
        draw_text(img, label, w - right - 104, ly, color)
    if path is not None:
        with open(path, "wb") as f:
            f.write(encode_png(img))
    return img
