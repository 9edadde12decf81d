"""Extractive QA: the answer span in a context, across overlapping windows, with a "no answer" score.

Long contexts are split into windows (`max_seq_len`, `doc_stride` tokens of overlap); the
question (cut to `max_question_len` tokens) and special tokens can never be an answer. Spans are
ranked across windows by start + end logits (a per-window softmax would make scores of different
windows incomparable), a start token counts only in the window where it has most context (BERT's
rule), and duplicate spans are merged. The null score comes from [CLS] (SQuAD 2.0 style).
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import re
import string
from html import escape
from typing import Any

import torch
from tqdm.auto import tqdm

from bert_engine import ui
from bert_engine.heads import SpanHead, SpanOutput
from bert_engine.hookspecs import InputError, TaskSpec, check_int, hookimpl, length_option
from bert_engine.runtime.inference import model_options
from bert_engine.ui import percent
from plugins.sentences import split_sentences
from plugins.starter import starter_checkpoint

N_BEST_PER_WINDOW = 20  # best spans kept per window before merging across windows
MAX_WINDOWS = 256


# The task's options and their defaults, declared once: the Predictor passes every one to preprocess
# and postprocess (a caller's values over these).
OPTIONS = {"top_k": 1, "max_seq_len": None, "doc_stride": None, "max_question_len": 64, "max_answer_len": 30,
           "null_threshold": None}


def preprocess(inputs, tokenizer, *, top_k, max_seq_len, doc_stride, max_question_len, max_answer_len,
               null_threshold):
    question, context = inputs["question"], inputs["context"]
    if not question.strip():
        raise InputError("qa: the question is empty; ask something about the context")
    if not context.strip():
        raise InputError("qa: the context is empty; paste the text that holds the answer")
    max_seq_len = length_option("qa", "max_seq_len", max_seq_len, 384, 32, tokenizer)
    for name, value, low, high in (("top_k", top_k, 1, 50), ("max_question_len", max_question_len, 4, 256),
                                   ("max_answer_len", max_answer_len, 1, 512)):
        check_int("qa", name, value, low, high)
    if null_threshold is not None and not isinstance(null_threshold, (int, float)):
        raise InputError(f"qa: null_threshold must be a number or None, got {null_threshold!r}")
    # Cut the question to max_question_len word pieces, at a character boundary of the original.
    question_batch = tokenizer(question, truncation=None)
    pieces = [o for o, s in zip(question_batch.offsets[0], question_batch.sequence_ids[0]) if s == 0]
    question_cut = len(pieces) > max_question_len
    if question_cut:
        question = question[:pieces[max_question_len - 1][1]]
    room = max_seq_len - min(len(pieces), max_question_len) - 3
    if room < 8:
        raise InputError(f"qa: the question takes {min(len(pieces), max_question_len)} of the {max_seq_len} tokens "
                         "a window holds, leaving no room for the context; ask a shorter question")
    doc_stride = min(128, room // 2) if doc_stride is None else doc_stride
    if not isinstance(doc_stride, int) or not 0 <= doc_stride < room:
        raise InputError(f"qa: doc_stride must be an integer in [0, {room}) for max_seq_len {max_seq_len} "
                         f"and this question, got {doc_stride!r}")
    batch = tokenizer(question, context, max_length=max_seq_len, truncation="only_second", stride=doc_stride,
                      return_overflowing=True)
    if not any(s == 1 for s in batch.sequence_ids[0]):
        raise InputError("qa: the context has no readable text (only control or invisible characters)")
    if len(batch) > MAX_WINDOWS:
        raise InputError(f"qa: the context needs {len(batch)} windows of {max_seq_len} tokens; "
                         f"the limit is {MAX_WINDOWS} (about {MAX_WINDOWS * (room - doc_stride):,} tokens)")
    batch.meta.update(context=context, question_truncated=question_cut)
    return batch


def max_context_windows(batch) -> dict[tuple[int, int], int]:
    """For every context token (by its character span), the window where it has most context:
    the largest min(tokens to its left, tokens to its right) in that window, ties to the longer window."""
    best: dict[tuple[int, int], tuple[float, int]] = {}
    for row, sequence_ids in enumerate(batch.sequence_ids):
        positions = [t for t, s in enumerate(sequence_ids) if s == 1]
        if not positions:
            continue
        first, last = positions[0], positions[-1]
        for t in positions:
            score = min(t - first, last - t) + 0.01 * len(positions)
            span = tuple(batch.offsets[row][t])
            if span not in best or score > best[span][0]:
                best[span] = (score, row)
    return {span: row for span, (_, row) in best.items()}


def postprocess(output, batch, *, top_k, max_seq_len, doc_stride, max_question_len, max_answer_len,
                null_threshold):
    context = batch.meta["context"]
    starts, ends = output.start_logits.float().cpu(), output.end_logits.float().cpu()  # (W, T)
    W, T = starts.shape
    home = max_context_windows(batch)
    # Which (start, end) pairs may be an answer: both in the context, start <= end < start + max_answer_len.
    offsets = torch.arange(T)
    length_ok = (offsets[None, :] >= offsets[:, None]) & (offsets[None, :] < offsets[:, None] + max_answer_len)  # (T, T)
    spans: dict[tuple[int, int], float] = {}
    null_score = None
    for row, sequence_ids in enumerate(batch.sequence_ids):
        null = float(starts[row, 0] + ends[row, 0])
        null_score = null if null_score is None else min(null_score, null)  # SQuAD 2.0: the minimum over windows
        in_context = torch.tensor([s == 1 for s in sequence_ids] + [False] * (T - len(sequence_ids)))
        # A start token counts only in the window where it has most context.
        is_home = torch.tensor([s == 1 and home.get(tuple(batch.offsets[row][t])) == row
                                for t, s in enumerate(sequence_ids)] + [False] * (T - len(sequence_ids)))
        allowed = length_ok & is_home[:, None] & in_context[None, :]  # (T, T)
        scores = (starts[row][:, None] + ends[row][None, :]).masked_fill(~allowed, float("-inf"))  # (T, T)
        k = min(N_BEST_PER_WINDOW, int(allowed.sum()))
        if k == 0:
            continue
        best_scores, flat = scores.flatten().topk(k)
        for score, index in zip(best_scores.tolist(), flat.tolist()):
            s, e = divmod(index, T)
            char_span = whole_words(context, batch.offsets[row][s][0], batch.offsets[row][e][1])
            if score > spans.get(char_span, float("-inf")):
                spans[char_span] = score  # duplicates (same characters) merged, best score kept
    ranked = sorted(spans.items(), key=lambda item: -item[1])
    # Probabilities over every span considered and "no answer", so they do not depend on top_k.
    probs = torch.tensor([score for _, score in ranked] + [null_score]).softmax(0).tolist()
    answers = [{"answer": context[s:e], "start": s, "end": e, "field": "context", "score": round(p, 6),
                "logit": round(score, 4)} for ((s, e), score), p in zip(ranked[:top_k], probs)]
    best = ranked[0][1] if ranked else None
    gap = None if best is None else round(null_score - best, 4)
    no_answer = best is None or (null_threshold is not None and gap > null_threshold)
    return {
        "answer": None if no_answer else answers[0]["answer"],
        "answers": answers,
        "no_answer": {"logit": round(null_score, 4), "score": round(probs[-1], 6), "null_gap": gap,
                      "threshold": null_threshold, "predicted": no_answer},
        "windows": len(batch), "question_truncated": batch.meta["question_truncated"],
    }


def whole_words(text: str, start: int, end: int) -> tuple[int, int]:
    """A character span widened to whole words: a span whose edge falls inside a word (a word piece
    boundary, e.g. "20:1" of "20:17") takes the rest of that word."""
    while 0 < start < len(text) and text[start - 1].isalnum() and text[start].isalnum():
        start -= 1
    while 0 < end < len(text) and text[end - 1].isalnum() and text[end].isalnum():
        end += 1
    return start, end


# -- SQuAD evaluation with the official EM / F1 semantics -------------------------------------------------

def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, and fold whitespace (SQuAD v1.1's script)."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, truth: str) -> float:
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    if not predicted or not gold:  # SQuAD 2.0: "no answer" is right exactly when the truth is "no answer"
        return float(predicted == gold)
    common = collections.Counter(predicted) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: list[str], golds: list[list[str]]) -> dict[str, float]:
    """Exact match and F1 in percent, each the maximum over the gold answers (official semantics)."""
    if not golds:
        raise ValueError("no questions to score")
    em = sum(max(normalize_answer(p) == normalize_answer(t) for t in gold) for p, gold in zip(predictions, golds))
    f1 = sum(max(f1_score(p, t) for t in gold) for p, gold in zip(predictions, golds))
    return {"exact_match": 100.0 * em / len(golds), "f1": 100.0 * f1 / len(golds)}


def metric(results: list[dict], targets: list[dict]) -> dict[str, float]:
    """Official SQuAD EM / F1 of the results' best answers against the targets' gold answers; on data
    with unanswerable questions (SQuAD 2.0) also the official v2 figures (`v2_scores`)."""
    scores = squad_scores([r["answer"] or "" for r in results], [t["answers"] for t in targets])
    if any(t["answers"] == [""] for t in targets):
        scores.update(v2_scores(results, targets))
    return scores


def _question_scores(result: dict, gold: list[str]) -> tuple[float, float, float, float]:
    """(null gap, F1 and EM of the best span answer, the score of answering nothing) for one question."""
    best = result["answers"][0]["answer"] if result["answers"] else ""
    gap = result["no_answer"]["null_gap"]
    gap = math.inf if gap is None else gap  # no span at all: no answer at any threshold
    span_f1 = max(f1_score(best, t) for t in gold)
    span_em = float(max(normalize_answer(best) == normalize_answer(t) for t in gold))
    return gap, span_f1, span_em, float(gold == [""])


def best_threshold(scored: list[tuple[float, float, float, float]], key: int = 1) -> tuple[float, float]:
    """The null-gap threshold that maximises the mean score (F1 for key 1, EM for key 2) when a
    question is answered "no answer" where its gap exceeds it, as the official v2 script's
    find_best_thresh does; returns (best score in percent, threshold)."""
    if not scored:
        raise ValueError("no questions to score")
    ordered = sorted(scored, key=lambda q: q[0])
    total = sum(q[3] for q in ordered)  # everything answered "no answer": right where there is none
    best, threshold = total, min(ordered[0][0], 0.0) - 1.0
    for gap, f1, em, none in ordered:  # answer this one (and every smaller gap) with its span instead
        total += (f1 if key == 1 else em) - none
        if total > best and math.isfinite(gap):
            best, threshold = total, gap
    return 100.0 * best / len(ordered), threshold


def v2_scores(results: list[dict], targets: list[dict]) -> dict[str, float]:
    """The official SQuAD 2.0 figures: HasAns / NoAns EM and F1 of the results as predicted, best_exact /
    best_f1 with their thresholds (on the null gap), and an honest variant: the F1 threshold tuned on
    the first half of the questions, scored on the second half (`heldout_f1` at `tuned_threshold`)."""
    scored = [_question_scores(r, t["answers"]) for r, t in zip(results, targets)]
    has = [i for i, t in enumerate(targets) if t["answers"] != [""]]
    none = [i for i, t in enumerate(targets) if t["answers"] == [""]]
    predicted = [r["no_answer"]["predicted"] for r in results]

    def as_predicted(indices: list[int], key: int) -> float:
        if not indices:
            return 0.0
        return 100.0 * sum(scored[i][3] if predicted[i] else scored[i][key] for i in indices) / len(indices)

    out = {"HasAns_exact": as_predicted(has, 2), "HasAns_f1": as_predicted(has, 1), "HasAns_total": len(has),
           "NoAns_exact": as_predicted(none, 2), "NoAns_f1": as_predicted(none, 1), "NoAns_total": len(none)}
    out["best_exact"], out["best_exact_thresh"] = best_threshold(scored, key=2)
    out["best_f1"], out["best_f1_thresh"] = best_threshold(scored, key=1)
    half = len(scored) // 2
    if half:
        _, tuned = best_threshold(scored[:half], key=1)
        heldout = scored[half:]
        out["tuned_threshold"] = tuned
        out["heldout_f1"] = _f1_at(heldout, tuned)
        out["heldout_total"] = len(heldout)
        cautious = cautious_threshold(scored[:half])
        if cautious is not None:
            out["default_threshold"] = cautious
            out["default_heldout_f1"] = _f1_at(heldout, cautious)
            for name, unanswerable in (("default_heldout_HasAns_refused", 0.0), ("default_heldout_NoAns_caught", 1.0)):
                gaps = [q[0] for q in heldout if q[3] == unanswerable]
                out[name] = sum(gap > cautious for gap in gaps) / max(len(gaps), 1)
    return out


def _f1_at(scored: list[tuple[float, float, float, float]], threshold: float) -> float:
    """Mean F1 in percent when a question whose null gap exceeds `threshold` is answered "no answer"."""
    return 100.0 * sum(q[3] if q[0] > threshold else q[1] for q in scored) / len(scored)


ANSWERABLE_REFUSAL = 0.05  # the share of answerable questions the default threshold may refuse


def cautious_threshold(scored: list[tuple[float, float, float, float]],
                       refusal: float = ANSWERABLE_REFUSAL) -> float | None:
    """The null-gap threshold a user-facing default uses: the lowest that refuses at most `refusal`
    of the answerable questions (their gap's (1 - refusal) quantile). best_f1's threshold is tuned for
    SQuAD 2.0's half-unanswerable mix and refuses many answerable questions; a visitor asks mostly
    answerable ones, so the default errs toward answering and says "no answer" where the model is
    clearly surer of it than of any span. None without answerable questions."""
    gaps = sorted(q[0] for q in scored if not q[3] and math.isfinite(q[0]))
    if not gaps:
        return None
    index = min(len(gaps) - 1, math.ceil((1.0 - refusal) * len(gaps)) - 1)
    return gaps[max(index, 0)]


NEGATIVES_SUFFIX = "+negatives"  # a split name ending in it adds unanswerable questions (read_data)
REMOVED_SUFFIX = "+removed"  # ... and in this: unanswerable questions over their paragraph less the answer
SWAPPED_SUFFIX = "+swapped"  # ... and in this: the question with one of its names or numbers swapped
NEGATED_SUFFIX = "+negated"  # ... and in this: the question negated ("did X leave" -> "did X not leave")
NEGATIVE_SHARE = 0.33  # about a third of the questions get a second, unanswerable copy: SQuAD 2.0's ratio


def _draw(qa: dict, salt: str = "") -> int:
    """A fixed pseudo-random 32-bit number per question (a hash of its id): the same choices every run."""
    return int(hashlib.sha256((salt + str(qa.get("id", qa["question"]))).encode()).hexdigest()[:8], 16)


def _says_an_answer(text: str, answers: list[dict]) -> bool:
    """Whether any answer's text occurs in `text` (normalised as the SQuAD metric does): a context that
    does cannot be labelled unanswerable."""
    text = normalize_answer(text)
    return any(normalize_answer(a["text"]) in text for a in answers)


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


def _mentions(folded: str, entity: str) -> bool:
    """Whether normalised text says a normalised name or number, as whole words (a possessive too)."""
    return re.search(rf"(?<!\w){re.escape(entity)}s?(?!\w)", folded) is not None


def swapped_question(question: str, context: str, answers: list[dict], pool: dict[str, list[str]],
                     draw: int) -> str | None:
    """The question with one of its names or numbers that the paragraph also says (and no answer
    contains) replaced by another of the same kind from `pool` (article_entities: the article's
    questions and answers) that the paragraph never says, or None when there is no such pair. The paragraph then no longer answers
    it: SQuAD 2.0's most common kind of unanswerable question (an entity swap)."""
    folded = normalize_answer(context)
    gold = [normalize_answer(a["text"]) for a in answers]
    anchors = []
    for start, end in question_entities(question):
        entity = question[start:end].rstrip(".")
        norm = normalize_answer(entity)
        if norm and _mentions(folded, norm) and not any(_mentions(g, norm) or _mentions(norm, g) for g in gold if g):
            anchors.append((start, start + len(entity), entity))
    if not anchors:
        return None
    start, end, entity = anchors[draw % len(anchors)]
    replacements = [other for other in pool.get(_entity_kind(entity), ())
                    if normalize_answer(other) and not _mentions(folded, normalize_answer(other))
                    and not _mentions(normalize_answer(entity), normalize_answer(other))]
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


def read_data(path, split: str = "dev"):
    """A SQuAD-format JSON file (v1.1, or v2.0 with unanswerable questions: answers [""], starts [-1]);
    yields ({"question", "context"}, {"answers": texts, "starts": char offsets}).

    Splits can add unanswerable questions built from the answerable ones, each for about a third of
    the questions (chosen by a hash of the question id, so the same ones every time) and each only
    where no answer's text is left in the new context:

    - "+negatives" (e.g. "train+negatives"): the question over another paragraph of the same
      article, the standard construction of no-answer training data from SQuAD 1.1. These are easy:
      the paragraph is about something else.
    - "+removed" (e.g. "train+negatives+removed"): the question over its own paragraph with the
      sentences holding the answer taken out. These are hard, as SQuAD 2.0's are: the paragraph is
      on topic and still names the question's entities, but no longer says the answer.
    - "+swapped": the question over its own paragraph with one name or number it shares with the
      paragraph replaced by another from the same article that the paragraph never says
      ("When did Beyonce leave Destiny's Child?" -> "When did Beyonce leave Def Jam?"), as SQuAD 2.0's
      writers most often made theirs (`swapped_question`): the model must check what the question
      asks about, not only that the paragraph is on topic.
    - "+negated": the question over its own paragraph with "not" put in (`negated_question`: "When
      did Beyonce leave Destiny's Child?" -> "When did Beyonce not leave Destiny's Child?"), SQuAD
      2.0's second way of writing one: the paragraph says who did, not who did not.
    """
    with open(path, encoding="utf-8") as handle:
        try:
            data = json.load(handle)["data"]
        except (ValueError, KeyError) as err:
            raise ValueError(f"{path}: not a SQuAD-format JSON file ({err})") from None
    kinds = str(split).split("+")[1:]
    known = (NEGATIVES_SUFFIX, REMOVED_SUFFIX, SWAPPED_SUFFIX, NEGATED_SUFFIX)
    unknown = sorted(set(kinds) - {suffix[1:] for suffix in known})
    if unknown:
        raise ValueError(f"qa: split {split!r} adds {unknown}; known additions are {', '.join(map(repr, known))}")
    negatives, removed, swapped, negated = (suffix[1:] in kinds for suffix in known)
    for article in data:
        paragraphs = article["paragraphs"]
        pool = article_entities([qa["question"] for p in paragraphs for qa in p["qas"]],
                                [a["text"] for p in paragraphs for qa in p["qas"] for a in qa["answers"]]) if swapped else {}
        for index, paragraph in enumerate(paragraphs):
            sentences = None  # split once per paragraph, when a question first needs it
            for qa in paragraph["qas"]:
                answers = [] if qa.get("is_impossible") else qa["answers"]
                yield ({"question": qa["question"], "context": paragraph["context"]},
                       {"answers": [a["text"] for a in answers] or [""],
                        "starts": [a["answer_start"] for a in answers] or [-1]})
                if not answers:
                    continue
                if negatives and len(paragraphs) > 1:
                    draw = _draw(qa)
                    if draw / 0xFFFFFFFF < NEGATIVE_SHARE:
                        other = paragraphs[(index + 1 + draw % (len(paragraphs) - 1)) % len(paragraphs)]["context"]
                        if not _says_an_answer(other, answers):
                            yield {"question": qa["question"], "context": other}, {"answers": [""], "starts": [-1]}
                if removed and _draw(qa, "removed") / 0xFFFFFFFF < NEGATIVE_SHARE:
                    if sentences is None:
                        sentences = split_sentences(paragraph["context"])
                    rest = without_answer_sentences(paragraph["context"], answers, sentences)
                    if rest is not None:
                        yield {"question": qa["question"], "context": rest}, {"answers": [""], "starts": [-1]}
                if swapped and (draw := _draw(qa, "swapped")) / 0xFFFFFFFF < NEGATIVE_SHARE:
                    question = swapped_question(qa["question"], paragraph["context"], answers, pool, draw)
                    if question is not None:
                        yield {"question": question, "context": paragraph["context"]}, {"answers": [""], "starts": [-1]}
                if negated and _draw(qa, "negated") / 0xFFFFFFFF < NEGATIVE_SHARE:
                    question = negated_question(qa["question"])
                    if question is not None:
                        yield {"question": question, "context": paragraph["context"]}, {"answers": [""], "starts": [-1]}


def _padded(batches: list, name: str, value: int) -> torch.Tensor:
    """The `name` tensors of several batches, right-padded with `value` to the widest, stacked: (rows, width)."""
    width = max(b.input_ids.shape[1] for b in batches)
    return torch.cat([torch.nn.functional.pad(getattr(b, name), (0, width - b.input_ids.shape[1]), value=value)
                      for b in batches])


def predict_many(predictor, items: list[dict], *, max_rows: int = 32, progress: bool = False, **options) -> list[dict]:
    """Answers for many (question, context) inputs, in order: each is windowed alone, then the windows
    of neighbouring inputs (sorted by length, so padding stays small) share forward passes of up to
    `max_rows` rows, and each input is postprocessed alone — the same answers as one `predict` each.

    Raises:
        InputError: a bad input or option, naming the input's position.
    """
    predictor = predictor.get()
    options = predictor.check_options(options)
    batches = []
    for i, item in enumerate(items):
        try:
            predictor.check_inputs(item, {})
            batches.append(preprocess(item, predictor.tokenizer, **options))
        except InputError as err:
            raise InputError(f"qa: input {i}: {err}") from None
    order = sorted(range(len(items)), key=lambda i: batches[i].input_ids.shape[1])
    groups, group, rows = [], [], 0
    for i in order:
        if group and rows + len(batches[i]) > max_rows:
            groups.append(group)
            group, rows = [], 0
        group.append(i)
        rows += len(batches[i])
    groups += [group] if group else []
    results: list[Any] = [None] * len(items)
    pad = predictor.tokenizer.pad_token_id
    for group in tqdm(groups, disable=not progress, desc="qa", unit="batch"):
        rows = [batches[i] for i in group]
        inputs = {"input_ids": _padded(rows, "input_ids", pad), "attention_mask": _padded(rows, "attention_mask", 0),
                  "token_type_ids": _padded(rows, "token_type_ids", 0)}
        output = predictor.forward_rows(inputs)
        starts, ends = output.start_logits.float().cpu(), output.end_logits.float().cpu()  # (rows, width)
        row = 0
        for i in group:
            n, t = len(batches[i]), batches[i].input_ids.shape[1]
            output = SpanOutput(starts[row:row + n, :t], ends[row:row + n, :t])
            results[i] = postprocess(output, batches[i], **options)
            row += n
    return results


def evaluate(predictor, examples: list, *, progress: bool = False, **options) -> dict[str, float]:
    """Official EM / F1 over (inputs, target) examples, predicted in shared batches (predict_many)."""
    results = predict_many(predictor, [inputs for inputs, _ in examples], progress=progress, **options)
    return metric(results, [target for _, target in examples])


def evaluate_squad(predictor, path, *, limit: int | None = None, progress: bool = True, **options) -> dict[str, Any]:
    """Predict every question of a SQuAD file and score it with the official EM / F1."""
    examples = list(read_data(path))[:limit]
    return {**evaluate(predictor, examples, progress=progress, **options), "questions": len(examples)}


def training_batch(examples, tokenizer, *, generator=None, max_seq_len: int = 384, doc_stride: int = 128,
                   max_question_len: int = 64):
    """Windows over each context (as at inference) and per window the (start, end) token of the first
    gold answer, or (0, 0) — the [CLS] token — when the answer is not wholly inside that window."""
    questions = []
    for (inputs, _), encoding in zip(examples, tokenizer.pieces([x["question"] for x, _ in examples])):
        offsets = encoding.offsets
        cut = offsets[max_question_len - 1][1] if len(offsets) > max_question_len else len(inputs["question"])
        questions.append(inputs["question"][:cut])
    contexts = [inputs["context"] for inputs, _ in examples]
    batch = tokenizer(questions, contexts, max_length=max_seq_len, truncation="only_second", stride=doc_stride,
                      return_overflowing=True)
    positions = []
    for r, sample in enumerate(batch.sample_index):
        target = examples[sample][1]
        start_char = target["starts"][0]
        end_char = start_char + len(target["answers"][0])
        start = end = 0
        if start_char >= 0:
            tokens = [t for t, seq in enumerate(batch.sequence_ids[r]) if seq == 1]
            first, last = batch.offsets[r][tokens[0]][0], batch.offsets[r][tokens[-1]][1]
            if first <= start_char and end_char <= last:
                start = next(t for t in tokens if batch.offsets[r][t][1] > start_char)
                end = next(t for t in reversed(tokens) if batch.offsets[r][t][0] < end_char)
        positions.append((start, end))
    return batch, positions


def loss(output, targets: list[tuple[int, int]]):
    """Mean cross-entropy of the start and end token positions (targets: (start, end) per row), the
    softmax over each row's real tokens only: padding is no candidate position."""
    positions = torch.tensor(targets, device=output.start_logits.device)
    starts, ends = output.start_logits.float(), output.end_logits.float()
    mask = output.encoder.attention_mask if output.encoder is not None else None
    if mask is not None:
        padding = ~mask.to(device=starts.device, dtype=torch.bool)
        starts, ends = starts.masked_fill(padding, -1e9), ends.masked_fill(padding, -1e9)
    ce = torch.nn.functional.cross_entropy
    return (ce(starts, positions[:, 0]) + ce(ends, positions[:, 1])) / 2


EXCERPT_CHARS = 600  # a longer context shows this much around the answer, the whole text one click away


def answer_view(context: str, result: dict) -> str:
    """The headline ("Answer: ... - 88 %" or "No answer in this context") over the context with the
    answer marked inline; a long context shows an excerpt around the answer and the rest on demand."""
    answers, null = result["answers"], result["no_answer"]
    if null["predicted"] or not answers:
        why = (f"the best span, “{escape(answers[0]['answer'])}” ({percent(answers[0]['score'])}), "
               f"is weaker than “no answer” by more than the threshold" if answers else "no span fits")
        return (f'<div class="qa-view"><p class="qa-headline qa-none"><b>No answer in this context</b> '
                f'<span class="qa-why">({why})</span></p></div>')
    best = answers[0]
    start, end, score = best["start"], best["end"], percent(best["score"])
    mark = (f'<mark class="be-mark qa-answer" style="background:#fde68a;padding:0 .15em;border-radius:3px;'
            f'white-space:nowrap">{escape(context[start:end])}<sup class="qa-score"> {score}</sup></mark>')
    if len(context) <= EXCERPT_CHARS:
        body = escape(context[:start]) + mark + escape(context[end:])
    else:
        lo, hi = max(0, start - EXCERPT_CHARS // 2), min(len(context), end + EXCERPT_CHARS // 2)
        body = ("… " if lo else "") + escape(context[lo:start]) + mark + escape(context[end:hi]) + (" …" if hi < len(context) else "")
        body += (f'<details class="qa-whole"><summary>The whole context ({len(context):,} characters)</summary>'
                 f'{escape(context[:start])}{mark}{escape(context[end:])}</details>')
    return (f'<div class="qa-view"><p class="qa-headline">Answer: <b>{escape(best["answer"])}</b> – {score}</p>'
            f'<div class="qa-context" style="white-space:pre-wrap;line-height:1.6">{body}</div></div>')


def candidate_scores(result: dict) -> dict[str, float]:
    """Candidates for the bars: answer text -> probability, with "no answer" among them; the same text
    found at two places is told apart by its position."""
    scores: dict[str, float] = {}
    for a in result["answers"]:
        label = a["answer"] if a["answer"] not in scores else f"{a['answer']} (at {a['start']})"
        scores[label] = a["score"]
    scores["(no answer)"] = result["no_answer"]["score"]
    return scores


def build_tab(predictor) -> None:
    import gradio as gr  # noqa: PLC0415 - Gradio loads only where a UI is built

    # The default model's calibrated value (its manifest's options), read without loading the model.
    folder = getattr(predictor, "checkpoint", None) or predictor.task.spec.default_checkpoint
    threshold = model_options(folder, predictor.task.spec).get("null_threshold") if folder else None
    question = gr.Textbox(label="Question", value=EXAMPLES[0]["question"])
    context = gr.Textbox(label="Context", lines=6, max_lines=16, value=EXAMPLES[0]["context"])
    with gr.Accordion("Options", open=False):
        top_k = gr.Slider(1, 10, value=3, step=1, label="Candidates (top-k)")  # the tab lists 3; the API default is 1
        allow_none = gr.Checkbox(value=threshold is not None, label="Answer “no answer” when that scores better "
                                 "than the best span by more than the threshold")
        null_threshold = gr.Slider(-20, 20, value=threshold if threshold is not None else 0.0, step=0.1,
                                   label="No-answer threshold (logits)" + (" – the model's calibrated value"
                                                                          if threshold is not None else ""))
    button = ui.run_button(gr, "Answer")
    view = gr.HTML(label="Answer in its context")
    candidates = gr.Label(label="Candidates", show_label=True)
    details = ui.details(gr)

    def run(question_value: str, context_value: str, k: float = 3, use_threshold: bool = threshold is not None,
            threshold_value: float = threshold or 0.0):
        output = predictor.predict({"question": question_value, "context": context_value}, top_k=int(k),
                                   null_threshold=float(threshold_value) if use_threshold else None)
        result = output["result"]
        return answer_view(context_value, result), candidate_scores(result), output

    ui.wire(gr, button, run, [question, context, top_k, allow_none, null_threshold], [view, candidates, details],
            api_name="qa", examples=[[e["question"], e["context"]] for e in EXAMPLES])


EXAMPLES = (
    {"question": "Where do water droplets collide with ice crystals to form precipitation?",
     "context": "In meteorology, precipitation is any product of the condensation of atmospheric water vapor "
                "that falls under gravity. Precipitation forms as smaller droplets coalesce via collision with "
                "other rain drops or ice crystals within a cloud."},
    {"question": "Who wrote the book?",
     "context": "The book, published in 1851, was written by Herman Melville and follows the voyage of a whaler."},
    {"question": "Who is the president of France?",  # not in the text: the default threshold says "no answer"
     "context": "Florida is a state in the southeastern United States. Its capital is Tallahassee and its largest "
                "city is Jacksonville."},
)


def pipeline_output(result: dict, options, single: bool):
    """The question-answering pipeline's shape (transformers v4): {"score", "start", "end", "answer"},
    a list of them with top_k > 1; "no answer" is {"score": its probability, "start": 0, "end": 0,
    "answer": ""} as with handle_impossible_answer=True."""
    answers = [{"score": a["score"], "start": a["start"], "end": a["end"], "answer": a["answer"]}
               for a in result["answers"]]
    if result["no_answer"]["predicted"] or not answers:
        answers = [{"score": result["no_answer"]["score"], "start": 0, "end": 0, "answer": ""}, *answers]
    top_k = options.get("top_k") or 1
    return answers[0] if top_k == 1 else answers[:top_k]



def brief(result) -> str:
    """The answer and its probability, or that the context holds none."""
    answers = result["answers"]
    if result["no_answer"]["predicted"] or not answers:
        return "no answer in this context"
    return f"{answers[0]['answer']} {ui.percent(answers[0]['score'])}"

@hookimpl
def register_tasks(register):
    register(TaskSpec(
        brief=brief,
        name="qa",
        default_checkpoint=starter_checkpoint("qa"),
        title="Question answering",
        description="Find the answer to a question inside a context; long contexts are read in overlapping windows.",
        build_head=SpanHead,
        preprocess=preprocess,
        postprocess=postprocess,
        build_tab=build_tab,
        input_fields=("question", "context"),
        options=OPTIONS,
        examples=EXAMPLES,
        read_data=read_data,
        loss=loss,
        training_batch=training_batch,
        metric=metric,
        best_metric="f1",
        aliases=("question-answering",),
        pipeline_output=pipeline_output,
        evaluate=evaluate,
    ))

