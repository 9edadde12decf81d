"""The playground's why and compare views as HTML (playground/insight.py): marks, escaping, differences."""

from bert_engine import ui
from playground import insight


def _explained(text: str) -> dict:
    tokens = [{"token": "[CLS]", "field": None, "start": None, "end": None},
              {"token": "<img", "field": "text", "start": 0, "end": 4},
              {"token": "good", "field": "text", "start": len(text) - 4, "end": len(text)},
              {"token": "[SEP]", "field": None, "start": None, "end": None}]
    return {"method": "integrated_gradients", "steps": 32, "baseline": "blank", "seconds": 0.1, "flops": 1e9,
            "explained_on": "the served model", "left_out": 0, "rows": [{"row": 0, "tokens": tokens}],
            "targets": [{"name": "POSITIVE <b>", "what": "probability", "row": 0, "score": 0.9, "baseline_score": 0.5,
                         "attributions": [0.0, -0.1, 0.5, 0.0], "sum": 0.4, "completeness_gap": 0.0}]}


def test_why_marks_each_token_by_sign_and_strength_and_escapes_the_text():
    text = '<img src=x onerror="alert(1)"> so good'
    page = insight.why_html(_explained(text), {"text": text})
    assert "<img src" not in page and "&lt;img" in page and "POSITIVE &lt;b&gt;" in page  # text, never HTML
    green, red = insight.mix(insight.RAISE, insight.MAX_MIX), insight.mix(insight.LOWER, 0.12 + 0.48 * 0.2)
    assert f"background:#{green[0]:02x}{green[1]:02x}{green[2]:02x}" in page  # the strongest: the darkest green
    assert f"background:#{red[0]:02x}{red[1]:02x}{red[2]:02x}" in page  # a fifth as strong, lowering: pale red
    assert "they add up" in page and "probability 90 %" in page


def test_the_strongest_highlight_keeps_its_dark_text_readable():
    for colour in (insight.RAISE, insight.LOWER):
        assert ui.contrast(insight.mix(colour, insight.MAX_MIX), (0x11, 0x18, 0x27)) >= 4.5


def test_differences_tell_a_different_answer_from_a_different_score():
    a = {"label": "POSITIVE", "score": 0.98, "labels": [{"label": "POSITIVE", "score": 0.98}]}
    b = {"label": "NEGATIVE", "score": 0.51, "labels": [{"label": "NEGATIVE", "score": 0.51},
                                                         {"label": "POSITIVE", "score": 0.49}]}
    disagree, scores = insight.differences(a, b)
    assert [d["path"] for d in disagree] == ["label", "labels.length", "labels[0].label", "labels[1].label",
                                             "labels[1].score"]  # a score only B has is a disagreement too
    assert scores[0]["path"] in ("score", "labels[0].score") and abs(scores[0]["difference"]) > 0.4
    same, tiny = insight.differences(a, {**a, "score": 0.9805})
    assert same == [] and tiny == []  # within 0.001: equal
    page = insight.compare_html({"a": {"label": "A", "model": "m", "precision": "float32", "seconds": 0.1,
                                       "brief": "POSITIVE 98 %"},
                                 "b": {"label": "B", "model": "m", "precision": "int8", "seconds": 0.1,
                                       "brief": "NEGATIVE 51 %", "untrained_head": True},
                                 "disagreements": disagree, "score_differences": scores})
    assert "They disagree" in page and page.count('class="be-disagree"') == len(disagree)
    assert page.count("head not trained") == 1  # B's card says its answers are chance (the browser audit)


def test_a_long_text_that_differs_is_shown_where_it_differs():
    """Two fill-mask sequences of a long text share their first 400 characters: the row shows both around the
    filled words (it showed the same first 79 characters twice)."""
    start = "word " * 80
    a, b = start + "hot tea and more text " * 10, start + "hot wine and more text " * 10
    page = insight.compare_html({"a": {"label": "A", "model": "m", "precision": "float32", "seconds": 0.1, "brief": "tea"},
                                 "b": {"label": "B", "model": "m", "precision": "int8", "seconds": 0.1, "brief": "wine"},
                                 "disagreements": insight.differences({"sequence": a}, {"sequence": b})[0],
                                 "score_differences": []})
    row = page[page.index('class="be-disagree"'):]
    assert "hot tea" in row and "hot wine" in row and row.count("…") >= 2
    assert max(map(len, insight._shown_pair(a, b))) <= insight.SHOWN_CHARS
    assert insight._shown_pair("tea", "wine") == ("tea", "wine")
