"""QA training and evaluation data: SQuAD-format files read as (inputs, target) pairs, and the
unanswerable questions built from answerable ones, since no SQuAD 2.0 train set is available offline.

Each construction edits an answerable SQuAD 1.1 question (or its paragraph) the way SQuAD 2.0's
writers made theirs (Rajpurkar et al. 2018; the SQuAD2-CR cause labels: entity swap ~36 %, antonym
~19 %, negation ~16 %, number or date swap ~8 %, then "the paragraph names it, but not this fact"),
and keeps a copy only where the paragraph provably no longer answers it. Every choice is a hash of
the question id, so the same split gives the same data on every run. Holds no model code.
"""

from __future__ import annotations

import calendar
import collections
import functools
import hashlib
import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from plugins.qa_metric import normalize_answer
from plugins.sentences import split_sentences

# normalize_answer, remembered for the last few thousand texts: building the data normalises each paragraph once
# per question and construction. Here only (training data): a server answering visitors' megabyte contexts must
# not keep them.
_fold = functools.lru_cache(maxsize=4096)(normalize_answer)

NEGATIVE_SHARE = 0.33  # each construction gets a draw at about a third of the questions: SQuAD 2.0's ratio
ANTONYMS_FILE = Path(__file__).with_name("qa_antonyms.tsv")  # scripts/build_antonyms.py writes it (WordNet 3.0)


def _draw(qa: dict, salt: str = "") -> int:
    """A fixed pseudo-random 32-bit number per question (a hash of its id): the same choices every run."""
    return int(hashlib.sha256((salt + str(qa.get("id", qa["question"]))).encode()).hexdigest()[:8], 16)


def _says_an_answer(text: str, answers: list[dict]) -> bool:
    """Whether any answer's text occurs in `text` (normalised as the SQuAD metric does): a context that
    does cannot be labelled unanswerable."""
    text = _fold(text)
    return any(_fold(a["text"]) in text for a in answers)


def without_answer_sentences(context: str, answers: list[dict], sentences: list[tuple[int, int]] | None = None,
                             ) -> str | None:
    """The paragraph with every sentence that holds (part of) an answer removed, or None when nothing
    is left, or an answer's text still occurs in what is left (then the question may still be
    answerable from it). `sentences`: the paragraph's sentence spans, if already split."""
    spans = [(a["answer_start"], a["answer_start"] + len(a["text"])) for a in answers]
    kept = [context[start:end] for start, end in (split_sentences(context) if sentences is None else sentences)
            if not any(start < a_end and a_start < end for a_start, a_end in spans)]
    rest = " ".join(kept)
    if not rest.strip() or _says_an_answer(rest, answers):
        return None
    return rest


# A name (a run of capitalised words, "of"/"the"/"de" allowed inside) or a number, as the questions of an
# article write them; the question's first word is capitalised as a sentence start and is never one.
_ENTITY = re.compile(r"\b(?:\d[\d,.]*\d|\d|[A-Z][\w'\u2019.-]*(?:\s+(?:(?:of|the|de|von|van|and)\s+)?[A-Z][\w'\u2019.-]*)*)")


def _entity_kind(entity: str) -> str:
    """"year", "number" or "name": a swap keeps the kind, so the question still reads naturally."""
    if entity[0].isdigit():
        return "year" if re.fullmatch(r"1\d{3}|20\d{2}", entity) else "number"
    return "name"


def question_entities(question: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the names and numbers in a question, the first word left out."""
    first = re.match(r"\s*\S+", question)
    skip = first.end() if first else 0
    return [(m.start(), m.end()) for m in _ENTITY.finditer(question) if m.start() >= skip]


def article_entities(questions: list[str], answers: list[str] = ()) -> dict[str, list[str]]:
    """Every distinct name and number the article's questions use, and every answer that is one
    whole name or number, by kind, in first-seen order."""
    pool: dict[str, dict[str, None]] = collections.defaultdict(dict)
    found = [question[start:end] for question in questions for start, end in question_entities(question)]
    found += [answer for answer in answers if _ENTITY.fullmatch(answer)]
    for entity in found:
        entity = entity.rstrip(".")
        pool[_entity_kind(entity)][entity] = None
    return {kind: list(entities) for kind, entities in pool.items()}


@cache
def _word_pattern(entity: str) -> re.Pattern:
    return re.compile(rf"(?<!\w){re.escape(entity)}s?(?!\w)")


def _mentions(folded: str, entity: str) -> bool:
    """Whether normalised text says a normalised name or number, as whole words (a possessive too)."""
    return entity in folded and _word_pattern(entity).search(folded) is not None  # the substring test first: fast


def swapped_question(question: str, context: str, answers: list[dict], pool: dict[str, list[str]],
                     draw: int) -> str | None:
    """The question with one of its names or numbers that the paragraph also says (and no answer
    contains) replaced by another of the same kind from `pool` (article_entities: the article's
    questions and answers) that the paragraph never says, or None when there is no such pair. The paragraph then no longer answers
    it: SQuAD 2.0's most common kind of unanswerable question (an entity swap)."""
    folded = _fold(context)
    gold = [_fold(a["text"]) for a in answers]
    anchors = []
    for start, end in question_entities(question):
        entity = question[start:end].rstrip(".")
        norm = _fold(entity)
        if norm and _mentions(folded, norm) and not any(_mentions(g, norm) or _mentions(norm, g) for g in gold if g):
            anchors.append((start, start + len(entity), entity))
    if not anchors:
        return None
    start, end, entity = anchors[draw % len(anchors)]
    replacements = [other for other in pool.get(_entity_kind(entity), ())
                    if _fold(other) and not _mentions(folded, _fold(other))
                    and not _mentions(_fold(entity), _fold(other))]
    if not replacements:
        return None
    return question[:start] + replacements[(draw // len(anchors)) % len(replacements)] + question[end:]


_COPULAS = {"is", "are", "was", "were"}
_AUXILIARIES = {"do", "does", "did", "can", "could", "will", "would", "should", "shall", "may", "might", "must",
                "has", "have", "had"}
_PRONOUNS = {"he", "she", "it", "they", "we", "you", "i", "there", "this", "these", "those"}
_NOT_A_VERB = {"and", "or", "of", "de", "the", "in", "on", "at", "for", "to", "from", "by", "with", "as", "than"}
_PARTICIPLE = re.compile(r"[a-z]+(?:ed|en|ing)|built|made|known|held|led|won|sold|set|put|found|born|called|given|"
                         r"said|told|taught|thought|brought|bought|caught|kept|left|lost|meant|paid|run|seen|sent|"
                         r"spent|used|considered|named")
_NEGATIONS = re.compile(r"\b(?:not|never|no|none|nor|cannot)\b|n't\b|n\u2019t\b", re.IGNORECASE)


def _after_subject(words: list[str], j: int) -> int | None:
    """Where a named subject starting at word j ends (after "the"/"a"/"an", a run of capitalised
    words, or one pronoun), or None when word j starts no such subject."""
    if j < len(words) and words[j].lower() in _PRONOUNS:
        return j + 1
    if j + 1 < len(words) and words[j].lower() in ("the", "a", "an") and words[j + 1][:1].isupper():
        j += 1
    k = j
    while k < len(words) and words[k][:1].isupper():
        k += 1
    return k if k > j else None


def negated_question(question: str) -> str | None:
    """The question with "not" put where an English writer would negate it, or None where no rule
    applies or the question is negative already. SQuAD 2.0's writers made about a tenth of its
    unanswerable questions this way (587 of the 5,945 in dev-v2.0 say not/never/n't, against 117 of
    its 5,928 answerable ones): over the paragraph that answers the question, the negated question
    asks for what the paragraph does not say.

    - an auxiliary (do, can, has, ...) with a named or pronoun subject: "not" goes before the verb
      after it ("When did Beyonce leave Destiny's Child?" -> "When did Beyonce not leave Destiny's
      Child?"); a lower-case subject ("did the government ...") has no reliable verb boundary without
      a parser, and is left alone;
    - a copula: before the participle after a named or pronoun subject ("Where was the Bus Depot
      built?" -> "Where was the Bus Depot not built?"), else right after the copula ("Who was the
      first president?" -> "Who was not the first president?");
    - questions without an auxiliary or copula in their first six words are left alone.
    """
    if _NEGATIONS.search(question):
        return None
    words = question.split(" ")
    for i, word in enumerate(words[1:7], start=1):
        lower = word.lower()
        if lower not in _COPULAS and lower not in _AUXILIARIES:
            continue
        k = _after_subject(words, i + 1)
        verb = words[k].rstrip("?.!,;:") if k is not None and k < len(words) else ""  # "won?" ends the question
        if lower in _COPULAS:
            at = k if _PARTICIPLE.fullmatch(verb) else i + 1
        elif re.fullmatch(r"[a-z]+", verb) and verb not in _NOT_A_VERB:
            at = k
        else:
            return None
        return " ".join(words[:at] + ["not"] + words[at:])
    return None


@cache
def antonyms() -> dict[str, str]:
    """word -> its antonym (both ways, inflected forms included), from the committed list
    (`qa_antonyms.tsv`: WordNet 3.0's antonym pointers, filtered by scripts/build_antonyms.py)."""
    table: dict[str, str] = {}
    for line in ANTONYMS_FILE.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            word, other = line.split("\t")[:2]
            table.setdefault(word, other)
            table.setdefault(other, word)
    return table


_WORD = re.compile(r"[A-Za-z]+")


def antonym_question(question: str, context: str, answers: list[dict], draw: int) -> str | None:
    """The question with one word the paragraph also says replaced by its antonym, which the
    paragraph never says ("What is the largest city?" -> "What is the smallest city?"), or None
    when no word qualifies. The paragraph then answers the original, not the edit: SQuAD 2.0's
    second commonest kind of unanswerable question. Words inside an answer are left alone."""
    table = antonyms()
    folded = _fold(context)
    gold = " ".join(_fold(a["text"]) for a in answers)
    choices = []
    for match in _WORD.finditer(question):
        word = match.group().lower()
        other = table.get(word)
        if other and _mentions(folded, word) and not _mentions(folded, other) and not _mentions(gold, word):
            if match.group()[0].isupper():
                other = other[0].upper() + other[1:]
            choices.append((match.start(), match.end(), other))
    if not choices:
        return None
    start, end, other = choices[draw % len(choices)]
    return question[:start] + other + question[end:]


_MONTHS = [m for m in calendar.month_name if m]
_NUMBER = re.compile(r"(?<![\w.,])(?:\d{1,3}(?:,\d{3})+|\d+)(?![\w,.]\d)|\b(?:" + "|".join(_MONTHS) + r")\b")


def _shifted(value: str, draw: int) -> list[str]:
    """Other values of the same kind for a number, a year or a month, nearest first."""
    if value in _MONTHS:
        i = _MONTHS.index(value)
        return [_MONTHS[(i + k) % 12] for k in (1, -1, 2, -2, 3, -3, 6)]
    number = int(value.replace(",", ""))
    if 1000 <= number <= 2099 and "," not in value:  # a year: a nearby one
        steps = [1, 2, 3, 5, 10, 20]
    else:
        steps = [max(1, round(number * f)) for f in (0.1, 0.25, 0.5, 1.0)] if number >= 10 else [1, 2, 3, 4]
    sign = 1 if draw % 2 else -1
    out = []
    for step in steps:
        for candidate in (number + sign * step, number - sign * step):
            if candidate > 0:
                out.append(f"{candidate:,}" if "," in value else str(candidate))
    return out


def number_question(question: str, context: str, answers: list[dict], draw: int) -> str | None:
    """The question with a number, year or month that the paragraph also says (outside any answer)
    replaced by a near value of the same kind that the paragraph never says ("in 1998" -> "in 1999"),
    or None: SQuAD 2.0's number or date swap."""
    folded = _fold(context)
    gold = " ".join(_fold(a["text"]) for a in answers)
    choices = [m for m in _NUMBER.finditer(question)
               if _mentions(folded, _fold(m.group())) and not _mentions(gold, _fold(m.group()))]
    if not choices:
        return None
    match = choices[draw % len(choices)]
    for other in _shifted(match.group(), draw // len(choices)):
        if not _mentions(folded, _fold(other)):
            return question[:match.start()] + other + question[match.end():]
    return None


def absent_fact_context(question: str, index: int, paragraphs: list[dict], answers: list[dict],
                        draw: int) -> str | None:
    """Another paragraph of the same article that names one of the question's names (so it is on
    topic for the question) but says none of its answers, or None: the "mentioned entity, absent
    fact" questions of SQuAD 2.0, harder than a random other paragraph (`+negatives`), which word
    overlap alone gives away."""
    names = [_fold(question[start:end].rstrip(".")) for start, end in question_entities(question)]
    names = [n for n in names if n]
    if not names:
        return None
    candidates = []
    for j, paragraph in enumerate(paragraphs):
        if j == index:
            continue
        folded = _fold(paragraph["context"])
        if any(_mentions(folded, n) for n in names) and not _says_an_answer(paragraph["context"], answers):
            candidates.append(paragraph["context"])
    return candidates[draw % len(candidates)] if candidates else None


# The additions a split name can ask for ("train+negatives+swapped"), each an unanswerable copy of
# about NEGATIVE_SHARE of the answerable questions, in the order read_data tries them.
CONSTRUCTIONS = {
    "negatives": "the question over another paragraph of the same article (easy: off topic)",
    "absent": "the question over another paragraph of its article that names its entity, not the answer",
    "removed": "the question over its own paragraph less the sentences holding the answer",
    "swapped": "one of its names or numbers swapped for another of the article the paragraph never says",
    "antonym": "one of its words swapped for its WordNet antonym, which the paragraph never says",
    "numbers": "a number, year or month swapped for a near one the paragraph never says",
    "negated": "'not' put in (did X leave -> did X not leave)",
}
NEGATIVES_SUFFIX, REMOVED_SUFFIX, SWAPPED_SUFFIX, NEGATED_SUFFIX = "+negatives", "+removed", "+swapped", "+negated"
ALL_NEGATIVES = "+" + "+".join(CONSTRUCTIONS)  # "train" + ALL_NEGATIVES: every construction


def construction_shares(split: str) -> dict[str, float]:
    """The constructions a split name asks for, each with the share of answerable questions it is
    drawn for: "train+negatives:0.1+swapped" -> {"negatives": 0.1, "swapped": NEGATIVE_SHARE}."""
    shares = {}
    for part in str(split).split("+")[1:]:
        kind, _, share = part.partition(":")
        if kind not in CONSTRUCTIONS:
            raise ValueError(f"qa: split {split!r} adds {kind!r}; known additions are "
                             f"{', '.join('+' + k for k in CONSTRUCTIONS)} (each optionally ':share', 0-1)")
        try:
            shares[kind] = float(share) if share else NEGATIVE_SHARE
        except ValueError:
            shares[kind] = -1.0
        if not 0.0 <= shares[kind] <= 1.0:
            raise ValueError(f"qa: split {split!r}: the share of {kind!r} must be a number from 0 to 1, got {share!r}")
    return shares


def _unanswerable(question: str, context: str, kind: str) -> tuple[dict, dict]:
    return {"question": question, "context": context}, {"answers": [""], "starts": [-1], "kind": kind}


def read_data(path, split: str = "dev") -> Iterator[tuple[dict, dict]]:
    """A SQuAD-format JSON file (v1.1, or v2.0 with unanswerable questions: answers [""], starts [-1]);
    yields ({"question", "context"}, {"answers": texts, "starts": char offsets}), an unanswerable
    copy's target also saying which construction made it ("kind").

    The split's base name ("train", "dev") is a label; each "+name" after it adds the unanswerable
    copies of one construction (CONSTRUCTIONS; "train+negatives+swapped"), each drawn for a share
    of the answerable questions (a third, or "+name:0.1") by a hash of the question id and kept only where the
    paragraph provably no longer answers it (no answer text in the new paragraph; a swapped word
    or number the paragraph never says).
    """
    with open(path, encoding="utf-8") as handle:
        try:
            data = json.load(handle)["data"]
        except (ValueError, KeyError) as err:
            raise ValueError(f"{path}: not a SQuAD-format JSON file ({err})") from None
    kinds = construction_shares(split)
    for article in data:
        paragraphs = article["paragraphs"]
        pool = article_entities([qa["question"] for p in paragraphs for qa in p["qas"]],
                                [a["text"] for p in paragraphs for qa in p["qas"] for a in qa["answers"]]
                                ) if "swapped" in kinds else {}
        for index, paragraph in enumerate(paragraphs):
            context = paragraph["context"]
            sentences = None  # split once per paragraph, when a question first needs it
            for qa in paragraph["qas"]:
                answers = [] if qa.get("is_impossible") else qa["answers"]
                yield ({"question": qa["question"], "context": context},
                       {"answers": [a["text"] for a in answers] or [""],
                        "starts": [a["answer_start"] for a in answers] or [-1]})
                if not answers:
                    continue
                question = qa["question"]
                for kind in CONSTRUCTIONS:
                    if kind not in kinds:
                        continue
                    draw = _draw(qa, "" if kind == "negatives" else kind)
                    if draw / 0xFFFFFFFF >= kinds[kind]:
                        continue
                    if kind == "negatives":
                        other = paragraphs[(index + 1 + draw % (len(paragraphs) - 1)) % len(paragraphs)]["context"] \
                            if len(paragraphs) > 1 else context
                        if other is not context and not _says_an_answer(other, answers):
                            yield _unanswerable(question, other, kind)
                    elif kind == "absent":
                        other = absent_fact_context(question, index, paragraphs, answers, draw)
                        if other is not None:
                            yield _unanswerable(question, other, kind)
                    elif kind == "removed":
                        if sentences is None:
                            sentences = split_sentences(context)
                        rest = without_answer_sentences(context, answers, sentences)
                        if rest is not None:
                            yield _unanswerable(question, rest, kind)
                    else:
                        if kind == "swapped":
                            edit = swapped_question(question, context, answers, pool, draw)
                        elif kind == "antonym":
                            edit = antonym_question(question, context, answers, draw)
                        elif kind == "numbers":
                            edit = number_question(question, context, answers, draw)
                        else:
                            edit = negated_question(question)
                        if edit is not None:
                            yield _unanswerable(edit, context, kind)


def construction_report(path, split: str, samples: int = 20) -> dict:
    """How many questions each construction of `split` made from a SQuAD file, its share of all the
    questions, and the first `samples` of each kind (for the model card)."""
    counts: collections.Counter = collections.Counter()
    shown: dict[str, list[dict]] = collections.defaultdict(list)
    previous = None
    for inputs, target in read_data(path, split):
        kind = target.get("kind", "answerable" if target["answers"] != [""] else "unanswerable (file)")
        counts[kind] += 1
        if "kind" in target and len(shown[kind]) < samples:
            shown[kind].append({"original": previous, "question": inputs["question"],
                                "context_start": inputs["context"][:80]})
        elif "kind" not in target:
            previous = inputs["question"]
    total = sum(counts.values())
    return {"split": split, "total": total,
            "counts": {k: {"questions": n, "share": round(n / total, 4)} for k, n in counts.most_common()},
            "samples": dict(shown)}
