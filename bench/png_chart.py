"""A small PNG canvas drawn with the standard library only (the venv has neither matplotlib nor Pillow):
pixels, dots, lines, a 3x5 pixel font and a plot panel; bench/accuracy.py's and bench/export_scale.py's charts."""

from __future__ import annotations

import struct
import zlib

FONT = {  # 3x5 pixels per glyph, rows top to bottom; an upper-case letter without its own is drawn lower-case
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001111001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001001001001",
    "8": "111101111101111",
    "9": "111101111001111",
    ".": "000000000000010",
    ",": "000000000010100",
    ":": "000010000010000",
    "%": "101001010100101",
    "+": "000010111010000",
    "-": "000000111000000",
    "=": "000111000111000",
    ">": "100010001010100",
    "<": "001010100010001",
    "(": "010100100100010",
    ")": "010001001001010",
    "/": "001001010100100",
    " ": "000000000000000",
    "_": "000000000000111",
    "M": "101111111101101",
    "i": "010000010010010",
    "B": "110101110101110",
    "G": "111100101101111",
    "L": "100100100100111",
    "Q": "111101101111001",
    "K": "101110100110101",
    "R": "110101110101101",
    "S": "111100111001111",
    "T": "111010010010010",
    "a": "000111011101111",
    "d": "001001111101111",
    "w": "000101101111101",
    "x": "000101010101000",
    "p": "000111101111100",
    "l": "010010010010010",
    "e": "000111111100111",
    "r": "000111100100100",
    "s": "000111110011111",
    "y": "000101111001111",
    "m": "000111111101101",
    "o": "000111101101111",
    "h": "100100111101101",
    "t": "010111010010011",
    "n": "000110101101101",
    "b": "100100111101111",
    "c": "000111100100111",
    "g": "000111101111011",
    "k": "100101110110101",
    "v": "000101101101010",
    "f": "011100110100100",
    "F": "111100110100100",
    "u": "000101101101111",
    "q": "000111101111001",
    "j": "001000001001110",
    "z": "000111001100111",
}


BLUE, RED, GRID, BLACK = (30, 60, 200), (200, 30, 30), (210, 210, 210), (0, 0, 0)


def canvas(w: int, h: int) -> tuple:
    """A white w x h RGB image: (w, h, bytearray)."""
    return (w, h, bytearray(b"\xff" * w * h * 3))


def px(img, x, y, color) -> None:
    w, h, buf = img
    if 0 <= x < w and 0 <= y < h:
        buf[(y * w + x) * 3 : (y * w + x) * 3 + 3] = bytes(color)


def text(img, x, y, s, color, scale=2) -> None:
    for ch in s:
        glyph = FONT.get(ch, FONT.get(ch.lower(), "000000000000000"))
        for i, bit in enumerate(glyph):
            if bit == "1":
                for dy in range(scale):
                    for dx in range(scale):
                        px(img, x + (i % 3) * scale + dx, y + (i // 3) * scale + dy, color)
        x += 4 * scale


def dot(img, cx, cy, color, radius=4) -> None:
    for dx in range(-radius, radius + 1):
        for dy in range(-radius, radius + 1):
            if dx * dx + dy * dy <= radius * radius:
                px(img, cx + dx, cy + dy, color)


def line(img, x0, y0, x1, y1, color, dash=0) -> None:
    """A straight line, dashed every `dash` pixels if dash > 0."""
    steps = max(abs(x1 - x0), abs(y1 - y0), 1)
    for i in range(steps + 1):
        if dash and (i // dash) % 2:
            continue
        px(img, round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps), color)


def panel(img, box, title: str, x_label: str, x_top: int, y_top: float, ours: list, theirs: list) -> None:
    """One plot in `box` (left, top, right, bottom), x from 0 to `x_top`, y from 0 to `y_top` rounded up:
    `ours` [(x, y, label)] as a blue line of labelled dots; `theirs` [(x, (low, high), label)] red, a
    range as a bar, high None ("more than low") as an arrow up."""
    left, top, right, bottom = box
    step = _tick_step(y_top)
    ticks = int(-(-y_top // step))
    y_top = ticks * step
    sx = lambda v: int(left + v / x_top * (right - left))
    sy = lambda v: int(bottom - min(v, y_top) / y_top * (bottom - top))
    line(img, left, bottom, right, bottom, BLACK)
    line(img, left, top, left, bottom, BLACK)
    for i in range(ticks + 1):
        line(img, left + 1, sy(i * step), right, sy(i * step), GRID, dash=3)
        text(img, left - 8 - 8 * len(f"{i * step:.0f}"), sy(i * step) - 5, f"{i * step:.0f}", BLACK)
    for x in range(x_top + 1):
        text(img, sx(x) - 4, bottom + 8, str(x), BLACK)
    text(img, right - 8 * len(x_label) - 40, bottom + 26, x_label, BLACK)
    text(img, left + 10, top - 20, title, BLACK)
    points = sorted(ours)
    for (x0, y0, _), (x1, y1, _) in zip(points, points[1:]):
        line(img, sx(x0), sy(y0), sx(x1), sy(y1), BLUE)
    for x, y, label in points:
        dot(img, sx(x), sy(y), BLUE)
        text(img, sx(x) + 8, sy(y) - 14, label, BLUE)
    for n, (x, (low, high), label) in enumerate(theirs):
        cx = sx(x)
        dot(img, cx, sy(low), RED)
        if high is None:
            line(img, cx, sy(low), cx, sy(low) - 24, RED)
            line(img, cx - 4, sy(low) - 18, cx, sy(low) - 24, RED)
            line(img, cx + 4, sy(low) - 18, cx, sy(low) - 24, RED)
        else:
            line(img, cx, sy(low), cx, sy(high), RED)
            dot(img, cx, sy(high), RED)
        y = sy(low if high is None else high) + (14 * n if high is None else -5)  # labels of one point stacked
        text(img, cx - 10 - 8 * len(label), y, label, RED)


def _tick_step(top: float) -> float:
    """A round tick step (1, 2 or 5 x 10^k) that divides 0..top into at most six intervals."""
    step = 1.0
    while top / step > 6:
        step *= 2.5 if str(step)[0] == "2" else 2  # 1, 2, 5, 10, 20, 50, ...
    return step


def png(img) -> bytes:
    w, h, buf = img
    raw = b"".join(b"\x00" + bytes(buf[y * w * 3 : (y + 1) * w * 3]) for y in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )
