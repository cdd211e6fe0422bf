"""A bar chart as a PNG file in pure Python (struct + zlib), so the comparison's results can
carry a picture without matplotlib in the environment."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path


def png_bar_chart(path: Path, groups: list[tuple[str, list[float | None]]], colors) -> None:
    """A dependency-free PNG: one cluster of bars per group (value / max of its panel).

    Two panels stacked: groups[i][1] holds [saved_jax, saved_torch, tps_jax, tps_torch,
    tps_compile]; the top panel draws the saved bytes, the bottom the tokens/s.
    """
    W, H, pad, panel_h = max(200, 8 + 44 * len(groups)), 260, 8, 120
    img = [[(255, 255, 255)] * W for _ in range(H)]

    def rect(x0, y0, x1, y1, c):
        for y in range(max(y0, 0), min(y1, H)):
            row = img[y]
            for x in range(max(x0, 0), min(x1, W)):
                row[x] = c

    for panel, idx in ((0, (0, 1)), (1, (2, 3, 4))):
        top = panel * (panel_h + 10) + 5
        vals = [g[1][i] for g in groups for i in idx if g[1][i] is not None]
        vmax = max(vals) if vals else 1.0
        rect(0, top + panel_h, W, top + panel_h + 1, (0, 0, 0))
        for gi, (_, v) in enumerate(groups):
            for k, i in enumerate(idx):
                if v[i] is None:
                    continue
                h = int(round((panel_h - 2) * v[i] / vmax))
                x0 = pad + gi * 44 + k * 12
                rect(x0, top + panel_h - h, x0 + 10, top + panel_h, colors[i])
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in img)

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    path.write_bytes(png)
