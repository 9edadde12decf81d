"""Extractive summarisation: pick a document's most central sentences, or those a trained scorer prefers.

Sentences come from plugins/sentences.py (pysbd, line by line, each with its character span);
ROUGE from plugins/rouge.py. Two modes:
- "centroid" (unsupervised): each sentence is embedded alone (mean of the encoder's hidden states,
  any layer), scored by cosine similarity to the document's centroid, and chosen with MMR so that
  near-duplicates are not picked twice.
- "supervised": BertSum-style; sentences are packed into windows as [CLS] s1 [SEP] [CLS] s2 [SEP] ...
  with alternating segment ids; a linear scorer scores every token and a sentence's score is the
  mean over its own tokens (sentence_logits).
- "hybrid": hybrid_weight x the scorer's probability + (1 - hybrid_weight) x the centroid
  similarity, top-k: the scorer knows where news puts its facts, the centroid what the text is about.
"auto" is hybrid when the checkpoint has a trained scorer, else centroid. A first line that does
not end like a sentence (a headline) is never chosen. Output is in document order.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from html import escape
from typing import Any

import torch
from torch import Tensor, nn

from bert_engine import ui
from bert_engine.hookspecs import ExplainTarget, InputError, TaskContext, TaskSpec, check_int, hookimpl, length_option
from bert_engine.model import mean_pool
from bert_engine.runtime.inference import predict_texts
from bert_engine.tokenizer import Batch
from plugins.rouge import rouge
from plugins.sentences import split_sentences
from plugins.starter import starter_checkpoint

MODES = ("auto", "centroid", "supervised", "hybrid")
MAX_SENTENCES = 2000
MAX_CHARS = 200_000  # per document; sentence splitting and embedding stay within seconds


# -- the supervised head -----------------------------------------------------------------------------

@dataclass
class SummaryOutput:
    token_scores: Tensor  # (B, T) logits; read at each sentence's [CLS]
    head: Any
    encoder: Any = None


class SentenceScorerHead(nn.Module):
    """A linear scorer over every token's final hidden state; the task averages it over each
    sentence's tokens (sentence_logits)."""

    needs_pooler = False
    optional_parameters = ("is_trained",)

    def __init__(self, config) -> None:
        super().__init__()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.scorer = nn.Linear(config.hidden_size, 1)
        nn.init.normal_(self.scorer.weight, std=config.initializer_range)
        nn.init.zeros_(self.scorer.bias)
        # Set to 1 by the first training step and saved with the weights: "auto" mode trusts the
        # scorer only when it has been trained.
        self.is_trained = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, encoded) -> SummaryOutput:
        if self.training:
            self.is_trained.fill_(1.0)
        scores = self.scorer(self.dropout(encoded.last_hidden_state)).squeeze(-1)  # (B, T)
        return SummaryOutput(scores, self)


# -- preprocessing ---------------------------------------------------------------------------------

def check_options(options) -> None:
    """The option values that need no tokenizer (TaskSpec.check_options: also when a pipeline is made)."""
    _check_values(**{name: options[name] for name in ("num_sentences", "ratio", "min_words", "mode", "mmr_lambda",
                                                      "hybrid_weight", "layer")})


def _check_options(num_sentences, ratio, min_words, mode, mmr_lambda, hybrid_weight, layer, max_length,
                   tokenizer) -> int:
    _check_values(num_sentences, ratio, min_words, mode, mmr_lambda, hybrid_weight, layer)
    return _max_length(max_length, tokenizer)


def _max_length(value, tokenizer) -> int:
    """The max_length option as a number of tokens (None: 512, or the model's positions if fewer), checked."""
    return length_option("summary", "max_length", value, 512, 32, tokenizer)


def _check_values(num_sentences, ratio, min_words, mode, mmr_lambda, hybrid_weight, layer) -> None:
    if num_sentences is not None:
        check_int("summary", "num_sentences", num_sentences, 1, 100)
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio <= 1:
        raise InputError(f"summary: ratio must lie in (0, 1], got {ratio!r}")
    check_int("summary", "min_words", min_words, 0, 100)
    if mode not in MODES:
        raise InputError(f"summary: mode {mode!r} is not one of {MODES}")
    if mmr_lambda is not None and (not isinstance(mmr_lambda, (int, float)) or isinstance(mmr_lambda, bool)
                                   or not 0 <= mmr_lambda <= 1):
        raise InputError(f"summary: mmr_lambda must lie in [0, 1] (or None: the mode's own), got {mmr_lambda!r}")
    if not isinstance(hybrid_weight, (int, float)) or isinstance(hybrid_weight, bool) or not 0 <= hybrid_weight <= 1:
        raise InputError(f"summary: hybrid_weight must lie in [0, 1], got {hybrid_weight!r}")
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise InputError(f"summary: layer must be an integer (-1 is the last layer), got {layer!r}")


# The task's options and their defaults, declared once: the Predictor passes every one to preprocess
# and postprocess (a caller's values over these).
# hybrid_weight: in hybrid mode, each sentence's score is hybrid_weight x the trained scorer's
# probability + (1 - hybrid_weight) x its centroid similarity; a packed model's manifest carries the
# weight tuned on its dev split (the starter's: 0.2, see MODEL_CARD.md).
# mmr_lambda: None is each mode's own (CENTROID_MMR_LAMBDA in centroid mode; off, 1.0, for the trained scorer's modes,
# as they were trained and scored); a value given applies in every mode (it was taken and ignored outside centroid).
CENTROID_MMR_LAMBDA = 0.7
OPTIONS = {"num_sentences": None, "ratio": 0.3, "min_words": 4, "mode": "auto", "mmr_lambda": None,
           "hybrid_weight": 0.5, "layer": -1, "max_length": None}


def preprocess(inputs, tokenizer, *, num_sentences, ratio, min_words, mode, mmr_lambda, hybrid_weight, layer,
               max_length):
    """Split into sentences; rows are one per sentence in centroid mode, packed BertSum windows
    otherwise ("auto" starts with the windows and re-encodes per sentence if the scorer is untrained;
    hybrid mode encodes each sentence alone too, in postprocess)."""
    max_length = _check_options(num_sentences, ratio, min_words, mode, mmr_lambda, hybrid_weight, layer, max_length,
                                tokenizer)
    texts = inputs["text"] if isinstance(inputs["text"], list) else [inputs["text"]]
    documents = []
    for text in texts:
        if not text.strip():
            raise InputError("summary: the document is empty; paste an article to summarise")
        if len(text) > MAX_CHARS:
            raise InputError(f"summary: the document has {len(text):,} characters; the limit is {MAX_CHARS:,} "
                             "(about 35,000 words); summarise it in parts")
        spans = split_sentences(text)
        if not spans:
            raise InputError("summary: the document has no sentences (only punctuation or invisible characters)")
        if len(spans) > MAX_SENTENCES:
            raise InputError(f"summary: the document has {len(spans):,} sentences; the limit is {MAX_SENTENCES:,}")
        documents.append(spans)
    if mode == "centroid":
        return centroid_batch(tokenizer, texts, documents, max_length, layer)
    batch = pack_sentences(tokenizer, texts, documents, max_length)
    batch.meta.update(texts=texts, spans=documents, mode=mode)
    return batch


def centroid_batch(tokenizer, texts: list[str], documents: list[list[tuple[int, int]]], max_length: int,
                   layer: int) -> Batch:
    """One row per sentence (each alone, at most 128 tokens) of documents already split into sentences: the
    centroid mode's input, and the second pass of the hybrid and "auto" modes (which reuse the first pass's
    sentences: splitting an article again cost about a tenth of a request)."""
    sentences = [text[a:b] for text, spans in zip(texts, documents) for a, b in spans]
    batch = tokenizer(sentences, max_length=min(max_length, 128))
    if layer != -1:
        batch.meta["model_kwargs"] = {"output_hidden_states": True}
    batch.meta.update(texts=texts, spans=documents, mode="centroid")
    return batch


def pack_sentences(tokenizer, texts: list[str], documents: list[list[tuple[int, int]]], max_length: int,
                   max_sentence_tokens: int = 80) -> Batch:
    """BertSum input: sentences as [CLS] pieces [SEP] with alternating segment ids, packed greedily into
    rows of at most `max_length` tokens (a new row per document). Each sentence is cut to
    `max_sentence_tokens` pieces. meta["cls"]: per row, (start, end, document, sentence index) with
    [start, end) the sentence's tokens in the row, its [CLS] and [SEP] included.

    A headline (body_start) is left out of the rows, in training and prediction alike: BBC articles
    open with one, never part of a summary, so a scorer that saw it learned "the first sentence of a
    row is never chosen" and dropped the lead of every article without a headline."""
    cls_id, sep_id = tokenizer.token_id("cls_token"), tokenizer.token_id("sep_token")
    owners = [(d, k) for d, spans in enumerate(documents)
              for k in range(body_start(texts[d], spans), len(spans))]
    sentences = [texts[d][slice(*documents[d][k])] for d, k in owners]
    limit = min(max_sentence_tokens, max_length - 2)
    rows, types, cls, sample_index = [], [], [], []
    current: list[int] = []
    for (d, k), encoding in zip(owners, tokenizer.pieces(sentences)):
        piece = [cls_id, *encoding.ids[:limit], sep_id]
        if current and (len(current) + len(piece) > max_length or sample_index[-1] != d):
            current = []
        if not current:
            rows.append(current)
            types.append([])
            cls.append([])
            sample_index.append(d)
        segment = len(cls[-1]) % 2
        cls[-1].append((len(current), len(current) + len(piece), d, k))
        current.extend(piece)
        types[-1].extend([segment] * len(piece))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    type_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (row, row_types) in enumerate(zip(rows, types)):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
        type_ids[r, :len(row)] = torch.tensor(row_types)
    empty = [[] for _ in rows]
    batch = Batch(ids, mask, type_ids, offsets=empty, sequence_ids=empty, word_ids=empty, sample_index=sample_index,
                  truncated=[False] * len(texts))
    batch.meta["cls"] = cls
    return batch


# -- scoring and selection -------------------------------------------------------------------------

def centroid_scores(embeddings: Tensor) -> Tensor:
    """Cosine similarity (S,) of each sentence embedding (S, H) to the mean of the normalised embeddings."""
    unit = torch.nn.functional.normalize(embeddings.float(), dim=-1)
    centroid = torch.nn.functional.normalize(unit.mean(0), dim=-1)
    return unit @ centroid


def mmr_select(scores: Tensor, embeddings: Tensor | None, candidates: list[int], k: int, mmr_lambda: float) -> list[int]:
    """Maximal marginal relevance: repeatedly take the candidate maximising
    λ·score − (1 − λ)·(max cosine similarity to those already taken). Without embeddings, top-k by score.

    Each sentence's redundancy is kept as a running maximum, updated once per pick, so choosing k of
    S sentences costs O(k·S) (it was O(k²·S) in Python: 1,000 sentences took 124 s, now milliseconds).
    Gains are computed in float64 and ties go to the earliest sentence, as the plain loop did.
    """
    if embeddings is None or mmr_lambda >= 1.0:
        return sorted(candidates, key=lambda i: -float(scores[i]))[:k]
    if not candidates or k <= 0:
        return []
    index = torch.tensor(sorted(candidates))
    unit = torch.nn.functional.normalize(embeddings.float(), dim=-1)
    # All pairs first, then the candidates' rows: a matmul over a slice rounds differently in float32
    similarity = (unit @ unit.T)[index][:, index].double()         # (C, C)
    relevance = mmr_lambda * scores.double()[index]                # (C,)
    redundancy = torch.zeros(len(index), dtype=torch.float64)      # max similarity to the chosen; 0 before any
    available = torch.ones(len(index), dtype=torch.bool)
    chosen: list[int] = []
    for _ in range(min(k, len(index))):
        gain = (relevance - (1 - mmr_lambda) * redundancy).masked_fill(~available, -math.inf)
        best = int(torch.argmax(gain))  # the first maximum: ties go to the earliest sentence
        chosen.append(int(index[best]))
        available[best] = False
        column = similarity[:, best]  # similarity[i, chosen]: a float32 matmul is not exactly symmetric
        redundancy = column if len(chosen) == 1 else torch.maximum(redundancy, column)
    return chosen


def target_count(num_candidates: int, num_sentences: int | None, ratio: float) -> int:
    if num_sentences is not None:
        return min(num_sentences, num_candidates)
    return min(num_candidates, max(1, math.ceil(ratio * num_candidates)))


def postprocess(output: SummaryOutput, batch, *, context: TaskContext, num_sentences, ratio, min_words, mode,
                mmr_lambda, hybrid_weight, layer, max_length):
    """Per document: the summary, every sentence with its span, score and whether it was chosen, and
    the sentences left out before scoring (a headline, short ones; with the reason)."""
    head = output.head
    used = mode
    if mode == "auto":
        used = "hybrid" if float(head.is_trained) > 0 else "centroid"
    texts, documents = batch.meta["texts"], batch.meta["spans"]
    options = dict(num_sentences=num_sentences, ratio=ratio, min_words=min_words, mmr_lambda=mmr_lambda,
                   hybrid_weight=hybrid_weight, layer=layer, max_length=max_length)
    if used == "centroid" and batch.meta["mode"] != "centroid":
        # "auto" fell back to centroid mode: embed each sentence alone (a second, cheaper pass).
        return _rerun_centroid(head, context, texts, documents, options)
    per_doc_scores: list[Tensor] = []
    per_doc_embeddings: list[Tensor | None] = []
    lam = mmr_lambda if mmr_lambda is not None else CENTROID_MMR_LAMBDA if used == "centroid" else 1.0
    if used in ("supervised", "hybrid"):
        per_doc_scores = [torch.zeros(len(spans)) for spans in documents]
        per_doc_embeddings = [None] * len(documents)
        logits = sentence_logits(output.token_scores.float().cpu(), batch.meta["cls"])
        for row, row_logits in zip(batch.meta["cls"], logits):
            for (_, _, d, k), logit in zip(row, row_logits):
                per_doc_scores[d][k] = torch.sigmoid(logit)
        if used == "hybrid" or lam < 1.0:  # the sentences alone: hybrid's similarities, and MMR's redundancy
            embedded = _sentence_embeddings(context, texts, documents, options)
            if used == "hybrid":
                similarities = [centroid_scores(vectors).clamp(min=0.0) for vectors in embedded]
                per_doc_scores = [hybrid_weight * p + (1 - hybrid_weight) * c
                                  for p, c in zip(per_doc_scores, similarities)]
            if lam < 1.0:
                per_doc_embeddings = embedded
    else:
        embeddings = _mean_pool(output.encoder, batch, layer)  # one row per sentence, documents in order
        per_doc_embeddings = _by_document(embeddings, documents)
        per_doc_scores = [centroid_scores(vectors).clamp(min=0.0) for vectors in per_doc_embeddings]
    results = [_choose(text, spans, scores, vectors, num_sentences, ratio, min_words, lam, used)
               for text, spans, scores, vectors in zip(texts, documents, per_doc_scores, per_doc_embeddings)]
    return results[0] if len(results) == 1 else results


def _by_document(rows: Tensor, documents: list[list[tuple[int, int]]]) -> list[Tensor]:
    """Per-sentence rows of several documents (in order) split into one tensor per document."""
    out, start = [], 0
    for spans in documents:
        out.append(rows[start:start + len(spans)])
        start += len(spans)
    return out


def _sentence_embeddings(context: TaskContext, texts: list[str], documents: list[list[tuple[int, int]]],
                         options: dict) -> list[Tensor]:
    """Each document's sentence embeddings (S, H), from a pass over each sentence alone."""
    sub = _sentences_alone(context, texts, documents, options)
    embeddings = _mean_pool(context.encode(sub.model_inputs()), sub, options["layer"])
    return _by_document(embeddings, sub.meta["spans"])


def _mean_pool(encoded, batch, layer: int) -> Tensor:
    states = encoded.last_hidden_state if layer == -1 else _layer(encoded, layer)
    return mean_pool(states, batch.attention_mask).float().cpu()  # (B, H)


def _layer(encoded, layer: int) -> Tensor:
    states = encoded.hidden_states
    if not -len(states) <= layer < len(states):
        raise InputError(f"summary: layer {layer} does not exist; the encoder has {len(states) - 1} layers "
                         f"(0 is the embeddings, -1 the last)")
    return states[layer]


def _sentences_alone(context: TaskContext, texts: list[str], documents: list[list[tuple[int, int]]],
                     options: dict) -> Batch:
    """centroid_batch for a postprocess's second pass, with the request's options."""
    return centroid_batch(context.tokenizer, texts, documents, _max_length(options["max_length"], context.tokenizer),
                          options["layer"])


def _rerun_centroid(head, context, texts: list[str], documents: list[list[tuple[int, int]]], options: dict):
    sub = _sentences_alone(context, texts, documents, options)
    output = SummaryOutput(torch.zeros(0), head, context.encode(sub.model_inputs()))
    return postprocess(output, sub, context=context, **options, mode="centroid")


SENTENCE_END = (".", "!", "?", '"', "'", "\u201d", "\u2019", ")")


def body_start(text: str, spans: list[tuple[int, int]]) -> int:
    """The index of the body's first sentence (the lead): 1 when the first "sentence" is a headline
    (a line of its own that does not end like a sentence, as news articles open), else 0."""
    if len(spans) < 2:
        return 0
    (a, b), (c, _) = spans[0], spans[1]
    return int("\n" in text[b:c] and not text[a:b].rstrip().endswith(SENTENCE_END))


def _choose(text, spans, scores, vectors, num_sentences, ratio, min_words, mmr_lambda, mode) -> dict[str, Any]:
    sentences = [text[a:b] for a, b in spans]
    start = body_start(text, spans)
    dropped = [{"index": 0, "start": spans[0][0], "end": spans[0][1], "text": sentences[0],
                "reason": "the headline (a first line that does not end like a sentence)"}] if start else []
    dropped += [{"index": k, "start": a, "end": b, "text": text[a:b],
                 "reason": f"shorter than min_words={min_words} ({len(text[a:b].split())} words)"}
                for k, (a, b) in enumerate(spans) if k >= start and len(text[a:b].split()) < min_words]
    dropped_index = {item["index"] for item in dropped}
    # A sentence that repeats an earlier one word for word (a pasted paragraph twice, a refrain) is not picked again:
    # the supervised and hybrid scores, which MMR does not temper, gave each copy the same high score
    first_of: dict[str, int] = {}
    for k in range(len(spans)):
        if k in dropped_index:
            continue
        key = " ".join(sentences[k].casefold().split())
        if key in first_of:
            dropped.append({"index": k, "start": spans[k][0], "end": spans[k][1], "text": sentences[k],
                            "reason": f"repeats sentence {first_of[key]} word for word"})
        else:
            first_of[key] = k
    dropped.sort(key=lambda item: item["index"])
    dropped_index = {item["index"] for item in dropped}
    candidates = [k for k in range(len(spans)) if k not in dropped_index]
    # The length follows the whole text, headline included (its share of the ratio goes to the body).
    count = min(len(candidates), target_count(len(candidates) + start, num_sentences, ratio))
    chosen = sorted(mmr_select(scores, vectors, candidates, count, mmr_lambda)) if candidates else []
    result = {
        "summary": " ".join(sentences[k] for k in chosen),
        "selected": chosen,
        "sentences": [{"index": k, "start": a, "end": b, "text": sentences[k], "score": round(float(scores[k]), 6),
                       "selected": k in chosen} for k, (a, b) in enumerate(spans)],
        "dropped": dropped,
        "lead": start,
        "mode": mode,
        "mmr_lambda": mmr_lambda,  # the one used (1.0: no redundancy penalty)
    }
    if not chosen:
        result["explanation"] = (f"no sentence was long enough: all {len(spans)} are shorter than "
                                 f"min_words={min_words}; lower min_words to include them")
    return result


# -- training, evaluation, baselines ---------------------------------------------------------------

def split_of(doc_id: str) -> str:
    """A fixed split by a hash of the id: 10 % test, 10 % dev, 80 % train (stable across runs and machines)."""
    bucket = zlib.crc32(doc_id.encode("utf-8")) % 10
    return "test" if bucket == 0 else "dev" if bucket == 1 else "train"


def read_data(path, split: str = "train"):
    """BBC News Summary JSON lines ({"id", "article", "summary"}); yields ({"text": article},
    {"summary", "id"}) for the documents of `split` ("train", "dev", "test" or "all")."""
    if split not in ("train", "dev", "test", "all"):
        raise ValueError(f"split {split!r} is not one of train, dev, test, all")
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                doc_id, article, summary = item["id"], item["article"], item["summary"]
            except (ValueError, KeyError) as err:
                raise ValueError(f"{path}:{number}: not a JSON object with id, article and summary ({err})") from None
            if split == "all" or split_of(doc_id) == split:
                yield {"text": article}, {"summary": summary, "id": doc_id}


def oracle_labels(text: str, spans: list[tuple[int, int]], summary: str) -> list[int]:
    """1 for each article sentence that appears verbatim in the reference summary (BBC summaries are
    article sentences joined together), else 0."""
    squashed = " ".join(summary.split())
    return [int(len(text[a:b].split()) > 0 and " ".join(text[a:b].split()) in squashed) for a, b in spans]


def training_batch(examples, tokenizer, *, generator=None, max_length: int = 512):
    """Packed BertSum rows and, per row, the (position, label) pairs of its sentences."""
    texts = [inputs["text"] for inputs, _ in examples]
    documents = [split_sentences(t) for t in texts]
    batch = pack_sentences(tokenizer, texts, documents, max_length)
    labels = [oracle_labels(t, spans, target["summary"]) for t, spans, (_, target) in zip(texts, documents, examples)]
    targets = [[(start, end, labels[d][k]) for start, end, d, k in row] for row in batch.meta["cls"]]
    return batch, targets


def sentence_logits(token_scores: Tensor, rows: list[list[tuple]]) -> list[Tensor]:
    """Each sentence's logit: the mean of the token scores over its span in the row, which for a
    linear scorer is the scorer applied to the sentence's mean-pooled hidden state.

    Not the [CLS] token's score, as in the original BertSum: MiniLM (a mean-pooling sentence
    encoder) maps every [CLS] of a packed row to the same vector (cosine 1.0000), so a [CLS]
    scorer can only learn the base rate; the starter scorer trained that way was constant."""
    cumulative = torch.nn.functional.pad(token_scores.float().cumsum(-1), (1, 0))  # (B, T + 1)
    out = []
    for r, row in enumerate(rows):
        starts = torch.tensor([span[0] for span in row], device=token_scores.device)
        ends = torch.tensor([span[1] for span in row], device=token_scores.device)
        out.append((cumulative[r, ends] - cumulative[r, starts]) / (ends - starts))  # (sentences in row,)
    return out


def loss(output: SummaryOutput, targets) -> Tensor:
    """Binary cross-entropy of each sentence's score (sentence_logits) against its oracle label."""
    logits = torch.cat(sentence_logits(output.token_scores, targets))
    labels = torch.tensor([float(y) for row in targets for *_, y in row], device=logits.device)
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


def metric(results: list[dict], targets: list[dict]) -> dict[str, float]:
    """ROUGE of the chosen sentences against the reference summaries."""
    return rouge([r["summary"] for r in results], [t["summary"] for t in targets])


def lead(text: str, k: int) -> str:
    """The first k sentences after any headline: the Lead-k baseline."""
    spans = split_sentences(text)
    start = body_start(text, spans)
    return " ".join(text[a:b] for a, b in spans[start:start + k])


def evaluate(predictor, examples, *, batch_size: int = 8, progress: bool = True, **options) -> dict[str, Any]:
    """ROUGE of the model (its mode, and the centroid mode), Lead-3 and first-k (k = the model's
    sentence count per document) on the same documents, so the table shows what the model adds."""
    texts = [inputs["text"] for inputs, _ in examples]
    references = [target["summary"] for _, target in examples]
    table: dict[str, Any] = {}
    model_results = predict_texts(predictor, texts, batch_size=batch_size, progress=progress, **options)
    mode = model_results[0]["mode"] if model_results else "centroid"
    table[f"model ({mode})"] = rouge([r["summary"] for r in model_results], references)
    if mode == "hybrid":
        alone = predict_texts(predictor, texts, batch_size=batch_size, progress=progress,
                              **{**options, "mode": "supervised"})
        table["supervised (the scorer alone)"] = rouge([r["summary"] for r in alone], references)
    if mode != "centroid":
        centroid = predict_texts(predictor, texts, batch_size=batch_size, progress=progress,
                                 **{**options, "mode": "centroid"})
        table["centroid (unsupervised)"] = rouge([r["summary"] for r in centroid], references)
    table["lead-3"] = rouge([lead(t, 3) for t in texts], references)
    table["first-k (k as the model)"] = rouge([lead(t, len(r["selected"])) for t, r in zip(texts, model_results)],
                                              references)
    lead_share = {f"model ({mode})": keeps_lead(model_results)}
    if mode != "centroid":
        lead_share["centroid (unsupervised)"] = keeps_lead(centroid)
    lead_share["references"] = references_with_lead(model_results, references)
    return {**table[f"model ({mode})"], "documents": len(examples), "lead_kept": lead_share[f"model ({mode})"],
            "rouge_f1": table, "first_sentence_kept": lead_share}


def keeps_lead(results: list[dict]) -> float:
    """The share of summaries that contain the document's lead, its first sentence after any headline
    (news puts its key fact there)."""
    return sum(r.get("lead", 0) in r["selected"] for r in results) / max(len(results), 1)


def references_with_lead(results: list[dict], references: list[str]) -> float:
    """The share of reference summaries that contain the document's lead (after any headline; spacing
    ignored: the BBC references join their sentences without one)."""
    def squeeze(text: str) -> str:
        return "".join(text.split())

    found = sum(len(r["sentences"]) > r.get("lead", 0) and squeeze(r["sentences"][r.get("lead", 0)]["text"])
                in squeeze(reference) for r, reference in zip(results, references))
    return found / max(len(references), 1)


# -- the tab ---------------------------------------------------------------------------------------

def render(text: str, result: dict) -> str:
    """The document as HTML: chosen sentences highlighted, every sentence's score after it."""
    parts, cursor = [], 0
    dropped = {item["index"] for item in result["dropped"]}
    for sentence in result["sentences"]:
        parts.append(escape(text[cursor:sentence["start"]]))
        style = (f"background:#fde68a;color:{ui.HIGHLIGHT_TEXT}" if sentence["selected"] else
                 "color:var(--body-text-color-subdued);text-decoration:line-through" if sentence["index"] in dropped
                 else "")
        parts.append(f'<span class="sentence{" chosen" if sentence["selected"] else ""}" style="{style}" '
                     f'title="score {sentence["score"]:.3f}">{escape(sentence["text"])}'
                     f'<sub style="color:inherit;font-size:0.75em"> {sentence["score"]:.2f}</sub></span>')
        cursor = sentence["end"]
    parts.append(escape(text[cursor:]))
    # the small numbers explained on the page itself: a touch screen shows no hover title
    key = ('<p class="summary-key" style="font-size:0.85em;opacity:.85">Highlighted: the sentences chosen. The small '
           "number after each sentence is its score (higher: more central to the document); struck through: "
           "dropped by the length filter.</p>")
    return key + '<div class="summary-doc" style="white-space:pre-wrap;line-height:1.7">' + "".join(parts) + "</div>"


# The tab's one length control: a number of sentences, or a share of the document's for long texts.
LENGTHS = {"1 sentence": (1, OPTIONS["ratio"]), **{f"{n} sentences": (n, OPTIONS["ratio"]) for n in (2, 3, 5, 10)},
           "a fifth of the document": (None, 0.2), "a third of the document": (None, 1 / 3),
           "half of the document": (None, 0.5)}


def build_tab(predictor) -> None:
    import gradio as gr  # noqa: PLC0415 - Gradio loads only where a UI is built

    text = gr.Textbox(label="Document", lines=10, value=EXAMPLES[0]["text"])
    with gr.Row():
        length = gr.Dropdown(list(LENGTHS), value="3 sentences", label="Length")
        min_words = gr.Slider(0, 20, value=OPTIONS["min_words"], step=1, label="Drop sentences shorter than (words)")
        # "auto": hybrid with a trained scorer (the starter's: best on BBC News, MODEL_CARD.md), else centroid.
        mode = gr.Radio(list(MODES), value="auto", label="Mode",
                        info="auto: hybrid when the model has a trained scorer (the starter has), else centroid; "
                             "hybrid: the trained scorer and the centroid together; centroid: unsupervised; "
                             "supervised: the scorer alone")
    button = ui.run_button(gr, "Summarise")
    summary = gr.Textbox(label="Summary", lines=4)
    document = gr.HTML(ui.empty_state("The document appears here with the chosen sentences highlighted."),
                       label="Document with chosen sentences")
    with gr.Accordion("Dropped by the length filter", open=False):
        dropped = gr.Dataframe(headers=["sentence", "reason"], interactive=False, wrap=True,
                               label="Dropped sentences", show_label=False)
    details = ui.details(gr)

    def run(text: str, length: str = "3 sentences", min_words: float = OPTIONS["min_words"], mode: str = "auto"):
        """Summarise a document by picking its most central sentences (extractive).

        Args:
            text: the document to summarise.
            length: "1 sentence", "2 sentences", "3 sentences", "5 sentences", "10 sentences",
                "a fifth of the document", "a third of the document" or "half of the document".
            min_words: sentences shorter than this many words are never picked (0-100; the page's slider stops at 20).
            mode: "auto", "hybrid", "centroid" or "supervised": how sentences are scored.
        """
        if length not in LENGTHS:
            raise InputError(f"summary: length must be one of {', '.join(map(repr, LENGTHS))}, got {length!r}")
        count, ratio = LENGTHS[length]
        output = predictor.predict({"text": text}, num_sentences=count, ratio=ratio, min_words=ui.whole(min_words), mode=mode)
        result = output["result"]
        dropped_rows = [[item["text"], item["reason"]] for item in result["dropped"]]
        return (result["summary"] or result.get("explanation", ""), render(text, result),
                dropped_rows or [["(none: every sentence was long enough)", ""]], output)

    ui.wire(gr, button, run, [text, length, min_words, mode], [summary, document, dropped, details],
            api_name="summary", examples=[[e["text"]] for e in EXAMPLES])


EXAMPLES = (
    {"text": "The city council approved a new budget on Monday. The plan raises spending on schools by 4.5 per cent "
             "and cuts the road maintenance fund. Mayor J. Smith said the vote was \"a turning point\" for the city. "
             "Opposition members argued that the cuts would hurt rural districts. The budget takes effect in "
             "January.\nLocal businesses welcomed the decision. Some residents plan to protest at next week's meeting."},
    {"text": "A storm brought heavy rain and strong winds to the coast overnight, cutting power to 40,000 homes. "
             "Engineers worked through the morning to restore supplies. Several roads were closed after trees "
             "fell across them. The weather service expects calmer conditions by the weekend. Schools in two "
             "districts stayed shut as a precaution. Residents were asked to avoid travel unless necessary."},
)


def pipeline_output(result: dict, options, single: bool):
    """The summarization pipeline's shape: [{"summary_text"}] for one document, one dict per document
    for a list (extractive: the chosen sentences in document order). Where no sentence could be chosen the
    summary is empty and "explanation" says why (every sentence shorter than min_words)."""
    summary = {"summary_text": result["summary"]}
    if "explanation" in result:
        summary["explanation"] = result["explanation"]
    return [summary] if single else summary


def explain(result, batch, **_options) -> list[ExplainTarget]:
    """Per chosen sentence: the trained scorer's probability of keeping it (in hybrid mode its share of the
    score; the centroid part compares sentences read one by one, which one gradient does not follow)."""
    if isinstance(result, list) or result.get("mode") not in ("supervised", "hybrid"):
        return []
    where = {k: (r, start, end) for r, row in enumerate(batch.meta["cls"]) for start, end, d, k in row if d == 0}
    targets = []
    for k in result["selected"]:
        if k not in where:
            continue
        row, start, end = where[k]
        words = result["sentences"][k]["text"].split()
        shown = " ".join(words[:6]) + (" …" if len(words) > 6 else "")
        targets.append(ExplainTarget(f"keep sentence {k + 1} (“{shown}”)", _keep_probability(start, end),
                                     "scorer's probability", row))
    return targets


def _keep_probability(start: int, end: int):
    def score(output: SummaryOutput) -> Tensor:
        return output.token_scores.float()[:, start:end].mean(-1).sigmoid()
    return score


BRIEF_SENTENCES = 3  # a card's share of a summary (the tab's own default length): All tasks showed 175 of a long paste


def brief(result) -> str:
    """The chosen sentences (the first BRIEF_SENTENCES of them, saying how many there are), or why there are none."""
    if not result["summary"]:
        return f"no sentence chosen: {result.get('explanation') or 'the text has none to choose'}"
    chosen = [s["text"] for s in result["sentences"] if s["selected"]]
    if len(chosen) <= BRIEF_SENTENCES:
        return result["summary"]
    return (" ".join(chosen[:BRIEF_SENTENCES]) + f" … ({len(chosen)} of the text's {len(result['sentences'])} "
            "sentences chosen; the Summary tab sets the length)")


@hookimpl
def register_tasks(register):
    register(TaskSpec(
        brief=brief,
        explain=explain,
        name="summary",
        default_checkpoint=starter_checkpoint("summary"),
        title="Summary",
        description="Extractive summary: the document's most central sentences, or those a trained scorer picks.",
        build_head=SentenceScorerHead,
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
        best_metric="rouge2",
        aliases=("summarization", "extractive-summarization"),
        pipeline_output=pipeline_output,
        evaluate=evaluate,
        predict_many=predict_texts,
    ))

