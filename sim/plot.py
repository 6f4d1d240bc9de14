"""The timeline as a PNG: stacked panels (queue depth, KV usage, replicas, TTFT p50) over virtual time.

matplotlib is not a dependency of tokenfleet, so this draws with numpy into an RGB array and writes the PNG
itself (zlib-compressed scanlines, the format's minimum: IHDR, IDAT, IEND). Labels use a 5x7 bitmap font.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

# 5x7 glyphs, one int per row, bit 4 = leftmost pixel.
_FONT = {
    "0": (14, 17, 19, 21, 25, 17, 14),
    "1": (4, 12, 4, 4, 4, 4, 14),
    "2": (14, 17, 1, 2, 4, 8, 31),
    "3": (31, 2, 4, 2, 1, 17, 14),
    "4": (2, 6, 10, 18, 31, 2, 2),
    "5": (31, 16, 30, 1, 1, 17, 14),
    "6": (6, 8, 16, 30, 17, 17, 14),
    "7": (31, 1, 2, 4, 8, 8, 8),
    "8": (14, 17, 17, 14, 17, 17, 14),
    "9": (14, 17, 17, 15, 1, 2, 12),
    "A": (14, 17, 17, 31, 17, 17, 17),
    "B": (30, 17, 17, 30, 17, 17, 30),
    "C": (14, 17, 16, 16, 16, 17, 14),
    "D": (28, 18, 17, 17, 17, 18, 28),
    "E": (31, 16, 16, 30, 16, 16, 31),
    "F": (31, 16, 16, 30, 16, 16, 16),
    "G": (14, 17, 16, 23, 17, 17, 15),
    "H": (17, 17, 17, 31, 17, 17, 17),
    "I": (14, 4, 4, 4, 4, 4, 14),
    "J": (7, 2, 2, 2, 2, 18, 12),
    "K": (17, 18, 20, 24, 20, 18, 17),
    "L": (16, 16, 16, 16, 16, 16, 31),
    "M": (17, 27, 21, 21, 17, 17, 17),
    "N": (17, 17, 25, 21, 19, 17, 17),
    "O": (14, 17, 17, 17, 17, 17, 14),
    "P": (30, 17, 17, 30, 16, 16, 16),
    "Q": (14, 17, 17, 17, 21, 18, 13),
    "R": (30, 17, 17, 30, 20, 18, 17),
    "S": (15, 16, 16, 14, 1, 1, 30),
    "T": (31, 4, 4, 4, 4, 4, 4),
    "U": (17, 17, 17, 17, 17, 17, 14),
    "V": (17, 17, 17, 17, 17, 10, 4),
    "W": (17, 17, 17, 21, 21, 21, 10),
    "X": (17, 17, 10, 4, 10, 17, 17),
    "Y": (17, 17, 17, 10, 4, 4, 4),
    "Z": (31, 1, 2, 4, 8, 16, 31),
    " ": (0,) * 7,
    ".": (0, 0, 0, 0, 0, 12, 12),
    ":": (0, 12, 12, 0, 12, 12, 0),
    "/": (0, 1, 2, 4, 8, 16, 0),
    "%": (24, 25, 2, 4, 8, 19, 3),
    "-": (0, 0, 0, 31, 0, 0, 0),
    "(": (2, 4, 8, 8, 8, 4, 2),
    ")": (8, 4, 2, 2, 2, 4, 8),
    "=": (0, 0, 31, 0, 31, 0, 0),
    "<": (2, 4, 8, 16, 8, 4, 2),
    "+": (0, 4, 4, 31, 4, 4, 0),
    ",": (0, 0, 0, 0, 12, 4, 8),
}
_GLYPHS = {
    ch: np.array([[(row >> (4 - i)) & 1 for i in range(5)] for row in rows], dtype=bool)
    for ch, rows in _FONT.items()
}

PANELS = (
    ("waiting", "QUEUE DEPTH (WAITING + ROUTER QUEUE)", (200, 60, 40)),
    ("kv_usage", "KV CACHE USAGE (MEAN OF READY REPLICAS)", (40, 110, 200)),
    ("replicas", "REPLICAS (ALL) AND READY", (40, 150, 60)),
    ("ttft_p50", "TTFT P50 S (FIRST TOKENS IN EACH INTERVAL)", (150, 60, 170)),
)


def _text(img: np.ndarray, x: int, y: int, text: str, color=(30, 30, 30), scale: int = 2) -> None:
    for ch in text.upper():
        glyph = _GLYPHS.get(ch, _GLYPHS[" "])
        big = np.kron(glyph, np.ones((scale, scale), dtype=bool))
        h, w = big.shape
        if y + h <= img.shape[0] and x + w <= img.shape[1]:
            img[y : y + h, x : x + w][big] = color
        x += 6 * scale


def _line(img: np.ndarray, xs: np.ndarray, ys: np.ndarray, color) -> None:
    """Connect consecutive points (integer pixel coordinates) with 2-pixel-wide segments."""
    for x0, y0, x1, y1 in zip(xs[:-1], ys[:-1], xs[1:], ys[1:], strict=True):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        px = np.linspace(x0, x1, n).round().astype(int)
        py = np.linspace(y0, y1, n).round().astype(int)
        for dx in (0, 1):
            img[np.clip(py, 0, img.shape[0] - 1), np.clip(px + dx, 0, img.shape[1] - 1)] = color


def render(timeline: dict, title: str, width: int = 1000, panel_h: int = 150) -> np.ndarray:
    margin_l, margin_r, top, gap = 70, 20, 40, 46
    height = top + len(PANELS) * (panel_h + gap)
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    _text(img, margin_l, 12, title)
    t = np.asarray(timeline["t"], dtype=float)
    t_max = float(t.max()) if len(t) and t.max() > 0 else 1.0
    plot_w = width - margin_l - margin_r
    for i, (key, label, color) in enumerate(PANELS):
        y0 = top + i * (panel_h + gap) + 24
        _text(img, margin_l, y0 - 20, label, scale=2)
        img[y0 : y0 + panel_h, margin_l] = (120, 120, 120)
        img[y0 + panel_h, margin_l : margin_l + plot_w] = (120, 120, 120)
        series = [np.asarray(timeline[key], dtype=float)]
        if key == "replicas":
            series.append(np.asarray(timeline["ready"], dtype=float))
        v_max = max((float(s.max()) for s in series if len(s)), default=0.0)
        v_max = v_max if v_max > 0 else 1.0
        _text(img, 4, y0 + 10, f"{v_max:.3g}", scale=1)
        _text(img, 4, y0 + panel_h - 7, "0", scale=1)
        xs = margin_l + 1 + (t / t_max * (plot_w - 2)).round().astype(int)
        for j, s in enumerate(series):
            if len(s) < 2:
                continue
            ys = (y0 + panel_h - 1 - s / v_max * (panel_h - 12)).round().astype(int)  # headroom at the top
            _line(img, xs, ys, color if j == 0 else tuple(c // 2 for c in color))
    last = top + len(PANELS) * (panel_h + gap) - gap + 28
    _text(img, margin_l, min(last, height - 16), f"0 - {t_max:.0f} S (VIRTUAL TIME)", scale=1)
    return img


def write_png(path: Path, img: np.ndarray) -> None:
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )
    Path(path).write_bytes(png)


def timeline_png(results: dict, path: Path) -> None:
    fleet = results["fleet"]
    title = (
        f"{results['config']['model']} ON {fleet['cost_model']}  {results['config']['routing']['strategy']}"
    )
    write_png(path, render(results["timeline"], title))
