"""Named-entity recognition: a token-classification head with a CRF, word-level entities with offsets.

Each word (as the tokenizer's pre-tokeniser splits it) is tagged at its first wordpiece. Decoding
is constrained Viterbi over the CRF, so even a checkpoint without a CRF (a plain
BertForTokenClassification) never yields an invalid tag sequence; a trained CRF's transitions are
used when the checkpoint has them (`head.crf.*`). Long texts run in overlapping windows; where
entities from two windows overlap, the higher-scoring one wins. Scores are CRF marginals.

An uncased encoder cannot see that a word is capitalised, the cue cased NER models lean on most. With
the `casing` option, every wordpiece of a word that starts with a capital letter gets segment id 1
instead of 0, so the encoder's second segment embedding marks it at the input and every layer can use
it (a one-text task never uses that embedding otherwise). A model trained with it answers with it by
default (its checkpoint's task_options.json and its pack's manifest say so). No effect on a model with
one segment (RoBERTa, DistilBERT).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from html import escape
from typing import Any

import torch
from torch import Tensor

from bert_engine import CheckpointError, ui
from bert_engine.crf import CRF
from bert_engine.heads import IGNORE_INDEX, TokenClassificationHead
from bert_engine.hookspecs import ExplainTarget, InputError, TaskSpec, check_int, hookimpl, length_option
from bert_engine.runtime.inference import predict_texts
from bert_engine.ui import percent
from plugins.starter import starter_checkpoint

from .tagging import SCHEMES, allowed_transitions, chunks, convert, detect_scheme, entity_scores, read_conll

CONLL_TAGS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")
MAX_WINDOWS = 256
MAX_NBEST = 20


@dataclass
class NerOutput:
    logits: Tensor  # (B, T, L) emission scores
    head: Any  # the NerHead: labels, scheme and CRF for decoding
    encoder: Any = None


class NerHead(TokenClassificationHead):
    """Token classification (`classifier.*`, as BertForTokenClassification) plus a CRF (`crf.*`)."""

    optional_parameters = ("crf.",)  # a plain token-classification checkpoint has no CRF

    def __init__(self, config, scheme: str | None = None) -> None:
        if config.num_labels == 0:  # an encoder-only checkpoint: CoNLL-2003's tags in BIO
            config = config.with_labels(list(CONLL_TAGS))
        super().__init__(config)
        self.labels = tuple(config.id2label[i] for i in range(config.num_labels))
        try:
            self.scheme = scheme or detect_scheme(self.labels)
            constraints = allowed_transitions(self.labels, self.scheme)
        except ValueError as err:  # another task's checkpoint (a sentiment model's labels): the user's choice of model
            raise CheckpointError(f"ner: the checkpoint's labels cannot be read as entity tags: {err}; "
                                  "pick a token-classification (NER) checkpoint") from None
        self.crf = CRF(len(self.labels))
        self.crf.set_constraints(*constraints)

    def forward(self, encoded) -> NerOutput:
        return NerOutput(super().forward(encoded).logits, self)


# -- preprocessing ---------------------------------------------------------------------------------

def check_options(options) -> None:
    """The option values that need no tokenizer (TaskSpec.check_options: also when a pipeline is made)."""
    check_int("ner", "nbest", options["nbest"], 1, MAX_NBEST)
    for name in ("constrained", "casing"):
        if not isinstance(options[name], bool):
            raise InputError(f"ner: {name} must be true or false, got {options[name]!r}")
    if options["scheme"] != "auto" and options["scheme"] not in SCHEMES:
        raise InputError(f"ner: scheme {options['scheme']!r} is not 'auto' or one of {SCHEMES}")


def _check_options(tokenizer, max_length, stride, nbest, constrained, scheme, casing) -> tuple[int, int]:
    """The checked options; returns max_length and stride with None resolved against the model."""
    max_length = length_option("ner", "max_length", max_length, 256, 16, tokenizer)
    stride = min(64, max_length // 4) if stride is None else stride
    check_int("ner", "stride", stride, 0, max_length // 2)
    check_options({"nbest": nbest, "constrained": constrained, "casing": casing, "scheme": scheme})
    return max_length, stride


# The task's options and their defaults, declared once: the Predictor passes every one to preprocess
# and postprocess (a caller's values over these).
OPTIONS = {"max_length": None, "stride": None, "nbest": 3, "constrained": True, "scheme": "auto", "casing": False}


def mark_capitalised(batch, texts: list[str], skip: set[int] = frozenset()) -> None:
    """Segment id 1 on every wordpiece of a word (as the pre-tokeniser splits them) whose first
    character in its text is a capital letter, 0 elsewhere: the `casing` option, in place. The rows
    of the texts numbered in `skip` keep 0 throughout."""
    spans = word_spans(batch)
    rows, columns = [], []  # set at once: a tensor's item assignment costs several microseconds each
    for r, sample in enumerate(batch.sample_index):
        for t, (word, seq) in enumerate(zip(batch.word_ids[r], batch.sequence_ids[r])):
            if word is not None and seq == 0 and sample not in skip and texts[sample][spans[(sample, word)][0]].isupper():
                rows.append(r)
                columns.append(t)
    if rows:
        batch.token_type_ids[rows, columns] = 1


def preprocess(inputs, tokenizer, *, max_length, stride, nbest, constrained, scheme, casing):
    """One text (or a list, for batches) -> overlapping windows; first wordpieces are found after the model."""
    max_length, stride = _check_options(tokenizer, max_length, stride, nbest, constrained, scheme, casing)
    texts = inputs["text"] if isinstance(inputs["text"], list) else [inputs["text"]]
    for text in texts:
        if not text.strip():
            raise InputError("ner: the text is empty; type a sentence with names, places or organisations")
    counted = getattr(tokenizer, "windows_at_least", None)  # from below, nothing tokenised: a text far over the
    if counted is not None:                                  # limit is refused in milliseconds, not seconds
        least = sum(counted(text, max_length=max_length, stride=stride) for text in texts)
        if least > MAX_WINDOWS * len(texts):
            raise InputError(f"ner: the text needs at least {least:,} windows of {max_length} tokens; the limit is "
                             f"{MAX_WINDOWS}")
    batch = tokenizer(texts, max_length=max_length, stride=stride, return_overflowing=True)
    if len(batch) > MAX_WINDOWS * len(texts):
        raise InputError(f"ner: the text needs {len(batch)} windows of {max_length} tokens; the limit is {MAX_WINDOWS}")
    # Special tokens typed into the text ("[MASK]", "[SEP]") are markup, never a word to tag.
    batch.meta.update(texts=texts, special_ids=frozenset(
        i for i in (tokenizer.token_id(n) for n in ("cls_token", "sep_token", "pad_token", "mask_token")) if i is not None))
    if casing:
        mark_capitalised(batch, texts)
    return batch


def word_spans(batch) -> dict[tuple[int, int], tuple[int, int]]:
    """{(sample, word id): (start char, end char)} of every word of the text, over all its windows."""
    spans: dict[tuple[int, int], tuple[int, int]] = {}
    for r, sample in enumerate(batch.sample_index):
        for (start, end), word, seq in zip(batch.offsets[r], batch.word_ids[r], batch.sequence_ids[r]):
            if word is None or seq != 0:
                continue
            old = spans.get((sample, word))
            spans[(sample, word)] = (start, end) if old is None else (min(old[0], start), max(old[1], end))
    return spans


def word_layout(batch) -> tuple[Tensor, Tensor, Tensor, dict]:
    """Which positions carry a tag, and where each window sits in its input.

    Returns:
        (mask (B, T) bool of each word's first wordpiece, begins (B,) bool, ends (B,) bool,
         {(sample, word id): (start char, end char)}). A window that starts mid-word does not tag
         that word; a window is a begin / end when it is its input's first / last row; a special token
         typed into the text (batch.meta["special_ids"]) is no word.
    """
    spans = word_spans(batch)
    B, T = batch.input_ids.shape
    special = batch.meta.get("special_ids", frozenset())
    rows = []
    for r, sample in enumerate(batch.sample_index):
        ids, word_ids = batch.input_ids[r].tolist(), batch.word_ids[r]
        row = [word is not None and seq == 0 and start == spans[(sample, word)][0] and (
               t == 0 or word_ids[t - 1] != word) and ids[t] not in special
               for t, ((start, _), word, seq) in enumerate(zip(batch.offsets[r], word_ids, batch.sequence_ids[r]))]
        rows.append(row + [False] * (T - len(row)))
    mask = torch.tensor(rows, dtype=torch.bool).reshape(B, T)
    samples = batch.sample_index
    begins = torch.tensor([r == 0 or samples[r - 1] != s for r, s in enumerate(samples)])
    ends = torch.tensor([r == len(samples) - 1 or samples[r + 1] != s for r, s in enumerate(samples)])
    return mask, begins, ends, spans


# -- postprocessing --------------------------------------------------------------------------------

def postprocess(output: NerOutput, batch, *, max_length, stride, nbest, constrained, scheme, casing):
    """Per input: entities (type, start, end, text, score, words), per-word tags (Viterbi and argmax),
    the n-best tag sequences of the first window with their probabilities."""
    head = output.head
    used_scheme = head.scheme if scheme == "auto" else scheme
    check_scheme_fits(used_scheme, head.labels)
    crf = _decoder(head, used_scheme)
    mask, begins, ends, spans = word_layout(batch)
    emissions = output.logits.float().cpu()
    kwargs = dict(constrained=constrained, begins=begins, ends=ends)
    paths, marginals, log_z = crf.decode_with_marginals(emissions, mask, nbest=nbest, **kwargs)  # marginals (B, T, L)
    rows_of: dict[int, list[int]] = {}
    for r, sample in enumerate(batch.sample_index):
        rows_of.setdefault(sample, []).append(r)
    results = []
    for i, text in enumerate(batch.meta["texts"]):
        results.append(_one_input(i, text, rows_of[i], batch, head.labels, mask, paths, marginals, log_z, emissions,
                                  spans, used_scheme, constrained))
    return results[0] if len(results) == 1 else results


def check_scheme_fits(scheme: str, labels) -> None:
    """Refuse a `scheme=` the model's labels cannot be read in: BIO or IOB1 over labels with E- or S- tags (the
    scheme has none), BIOES over labels without them (no entity could end: every word would be "O"). BIO labels read
    as IOB1 are a real choice (B- then only splits two neighbouring entities of one type) and pass."""
    own = detect_scheme(labels)
    if own != "BIOES" and scheme == "BIOES":
        raise InputError("ner: scheme 'BIOES' does not fit this model's labels (B-/I- tags, no E- or S-: no entity "
                         "could end); use 'auto', 'BIO' or 'IOB1'")
    if own == "BIOES" and scheme != "BIOES":
        raise InputError(f"ner: scheme {scheme!r} does not fit this model's labels (they use E- and S- tags); use "
                         "'auto' or 'BIOES'")


def _decoder(head: NerHead, scheme: str) -> CRF:
    """The head's CRF on the CPU (decoding is sequential) with the constraints of `scheme`."""
    crf = head.crf
    if crf.transitions.device.type == "cpu" and scheme == head.scheme:
        return crf
    copy = CRF(crf.num_tags)
    copy.load_state_dict({k: v.detach().float().cpu() for k, v in crf.state_dict().items()})
    copy.set_constraints(*allowed_transitions(head.labels, scheme))
    return copy


def _one_input(i, text, rows, batch, labels, mask, paths, marginals, log_z, emissions, spans, scheme, constrained):
    candidates = []  # (score, first word, last word + 1, type) from every window
    best_row: dict[int, tuple[int, int, int, int]] = {}  # word -> (context, row, position, path index)
    probs_of = {r: marginals[r].tolist() for r in rows}  # (T, L) as lists: read per word below
    argmax_of = {r: emissions[r].argmax(-1).tolist() for r in rows}  # (T,)
    for r in rows:
        positions = mask[r].nonzero().squeeze(-1).tolist()
        words = [batch.word_ids[r][t] for t in positions]
        tags = [labels[k] for k in paths[r][0][0]] if paths[r] else ["O"] * len(positions)
        for begin, end, kind in chunks(tags):
            probs = [probs_of[r][positions[j]][paths[r][0][0][j]] for j in range(begin, end)]
            candidates.append((sum(probs) / len(probs), words[begin], words[end - 1] + 1, kind))
        for j, word in enumerate(words):
            context = min(j, len(words) - 1 - j)
            if word not in best_row or context > best_row[word][0]:
                best_row[word] = (context, r, positions[j], j)
    taken: set[int] = set()
    entities = []
    for score, first, stop, kind in sorted(candidates, key=lambda c: (-c[0], c[1])):
        covered = set(range(first, stop))
        if covered & taken:
            continue  # overlaps an entity from a higher-scoring window (or the same one found twice)
        taken |= covered
        start, end = spans[(i, first)][0], spans[(i, stop - 1)][1]
        entities.append({"type": kind, "start": start, "end": end, "text": text[start:end],
                         "score": round(score, 6), "words": [text[slice(*spans[(i, w)])] for w in range(first, stop)
                                                              if (i, w) in spans]})
    entities.sort(key=lambda e: e["start"])
    words_out = []
    for word in sorted(best_row):
        _, r, t, j = best_row[word]
        tag_id = paths[r][0][0][j] if paths[r] else 0
        start, end = spans[(i, word)]
        words_out.append({"word": text[start:end], "start": start, "end": end, "tag": labels[tag_id],
                          "argmax": labels[argmax_of[r][t]], "score": round(probs_of[r][t][tag_id], 6)})
    first_row = rows[0]
    nbest = [{"tags": [labels[k] for k in path], "probability": _prob(score - float(log_z[first_row]))}
             for path, score in paths[first_row]]
    argmax_tags = [w["argmax"] for w in words_out]
    return {"entities": entities, "words": words_out, "nbest": nbest, "scheme": scheme, "constrained": constrained,
            "argmax_valid": is_valid(argmax_tags, labels, scheme), "windows": len(rows)}


def _prob(log_prob: float) -> float:
    """A probability from its log, kept to 6 significant digits (tiny n-best probabilities stay visible)."""
    return float(f"{math.exp(min(log_prob, 0.0)):.6g}")


def is_valid(tags: list[str], labels, scheme: str) -> bool:
    """Whether a tag sequence obeys the scheme's transitions (start and end included)."""
    allowed, start, end = _allowed_lists(tuple(labels), scheme)
    index = {label: k for k, label in enumerate(labels)}
    ids = [index[t] for t in tags]
    if not ids:
        return True
    return start[ids[0]] and end[ids[-1]] and all(allowed[a][b] for a, b in zip(ids, ids[1:]))


@functools.lru_cache(maxsize=64)
def _allowed_lists(labels: tuple[str, ...], scheme: str) -> tuple[list, list, list]:
    """allowed_transitions as nested lists of bools, worked out once per label set and scheme (not per request)."""
    return tuple(t.tolist() for t in allowed_transitions(labels, scheme))


def transition_table(head: NerHead, constrained: bool = True) -> dict[str, Any]:
    """The CRF's transition scores as a JSON-friendly table (from-tag rows, to-tag columns)."""
    trans, start, end = (t.detach().float().cpu() for t in head.crf.potentials(constrained))
    return {"labels": list(head.labels), "transitions": trans.tolist(), "start": start.tolist(), "end": end.tolist(),
            "trained": bool(head.crf.transitions.detach().abs().sum() > 0)}


# -- training and evaluation -----------------------------------------------------------------------

LOWER_SUFFIX = "+lower"  # a split name ending in it reads the text in lower case (read_data)


SPLITS = ("train", "dev", "validation", "test", "all")


def read_data(path, split: str = "train"):
    """A CoNLL-2003 file; yields ({"text": words joined by spaces}, {"words", "tags" in BIO}) per sentence.
    A split ending in "+lower" (e.g. "test+lower") lower-cases every word: how the model reads text
    typed without capitals, the cue a casing model leans on. The file is one split: `split` names it (train,
    dev, validation, test or all, each with "+lower" or not) and selects nothing.

    Raises:
        ValueError: a split that is none of those names (a typo was read as the file)."""
    lower = str(split).endswith(LOWER_SUFFIX)
    if split is not None and str(split).removesuffix(LOWER_SUFFIX) not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}, each with {LOWER_SUFFIX!r} or not (a "
                         "CoNLL file holds one split: the name only says which)")
    for words, tags in read_conll(path):
        words = [word.lower() for word in words] if lower else words
        yield {"text": " ".join(words)}, {"words": words, "tags": convert(tags, "BIO")}


def training_batch(examples, tokenizer, *, generator=None, max_length: int = 256, stride: int = 64,
                   casing: bool = False, casing_dropout: float = 0.0):
    """Tokenise sentences and place each word's tag on its first wordpiece (-100 elsewhere); `casing`
    marks capitalised words as preprocess does (train with `-o casing=true`, and the packed model
    answers with it); `casing_dropout` leaves the marks off that share of the sentences (drawn from
    `generator`), so the model also reads text that has no capitals (typed in lower case) by its words.

    A data word the pre-tokeniser splits ("U.S.") tags its later pieces as the entity's continuation,
    the same way inference reads them. Returns (Batch, {"tags": per row per token tag or None,
    "begins", "ends"}) for `loss`.
    """
    texts = [inputs["text"] for inputs, _ in examples]
    batch = tokenizer(texts, max_length=max_length, stride=stride, return_overflowing=True)
    if casing:
        if not 0.0 <= casing_dropout <= 1.0:
            raise ValueError(f"ner: casing_dropout must lie in [0, 1], got {casing_dropout!r}")
        drop = torch.rand(len(texts), generator=generator) < casing_dropout
        mark_capitalised(batch, texts, skip={k for k, off in enumerate(drop.tolist()) if off})
    mask, begins, ends, spans = word_layout(batch)
    starts = []
    for _, target in examples:  # the character start of each data word in the joined text
        offset, row = 0, {}
        for k, word in enumerate(target["words"]):
            row[offset] = k
            offset += len(word) + 1
        starts.append(row)
    tags = []
    for r, sample in enumerate(batch.sample_index):
        gold, row_tags, current = examples[sample][1]["tags"], [], None
        for t in range(batch.input_ids.shape[1]):
            word = batch.word_ids[r][t] if t < len(batch.word_ids[r]) else None
            if not mask[r, t]:
                row_tags.append(None)
                continue
            start = spans[(sample, word)][0]
            if start in starts[sample]:
                current = starts[sample][start]
                row_tags.append(gold[current])
            else:  # a later piece of a data word: continue its entity
                tag = gold[current] if current is not None else "O"
                row_tags.append("O" if tag == "O" else "I-" + tag[2:])
        tags.append(row_tags)
    return batch, {"tags": tags, "begins": begins, "ends": ends}


def loss(output: NerOutput, targets) -> Tensor:
    """Mean negative CRF log-likelihood of the gold tags (untagged positions skipped)."""
    head = output.head
    index = {label: k for k, label in enumerate(head.labels)}
    unknown = sorted({t for row in targets["tags"] for t in row if t is not None and t not in index})
    if unknown:
        raise ValueError(f"ner: tags {unknown} are not in the head's labels {list(head.labels)}")
    labels = torch.tensor([[index[t] if t is not None else IGNORE_INDEX for t in row] for row in targets["tags"]],
                          device=output.logits.device)
    ll = head.crf.log_likelihood(output.logits, labels, begins=targets["begins"], ends=targets["ends"])
    return -ll.mean()


def metric(results: list[dict], targets: list[dict]) -> dict[str, Any]:
    """Entity-level P/R/F1 (conlleval semantics) over the data's own words.

    Each data word takes the predicted tag of its first pre-tokenised word (the usual first-subword rule).
    """
    gold, predicted = [], []
    for result, target in zip(results, targets):
        by_start = {w["start"]: w["tag"] for w in result["words"]}
        offset, tags = 0, []
        for word in target["words"]:
            tags.append(by_start.get(offset, "O"))
            offset += len(word) + 1
        gold.append(chunks(target["tags"]))
        predicted.append(chunks(tags))
    return entity_scores(gold, predicted)


# -- the tab ---------------------------------------------------------------------------------------

COLOURS = {"PER": "#fca5a5", "ORG": "#93c5fd", "LOC": "#86efac", "MISC": "#fde68a"}
OTHER_COLOUR = "#d8b4fe"


def render_entities(text: str, entities: list[dict]) -> str:
    """The text as HTML with each entity marked in its type's colour (dark text on a pale background:
    readable in light and dark themes), then a legend and the list of entities with type and score."""
    parts, cursor = [], 0
    for e in entities:
        colour = COLOURS.get(e["type"], OTHER_COLOUR)
        parts.append(ui.user_text(text[cursor:e["start"]]))
        parts.append(f'<mark class="entity be-mark" data-type="{escape(e["type"])}" title="{escape(e["type"])} '
                     f'{percent(e["score"])}" style="background:{colour};color:{ui.HIGHLIGHT_TEXT};padding:0 2px;'
                     f'border-radius:3px">{ui.user_text(text[e["start"]:e["end"]])}<sup style="font-size:0.7em;color:{ui.HIGHLIGHT_TEXT}"> '
                     f'{escape(e["type"])}</sup></mark>')
        cursor = e["end"]
    parts.append(ui.user_text(text[cursor:]))
    # an unbroken long word (a Welsh place name, a URL) wraps instead of pushing the page sideways on a phone
    marked = ('<div class="ner-text" style="white-space:pre-wrap;line-height:1.9;overflow-wrap:anywhere">'
              + "".join(parts) + "</div>")
    if not entities:
        return marked + '<p class="ner-empty">No entities found in this text.</p>'
    types = sorted({e["type"] for e in entities} | set(COLOURS))
    legend = "".join(f'<span class="be-mark" style="background:{COLOURS.get(t, OTHER_COLOUR)};color:{ui.HIGHLIGHT_TEXT};'
                     f'padding:0 4px;border-radius:3px;margin-right:6px">{escape(t)}</span>' for t in types)
    rows = "".join(f'<tr><td style="overflow-wrap:anywhere">{ui.user_text(e["text"])}</td><td>{escape(e["type"])}</td>'
                   f"<td>{ui.bar(e['score'])}</td></tr>" for e in entities)
    return (marked + f'<p class="ner-legend">{legend}</p>'
            f'<div style="max-width: 100%; overflow-x: auto"><table class="ner-entities" style="width: 100%">'
            f'<tr><th>entity</th><th>type</th><th>score</th></tr>{rows}</table></div>'
            ).replace("<th>", f'<th style="color:{ui.HIGHLIGHT_TEXT};background:#f3f4f6;white-space:nowrap">')


def transition_heatmap(table: dict[str, Any]) -> str:
    """The transition matrix as a coloured table: blue for likely moves, red for unlikely ones, grey for
    the moves the tag scheme forbids; from-tag rows, to-tag columns, the score in each cell."""
    values = [v for row in table["transitions"] for v in row if v > -1e3]
    peak = max((abs(v) for v in values), default=1.0) or 1.0
    th = f'<th style="color:{ui.HIGHLIGHT_TEXT};background:#f9fafb;font-variant:normal;text-transform:none">'  # inline: the theme's table CSS loses to it
    header = "".join(f"{th}{escape(label)}</th>" for label in table["labels"])
    body = []
    for label, row in zip(table["labels"], table["transitions"]):
        cells = []
        for v in row:
            if v <= -1e3:
                cells.append('<td class="forbidden" style="background:#9ca3af;color:#111827" title="forbidden">×</td>')
                continue
            alpha = 0.6 * min(1.0, abs(v) / peak)  # up to 60 % of the hue: dark text stays above 6:1 on every cell
            # opaque (blended with white), so the cell reads the same over a light or a dark page
            base = (37, 99, 235) if v >= 0 else (220, 38, 38)
            rgb = tuple(round(255 + (c - 255) * alpha) for c in base)
            colour = "#{:02x}{:02x}{:02x}".format(*rgb)
            text = ui.readable_text(rgb)
            cells.append(f'<td style="background:{colour};color:{text}">{v:.2f}</td>')
        body.append(f"<tr>{th}{escape(label)}</th>{''.join(cells)}</tr>")
    note = "" if table.get("trained") else "<p>This CRF is untrained: every allowed move scores 0.</p>"
    note += ('<p class="ner-key" style="font-size:0.85em;opacity:.85">How likely the CRF finds one tag after another: '
             "the row is the tag of a word, the column the tag of the next word. Each number is the learned score "
             "of that move (blue above 0: favoured; red below 0: avoided); × is a move the tag scheme forbids "
             "(e.g. I-PER right after O).</p>")
    return (f'{note}<div style="overflow-x:auto"><table class="ner-transitions" style="background:#f9fafb;'
            f'color:#111827;font-size:12px;font-variant:normal"><tr>{th}from \\ to</th>{header}</tr>{"".join(body)}'
            '</table></div>')


def build_tab(predictor) -> None:
    import gradio as gr  # noqa: PLC0415 - Gradio loads only where a UI is built

    text = gr.Textbox(label="Text", lines=4, value=EXAMPLES[0]["text"])
    with gr.Accordion("Options", open=False), gr.Row():
        constrained = gr.Checkbox(value=OPTIONS["constrained"], label="Scheme constraints in decoding")
        nbest = gr.Slider(1, MAX_NBEST, value=OPTIONS["nbest"], step=1, label="n-best paths")
        # "model" keeps whatever the chosen model was trained with (a casing model reads capitals)
        casing = gr.Radio(list(CASING_CHOICES), value="model", label="Read capital letters",
                          info="model: as the model was trained (the starter reads them); on / off to compare")
    button = ui.run_button(gr, "Find entities")
    marked = gr.HTML(ui.empty_state("The text appears here with its people, places and organisations marked."),
                     label="Entities")
    with gr.Accordion("Token-wise argmax vs the Viterbi path (≠: they differ)", open=False):
        words = gr.Dataframe(headers=["word", "argmax", "viterbi", "probability", "differs"], interactive=False,
                             wrap=True, label="Token-wise tags", show_label=False)
    with gr.Accordion("n-best paths (one column per path, one row per word)", open=False):
        paths = gr.Dataframe(headers=["word", "path 1"], interactive=False, wrap=True,
                             label="n-best paths", show_label=False)
    with gr.Accordion("Transition matrix", open=False):
        transitions = gr.HTML(label="Transition matrix")
    details = ui.details(gr)

    def run(text: str, constrained: bool = OPTIONS["constrained"], nbest: float = OPTIONS["nbest"],
            read_capitals: str = "model"):
        """Find the names of people, places, organisations and other entities in a text.

        Args:
            text: the text to tag.
            constrained: keep every tag sequence valid for the tag scheme (true) or decode freely (false).
            nbest: how many of the best tag sequences to return (1-20).
            read_capitals: "model" (as the model was trained), "on" or "off": whether capital letters are read.
        """
        if read_capitals not in CASING_CHOICES:
            raise InputError(f"ner: read_capitals must be one of {list(CASING_CHOICES)}, got {read_capitals!r}")
        chosen = {} if CASING_CHOICES[read_capitals] is None else {"casing": CASING_CHOICES[read_capitals]}
        output = predictor.predict({"text": text}, constrained=bool(constrained), nbest=ui.whole(nbest), **chosen)
        result = output["result"]
        table = transition_table(predictor.get().model.head, bool(constrained))
        return (render_entities(text, result["entities"]),
                [[w["word"], w["argmax"], w["tag"], percent(w["score"]), "≠" if w["argmax"] != w["tag"] else ""]
                 for w in result["words"]],
                nbest_table(result),
                transition_heatmap(table), output)

    ui.wire(gr, button, run, [text, constrained, nbest, casing], [marked, words, paths, transitions, details], api_name="ner",
            examples=[[e["text"]] for e in EXAMPLES])


def nbest_table(result: dict) -> dict:
    """The n-best paths lined up with the words they tag: a row per word of the first window, a column
    per path headed by its rank and probability (Gradio's Dataframe value: headers and rows)."""
    paths = result["nbest"]
    headers = ["word"] + [f"path {n + 1} ({percent(p['probability'])})" for n, p in enumerate(paths)]
    width = max((len(p["tags"]) for p in paths), default=0)
    rows = [[w["word"]] + [p["tags"][j] if j < len(p["tags"]) else "" for p in paths]
            for j, w in enumerate(result["words"][:width])]
    return {"headers": headers, "data": rows}


CASING_CHOICES = {"model": None, "on": True, "off": False}  # the tab's "Read capital letters" -> the casing option

EXAMPLES = (
    {"text": "Angela Merkel met Emmanuel Macron in Paris to discuss the European Union budget."},
    {"text": "Apple opened a new office in Berlin, said Tim Cook on Tuesday."},
)


def pipeline_output(result: dict, options, single: bool) -> list[dict]:
    """transformers' token-classification shape with aggregation_strategy="simple": one dict per
    entity with entity_group, score, word, start, end."""
    return [{"entity_group": e["type"], "score": e["score"], "word": e["text"], "start": e["start"], "end": e["end"]}
            for e in result["entities"]]


def _aggregation_strategy(value) -> dict:
    name = getattr(value, "value", value)  # (transformers' AggregationStrategy enum holds the name)
    if isinstance(name, str) and name.lower() == "simple":
        return {}
    raise InputError(f"ner: aggregation_strategy {value!r:.80} is not offered: entities are whole words as the CRF "
                     "tags them, grouped as aggregation_strategy='simple' groups them (the shape given); raw=True gives "
                     "every word's tag and probabilities")


PIPELINE_ARGUMENTS = {"aggregation_strategy": _aggregation_strategy}  # transformers' token-classification's


def explain(result, batch, **_options) -> list[ExplainTarget]:
    """Per entity: the mean over its tokens of the probability of its type (B-, I-, ... tags of that
    type together, before the CRF), in the first window holding it."""
    if isinstance(result, list):  # several texts at once: explained one by one
        return []
    targets, seen = [], {}
    for entity in result["entities"]:
        row, positions = next(((r, p) for r in range(len(batch))
                               if (p := batch.tokens_within(r, entity["start"], entity["end"]))), (None, []))
        if row is None:
            continue
        name = f"{entity['text']} ({entity['type']})"
        seen[name] = seen.get(name, 0) + 1
        targets.append(ExplainTarget(name if seen[name] == 1 else f"{name} #{seen[name]}",
                                     _type_probability(positions, entity["type"]),
                                     f"mean probability of {entity['type']} per token", row))
    return targets


def _type_probability(positions: list[int], kind: str):
    def score(output: NerOutput) -> Tensor:
        tags = [i for i, label in enumerate(output.head.labels) if label != "O" and label.split("-", 1)[-1] == kind]
        return output.logits.float().softmax(-1)[:, positions][:, :, tags].sum(-1).mean(-1)
    return score


BRIEF_ENTITIES = 20  # a card's share: a long paste's 242 entities filled All tasks' card


def brief(result) -> str:
    """The entities with type and score: "Tim Cook (PER 99 %), Berlin (LOC 98 %)"; past BRIEF_ENTITIES, how many more."""
    entities = result["entities"]
    if not entities:
        return "no entities found"
    shown = ", ".join(f"{e['text']} ({e['type']} {ui.percent(e['score'])})" for e in entities[:BRIEF_ENTITIES])
    more = len(entities) - BRIEF_ENTITIES
    return shown + (f" … and {more:,} more (the Named entities tab shows them all)" if more > 0 else "")


@hookimpl
def register_tasks(register):
    register(TaskSpec(
        brief=brief,
        explain=explain,
        name="ner",
        default_checkpoint=starter_checkpoint("ner"),
        title="Named entities",
        description="Tag people, organisations, places and other names; CRF decoding keeps every tag sequence valid.",
        build_head=NerHead,
        preprocess=preprocess,
        postprocess=postprocess,
        build_tab=build_tab,
        input_fields=("text",),
        options=OPTIONS,
        check_options=check_options,
        examples=EXAMPLES,
        read_data=read_data,
        training_batch=training_batch,
        loss=loss,
        metric=metric,
        labels=CONLL_TAGS,
        target_labels=lambda target: target["tags"],
        best_metric="f1",
        aliases=("token-classification",),
        pipeline_output=pipeline_output,
        pipeline_arguments=PIPELINE_ARGUMENTS,
        predict_many=predict_texts,
    ))
