"""Fill-mask scored as a visitor uses it: one whole word of running text behind one [MASK], the model's
top-1 / top-5 words compared with it, split into content words (nouns, verbs, adjectives, adverbs,
numbers: anything not in FUNCTION_WORDS) and function words.

Words are drawn uniformly (seeded) from the alphabetic or numeric whitespace-separated words of the
passages; punctuation and WikiText's "@-@" marks are never drawn. A word the tokenizer splits into
several pieces still gets one [MASK] (what a visitor types), so the model gets it right only by naming
the whole word. Case is ignored (the starter is uncased). `fill_mask.evaluate` reports these beside the
token-level figures; `scripts/fill_mask_whole_words.py` is the command for one file.
"""

from __future__ import annotations

import random
import re

from bert_engine.progress import progress_bar

# Closed-class English words (determiners, pronouns, prepositions, conjunctions, auxiliaries, particles).
FUNCTION_WORDS = frozenset("""
a an the this that these those my your his her its our their some any no every each either neither all both
i me you he him she it we us they them myself yourself himself herself itself ourselves themselves who whom
whose which what whatever whoever one ones
of in on at by for with from to into onto upon about above below over under between among through during
before after since until till against within without along across around behind beyond near off out up down
as than like via per despite toward towards
and or but nor so yet because although though while whereas if unless whether when where why how then
be am is are was were been being have has had having do does did done can could may might must shall should
will would not n't 's 'd 'll 're 've there here also only just very too more most less least such same other
""".split())
KINDS = ("all", "content", "function")


def draw_words(passages: list[str], count: int, seed: int = 0) -> list[tuple[str, str]]:
    """(the passage with one word replaced by [MASK], that word) for `count` words drawn uniformly
    (by `seed`) from the passages' alphabetic or numeric words; fewer if the passages hold fewer."""
    slots = [(p, i) for p, text in enumerate(passages) for i, word in enumerate(text.split())
             if re.fullmatch(r"[A-Za-z]+|\d+", word)]
    chosen = random.Random(seed).sample(slots, min(count, len(slots)))
    out = []
    for p, i in chosen:
        words = passages[p].split()
        out.append((" ".join(words[:i] + ["[MASK]"] + words[i + 1:]), words[i]))
    return out


def kind_of(word: str) -> str:
    return "function" if word.lower() in FUNCTION_WORDS else "content"


def score_words(predictor, items: list[tuple[str, str]], *, progress: bool = False) -> dict[str, dict]:
    """Per kind (all, content, function): the words scored and the shares (0-1) whose hidden word is
    the predictor's first candidate (top1) or among its first five (top5), each request as the tab sends it."""
    tallies = {kind: {"words": 0, "top1": 0, "top5": 0} for kind in KINDS}
    for text, word in progress_bar(items, desc="whole words", unit="word", disable=not progress):
        result = predictor.predict({"text": text}, top_k=5)["result"]
        guesses = [c["token"].lower() for c in result["predictions"][0]["candidates"]]
        for key in ("all", kind_of(word)):
            tallies[key]["words"] += 1
            tallies[key]["top1"] += guesses[:1] == [word.lower()]
            tallies[key]["top5"] += word.lower() in guesses
    return {kind: {"words": t["words"], "top1": t["top1"] / max(t["words"], 1), "top5": t["top5"] / max(t["words"], 1)}
            for kind, t in tallies.items()}


def flat(scores: dict[str, dict]) -> dict[str, float]:
    """score_words' figures as flat metric names: words_top1, content_top5, function_words, ..."""
    out = {}
    for kind, figures in scores.items():
        prefix = "words" if kind == "all" else kind
        out[f"{prefix}_top1"], out[f"{prefix}_top5"] = figures["top1"], figures["top5"]
        out["words" if kind == "all" else f"{kind}_words"] = figures["words"]
    return out
