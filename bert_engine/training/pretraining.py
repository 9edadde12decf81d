"""BERT's pretraining data: NSP sentence pairs packed from raw documents, and dynamic MLM masking.

Documents come from one text file or a folder of them; blank lines separate documents and each
non-empty line is one unit (a sentence or a paragraph), as in the original create_pretraining_data.
Pairs are rebuilt every epoch and masks are drawn in every batch (dynamic masking), so no two
epochs see the same masks. Task-agnostic: the fill-mask task reuses `mask_tokens`.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..heads import IGNORE_INDEX
from ..tokenizer import Batch, Tokenizer

logger = logging.getLogger(__name__)


def read_documents(path: str | Path) -> list[list[str]]:
    """Documents (lists of non-empty lines) from a file or every *.txt / *.tokens / *.raw file in a folder.

    Raises:
        FileNotFoundError: naming the path; ValueError if nothing readable is found.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".tokens", ".raw"))
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"no text file or folder at {path}")
    documents: list[list[str]] = []
    for file in files:
        current: list[str] = []
        with open(file, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                line = line.strip()
                if line:
                    current.append(line)
                elif current:
                    documents.append(current)
                    current = []
        if current:
            documents.append(current)
    if not documents:
        raise ValueError(f"{path}: no text found (expected UTF-8 text files, blank lines between documents)")
    return documents


@dataclass
class Pair:
    a: list[int]
    b: list[int]
    is_random_next: bool


class PairBuilder:
    """Builds NSP pairs from tokenised documents (token ids per unit), following BERT's recipe.

    Args:
        max_seq_len: tokens per row including [CLS] and two [SEP].
        short_seq_prob: probability of a shorter target length, so the model also sees short inputs.
        nsp_prob: probability that segment B is a random segment from another document.
    """

    def __init__(self, documents: list[list[list[int]]], max_seq_len: int = 128, short_seq_prob: float = 0.1,
                 nsp_prob: float = 0.5, objective: str = "mlm+nsp") -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"objective {objective!r} is not one of {OBJECTIVES}")
        self.objective = objective
        if max_seq_len < 8:
            raise ValueError(f"max_seq_len {max_seq_len} is too small for a sentence pair (at least 8)")
        self.documents = [d for d in documents if any(d)]
        if len(self.documents) < 2 and objective == "mlm+nsp":
            raise ValueError(f"next-sentence pairs need at least 2 non-empty documents, got {len(self.documents)}")
        if not self.documents:
            raise ValueError("no non-empty document to pretrain on")
        self.max_seq_len, self.short_seq_prob, self.nsp_prob = max_seq_len, short_seq_prob, nsp_prob

    def pairs(self, seed: int) -> list[Pair]:
        """All pairs for one epoch, shuffled; deterministic given the seed."""
        rng = random.Random(seed)
        out: list[Pair] = []
        for index in range(len(self.documents)):
            out.extend(self._document_pairs(index, rng))
        rng.shuffle(out)
        return out

    def _target(self, rng: random.Random, max_tokens: int) -> int:
        """The next row's length: full, or with short_seq_prob a shorter one, so short inputs are seen too."""
        return rng.randint(2, max_tokens) if rng.random() < self.short_seq_prob else max_tokens

    def _document_pairs(self, index: int, rng: random.Random) -> list[Pair]:
        if self.objective == "mlm":
            return self._document_rows(index, rng)
        document = self.documents[index]
        max_tokens = self.max_seq_len - 3
        target = self._target(rng, max_tokens)
        pairs, chunk, length, i = [], [], 0, 0
        while i < len(document):
            chunk.append(document[i])
            length += len(document[i])
            if i == len(document) - 1 or length >= target:
                if len(chunk) == 1 and len(chunk[0]) >= 2:
                    # One long unit (a paragraph): cut it at a token, so it can still give a true pair.
                    cut = rng.randint(1, len(chunk[0]) - 1)
                    chunk = [chunk[0][:cut], chunk[0][cut:]]
                    units_in_chunk = 1
                else:
                    units_in_chunk = len(chunk)
                if len(chunk) >= 2 or chunk[0]:
                    a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                    a = [t for unit in chunk[:a_end] for t in unit]
                    if self.objective == "mlm+sop":  # ALBERT: the true continuation, swapped below or not
                        is_random = False
                        b = [t for unit in chunk[a_end:] for t in unit]
                    elif len(chunk) == 1 or rng.random() < self.nsp_prob:
                        is_random = True
                        other = rng.randrange(len(self.documents) - 1)
                        other += other >= index  # any document but this one
                        source = self.documents[other]
                        start = rng.randrange(len(source))
                        b = [t for unit in source[start:] for t in unit][:max(1, target - len(a))]
                        if units_in_chunk > 1:
                            i -= len(chunk) - a_end  # the unused units of this chunk go back
                    else:
                        is_random = False
                        b = [t for unit in chunk[a_end:] for t in unit]
                    a, b = _truncate_pair(a, b, max_tokens, rng)
                    if self.objective == "mlm+sop" and a and b and rng.random() < 0.5:
                        a, b, is_random = b, a, True  # SOP label 1: the two segments swapped
                    if a and b:
                        pairs.append(Pair(a, b, is_random))
                chunk, length = [], 0
                target = self._target(rng, max_tokens)
            i += 1
        return pairs

    def _document_rows(self, index: int, rng: random.Random) -> list[Pair]:
        """RoBERTa's FULL-SENTENCES rows: the document's units packed up to max_seq_len - 2 tokens, one
        segment each (Pair.b empty); a shorter target with short_seq_prob, as for pairs."""
        max_tokens = self.max_seq_len - 2
        rows, current = [], []
        target = self._target(rng, max_tokens)
        for unit in self.documents[index]:
            while unit:
                room = target - len(current)
                current.extend(unit[:room])
                unit = unit[room:]
                if len(current) >= target:
                    rows.append(Pair(current, [], False))
                    current = []
                    target = self._target(rng, max_tokens)
        if current:
            rows.append(Pair(current, [], False))
        return rows


OBJECTIVES = ("mlm", "mlm+sop", "mlm+nsp")


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """Cut the longer segment, from the front or the back at random, until both fit."""
    a, b = list(a), list(b)
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        del longer[0 if rng.random() < 0.5 else -1]
    return a, b


def collate_pairs(pairs: list[Pair], tokenizer: Tokenizer) -> tuple[Batch, Tensor]:
    """[CLS] A [SEP] B [SEP] rows (one segment, [CLS] A [SEP], where B is empty) padded to the longest;
    returns the batch and the pair labels (NSP: 1 = random B; SOP: 1 = swapped)."""
    cls_id, sep_id, pad_id = tokenizer.token_id("cls_token"), tokenizer.token_id("sep_token"), tokenizer.pad_token_id
    width = max(len(p.a) + len(p.b) + (3 if p.b else 2) for p in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    types = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for r, pair in enumerate(pairs):
        row = [cls_id, *pair.a, sep_id, *pair.b, sep_id] if pair.b else [cls_id, *pair.a, sep_id]
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
        types[r, len(pair.a) + 2:len(row)] = 1
    empty = [[] for _ in pairs]
    batch = Batch(ids, mask, types, offsets=empty, sequence_ids=empty, word_ids=empty,
                  sample_index=list(range(len(pairs))), truncated=[False] * len(pairs))
    return batch, torch.tensor([int(p.is_random_next) for p in pairs])


def special_mask(input_ids: Tensor, tokenizer: Tokenizer) -> Tensor:
    """(B, T) bool: [CLS], [SEP], [PAD], [MASK] and [UNK] positions, which are never chosen for MLM."""
    specials = torch.tensor(sorted({tokenizer.token_id(name) for name in
                                    ("cls_token", "sep_token", "pad_token", "mask_token", "unk_token")}))
    return torch.isin(input_ids, specials)


def continuation_mask(input_ids: Tensor, tokenizer: Tokenizer) -> Tensor:
    """(B, T) bool: pieces that continue a word, for whole-word masking: "##" pieces of WordPiece, the
    pieces without a word-start mark of BPE ("Ġ") and Unigram ("▁") (Tokenizer.starts_word)."""
    is_continuation = continuation_ids(tokenizer)
    return is_continuation[input_ids.clamp(max=len(is_continuation) - 1)]


def continuation_ids(tokenizer: Tokenizer) -> Tensor:
    """(V,) bool by token id: the pieces that continue a word (Tokenizer.starts_word is false); one scan
    of the vocabulary per tokenizer, kept on it."""
    is_continuation = getattr(tokenizer, "_continuation_ids", None)
    if is_continuation is None:
        vocab = tokenizer.backend.get_vocab()
        is_continuation = torch.zeros(max(vocab.values()) + 1, dtype=torch.bool)
        is_continuation[[i for token, i in vocab.items() if not tokenizer.starts_word(token)]] = True
        tokenizer._continuation_ids = is_continuation
    return is_continuation


def mask_tokens(input_ids: Tensor, tokenizer: Tokenizer, *, mlm_prob: float = 0.15, whole_word: bool = False,
                generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """BERT's masking: choose `mlm_prob` of the ordinary tokens; of those 80 % become [MASK],
    10 % a random ordinary token, 10 % stay. Specials and padding are never chosen.

    With `whole_word`, a word is chosen or not as a whole (its "##" pieces follow its first piece).
    Returns:
        (masked input ids (B, T), labels (B, T): the original id where chosen, -100 elsewhere).
    """
    if not 0 < mlm_prob < 1:
        raise ValueError(f"mlm_prob must lie in (0, 1), got {mlm_prob}")
    special = special_mask(input_ids, tokenizer)
    draw = torch.rand(input_ids.shape, generator=generator)
    if whole_word:
        after_special = torch.nn.functional.pad(special[:, :-1], (1, 0), value=True)  # a text's first piece
        continuation = continuation_mask(input_ids, tokenizer) & ~special & ~after_special  # starts a word (BPE: no "Ġ")
        # Each piece takes the draw of its word's first piece: carry the draw forward over "##" pieces.
        word_start = torch.where(continuation, torch.zeros_like(input_ids), torch.arange(input_ids.shape[1]))
        word_start = torch.cummax(word_start, dim=1).values
        draw = draw.gather(1, word_start)
    chosen = (draw < mlm_prob) & ~special
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    action = torch.rand(input_ids.shape, generator=generator)
    masked = input_ids.clone()
    masked[chosen & (action < 0.8)] = tokenizer.mask_token_id
    randomise = chosen & (action >= 0.8) & (action < 0.9)
    ordinary = _ordinary_ids(tokenizer)
    picks = ordinary[torch.randint(len(ordinary), (int(randomise.sum()),), generator=generator)]
    masked[randomise] = picks
    return masked, labels


def _ordinary_ids(tokenizer: Tokenizer) -> Tensor:
    """Ids of every non-special token (the pool for the 10 % random replacements), cached per tokenizer."""
    cached = getattr(tokenizer, "_ordinary_ids", None)
    if cached is None:
        everything = torch.arange(tokenizer.vocab_size)
        cached = everything[~special_mask(everything[None], tokenizer)[0]]
        tokenizer._ordinary_ids = cached
    return cached


def masked_lm_counts(logits: Tensor, gold: Tensor) -> dict[str, float]:
    """Sums for masked-token evaluation over (M, V) logits at M masked positions and their (M,) ids:
    summed negative log-likelihood, top-1 and top-5 hits, and M. Divide after summing over batches."""
    logits = logits.float()
    best = logits.topk(min(5, logits.shape[-1]), dim=-1).indices  # (M, 5)
    return {"nll": torch.nn.functional.cross_entropy(logits, gold, reduction="sum").item(),
            "top1": (best[:, 0] == gold).sum().item(), "top5": (best == gold[:, None]).any(-1).sum().item(),
            "masked": gold.numel()}


def tokenize_documents(documents: list[list[str]], tokenizer: Tokenizer, batch_size: int = 2048) -> list[list[list[int]]]:
    """Token ids of every unit of every document (no special tokens)."""
    flat = [unit for document in documents for unit in document]
    ids: list[list[int]] = []
    for start in range(0, len(flat), batch_size):
        ids.extend(e.ids for e in tokenizer.pieces(flat[start:start + batch_size]))
    out, cursor = [], 0
    for document in documents:
        out.append(ids[cursor:cursor + len(document)])
        cursor += len(document)
    return out
