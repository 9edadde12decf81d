"""Fill-mask: the masked-LM head tied to the word embeddings; top-k candidates per [MASK].

Two modes for several masks: "independent" (each mask's top-k from one forward pass, as the
reference pipeline does) and "joint" (beam search over the masks, left to right, re-encoding the
sentence with each partial filling, so later masks see earlier choices; a filling is scored by
the product of its conditional probabilities). `targets` (a list of words, or one text of comma-separated
words) scores given words only; a word that splits into several word pieces is scored by the chain rule
over as many masks, and says so.
"""

from __future__ import annotations

import math
import re
import unicodedata
import zlib
from dataclasses import dataclass
from html import escape
from typing import Any

import torch
from torch import Tensor

from bert_engine import ui
from bert_engine.heads import IGNORE_INDEX, MaskedLMHead
from bert_engine.hookspecs import ExplainTarget, InputError, TaskContext, TaskSpec, check_int, hookimpl, length_option
from bert_engine.progress import progress_bar
from bert_engine.runtime.inference import max_request_tokens, predict_texts
from bert_engine.tokenizer import Batch
from bert_engine.training.pretraining import continuation_ids, mask_tokens, masked_lm_counts, read_documents
from plugins import fill_mask_words
from plugins.starter import starter_checkpoint

MODES = ("independent", "joint")
MAX_TARGETS = 100        # target words scored in one request
MAX_TARGET_PIECES = 8    # word pieces of one target (a word, not a phrase)


@dataclass
class FillMaskOutput:
    """Hidden states, and the head to finish the job: logits are computed only where needed."""

    hidden_states: Tensor  # (B, T, H)
    head: FillMaskHead
    encoder: Any = None


class FillMaskHead(MaskedLMHead):
    """The standard masked-LM head (checkpoint `cls.predictions.*`), computing the V-wide decoder
    only at [MASK] positions instead of at every token."""

    def forward(self, encoded) -> FillMaskOutput:
        return FillMaskOutput(encoded.last_hidden_state, self)


def log_probs_at(head: FillMaskHead, encode, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor,
                 positions: Tensor) -> Tensor:
    """Re-encode (B, T) inputs (`encode`: TaskContext.encode) and return log-probabilities (B, V) at
    one position per row."""
    encoded = encode({"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids})
    states = encoded.last_hidden_state
    rows = torch.arange(input_ids.shape[0], device=states.device)
    return head.logits(states[rows, positions.to(states.device)]).float().log_softmax(-1).cpu()


# The task's options and their defaults, declared once: the Predictor passes every one to preprocess
# and postprocess (a caller's values over these).
OPTIONS = {"top_k": 5, "mode": "independent", "targets": None, "beam_width": 8, "max_masks": 5,
           "max_length": None, "subwords": False}
MAX_MASKS = 50  # the most masks a caller may allow (max_masks); the joint search's work is bounded apart


def preprocess(inputs, tokenizer, **options):
    """One text -> its one row (the window holding every mask). A list of texts (predict_many, a batched
    request) -> one row each, right-padded to the longest, with each text's own one-row batch kept in
    meta["parts"] for postprocess; an error names the text's position."""
    texts = inputs["text"]
    if not isinstance(texts, list):
        return _one_text(texts, tokenizer, **options)
    parts = []
    for i, text in enumerate(texts):
        try:
            parts.append(_one_text(text, tokenizer, **options))
        except InputError as err:
            raise InputError.at("fill_mask", i, str(err).removeprefix("fill_mask: ")) from None
    if not parts:
        raise InputError("fill_mask: no texts were given")
    return Batch.stacked(parts, tokenizer.pad_token_id)


def check_options(options) -> None:
    """The option values that need no tokenizer (TaskSpec.check_options: also when a pipeline is made)."""
    check_int("fill_mask", "top_k", options["top_k"], 1, 100)
    if not isinstance(options["subwords"], bool):
        raise InputError(f"fill_mask: subwords must be true or false, got {options['subwords']!r}")
    if options["mode"] not in MODES:
        raise InputError(f"fill_mask: mode {options['mode']!r} is not one of {MODES}")
    beam_width = options["beam_width"]
    if not isinstance(beam_width, int) or isinstance(beam_width, bool) or not 1 <= beam_width <= 64:
        raise InputError(f"fill_mask: beam_width must be an integer in [1, 64], got {beam_width!r}")
    check_int("fill_mask", "max_masks", options["max_masks"], 1, MAX_MASKS)


REGION_CHARS = 50_000  # a longer text is cut to the part a window around its masks can reach before tokenising


def _one_text(text, tokenizer, *, top_k, mode, targets, beam_width, max_masks, max_length, subwords):
    mask = tokenizer.mask_token
    if mask != "[MASK]":  # a model whose mask is "<mask>" (RoBERTa) still reads the tab's "[MASK]"
        text = text.replace("[MASK]", mask)
    check_options({"top_k": top_k, "subwords": subwords, "mode": mode, "beam_width": beam_width, "max_masks": max_masks})
    max_length = length_option("fill_mask", "max_length", max_length, 512, 8, tokenizer)
    if targets is not None:
        # one text is comma-separated words, as the tab's box takes them (`-o targets=paris,london` on the CLI)
        targets = [t for t in targets.split(",") if t.strip()] if isinstance(targets, str) else targets
        if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) and t.strip() for t in targets):
            raise InputError(f"fill_mask: targets must be a non-empty list of words, got {targets!r:.80}")
        targets = list(dict.fromkeys(t.strip() for t in targets))  # a word given twice is scored once
    if not text.strip():
        raise InputError(f"fill_mask: the text is empty; type a sentence with {mask} where a word is missing")
    count = text.count(mask)
    if count == 0:
        raise InputError(f"fill_mask: the text has no {mask} token; write {mask} where a word is missing")
    if count > max_masks:
        raise InputError(f"fill_mask: the text has {count} {mask} tokens; at most {max_masks} are allowed (the option max_masks "
                         f"raises that, up to {MAX_MASKS}: max_masks= in Python and the API, -o max_masks=N on the command "
                         "line)")
    if targets is not None and count > 1:
        raise InputError(f"fill_mask: targets work with exactly one {mask}; the text has {count}")
    # A text longer than one window is read in the window centred on its masks (as much context either side). A long
    # text is cut first to the part such a window can reach (from counted words): 1,000,000 characters took 1.2 s to
    # tokenise whole, for the one window read. The window is the same whether the text was cut or not.
    lo, hi = 0, len(text)
    if len(text) > REGION_CHARS and hasattr(tokenizer, "span_around"):
        lo, hi = tokenizer.span_around(text, text.index(mask), text.rindex(mask) + len(mask), max_length)
    batch = _centred_window(text, lo, hi, tokenizer, max_length, count)
    if batch is None:  # (a tokenizer without pieces(), or one whose pieces differ cut: windows of half overlap)
        batch = _best_of_windows(text, lo, hi, tokenizer, max_length, count)
    if mode == "joint" and count > 1:
        _check_beam_work(count, max(beam_width, top_k), batch.input_ids.shape[1])
    if targets is not None:
        batch.meta["target_pieces"] = _target_pieces(list(targets), tokenizer, batch.input_ids.shape[1])
        targets = list(batch.meta["target_pieces"])  # spellings of one word (Paris, paris: one uncased piece) once
    batch.meta.update(text=text, targets=targets, windowed=batch.meta["windowed"] or (lo, hi) != (0, len(text)))
    return batch


def _shifted(batch, shift: int):
    """`batch` with its text offsets moved by `shift` characters (a part of the text tokenised, read in the whole)."""
    if shift:
        batch.offsets = [[(a + shift, b + shift) if sid is not None else (a, b) for (a, b), sid in zip(row, ids)]
                         for row, ids in zip(batch.offsets, batch.sequence_ids)]
    return batch


def _too_far_apart(count: int, mask: str, max_length: int) -> InputError:
    return InputError(f"fill_mask: the {count} {mask} tokens lie further apart than {max_length} tokens; "
                      "shorten the text around them")


def _centred_window(text: str, lo: int, hi: int, tokenizer, max_length: int, count: int):
    """One row over text[lo:hi]: all of it where it fits, else the window of max_length tokens whose masks sit in
    its middle (the spare tokens split evenly before the first mask and after the last, fewer on a side the text
    ends on). None where the tokenizer cannot give the part's pieces, or the window read again does not hold
    every mask (a tokenizer whose pieces change where a text is cut)."""
    if not hasattr(tokenizer, "pieces") or not hasattr(tokenizer, "backend"):
        return None
    region = text[lo:hi]
    room = max_length - tokenizer.backend.num_special_tokens_to_add(False)
    mask_id = tokenizer.mask_token_id
    # No more pieces than UTF-8 bytes, and one (SentencePiece's first "▁"): a text of fewer fits; else count them
    ids = [] if len(region) + 1 <= room and len(region.encode("utf-8", "surrogatepass")) + 1 <= room else None
    if ids is None:
        encoding = tokenizer.pieces([region])[0]
        ids = encoding.ids
    if len(ids) > room:
        positions = [i for i, piece in enumerate(ids) if piece == mask_id]
        if len(positions) != count:
            return None
        if positions[-1] - positions[0] + 1 > room:
            raise _too_far_apart(count, tokenizer.mask_token, max_length)
        spare = room - (positions[-1] - positions[0] + 1)
        first = min(max(0, positions[0] - spare // 2), len(ids) - room)
        start, end = encoding.offsets[first][0], encoding.offsets[first + room - 1][1]
        lo, region = lo + start, region[start:end]
    windowed = len(ids) > room
    batch = _shifted(tokenizer(region, max_length=max_length), lo)
    if int((batch.input_ids[0] == mask_id).sum()) != count:
        return None
    batch.meta.update(window=0, windowed=windowed)
    return batch


def _best_of_windows(text: str, lo: int, hi: int, tokenizer, max_length: int, count: int):
    """Windows of half overlap over text[lo:hi]; the one holding every mask with the most context around them."""
    batch = _shifted(tokenizer(text[lo:hi], max_length=max_length, stride=max_length // 2 - 1, return_overflowing=True),
                     lo)
    mask_id = tokenizer.mask_token_id
    best, best_margin = None, -1
    for row in range(len(batch)):
        positions = (batch.input_ids[row] == mask_id).nonzero().squeeze(-1).tolist()
        if len(positions) == count:
            length = int(batch.attention_mask[row].sum())
            margin = min(positions[0], length - 1 - positions[-1])
            if margin > best_margin:
                best, best_margin = row, margin
    if best is None:
        raise _too_far_apart(count, tokenizer.mask_token, max_length)
    windowed = len(batch.sample_index) > 1
    batch = _select_row(batch, best)
    batch.meta["windowed"] = windowed
    return batch


def _check_beam_work(masks: int, width: int, length: int) -> None:
    """The joint search re-encodes its row once per beam for each mask after the first (up to `width` beams of
    `length` tokens): that work, in tokens, within the request bound, refused before any of it runs."""
    work = length * (1 + (masks - 1) * width)
    if work > (limit := max_request_tokens()):
        raise InputError(f"fill_mask: mode joint over {masks} masks re-reads the text's {length} tokens up to {width} "
                         f"times a mask (the larger of beam_width and top_k), {work:,} tokens of work; the limit per "
                         f"request is {limit:,}: use fewer masks, fewer candidates (top_k), mode independent or a shorter "
                         f"text (API callers: a smaller beam_width too)")


def _select_row(batch, row: int):
    n = int(batch.attention_mask[row].sum())
    batch.input_ids = batch.input_ids[row:row + 1, :n]
    batch.attention_mask = batch.attention_mask[row:row + 1, :n]
    batch.token_type_ids = batch.token_type_ids[row:row + 1, :n]
    for name in ("offsets", "sequence_ids", "word_ids"):
        setattr(batch, name, [getattr(batch, name)[row][:n]])
    batch.meta["window"] = row
    return batch


def _fill(text: str, spans: list[tuple[int, int]], pieces: list[str]) -> str:
    """The original text with each masked span replaced by its piece; "##x" pieces join the word before."""
    out, cursor = [], 0
    for (start, end), piece in zip(spans, pieces):
        before = text[cursor:start]
        if piece.startswith("##"):
            before, piece = before.rstrip(), piece[2:]
        out += [before, piece]
        cursor = end
    return "".join(out) + text[cursor:]


def postprocess(output: FillMaskOutput, batch, *, context: TaskContext, **options):
    """One result per text: a list for a batch of several (preprocess's meta["parts"]), else the one.

    In a batch, the independent mode's logits at every text's masks come from one pass of the head: its
    decoder is vocabulary x hidden (30,522 x 384 in MiniLM, 47 MB in fp32), read once per batch instead of
    once per text."""
    parts = batch.meta.get("parts")
    if parts is None:
        return _one_result(output, batch, context=context, **options)
    mask_id = context.tokenizer.mask_token_id
    positions = [(part.input_ids[0] == mask_id).nonzero().squeeze(-1) for part in parts]
    logits: list[Tensor | None] = [None] * len(parts)
    if options["targets"] is None:
        shared = [i for i, p in enumerate(positions) if options["mode"] == "independent" or len(p) == 1]
        if shared:
            states = output.hidden_states
            rows = torch.cat([torch.full((len(positions[i]),), i) for i in shared]).to(states.device)
            columns = torch.cat([positions[i] for i in shared]).to(states.device)
            found = output.head.logits(states[rows, columns]).split([len(positions[i]) for i in shared])
            for i, part_logits in zip(shared, found):
                logits[i] = part_logits
    results = []
    for i, part in enumerate(parts):
        try:
            results.append(_one_result(FillMaskOutput(output.hidden_states[i:i + 1, :part.input_ids.shape[1]],
                                                      output.head, output.encoder), part, context=context,
                                       logits=logits[i], positions=positions[i], **options))
        except InputError as err:  # (a joint search past the work limit): which text of the list
            if len(parts) == 1 or err.position is not None:
                raise
            raise InputError.at("fill_mask", i, str(err).removeprefix("fill_mask: ")) from None
    return results[0] if len(results) == 1 else results


def _one_result(output: FillMaskOutput, batch, *, context: TaskContext, top_k, mode, targets, beam_width, max_masks,
                max_length, subwords, logits: Tensor | None = None, positions: Tensor | None = None):
    """One text's result; `logits` (masks, V): the head's at its masks, and `positions` the masks' places in the
    row, where postprocess has them already."""
    tokenizer, text = context.tokenizer, batch.meta["text"]
    if positions is None:
        positions = (batch.input_ids[0] == tokenizer.mask_token_id).nonzero().squeeze(-1)
    spans = [tuple(batch.offsets[0][p]) for p in positions.tolist()]
    head = output.head
    specials = [tokenizer.token_id(n) for n in ("cls_token", "sep_token", "pad_token", "mask_token")]
    shown, shown_spans, cut = _excerpt(text, spans, batch)  # what each candidate's "sequence" fills in
    excerpt = {"sequence_excerpt": list(cut)} if cut else {}
    if batch.meta["targets"] is not None:
        return {"mode": "targets", "masks": len(spans), **excerpt,
                "candidates": _score_targets(head, context.encode, batch, positions[0], batch.meta["targets"],
                                              tokenizer, shown, shown_spans[0])}
    blocked = [] if subwords else word_piece_blocks(tokenizer, text, spans)
    if mode == "joint" and len(spans) > 1:
        if context.check_work is not None:  # every pass of the search, refused before the first runs
            width = max(beam_width, top_k)
            context.check_work(1 + (len(spans) - 1) * width, batch.input_ids.shape[1],
                               f"mode joint over {len(spans)} masks ({width} beams of the text's "
                               f"{batch.input_ids.shape[1]} tokens for each mask after the first)")
        return {"mode": "joint", "masks": len(spans), **excerpt,
                "candidates": _beam(head, context.encode, batch, positions, shown_spans, tokenizer, shown, top_k,
                                   beam_width, specials, blocked)}
    if logits is None:
        logits = head.logits(output.hidden_states[0, positions.to(output.hidden_states.device)])  # (M, V)
    log_probs = logits.float().log_softmax(-1).cpu()  # (M, V)
    log_probs[:, specials] = -math.inf  # special tokens are never a word
    for m, pieces in blocked:  # a mask standing for a whole word gets words, not "##s"
        log_probs[m, pieces[:log_probs.shape[1]]] = -math.inf
    per_mask = []
    for m, span in enumerate(spans):
        scores, token_ids = log_probs[m].topk(top_k)
        per_mask.append({"mask": m, "start": span[0], "end": span[1], "field": "text", "text": text[span[0]:span[1]],
                         "candidates": [_candidate(tokenizer, t, s.exp(), shown, shown_spans, m)
                                        for t, s in zip(token_ids.tolist(), scores)]})
    return {"mode": "independent", "masks": len(spans), "windowed": batch.meta["windowed"], **excerpt,
            "predictions": per_mask}


# A candidate's "sequence" repeats the text with the word filled in: for a long text, top_k x the text per
# request (a 500 KB text at top_k 100 answered 50 MB). Over this many characters it shows an excerpt instead:
# the part of the window the model read that lies within EXCERPT_CHARS of the masks, "…" marking the cuts.
EXCERPT_CHARS = 2000
_SPACE = re.compile(r"\s+")


def _excerpt(text: str, spans: list[tuple[int, int]], batch) -> tuple[str, list[tuple[int, int]], tuple[int, int] | None]:
    """(the text the sequences fill in, the masks' spans in it, the excerpt's (start, end) in `text` or None)."""
    if len(text) <= EXCERPT_CHARS:
        return text, spans, None
    read = [o for o, sid in zip(batch.offsets[0], batch.sequence_ids[0]) if sid is not None]
    start = max(min(o[0] for o in read), spans[0][0] - EXCERPT_CHARS // 2)
    end = min(max(o[1] for o in read), spans[-1][1] + EXCERPT_CHARS // 2)
    if start > 0 and not text[start - 1].isspace() and (space := _SPACE.search(text, start, spans[0][0])):
        start = space.end()  # a whole word first, not the end of one cut through ("…ital of France")
    if end < len(text) and not text[end].isspace():
        end = max((m.start() for m in _SPACE.finditer(text, spans[-1][1], end)), default=end)
    lead, tail = ("…" if start > 0 else ""), ("…" if end < len(text) else "")
    shift = len(lead) - start
    return lead + text[start:end] + tail, [(a + shift, b + shift) for a, b in spans], (start, end)


def _candidate(tokenizer, token_id: int, score: Tensor, text: str, spans, mask_index: int) -> dict[str, Any]:
    """One candidate: the piece (WordPiece's as it is, "##s" included, as transformers shows it; BPE's and
    Unigram's without their "Ġ"/"▁" marks) and the filled-in text, where a piece that continues a word
    joins the word before the mask."""
    raw = tokenizer.convert_ids_to_tokens([token_id])[0]
    token = raw if tokenizer.kind == "WordPiece" else tokenizer.piece_text(token_id)
    pieces = [tokenizer.mask_token] * len(spans)
    pieces[mask_index] = token if tokenizer.kind == "WordPiece" or tokenizer.starts_word(raw) else "##" + token
    return {"token_id": token_id, "token": token, "score": _sig(float(score)), "sequence": _fill(text, spans, pieces)}


def _sig(value: float) -> float:
    """Six significant digits: products of many probabilities are tiny, not zero."""
    return float(f"{value:.6g}")


def _score_targets(head, encode, batch, position: Tensor, targets, tokenizer, text, span) -> list[dict[str, Any]]:
    """Each target word's probability at the mask; a word of several pieces is scored left to right
    by the chain rule over as many masks. Batched: words of n pieces share n forward passes, and the
    first piece of every word is read from one pass (the widened inputs are identical until then)."""
    p, ids = int(position), batch.input_ids[0].tolist()
    pieces = batch.meta["target_pieces"]  # word -> its pieces, from preprocess
    log_p = {word: 0.0 for word in targets}
    for n in sorted({len(v) for v in pieces.values()}):
        words = [w for w in targets if len(pieces[w]) == n]
        piece_ids = torch.tensor([tokenizer.convert_tokens_to_ids(pieces[w]) for w in words])  # (W, n)
        widened = torch.tensor([ids[:p] + [tokenizer.mask_token_id] * n + ids[p + 1:]])        # (1, T + n - 1)
        for k in range(n):
            rows = widened if k == 0 else widened.expand(len(words), -1).clone()
            if k:
                rows[:, p:p + k] = piece_ids[:, :k]  # the earlier pieces filled in
            logits = log_probs_at(head, encode, rows, torch.ones_like(rows), torch.zeros_like(rows),
                                  torch.full((rows.shape[0],), p + k))                           # (1 or W, V)
            scores = logits[0, piece_ids[:, k]] if k == 0 else logits.gather(1, piece_ids[:, k:k + 1])[:, 0]
            for word, score in zip(words, scores.tolist()):
                log_p[word] += score
    results = []
    for word in targets:
        entry = {"word": word, "token": " ".join(pieces[word]),
                 "token_ids": tokenizer.convert_tokens_to_ids(pieces[word]), "score": _sig(math.exp(log_p[word])),
                 "log_score": round(log_p[word], 6), "sequence": text[:span[0]] + word + text[span[1]:]}
        if len(pieces[word]) > 1:
            entry["note"] = (f"{word!r} is {len(pieces[word])} word pieces {pieces[word]}; scored by the chain rule "
                             f"over {len(pieces[word])} masks")
        results.append(entry)
    return sorted(results, key=lambda r: -r["score"])


def _target_pieces(targets: list[str], tokenizer, length: int) -> dict[str, list[str]]:
    """Each target's word pieces, checked: at most MAX_TARGETS words of 1 to MAX_TARGET_PIECES pieces, none a
    special token, the widened text within the model's positions, the scoring's forward work within the request
    bound. A target whose pieces an earlier one has (another spelling of it for an uncased model) is left out."""
    if len(targets) > MAX_TARGETS:
        raise InputError(f"fill_mask: {len(targets):,} target words; at most {MAX_TARGETS} can be scored at once")
    pieces = {word: tokenizer.tokenize(word) for word in targets}
    for word in targets:
        if not pieces[word]:  # zero pieces would score 1 (a product over no masks)
            shown = "".join(c if c.isprintable() and not unicodedata.combining(c) else f"\\u{ord(c):04x}" for c in word[:40])
            raise InputError(f"fill_mask: the target '{shown}' holds no word piece (only invisible, control or "
                             "combining characters); give a word")
    unk = tokenizer.special_tokens.get("unk_token")
    unknown = [word for word in targets if unk is not None and unk in pieces[word]]
    if unknown:  # scored as the unknown token, each would show its own word beside the same score
        shown = ", ".join(repr(w[:40]) for w in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise InputError(f"fill_mask: the target{'s' if len(unknown) > 1 else ''} {shown} {'are' if len(unknown) > 1 else 'is'} "
                         f"not in the model's vocabulary (read as {unk}); leave "
                         f"{'them' if len(unknown) > 1 else 'it'} out")
    specials = set(tokenizer.special_tokens.values())
    special = [word for word in targets if specials & set(pieces[word])]
    if special:
        raise InputError(f"fill_mask: the target {special[0][:40]!r} is a special token of the model "
                         f"({', '.join(sorted(specials & set(pieces[special[0]])))}), not a word")
    seen: set[tuple[str, ...]] = set()
    for word in targets:  # another spelling of a word given before (Paris after paris, uncased): left out
        if tuple(pieces[word]) in seen:
            del pieces[word]
        else:
            seen.add(tuple(pieces[word]))
    targets = list(pieces)
    counts = {}
    for word in targets:
        n = len(pieces[word])
        if n > MAX_TARGET_PIECES:
            raise InputError(f"fill_mask: the target {word[:40]!r}{'...' if len(word) > 40 else ''} is {n} word pieces; "
                             f"at most {MAX_TARGET_PIECES} (a word or a short phrase)")
        if length + n - 1 > tokenizer.model_max_length:
            raise InputError(f"fill_mask: with the target {word[:40]!r} the text would be {length + n - 1} tokens; "
                             f"the model takes {tokenizer.model_max_length}: shorten the text")
        counts[n] = counts.get(n, 0) + 1
    work = sum((1 + words * (n - 1)) * (length + n - 1) for n, words in counts.items())
    if work > (limit := max_request_tokens()):
        raise InputError(f"fill_mask: scoring these targets over a text of {length} tokens needs {work:,} tokens of "
                         f"work; the limit per request is {limit:,}: use fewer targets or a shorter text")
    return pieces


def word_piece_blocks(tokenizer, text: str, spans) -> list[tuple[int, Tensor]]:
    """For each mask that stands alone as a word (no letter or digit right after it; before it, anything
    but a letter or digit for WordPiece, a space for BPE and Unigram, whose word-start marks follow
    spaces), the ids of the pieces that only continue a word ("##s", BPE's pieces without "Ġ"), as
    (mask index, ids): such a mask is never filled with half a word."""
    pieces = continuation_ids(tokenizer).nonzero().squeeze(-1)  # cached on the tokenizer
    blocked = []
    for m, (start, end) in enumerate(spans):
        before = text[start - 1] if start > 0 else ""
        after = text[end] if end < len(text) else ""
        if after.isalnum():
            continue
        if tokenizer.kind == "WordPiece" and not before.isalnum():  # punctuation splits words too: "(x)"
            blocked.append((m, pieces))
        elif tokenizer.kind != "WordPiece" and before.isspace():  # BPE / Unigram mark a word after a space
            blocked.append((m, pieces))
    return blocked


def _beam(head, encode, batch, positions: Tensor, spans, tokenizer, text, top_k: int, beam_width: int, specials,
          blocked=()):
    """Beam search over the masks left to right, re-encoding each partial filling."""
    beams = [(batch.input_ids[0].clone(), 0.0, [])]  # (ids, log-prob, chosen token ids)
    mask, types = batch.attention_mask[:1], batch.token_type_ids[:1]
    width = max(beam_width, top_k)
    for position in positions.tolist():
        stacked = torch.stack([ids for ids, _, _ in beams])  # (beams, T)
        log_probs = log_probs_at(head, encode, stacked, mask.expand_as(stacked), types.expand_as(stacked),
                                 torch.full((len(beams),), position))  # (beams, V)
        log_probs[:, specials] = -math.inf
        for m, pieces in blocked:
            if positions[m] == position:
                log_probs[:, pieces[:log_probs.shape[1]]] = -math.inf
        scores, token_ids = log_probs.topk(width, dim=-1)
        expanded = []
        for b, (ids, total, chosen) in enumerate(beams):
            for score, token_id in zip(scores[b].tolist(), token_ids[b].tolist()):
                new_ids = ids.clone()
                new_ids[position] = token_id
                expanded.append((new_ids, total + score, chosen + [token_id]))
        beams = sorted(expanded, key=lambda beam: -beam[1])[:width]
    results = []
    for _, total, chosen in beams[:top_k]:
        tokens = tokenizer.convert_ids_to_tokens(chosen)
        results.append({"tokens": tokens, "token_ids": chosen, "score": _sig(math.exp(total)), "log_score": round(total, 6),
                        "sequence": _fill(text, spans, tokens)})
    return results


def build_tab(predictor) -> None:
    import gradio as gr  # noqa: PLC0415 - Gradio loads only where a UI is built

    if getattr(predictor, "checkpoint", None) in (None, predictor.task.spec.default_checkpoint):
        gr.Markdown(STARTER_NOTE, elem_classes=["be-note"])
    text = gr.Textbox(label="Text with [MASK]", lines=2, value=EXAMPLES[0]["text"])
    with gr.Row():
        top_k = gr.Slider(1, 20, value=OPTIONS["top_k"], step=1, label="Candidates (top-k)")
        mode = gr.Radio(list(MODES), value=OPTIONS["mode"], label="Several masks")
        targets = gr.Textbox("", label="Only score these words (comma-separated, optional)")
    button = ui.run_button(gr, "Fill")
    view = gr.HTML(ui.empty_state("The likeliest words for each [MASK] appear here, with their probabilities."),
                   label="Candidates")
    details = ui.details(gr)

    def run(text: str, top_k: float = OPTIONS["top_k"], mode: str = OPTIONS["mode"], targets: str | None = ""):
        """Guess the words hidden behind [MASK] tokens in a text.

        Args:
            text: a text with one or more [MASK] tokens, e.g. "She drank a cup of hot [MASK]."
            top_k: how many candidate words to return per mask (1-100; the page's slider stops at 20).
            mode: with several masks, "independent" (each mask alone) or "joint" (the masks filled together).
            targets: optional comma-separated words to score instead of the model's own guesses.
        """
        words = [w.strip() for w in (targets or "").split(",") if w.strip()] or None  # API clients may send null
        output = predictor.predict({"text": text}, top_k=ui.whole(top_k), mode=mode, targets=words)
        return candidate_bars(output["result"]), output

    ui.wire(gr, button, run, [text, top_k, mode, targets], [view, details], api_name="fill_mask",
            examples=[[e["text"]] for e in EXAMPLES])


CARD_CHARS = 240  # the card shows the filled word with this much of its text on each side


def _around(sequence: str, prediction: dict[str, Any], result: dict[str, Any]) -> str:
    """The part of a long text's filled sequence around the filled word (the card's line: a 2,000-character
    excerpt opened at its top, the word out of sight at its bottom)."""
    if len(sequence) <= 2 * CARD_CHARS:
        return sequence
    start, _ = result.get("sequence_excerpt") or (0, 0)
    at = prediction["start"] - start + (1 if start > 0 else 0)  # after the excerpt's leading "…"
    lo, hi = max(0, at - CARD_CHARS), min(len(sequence), at + CARD_CHARS)
    return ("…" if lo > 0 else "") + sequence[lo:hi].strip("…") + ("…" if hi < len(sequence) else "")


def candidate_bars(result: dict[str, Any]) -> str:
    """Per mask (or per joint filling), each candidate with a bar and its probability in percent, and
    the completed sentence of the best one."""
    groups = []
    if result["mode"] == "independent":
        for p in result["predictions"]:
            groups.append((f"[MASK] {p['mask'] + 1}", [(c["token"], c["score"]) for c in p["candidates"]],
                           _around(p["candidates"][0]["sequence"], p, result) if p["candidates"] else ""))
    elif result["mode"] == "joint":
        groups.append(("All masks together", [(" + ".join(c["tokens"]), c["score"]) for c in result["candidates"]],
                       result["candidates"][0]["sequence"] if result["candidates"] else ""))
    else:
        groups.append(("The words asked for", [(c["word"], c["score"]) for c in result["candidates"]],
                       result["candidates"][0]["sequence"] if result["candidates"] else ""))
    parts = []
    for title, candidates, sentence in groups:
        bars = "".join(ui.bar(score, label) for label, score in candidates)
        # under the bars, in a box of its own height: a long text's filling must not push the answer off screen
        best = (f'<p class="fm-sentence" style="max-height: 6.5em; overflow-y: auto; opacity: .85">'
                f'{escape(sentence)}</p>') if sentence else ""
        parts.append(f'<section class="fm-mask"><h4>{escape(title)}</h4>{bars}{best}</section>')
    return '<div class="fill-mask">' + "".join(parts) + "</div>"


# Sentences of scripts/fill_mask_probes.py the starter answers right at the first guess (4 of its 30), and
# two masks for the joint mode: the tab opens on what the model can do, its limits in MODEL_CARD.md.
EXAMPLES = (
    {"text": "The capital of France is [MASK]."},
    {"text": "A week has seven [MASK]."},
    {"text": "She drank a cup of hot [MASK]."},
    {"text": "I [MASK] to the [MASK] to buy some bread."},
)
# What the starter is, in one line on the tab (a picked checkpoint says its own name in the raw result).
STARTER_NOTE = ("The starter: all-MiniLM-L6-v2, a sentence encoder never trained to guess words, with a word-guessing "
                "head and adapter trained on books, Wikipedia and news: sure of grammar words, often wrong on names "
                "and facts.")


PASSAGE_WORDS = 80  # training passages: about 110 wordpieces, inside max_length 128


def held_out(passage: str) -> bool:
    """Whether a passage is in the fixed 5 % "test" split (by the CRC-32 of its text)."""
    return zlib.crc32(passage.encode("utf-8")) % 20 == 0


def read_data(path, split: str = "all"):
    """Plain text (a file or a folder; blank lines separate paragraphs) as passages of about
    PASSAGE_WORDS words; yields ({"text": passage}, None). `split` "train" / "test" keeps a fixed
    95 % / 5 % of the passages (by a hash of their text), "all" keeps every passage."""

    if split not in ("all", "train", "test"):
        raise ValueError(f"split {split!r} is not one of all, train, test")
    for document in read_documents(path):
        words = " ".join(document).split()
        for start in range(0, len(words), PASSAGE_WORDS):
            passage = " ".join(words[start:start + PASSAGE_WORDS])
            if len(passage.split()) < 8:
                continue
            if split == "all" or held_out(passage) == (split == "test"):
                yield {"text": passage}, None


def training_batch(examples, tokenizer, *, generator=None, max_length: int = 128, mlm_prob: float = 0.15,
                   whole_word: bool = False):
    """Passages with BERT's 80/10/10 masking drawn from `generator`; targets: (B, T) labels, -100 unmasked.
    `whole_word` (`-o whole_word=true`) masks every piece of a chosen word together, so the model learns
    to name a word from its context, not to finish one from its own first pieces."""
    batch = tokenizer([inputs["text"] for inputs, _ in examples], max_length=max_length)
    masked, labels = mask_tokens(batch.input_ids, tokenizer, mlm_prob=mlm_prob, generator=generator,
                                 whole_word=bool(whole_word))
    batch.input_ids = masked
    return batch, labels


def loss(output: FillMaskOutput, targets) -> Tensor:
    """Cross-entropy at labelled positions; `targets` is a (B, T) tensor with -100 where unlabelled."""
    labels = torch.as_tensor(targets, device=output.hidden_states.device)
    chosen = labels != IGNORE_INDEX
    logits = output.head.logits(output.hidden_states[chosen])  # (masked tokens, V)
    return torch.nn.functional.cross_entropy(logits.float(), labels[chosen])


def evaluate(predictor, examples, *, progress: bool = False, batch_size: int = 64, seed: int = 0,
             words: int = 1000, **options) -> dict[str, float]:
    """Masked-token accuracy on held-out passages: 15 % of the tokens masked with a fixed seed;
    top-1 / top-5 accuracy of the original token and the perplexity over the masked tokens. Beside
    them, what a visitor gets: `words` whole words drawn with the same seed, each behind one [MASK]
    (fill_mask_words: words_top1 / words_top5, and the same for content and function words; 0 to skip)."""

    predictor = predictor.get()
    model, tokenizer = predictor.model, predictor.tokenizer
    generator = torch.Generator().manual_seed(seed)
    totals = {"nll": 0.0, "top1": 0, "top5": 0, "masked": 0}
    device = next(model.parameters()).device
    with torch.inference_mode():
        for start in progress_bar(range(0, len(examples), batch_size), disable=not progress, desc="fill_mask", unit="batch"):
            batch, labels = training_batch(examples[start:start + batch_size], tokenizer, generator=generator)
            output = model(**batch.to(device).model_inputs())
            labels = labels.to(device)
            chosen = labels != IGNORE_INDEX
            counts = masked_lm_counts(output.head.logits(output.hidden_states[chosen]), labels[chosen])
            totals = {k: totals[k] + counts[k] for k in totals}
    count = totals["masked"]
    if not count:
        raise ValueError("no tokens were masked: the evaluation passages are empty")
    figures = {"top1": totals["top1"] / count, "top5": totals["top5"] / count,
               "perplexity": math.exp(min(totals["nll"] / count, 50)), "masked_tokens": count}
    check_int("fill_mask", "words", words, 0, 100_000)
    if words:
        items = fill_mask_words.draw_words([inputs["text"] for inputs, _ in examples], words, seed)
        figures.update(fill_mask_words.flat(fill_mask_words.score_words(predictor, items, progress=progress)))
    return figures


def pipeline_output(result: dict, options, single: bool):
    """transformers' fill-mask shape: per [MASK], a list of {"score", "token", "token_str",
    "sequence"}; one mask gives that list, several a list of lists. With targets, the top_k best
    targets in that shape, as transformers gives them; "token" is the word's vocabulary id, or the
    list of its piece ids for a word of several pieces (transformers would score its first piece
    only; the engine scores the whole word). Joint mode keeps the engine's result (the pipeline has
    no equivalent)."""
    if result["mode"] == "targets":
        return [{"score": c["score"], "token": c["token_ids"][0] if len(c["token_ids"]) == 1 else c["token_ids"],
                 "token_str": c["word"], "sequence": c["sequence"]}
                for c in result["candidates"][:options.get("top_k") or OPTIONS["top_k"]]]
    if result["mode"] != "independent":
        return result
    per_mask = [[{"score": c["score"], "token": c["token_id"], "token_str": c["token"], "sequence": c["sequence"]}
                 for c in prediction["candidates"]] for prediction in result["predictions"]]
    return per_mask[0] if len(per_mask) == 1 else per_mask


def explain(result, batch, **_options) -> list[ExplainTarget]:
    """Per mask: the top candidate's probability there (independent mode; the joint and target modes
    score sequences of passes, which one gradient does not follow)."""
    if result.get("mode") != "independent":
        return []
    targets = []
    for prediction in result["predictions"]:
        positions = batch.tokens_within(0, prediction["start"], prediction["end"])
        if not positions or not prediction["candidates"]:
            continue
        top = prediction["candidates"][0]
        label = f"“{top['token']}” at [MASK] {prediction['mask'] + 1}" if result["masks"] > 1 else f"“{top['token']}”"
        targets.append(ExplainTarget(label, _token_probability(positions[0], top["token_id"])))
    return targets


def _token_probability(position: int, token_id: int):
    def score(output: FillMaskOutput) -> Tensor:
        return output.head.logits(output.hidden_states[:, position]).float().softmax(-1)[:, token_id]
    return score


def brief(result) -> str:
    """The top candidates per mask: "[MASK] 1: city 41 %, capital 30 %"."""
    parts = []
    for prediction in result["predictions"]:
        top = ", ".join(f"{c['token']} {ui.percent(c['score'])}" for c in prediction["candidates"][:3])
        parts.append(f"{prediction['text']} {prediction['mask'] + 1}: {top}" if result["masks"] > 1 else top)
    return "; ".join(parts)


@hookimpl
def register_tasks(register):
    register(TaskSpec(
        brief=brief,
        explain=explain,
        name="fill_mask",
        default_checkpoint=starter_checkpoint("fill_mask"),
        title="Fill-mask",
        description="Ask the masked-LM head what fits each [MASK]: ranked candidates with probabilities.",
        build_head=FillMaskHead,
        preprocess=preprocess,
        postprocess=postprocess,
        build_tab=build_tab,
        input_fields=("text",),
        options=OPTIONS,
        check_options=check_options,
        examples=EXAMPLES,
        predict_many=predict_texts,
        read_data=read_data,
        training_batch=training_batch,
        loss=loss,
        evaluate=evaluate,
        best_metric="top1",
        aliases=("fill-mask",),
        pipeline_output=pipeline_output,
    ))
