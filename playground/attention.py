"""The Attention tab's pictures: one head (or the mean of a layer's heads) as a labelled heatmap, every
head of a layer as a grid of small heatmaps (in the spirit of BertViz's model view), and the strongest
links of each token as text, which reads on a touch screen where hovering does not exist.

Images are drawn with Pillow (a Gradio dependency), so their size follows the input, not a table's
styles: cells shrink as the input grows and the picture stays within about 720 px.
"""

from __future__ import annotations

import html
import math

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

MAX_TOKENS = 48  # shown at once (labels >= 11 px in PLOT_PX); a longer input is shown a window at a time
MAX_LABEL_CHARS = 14
PLOT_PX = 640  # the heatmap's side, labels not counted
THUMB_PX = 150  # each head's side in the grid
GRID_COLUMNS = 4
BLUE = np.array([37, 99, 235], dtype=np.float32)  # the cell colour at the matrix's peak; white at 0
INK = (31, 41, 55)


def cut(tokens: list[str], weights: list[torch.Tensor], start: int = 0) -> tuple[list[str], list[torch.Tensor], str]:
    """MAX_TOKENS tokens from `start` and their attention among themselves (labels stay readable: at
    most MAX_TOKENS rows in PLOT_PX), with a notice when that left any out."""
    asked = int(start)
    if len(tokens) <= MAX_TOKENS:  # (a start past a short input was dropped without a word)
        return tokens, weights, (f"The input's {len(tokens)} tokens are all shown (“From token” {asked} is past "
                                 "them)." if asked >= len(tokens) else "")
    start = max(0, min(asked, len(tokens) - MAX_TOKENS))
    stop = start + MAX_TOKENS
    notice = (f"Showing tokens {start}-{stop - 1} of {len(tokens)} (move “From token” for the others); rows "
              "leave out the attention to tokens outside them." + (
                  f" (“From token” {asked} is past the last window's start.)" if asked > start else ""))
    return tokens[start:stop], [w[:, start:stop, start:stop] for w in weights], notice


def head_matrix(weights: list[torch.Tensor], layer: int, head: int | None) -> torch.Tensor:
    """One (T, T) matrix: layer `layer`'s head `head`, or the mean of its heads (head None)."""
    return weights[layer].mean(0) if head is None else weights[layer][head]


def _cells(matrix: torch.Tensor, cell: int) -> Image.Image:
    values = matrix.float().clamp(min=0).numpy()
    peak = float(values.max()) or 1.0
    shade = (values / peak)[..., None]
    rgb = (255 - shade * (255 - BLUE)).round().astype(np.uint8)
    image = Image.fromarray(rgb, "RGB")
    return image.resize((image.width * cell, image.height * cell), Image.Resampling.NEAREST)


def _label(token: str) -> str:
    return token if len(token) <= MAX_LABEL_CHARS else token[:MAX_LABEL_CHARS - 1] + "…"


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except (ImportError, OSError, TypeError):  # a Pillow without FreeType: the small bitmap font
        return ImageFont.load_default()


BUTTONS_PX = 64


def heatmap_image(tokens: list[str], matrix: torch.Tensor) -> Image.Image:
    """The (T, T) matrix as a heatmap with the tokens along both sides: rows are the tokens attending
    (queries), columns the tokens they attend to (keys); white is 0, full blue the matrix's peak."""
    n = len(tokens)
    cell = max(4, min(28, PLOT_PX // max(1, n)))
    font = _font(max(8, min(13, cell - 2)))
    labels = [_label(t) for t in tokens]
    margin = max(int(font.getlength(label)) for label in labels) + 8 if labels else 8
    plot = _cells(matrix, cell)
    # white on the right: Gradio's download and fullscreen buttons sit over the top-right corner, where the
    # last column's label ([SEP]) would be
    image = Image.new("RGB", (margin + plot.width + BUTTONS_PX, margin + plot.height + 4), "white")
    image.paste(plot, (margin, margin))
    draw = ImageDraw.Draw(image)
    top = Image.new("RGB", (margin, plot.width), "white")  # the column labels, drawn then turned upright
    top_draw = ImageDraw.Draw(top)
    for i, label in enumerate(labels):
        middle = margin + i * cell + cell // 2
        draw.text((margin - 4, middle), label, fill=INK, font=font, anchor="rm")
        top_draw.text((4, i * cell + cell // 2), label, fill=INK, font=font, anchor="lm")
    image.paste(top.rotate(90, expand=True), (margin, 0))
    draw.rectangle((margin - 1, margin - 1, margin + plot.width, margin + plot.height), outline=(209, 213, 219))
    return image


def head_grid_image(weights: list[torch.Tensor], layer: int) -> Image.Image:
    """Every head of one layer as a small heatmap, GRID_COLUMNS to a row, each titled with its number."""
    heads = weights[layer]
    count, n = heads.shape[0], heads.shape[-1]
    cell = max(1, THUMB_PX // max(1, n))
    side = cell * n
    font = _font(12)
    title = 18
    columns = min(GRID_COLUMNS, count)
    rows = math.ceil(count / columns)
    pad, top = 10, 30  # the top row leaves room for the image's label, which Gradio draws over the corner
    image = Image.new("RGB", (columns * (side + pad) + pad, top + rows * (side + title + pad)), "white")
    draw = ImageDraw.Draw(image)
    for h in range(count):
        x = pad + (h % columns) * (side + pad)
        y = top + (h // columns) * (side + title + pad)
        draw.text((x, y), f"head {h}", fill=INK, font=font)
        image.paste(_cells(heads[h], cell), (x, y + title))
        draw.rectangle((x - 1, y + title - 1, x + side, y + title + side), outline=(209, 213, 219))
    return image


def strongest_links(tokens: list[str], matrix: torch.Tensor, k: int = 3) -> str:
    """Each token's k strongest links as text ("token -> key 41 %"): readable without hovering."""
    k = min(k, len(tokens))
    top = torch.topk(matrix.float(), k, dim=-1)
    rows = []
    for i, token in enumerate(tokens):
        links = ", ".join(f"{html.escape(tokens[j])} <span class='be-pct'>{float(w) * 100:.0f} %</span>"
                          for w, j in zip(top.values[i].tolist(), top.indices[i].tolist(), strict=True))
        rows.append(f"<tr><th>{i}</th><td>{html.escape(token)}</td><td>{links}</td></tr>")
    return ("<div class='attention-links'><table><thead><tr><th>#</th><th>token</th>"
            f"<th>attends most to</th></tr></thead><tbody>{''.join(rows)}</tbody></table></div>")
