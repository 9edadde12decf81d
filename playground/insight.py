"""The playground's "why this answer" and "compare two models" views: what they show, as HTML.

`why_html` draws an explanation (bert_engine.runtime.explain) as highlights over the input's own text:
green where a token raised the explained number, red where it lowered it, the stronger the darker.
`differences` and `compare_html` set two models' results for one input side by side and mark where
they disagree: a differing label, word, answer or count is a disagreement; a differing number only a
different score.
"""

from __future__ import annotations

import html
import math
import os
from typing import Any

from bert_engine import ui
from bert_engine.runtime.explain import METHODS

RAISE, LOWER = (22, 163, 74), (220, 38, 38)  # green, red
MAX_MIX = 0.6  # the strongest highlight: 60 % colour on white (dark text on it reads >= 4.5:1, see tests)
FAINT = 0.05  # attributions under 5 % of the largest are not coloured
SCORE_TOLERANCE = 1e-3  # numbers closer than this count as equal


def mix(colour: tuple[int, int, int], share: float) -> tuple[int, int, int]:
    """`colour` laid over white at `share` (0..1), as an opaque colour."""
    return tuple(round(255 + (c - 255) * share) for c in colour)


def _number(value: float, what: str) -> str:
    return ui.percent(value) if what == "probability" else f"{value:+.3f}"


def why_html(explained: dict[str, Any], inputs: dict[str, Any]) -> str:
    """The explanation as HTML: per explained number, a heading with its value at the input and at the
    baseline, the input's texts with each token highlighted by its attribution, and how well the
    attributions add up (completeness); a line on the method, its cost and the model it ran on."""
    method = METHODS[explained["method"]] + (f" ({explained['steps']} steps)" if explained["method"] ==
                                             "integrated_gradients" else "")
    if not explained["targets"]:
        return ui.empty_state("Nothing to explain in this answer (no label, entity, answer or mask was predicted).")
    tokens = {row["row"]: row["tokens"] for row in explained["rows"]}
    parts = ['<div class="be-why">',
             f'<p class="be-why-legend"><span class="be-mark" style="background:{_css(mix(RAISE, MAX_MIX))}">green</span> raised the number, '
             f'<span class="be-mark" style="background:{_css(mix(LOWER, MAX_MIX))}">red</span> lowered it; the darker, the more. Hover a word '
             'for its share.</p>']
    for target in explained["targets"]:
        what = target["what"]
        difference = target["score"] - target["baseline_score"]
        gap = target["completeness_gap"]
        share = abs(gap) / abs(difference) if difference else 0.0
        check = ("they add up" if share <= 0.05 or abs(gap) < 1e-3 else
                 "more steps would make them add up more closely" if explained["method"] == "integrated_gradients"
                 else "gradient x input does not promise that they add up")
        parts.append(f'<h4 class="be-why-title">{html.escape(target["name"])}: {html.escape(what)} '
                     f'{_number(target["score"], what)} (blank text: {_number(target["baseline_score"], what)})</h4>')
        parts.append(_highlights(tokens[target["row"]], target["attributions"], inputs))
        parts.append(f'<p class="be-why-sum">The attributions sum to {target["sum"]:+.4f}; the {html.escape(what)} '
                     f'moved {difference:+.4f} from the blank text to yours (gap {gap:+.4f}): {check}.</p>')
    if explained.get("left_out"):
        parts.append(f'<p class="be-why-sum">{explained["left_out"]} more not explained (the first '
                     f'{len(explained["targets"])} are).</p>')
    parts.append(f'<p class="be-why-sum">{html.escape(method)} over the word embeddings, from {html.escape(explained["baseline"])}; '
                 f'{explained["seconds"]:.2f} s, {explained["flops"] / 1e9:,.0f} GFLOP; '
                 f'on {html.escape(explained["explained_on"] or "")}.</p></div>')
    return "".join(parts)


def _css(rgb: tuple[int, int, int]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def _highlights(tokens: list[dict[str, Any]], attributions: list[float], inputs: dict[str, Any]) -> str:
    """Each input field's text with its tokens' spans highlighted (the text between tokens as it is)."""
    peak = max((abs(a) for a in attributions), default=0.0) or 1.0
    fields: dict[str, list[tuple[int, int, float, str]]] = {}
    for token, value in zip(tokens, attributions):
        if token["field"] is not None and token["start"] is not None:
            fields.setdefault(token["field"], []).append((token["start"], token["end"], value, token["token"]))
    out = []
    for field, spans in fields.items():
        text = str(inputs.get(field, ""))
        pieces, at = [], 0
        for start, end, value, piece in sorted(spans):
            if start < at or end > len(text):
                continue
            pieces.append(html.escape(text[at:start]))
            strength = abs(value) / peak
            word = html.escape(text[start:end])
            title = html.escape(f"{piece}: {value:+.4f} ({100 * value / peak:+.0f} % of the largest)")
            if strength < FAINT:
                pieces.append(f'<span title="{title}">{word}</span>')
            else:
                colour = mix(RAISE if value > 0 else LOWER, 0.12 + (MAX_MIX - 0.12) * strength)
                pieces.append(f'<span class="be-mark" title="{title}" style="background:{_css(colour)}">{word}</span>')
            at = end
        pieces.append(html.escape(text[at:]))
        label = f'<span class="be-why-field">{html.escape(field)}</span> ' if len(fields) > 1 else ""
        out.append(f'<p class="be-why-text">{label}{"".join(pieces)}</p>')
    return "".join(out)


# -- compare -------------------------------------------------------------------------------------------

def _leaves(value: Any, path: str = "") -> dict[str, Any]:
    """A JSON-like value flattened to {path: leaf} ("labels[0].score": 0.98)."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_leaves(item, f"{path}.{key}" if path else str(key)))
        return out
    if isinstance(value, (list, tuple)):
        out = {f"{path}.length" if path else "length": len(value)}
        for i, item in enumerate(value):
            out.update(_leaves(item, f"{path}[{i}]"))
        return out
    return {path: value}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def differences(a: Any, b: Any, limit: int = 30) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(disagreements, score differences) between two results: leaves that differ in anything but a
    number (a label, a word, an answer, a count of items), and numbers that differ by more than
    SCORE_TOLERANCE, largest first; at most `limit` of each."""
    left, right = _leaves(a), _leaves(b)
    disagree, scores = [], []
    for path in [*left, *(p for p in right if p not in left)]:  # A's order, then what only B has
        x, y = left.get(path, "—"), right.get(path, "—")
        if _is_number(x) and _is_number(y) and not path.endswith("length"):
            if abs(x - y) > SCORE_TOLERANCE and math.isfinite(x - y):
                scores.append({"path": path, "a": x, "b": y, "difference": round(y - x, 6)})
        elif x != y:
            disagree.append({"path": path, "a": x, "b": y})
    scores.sort(key=lambda d: -abs(d["difference"]))
    return disagree[:limit], scores[:limit]


def compare_html(compared: dict[str, Any]) -> str:
    """Both models' answers side by side, then where they disagree (marked) or, when they agree, their
    largest score differences."""
    cards = "".join(
        f'<div class="be-card"><div class="be-card-title">{html.escape(side["label"])}: {html.escape(side["model"])} · '
        f'{html.escape(side["precision"])} · {side["seconds"]:.2f} s'
        f'{" · <strong>head not trained</strong> (its answers are chance)" if side.get("untrained_head") else ""}</div>'
        f'<div class="be-card-answer">{html.escape(side["brief"])}</div></div>' for side in (compared["a"], compared["b"]))
    disagree, scores = compared["disagreements"], compared["score_differences"]
    if disagree:
        verdict = (f'<p class="be-compare-verdict"><strong>They disagree</strong> on {len(disagree)} '
                   f'point{"s" if len(disagree) != 1 else ""} (marked ≠ below).</p>')
    else:
        verdict = '<p class="be-compare-verdict"><strong>They agree</strong> on every answer' + (
            f"; scores differ by up to {max(abs(d['difference']) for d in scores):.4f}.</p>" if scores else
            ", and every score is within 0.001.</p>")
    # (the ≠ column only where something differs: empty and unheaded, it read as a broken table)
    mark = (lambda cell: f"<td>{cell}</td>") if disagree else (lambda cell: "")
    rows = [f'<tr class="be-disagree">{mark("≠")}<td>{html.escape(d["path"])}</td>'
            + "".join(f"<td>{html.escape(cell)}</td>" for cell in _shown_pair(d["a"], d["b"])) + "</tr>"
            for d in disagree]
    rows += [f'<tr>{mark("")}<td>{html.escape(d["path"])}</td><td>{_shown(d["a"])}</td><td>{_shown(d["b"])}</td></tr>'
             for d in scores[:10]]
    head = '<th title="the answers differ">≠</th>' if disagree else ""
    table = (f'<div class="table-wrap"><table class="be-compare"><thead><tr>{head}<th>where</th><th>A</th><th>B</th>'
             f'</tr></thead><tbody>{"".join(rows)}</tbody></table></div>') if rows else ""
    return f'<div class="be-cards">{cards}</div>{verdict}{table}'


SHOWN_CHARS = 80  # a compare cell's most characters


def _shown(value: Any) -> str:
    if _is_number(value):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 1] + "…"


def _shown_pair(a: Any, b: Any) -> tuple[str, str]:
    """Two differing values as a compare row shows them: long texts (a fill-mask sequence, a summary) cut
    around where they first differ, not at their start, which they may share for pages."""
    if not (isinstance(a, str) and isinstance(b, str)) or max(len(a), len(b)) <= SHOWN_CHARS:
        return _shown(a), _shown(b)
    same = len(os.path.commonprefix([a, b]))
    start = max(0, same - SHOWN_CHARS // 3)
    if start and (space := a.rfind(" ", max(0, start - 15), start)) >= 0:
        start = space + 1  # at a word's start where one is near

    def cut(text: str) -> str:
        lead = "…" if start else ""
        room = SHOWN_CHARS - len(lead)
        part = text[start:]
        return lead + (part if len(part) <= room else part[:room - 1] + "…")

    return cut(a), cut(b)
