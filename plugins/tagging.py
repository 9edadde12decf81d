"""Tag sequences for NER: CoNLL files, tag schemes (parsing, the transitions each allows, conversion),
chunks and entity-level P/R/F1.

Chunk boundaries follow conlleval (and seqeval's default mode), so one function reads BIO, IOB1
and BIOES, and an `I-X` after `O` starts an entity as conlleval counts it. Scores are exact-match:
an entity counts only when its span and its type both equal a gold entity's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

SCHEMES = ("BIO", "IOB1", "BIOES")


def parse_tag(tag: str) -> tuple[str, str | None]:
    """"B-PER" -> ("B", "PER"); "O" -> ("O", None). Raises ValueError for a tag without a prefix."""
    if tag == "O":
        return "O", None
    prefix, sep, kind = tag.partition("-")
    if not sep or prefix not in ("B", "I", "E", "S") or not kind:
        raise ValueError(f"tag {tag!r} is not 'O' or PREFIX-TYPE with a prefix in B, I, E, S")
    return prefix, kind


def detect_scheme(tags: list[str] | tuple[str, ...]) -> str:
    """BIOES when any tag uses E- or S-, otherwise BIO (IOB1 is never guessed: it must be asked for)."""
    return "BIOES" if any(parse_tag(t)[0] in ("E", "S") for t in tags) else "BIO"


def allowed_transitions(tags: list[str] | tuple[str, ...], scheme: str) -> tuple[Tensor, Tensor, Tensor]:
    """Which transitions a tag scheme allows.

    Returns:
        (allowed (L, L) bool indexed [from, to], allowed_start (L,) bool, allowed_end (L,) bool).
    Raises:
        ValueError: an unknown scheme, or a tag whose prefix the scheme does not use.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"tag scheme {scheme!r} is not one of {SCHEMES}")
    parsed = [parse_tag(t) for t in tags]
    used = {"BIO": "BIO", "IOB1": "BIO", "BIOES": "BIOES"}[scheme]
    bad = [t for t, (prefix, _) in zip(tags, parsed) if prefix not in used]
    if bad:
        raise ValueError(f"tags {bad} do not belong to the {scheme} scheme")
    L = len(tags)
    allowed = torch.ones(L, L, dtype=torch.bool)
    start = torch.ones(L, dtype=torch.bool)
    end = torch.ones(L, dtype=torch.bool)
    for j, (to_prefix, to_kind) in enumerate(parsed):
        for i, (from_prefix, from_kind) in enumerate(parsed):
            same = from_kind == to_kind
            if scheme == "BIO" and to_prefix == "I":
                allowed[i, j] = same and from_prefix in "BI"  # I-X continues a B-X or I-X
            elif scheme == "IOB1" and to_prefix == "B":
                allowed[i, j] = same and from_prefix in "BI"  # B-X only splits two adjacent X entities
            elif scheme == "BIOES":
                if to_prefix in "IE":
                    allowed[i, j] = same and from_prefix in "BI"
                else:  # B, S or O may only follow a finished entity or O
                    allowed[i, j] = from_prefix in "ESO"
        if scheme == "BIO":
            start[j] = to_prefix != "I"
        elif scheme == "IOB1":
            start[j] = to_prefix != "B"
        else:
            start[j] = to_prefix in "BSO"
            end[j] = to_prefix in "ESO"
    return allowed, start, end


def _split(tag: str) -> tuple[str, str]:
    prefix, kind = parse_tag(tag)
    return prefix, kind or ""


def _starts(prev: str, prev_type: str, tag: str, kind: str) -> bool:
    if tag in ("B", "S"):
        return True
    if tag in ("I", "E") and prev in ("E", "S", "O"):
        return True
    return tag != "O" and prev_type != kind


def _ends(prev: str, prev_type: str, tag: str, kind: str) -> bool:
    if prev in ("E", "S"):
        return True
    if prev in ("B", "I") and tag in ("B", "S", "O"):
        return True
    return prev != "O" and prev_type != kind


def chunks(tags: list[str]) -> list[tuple[int, int, str]]:
    """Entities in a tag sequence as (first index, last index + 1, type), with conlleval's rules."""
    found = []
    prev, prev_type, begin = "O", "", None
    for i, label in enumerate([*tags, "O"]):
        tag, kind = _split(label)
        if begin is not None and _ends(prev, prev_type, tag, kind):
            found.append((begin, i, prev_type))
            begin = None
        if _starts(prev, prev_type, tag, kind):
            begin = i
        prev, prev_type = tag, kind
    return found


def convert(tags: list[str], target: str) -> list[str]:
    """Rewrite a tag sequence in BIO, IOB1 or BIOES; the entities (conlleval chunks) stay the same."""
    if target not in ("BIO", "IOB1", "BIOES"):
        raise ValueError(f"tag scheme {target!r} is not one of BIO, IOB1, BIOES")
    spans = chunks(tags)
    out = ["O"] * len(tags)
    ends = {(end, kind) for _, end, kind in spans}
    for begin, end, kind in spans:
        if target == "BIOES" and end - begin == 1:
            out[begin] = f"S-{kind}"
            continue
        inside = "I"
        first = "I" if target == "IOB1" and (begin, kind) not in ends else "B"  # IOB1: B- only between two X
        out[begin:end] = [f"{first}-{kind}"] + [f"{inside}-{kind}"] * (end - begin - 1)
        if target == "BIOES":
            out[end - 1] = f"E-{kind}"
    return out


def entity_scores(gold: list[list[tuple]], predicted: list[list[tuple]]) -> dict:
    """Entity-level precision, recall and F1 (in percent), overall and per type.

    Args:
        gold, predicted: per sentence, entities as tuples whose last item is the type (spans compared
            exactly, e.g. (start, end, type)).
    Returns:
        {"precision", "recall", "f1", "entities": gold count, "per_type": {type: {...}}}.
    """
    if len(gold) != len(predicted):
        raise ValueError(f"{len(gold)} gold sentences but {len(predicted)} predicted ones")
    tp, n_gold, n_pred = Counter(), Counter(), Counter()
    for g, p in zip(gold, predicted):
        g, p = set(g), set(p)
        for entity in g:
            n_gold[entity[-1]] += 1
        for entity in p:
            n_pred[entity[-1]] += 1
            tp[entity[-1]] += entity in g

    def prf(t: int, ng: int, np_: int) -> dict:
        precision = 100.0 * t / np_ if np_ else 0.0
        recall = 100.0 * t / ng if ng else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        return {"precision": precision, "recall": recall, "f1": f1, "entities": ng, "predicted": np_}

    per_type = {kind: prf(tp[kind], n_gold[kind], n_pred[kind]) for kind in sorted(set(n_gold) | set(n_pred))}
    return {**prf(sum(tp.values()), sum(n_gold.values()), sum(n_pred.values())), "per_type": per_type}


def read_conll(path: str | Path) -> Iterator[tuple[list[str], list[str]]]:
    """Sentences of a CoNLL-2003 file (`TOKEN POS CHUNK NER` per line) as (words, NER tags).

    `-DOCSTART-` lines are skipped; the tags are returned in the file's own scheme (IOB1 for CoNLL-2003).
    Raises ValueError naming the file and line for a line without four columns.
    """
    words: list[str] = []
    tags: list[str] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            parts = line.split()
            if not parts:
                if words:
                    yield words, tags
                words, tags = [], []
                continue
            if parts[0] == "-DOCSTART-":
                continue
            if len(parts) < 2:
                raise ValueError(f"{path}:{number}: expected 'TOKEN ... TAG', got {line.strip()!r}")
            try:
                parse_tag(parts[-1])
            except ValueError as err:  # another task's file (a TSV's "label" column), named where it is
                raise ValueError(f"{path}:{number}: {err}; a CoNLL line is 'TOKEN POS CHUNK TAG'") from None
            words.append(parts[0])
            tags.append(parts[-1])
    if words:
        yield words, tags
