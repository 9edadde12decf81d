"""A thin layer over the `tokenizers` library (WordPiece, byte-level BPE, Unigram): texts and pairs -> padded model tensors.

Keeps what tasks need after the model has run: character offsets, which sequence each token
belongs to, word ids, and for long inputs the overflowing windows with their source text.
It writes no tokenisation rules of its own; those come from tokenizer.json or a vocab.txt.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors
from torch import Tensor

from .errors import InputError
from .files import MAX_METADATA_BYTES, MAX_TOKENIZER_BYTES, metadata_file

logger = logging.getLogger(__name__)

Truncation = Literal["longest_first", "only_first", "only_second"]
TRUNCATIONS = ("longest_first", "only_first", "only_second")
SPECIAL_TOKENS = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                  "mask_token": "[MASK]"}
_SURROGATES = re.compile("[\ud800-\udfff]")


@dataclass
class Batch:
    """Tokenised inputs, padded to one length, plus the bookkeeping postprocessing needs.

    Row r may be a window of input `sample_index[r]` (long inputs with `return_overflowing`).
    `offsets[r][t]` is the (start, end) character span of token t in its own text (the first or
    the second of a pair, per `sequence_ids[r][t]`); specials and padding have (0, 0) and None.
    """

    input_ids: Tensor  # (B, T) int64
    attention_mask: Tensor  # (B, T) int64, 1 = real token
    token_type_ids: Tensor  # (B, T) int64, segment 0 / 1
    offsets: list[list[tuple[int, int]]]
    sequence_ids: list[list[int | None]]
    word_ids: list[list[int | None]]
    sample_index: list[int]
    truncated: list[bool]  # per input: some of its tokens are in no row (cut, not windowed)
    meta: dict[str, Any] = field(default_factory=dict)  # what a task's postprocess needs (its texts, ...)

    def model_inputs(self) -> dict[str, Any]:
        """The keyword arguments of BertModel.forward (plus any a task put in `meta["model_kwargs"]`,
        such as output_hidden_states)."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "token_type_ids": self.token_type_ids, **self.meta.get("model_kwargs", {})}

    def to(self, device: torch.device | str) -> Batch:
        self.input_ids = self.input_ids.to(device)
        self.attention_mask = self.attention_mask.to(device)
        self.token_type_ids = self.token_type_ids.to(device)
        return self

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def stacked(cls, parts: Sequence[Batch], pad_id: int) -> Batch:
        """The rows of several batches as one, in order, right-padded to the widest (ids with `pad_id`, masks and
        segments with 0, offsets with (0, 0), the rest with None): inputs tokenised one at a time, then run in
        one forward pass. Part i's inputs follow part i - 1's in `sample_index`; each part is kept whole in
        meta["parts"], for a postprocess that answers them one by one."""
        width = max(part.input_ids.shape[1] for part in parts)

        def padded(name: str, value: int) -> Tensor:
            return torch.cat([torch.nn.functional.pad(getattr(part, name), (0, width - part.input_ids.shape[1]),
                                                      value=value) for part in parts])

        def listed(name: str, value: Any) -> list[list[Any]]:
            return [row + [value] * (width - len(row)) for part in parts for row in getattr(part, name)]

        sample_index, first = [], 0
        for part in parts:
            sample_index += [first + i for i in part.sample_index]
            first += len(part.truncated)
        return cls(padded("input_ids", pad_id), padded("attention_mask", 0), padded("token_type_ids", 0),
                   listed("offsets", (0, 0)), listed("sequence_ids", None), listed("word_ids", None), sample_index,
                   [cut for part in parts for cut in part.truncated], meta={"parts": list(parts)})

    def split(self) -> list[Batch]:
        """Each input's rows as a Batch of its own, padded to its own longest row: what tokenising that input
        alone gives (the rows' bookkeeping is per row already; meta is not copied)."""
        rows: list[list[int]] = [[] for _ in self.truncated]
        for r, sample in enumerate(self.sample_index):
            rows[sample].append(r)
        lengths = self.attention_mask.sum(1).tolist()
        parts = []
        for sample, chosen in enumerate(rows):
            width = max(lengths[r] for r in chosen)
            index = torch.tensor(chosen)
            parts.append(Batch(self.input_ids[index, :width], self.attention_mask[index, :width],
                               self.token_type_ids[index, :width], [self.offsets[r] for r in chosen],
                               [self.sequence_ids[r] for r in chosen], [self.word_ids[r] for r in chosen],
                               [0] * len(chosen), [self.truncated[sample]]))
        return parts

    def tokens_within(self, row: int, start: int, end: int, sequence: int = 0) -> list[int]:
        """Positions in row `row` of the tokens of text `sequence` (0: the first, 1: the second of a pair)
        whose characters lie in [start, end), e.g. an entity's or an answer's pieces."""
        return [t for t, (span, seq) in enumerate(zip(self.offsets[row], self.sequence_ids[row]))
                if seq == sequence and span[1] > span[0] and start <= span[0] and span[1] <= end]

    def word_starts(self, word_spans: Sequence[Sequence[tuple[int, int]]], sequence: int = 0) -> list[list[tuple[int, int]]]:
        """For a token task: per row, (token position, word index) of each word's first piece.

        `word_spans[i]` gives input i's words as (start, end) characters of its text (of the first text
        of a pair, or the second with sequence=1), however the data splits them ("U.S." one word or
        three). A piece belongs to the word its first character falls in; each word's first piece in a
        row is listed (a word split across two windows starts in both). Special tokens, padding and
        pieces outside every word (spaces a BPE piece starts with) are never listed.
        """
        out = []
        for r, sample in enumerate(self.sample_index):
            bounds = sorted((start, end, k) for k, (start, end) in enumerate(word_spans[sample]))
            starts, row, seen = [b[0] for b in bounds], [], set()
            for t, ((start, end), seq) in enumerate(zip(self.offsets[r], self.sequence_ids[r])):
                if seq != sequence or end <= start:
                    continue
                i = bisect.bisect_right(starts, start) - 1
                if i < 0 or start >= bounds[i][1]:
                    continue  # a piece between words
                word = bounds[i][2]
                if word not in seen:
                    seen.add(word)
                    row.append((t, word))
            out.append(row)
        return out

    def word_targets(self, word_spans: Sequence[Sequence[tuple[int, int]]], word_labels: Sequence[Sequence[int]],
                     ignore_index: int = -100, sequence: int = 0) -> Tensor:
        """(rows, T) int64 targets for a token task: each word's label id on its first piece
        (`word_starts`), `ignore_index` everywhere else (later pieces, specials, padding), the loss
        `heads.IGNORE_INDEX` expects. `word_labels[i][k]` is input i's word k's label id (in the head's
        order: training_batch's `labels=`)."""
        targets = torch.full(self.input_ids.shape, ignore_index, dtype=torch.long)
        for r, row in enumerate(self.word_starts(word_spans, sequence)):
            for t, word in row:
                targets[r, t] = int(word_labels[self.sample_index[r]][word])
        return targets


def whitespace_words(text: str) -> list[tuple[int, int]]:
    """The (start, end) characters of the whitespace-separated words of `text` (what `Batch.word_starts`
    takes for data given as words joined by spaces, as CoNLL's)."""
    return [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]


class Tokenizer:
    """A tokenizer from tokenizer.json (WordPiece for BERT and DistilBERT, byte-level BPE for RoBERTa,
    Unigram for ALBERT: whatever the file's model, normaliser and post-processor say) or BERT's vocab.txt,
    with the special tokens by role (tokenizer_config.json names them; BERT's by default).

    Args:
        backend: a configured `tokenizers.Tokenizer` (normaliser, pre-tokeniser, post-processor).
        model_max_length: default `max_length` (the model's position table).
        special_tokens: names -> strings, as in tokenizer_config.json.
    """

    def __init__(self, backend: Backend, *, model_max_length: int = 512,
                 special_tokens: dict[str, str] | None = None, do_lower_case: bool | None = None,
                 tokenizer_class: str = "BertTokenizer") -> None:
        self.backend = backend
        self.tokenizer_class = tokenizer_class
        self.kind = type(backend.model).__name__  # "WordPiece", "BPE" or "Unigram"
        self.model_max_length = model_max_length
        self.special_tokens = {**SPECIAL_TOKENS, **(special_tokens or {})}
        self.do_lower_case = do_lower_case
        self.backend.no_padding()
        # A normaliser that can lengthen text (Replace, NFKC's ligatures, a SentencePiece map): texts are
        # measured after it, in pieces, before the whole is tokenised (normalised_length).
        spec = json.loads(backend.to_str())
        self.grows = _can_grow(spec.get("normalizer"))
        # Whether every whitespace-separated chunk holding a letter or digit is at least one token (windows_at_least)
        self.counts_words = self.kind in ("WordPiece", "BPE", "Unigram") and _keeps_words(
            spec.get("normalizer"), spec.get("pre_tokenizer"))
        self._words = _WORDS_SPACE_ONLY if "Metaspace" in json.dumps(spec.get("pre_tokenizer")) else _WORDS
        self.backend.no_truncation()  # never changed after this: each truncation setting has its own copy
        self._lock = threading.Lock()  # guards _backends, not the calls: those run at once
        self._backends: OrderedDict[tuple, Backend] = OrderedDict()
        for name, token in self.special_tokens.items():
            if backend.token_to_id(token) is None:
                raise ValueError(f"special token {name}={token!r} is not in the vocabulary")

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def from_vocab(cls, vocab_file: str | Path, *, lowercase: bool = True, strip_accents: bool | None = None,
                   tokenize_chinese_chars: bool = True, model_max_length: int = 512) -> Tokenizer:
        """BERT's WordPiece pipeline assembled from the `tokenizers` library's parts over a vocab.txt."""
        path = Path(vocab_file)
        try:
            tokens = path.read_text(encoding="utf-8").split("\n")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: cannot read vocabulary ({err})") from None
        if tokens and tokens[-1] == "":
            tokens.pop()
        vocab: dict[str, int] = {}
        for index, token in enumerate(tokens):
            vocab.setdefault(token.rstrip("\r"), index)
        missing = [t for t in SPECIAL_TOKENS.values() if t not in vocab]
        if missing:
            raise ValueError(f"{path}: vocabulary lacks the special tokens {missing}")
        backend = Backend(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
        backend.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=tokenize_chinese_chars, strip_accents=strip_accents,
            lowercase=lowercase)
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        backend.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
        backend.decoder = decoders.WordPiece(prefix="##")
        # Registered as special tokens, a literal "[MASK]" in user text stays one token.
        backend.add_special_tokens(list(SPECIAL_TOKENS.values()))
        return cls(backend, model_max_length=model_max_length, do_lower_case=lowercase)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Tokenizer:
        """Load from a checkpoint folder: tokenizer.json if present, else vocab.txt + tokenizer_config.json.

        Raises:
            ValueError: naming the folder, if neither file exists or a file cannot be parsed;
                CheckpointError (a ValueError) where a file links outside the folder or is too large.
        """
        folder = Path(folder)
        config = {}
        if (folder / "tokenizer_config.json").is_file():
            path = metadata_file(folder, "tokenizer_config.json", MAX_METADATA_BYTES)
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
            except (ValueError, RecursionError) as err:
                raise ValueError(f"{folder / 'tokenizer_config.json'}: not valid JSON ({err})") from None
            if not isinstance(config, dict):
                raise ValueError(f"{folder / 'tokenizer_config.json'}: expected a JSON object")
        max_length = config.get("model_max_length", 512)
        # Checkpoints without a limit store a huge sentinel (1e30); BERT's position table caps it anyway.
        max_length = max_length if isinstance(max_length, int) and 0 < max_length <= 1_000_000 else 512
        specials = {k: v for k, v in config.items() if k in SPECIAL_TOKENS and isinstance(v, str)}
        lowercase = config.get("do_lower_case")
        if (folder / "tokenizer.json").is_file():
            path = metadata_file(folder, "tokenizer.json", MAX_TOKENIZER_BYTES)
            try:
                backend = Backend.from_file(str(path))
            except Exception as err:  # the Rust library raises a bare Exception on parse errors
                raise ValueError(f"{folder / 'tokenizer.json'}: cannot be parsed ({err})") from None
            spec = json.loads(backend.to_str())
            if (problem := tokenizer_work_problem(spec)) is not None:
                raise ValueError(f"{folder / 'tokenizer.json'}: {problem}")
            growth = _growth(spec.get("normalizer"))
            if growth > MAX_NORMALISER_GROWTH:
                raise ValueError(f"{folder / 'tokenizer.json'}: its normaliser can make a text {growth:,.0f} times "
                                 f"longer before tokenising (a Replace rule); the limit is {MAX_NORMALISER_GROWTH}")
            kind = config.get("tokenizer_class")
            return cls(backend, model_max_length=max_length, special_tokens=specials, do_lower_case=lowercase,
                       tokenizer_class=kind if isinstance(kind, str) and kind.isidentifier() else "BertTokenizer")
        if (folder / "vocab.txt").is_file():
            return cls.from_vocab(metadata_file(folder, "vocab.txt", MAX_TOKENIZER_BYTES),
                                  lowercase=lowercase if lowercase is not None else True,
                                  strip_accents=config.get("strip_accents"),
                                  tokenize_chinese_chars=config.get("tokenize_chinese_chars", True),
                                  model_max_length=max_length)
        raise ValueError(f"{folder}: no tokenizer found (looked for tokenizer.json and vocab.txt)")

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json, vocab.txt and tokenizer_config.json (readable by transformers too)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        if self.kind == "WordPiece":  # a vocab.txt says all of a WordPiece model; BPE and Unigram live in the JSON
            vocab = sorted(self.backend.get_vocab(with_added_tokens=False).items(), key=lambda item: item[1])
            (folder / "vocab.txt").write_text("".join(token + "\n" for token, _ in vocab), encoding="utf-8")
        config = {"tokenizer_class": self.tokenizer_class, "model_max_length": self.model_max_length,
                  **self.special_tokens}
        if self.do_lower_case is not None:
            config["do_lower_case"] = self.do_lower_case
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    # -- vocabulary ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, name: str) -> int:
        """Id of a special token by its role: "cls_token", "sep_token", "pad_token", "mask_token", "unk_token"."""
        return self.backend.token_to_id(self.special_tokens[name])

    @property
    def pad_token_id(self) -> int:
        return self.token_id("pad_token")

    @property
    def mask_token_id(self) -> int:
        return self.token_id("mask_token")

    @property
    def mask_token(self) -> str:
        return self.special_tokens["mask_token"]

    @property
    def _continuing_prefix(self) -> str:
        """WordPiece's mark of a piece that continues a word ("##" unless the model says otherwise)."""
        return getattr(self.backend.model, "continuing_subword_prefix", "##") or "##"

    def starts_word(self, token: str) -> bool:
        """Whether a piece begins a word, by the model's convention: WordPiece marks continuations ("##ing"),
        byte-level BPE marks word starts after a space ("Ġword"), Unigram marks word starts ("▁word")."""
        if self.kind == "BPE":
            return token.startswith("Ġ")
        if self.kind == "Unigram":
            return token.startswith("▁")
        return not token.startswith(self._continuing_prefix)

    def piece_text(self, token_id: int) -> str:
        """A piece as a reader sees it: "capital" for "Ġcapital", "▁capital" or "capital"; "ing" for "##ing"."""
        token = self.backend.id_to_token(int(token_id)) or ""
        if self.kind == "WordPiece":
            prefix = self._continuing_prefix
            return token[len(prefix):] if token.startswith(prefix) else token
        return self.backend.decode([int(token_id)], skip_special_tokens=False).strip()

    def check_normalised_length(self, text: str) -> int:
        """The text's length after the normaliser, measured a piece at a time (memory stays bounded
        whatever the normaliser does).

        Raises:
            InputError: past MAX_NORMALISED_CHARS, naming the growth.
        """
        normalizer, total = self.backend.normalizer, 0
        if normalizer is None:
            return len(text)
        for start in range(0, len(text), _NORMALISE_PIECE):
            total += len(normalizer.normalize_str(text[start:start + _NORMALISE_PIECE]))
            if total > MAX_NORMALISED_CHARS:
                raise InputError(f"this model's tokenizer turns the first {start + _NORMALISE_PIECE:,} of the text's "
                                 f"{len(text):,} characters into {total:,} (its normaliser lengthens text); the limit "
                                 f"is {MAX_NORMALISED_CHARS:,}: send a shorter text or pick another model")
        return total

    def words_at_least(self, text: str) -> int:
        """A lower bound of the tokens `text` makes, from one linear scan, nothing tokenised: its space-separated
        chunks that hold a letter or digit every admitted normaliser keeps (_KEPT_LETTERS), each at least one token
        (an unknown one included) where the normaliser removes no such letter and the pre-tokeniser splits at
        spaces (counts_words); else 0."""
        return len(self._words.findall(text)) if self.counts_words else 0

    def windows_at_least(self, text: str, text_pair: str | None = None, *, max_length: int | None = None,
                         stride: int = 0) -> int:
        """A lower bound of the rows `self(text, text_pair, max_length=..., stride=..., return_overflowing=True)`
        makes (truncation "longest_first" alone, "only_second" for a pair), from words_at_least: a text far past
        a request's window limit is refused in milliseconds, where tokenising all of it first took seconds (1.75 s
        for 1,000,000 characters of a QA context on a 2-core Ice Lake Xeon)."""
        max_length = max_length or self.model_max_length
        first, second = (0, self.words_at_least(text)) if text_pair is None else (
            self.words_at_least(text), self.words_at_least(text_pair))
        room = max_length - self.backend.num_special_tokens_to_add(text_pair is not None) - first
        if room <= stride or second <= room:
            return 1
        return 1 + -(-(second - room) // (room - stride))

    def span_around(self, text: str, start: int, end: int, tokens: int) -> tuple[int, int]:
        """(lo, hi): a part of `text` that holds every run of at most `tokens` tokens including text[start:end],
        cut at whitespace, from counted words (words_at_least), nothing tokenised: a task that reads one window
        around a place (fill-mask's masks) tokenises that part, not all of a long text. (0, len(text)) where no
        count is known (counts_words)."""
        if not self.counts_words:
            return 0, len(text)
        starts = [m.start() for m in self._words.finditer(text)]  # each counted chunk's start (or the space before it)
        first, last = bisect.bisect_right(starts, start) - 1, bisect.bisect_right(starts, max(start, end - 1)) - 1
        lo = starts[first - tokens] if first - tokens > 0 else 0
        hi = starts[last + tokens + 1] if last >= 0 and last + tokens + 1 < len(starts) else len(text)
        return lo, hi

    def tokenize(self, text: str) -> list[str]:
        """Word pieces of `text`, without special tokens."""
        return self.pieces([text])[0].tokens

    def pieces(self, texts: Sequence[str]) -> list:
        """Each text's encoding (ids, tokens, offsets, word ids) without special tokens or truncation.

        For callers that assemble model inputs themselves (several sentences per row, for example).
        """
        texts = [_clean(t) for t in _as_batch(list(texts), "text")] if texts else []
        if self.grows:
            for text in texts:
                self.check_normalised_length(text)
        with _backend_crash_is_the_models():  # (the shared backend never truncates: no setting to change)
            return self.backend.encode_batch(texts, add_special_tokens=False) if texts else []

    def _truncating(self, max_length: int, stride: int, strategy: str) -> Backend:
        """A copy of the backend with this truncation set once and never changed, kept for the next call (at
        most BACKENDS_KEPT settings). With one backend whose settings each call changed, calls had to run in
        turn behind a lock: a visitor's 1,000,000-character text held every other request of the task for the
        seconds it took to tokenise (a hostile-visitor audit, session 53); now they run at once."""
        key = (max_length, stride, strategy)
        with self._lock:
            if (backend := self._backends.get(key)) is not None:
                self._backends.move_to_end(key)
                return backend
        backend = Backend.from_str(self.backend.to_str())  # ~20 ms for BERT's vocabulary; once per setting
        backend.no_padding()
        backend.enable_truncation(max_length, stride=stride, strategy=strategy)
        with self._lock:
            backend = self._backends.setdefault(key, backend)  # another thread's copy if it was first
            while len(self._backends) > BACKENDS_KEPT:
                self._backends.popitem(last=False)
        return backend

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int]:
        unk = self.token_id("unk_token")
        return [i if (i := self.backend.token_to_id(t)) is not None else unk for t in tokens]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- encoding -----------------------------------------------------------------------------------

    def __call__(self, text: str | Sequence[str], text_pair: str | Sequence[str] | None = None, *,
                 max_length: int | None = None, truncation: Truncation | None = "longest_first",
                 stride: int = 0, return_overflowing: bool = False, padding: Literal["longest", "max_length"] = "longest",
                 pad_to_multiple_of: int | None = None) -> Batch:
        """Encode one text or a batch (optionally paired with second texts) into a padded Batch.

        Args:
            text, text_pair: a string or a list of strings; pairs get segment ids 0 / 1.
            max_length: tokens per row including specials; default `model_max_length`.
            truncation: which sequence to cut ("only_second" keeps a QA question whole); None: no cut.
            stride: tokens shared by consecutive windows when `return_overflowing`.
            return_overflowing: keep what truncation cut as extra rows (windows) instead of dropping it.
            padding: to the longest row, or to `max_length`.
        Raises:
            TypeError: if a text is not a string. ValueError: on an empty batch or impossible lengths.
        """
        if truncation is not None and truncation not in TRUNCATIONS:  # transformers' True/False mean something else here
            raise TypeError(f"truncation must be one of {', '.join(map(repr, TRUNCATIONS))} or None (no cut), got "
                            f"{truncation!r}" + ("; for transformers' truncation=True pass 'longest_first'"
                                                  if truncation is True else ""))
        texts, pairs = _as_batch(text, "text"), None
        if text_pair is not None:
            pairs = _as_batch(text_pair, "text_pair")
            if len(pairs) != len(texts):
                raise ValueError(f"got {len(texts)} texts but {len(pairs)} text pairs")
        max_length = max_length or self.model_max_length
        num_specials = self.backend.num_special_tokens_to_add(pairs is not None)  # RoBERTa pairs: 4
        if truncation is not None and max_length <= num_specials:
            raise ValueError(f"max_length {max_length} leaves no room for text after {num_specials} special tokens")
        if return_overflowing and not 0 <= stride < max_length - num_specials:
            raise ValueError(f"stride {stride} must lie in [0, {max_length - num_specials})")
        if self.grows:
            for value in (*texts, *(pairs or ())):
                self.check_normalised_length(value)
        inputs = list(zip(texts, pairs)) if pairs is not None else texts
        backend = self.backend if truncation is None else self._truncating(
            max_length, stride if return_overflowing else 0, truncation)
        cut = [False] * len(inputs)  # a text read in part because its start alone already overflows
        # a long text that truncation cuts anyway is read from its start (the rest, all together, in one call)
        long = {i for i, text in enumerate(texts) if len(text) > START_CHARS} if (
            truncation is not None and not return_overflowing and pairs is None) else set()
        try:
            with _backend_crash_is_the_models():
                encodings = backend.encode_batch([text for i, text in enumerate(inputs) if i not in long] if long
                                                 else inputs)
                for i in sorted(long):  # (ascending: each goes back to its place)
                    encoding, cut[i] = _start_of(backend, texts[i], max_length)
                    encodings.insert(i, encoding)
        except InputError:
            raise
        except Exception as err:  # the Rust library raises a bare Exception, e.g. a pair that cannot fit
            raise ValueError(f"cannot tokenise with max_length={max_length}, truncation={truncation!r}: {err}") from None
        rows, sample_index, truncated = [], [], []
        for index, encoding in enumerate(encodings):
            rows.append(encoding)
            sample_index.append(index)
            truncated.append((cut[index] or bool(encoding.overflowing)) and not return_overflowing)
            if return_overflowing:
                rows.extend(encoding.overflowing)
                sample_index.extend([index] * len(encoding.overflowing))
        offsets = [list(e.offsets) for e in rows]
        if self.kind != "WordPiece":  # Unigram's "▁word" (and BPE's "Ġword") spans start at the space before it
            for r, row in enumerate(offsets):
                sources = (texts[sample_index[r]], pairs[sample_index[r]] if pairs is not None else "")
                offsets[r] = _without_leading_space(row, rows[r].sequence_ids, sources)
        width = max_length if padding == "max_length" else max(len(e.ids) for e in rows)
        if pad_to_multiple_of:
            width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
        return self._pad(rows, width, sample_index, truncated, offsets)

    def _pad(self, rows, width: int, sample_index: list[int], truncated: list[bool], offsets) -> Batch:
        ids = np.full((len(rows), width), self.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        types = np.zeros((len(rows), width), dtype=np.int64)
        for r, encoding in enumerate(rows):
            n = len(encoding.ids)
            ids[r, :n], types[r, :n], mask[r, :n] = encoding.ids, encoding.type_ids, 1
        return Batch(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(types),
                     offsets=offsets, sequence_ids=[e.sequence_ids for e in rows],
                     word_ids=[e.word_ids for e in rows], sample_index=sample_index, truncated=truncated)


BACKENDS_KEPT = 4  # truncation settings whose backend copies a tokenizer keeps (a task uses one or two)
# A truncated text is read from its start, this many characters first, doubling, until the tokens kept end
# this far before the cut: a 1,000,000-character text cut to 512 tokens costs ~1 ms, not seconds.
START_CHARS, CUT_MARGIN = 8_192, 256


def _start_of(backend: Backend, text: str, max_length: int):
    """(the encoding of `text` truncated to `max_length`, whether only a start of it was read): its start,
    read in growing pieces, until the tokens kept end CUT_MARGIN characters before the cut (a cut changes the
    tokens of the word it splits, which ends past the kept ones then), else the whole text: at most about twice
    the whole text's work, for a text whose kept tokens reach its second half."""
    size = max(START_CHARS, 8 * max_length)
    while 2 * size <= len(text):
        part = backend.encode(text[:size])
        ends = [end for (_, end), sequence in zip(part.offsets, part.sequence_ids) if sequence is not None]
        if part.overflowing and ends and ends[-1] <= size - CUT_MARGIN:
            return part, True
        size *= 2
    return backend.encode(text), False


def _without_leading_space(offsets, sequence_ids, texts: tuple[str, str]) -> list[tuple[int, int]]:
    """Offsets that start at the piece's first character, not at the space its word-start mark stands for."""
    out = []
    for (start, end), sequence in zip(offsets, sequence_ids):
        if sequence is not None:
            text = texts[sequence]
            while start < end and text[start].isspace():
                start += 1
        out.append((start, end))
    return out


# A tokenizer.json whose Replace rules lengthen text more than this is refused at load; the longest a
# text may be after normalising (the inputs' limit is 1,000,000 characters) is checked per request.
MAX_NORMALISER_GROWTH = 8
MAX_NORMALISED_CHARS = 2_000_000
_NORMALISE_PIECE = 65_536  # characters normalised at a time while measuring


# WordPiece reads a word of n characters in up to n^2 / 2 vocabulary lookups of up to n characters each, and gives a
# longer word [UNK] at once: BERT's tokenizers set 100. A tokenizer.json that sets 10^9 made one 16,000-letter word
# take 116 s (a hostile-visitor audit, session 57).
MAX_WORD_CHARS = 200
_QUANTIFIER = re.compile(r"[*+?]|\{(\d*)(,?)(\d*)\}")
_BOUNDED_REPEAT = 16  # {n,m} with m at most this counts as bounded


def tokenizer_work_problem(spec: Any) -> str | None:
    """What in a tokenizer.json could make tokenising a text cost more than linear time, in words; None where nothing
    does. Its model's longest word (WordPiece's `max_input_chars_per_word`) and every regular expression of its
    normaliser and pre-tokeniser (`Replace`, `Split`), which the Rust library runs with a backtracking engine, in
    the request's thread, where no time limit can stop it: `(a|a)+b` took about 1 ms a character."""
    if not isinstance(spec, dict):
        return None
    model = spec.get("model") if isinstance(spec.get("model"), dict) else {}
    longest = model.get("max_input_chars_per_word")
    if model.get("type") == "WordPiece" and isinstance(longest, int) and longest > MAX_WORD_CHARS:
        return (f"its WordPiece model reads words of up to {longest:,} characters (max_input_chars_per_word); "
                f"at most {MAX_WORD_CHARS} are allowed (BERT's tokenizers read 100), as a word's cost grows with the "
                "cube of its length")
    for part in ("normalizer", "pre_tokenizer"):
        for pattern in _regexes(spec.get(part)):
            if (why := regex_problem(pattern)) is not None:
                shown = repr(pattern) if len(pattern) <= 80 else repr(pattern[:80]) + "..."
                return (f"its {part.replace('_', '-')} has the regular expression {shown}, which {why}; "
                        "such a pattern can take time that grows faster than the text (catastrophic backtracking)")
    return None


def _regexes(spec: Any) -> Iterator[str]:
    """Every {"Regex": pattern} string inside a tokenizer.json part."""
    if isinstance(spec, dict):
        for key, value in spec.items():
            if key == "Regex" and isinstance(value, str):
                yield value
            else:
                yield from _regexes(value)
    elif isinstance(spec, list):
        for value in spec:
            yield from _regexes(value)


def regex_problem(pattern: str) -> str | None:
    """Why matching `pattern` might not take linear time, or None. Admitted: alternatives of single atoms (a
    character, an escape such as \\s or \\p{L}, a [class]) each optionally quantified, with at most one
    repetition without a small bound per alternative and nothing after it but zero-width checks (a lookahead of
    one atom, $, \\b); groups only without quantifiers inside and not repeated (`(?i:'s|'t)`). That covers BERT's,
    ALBERT's (" {2,}") and GPT-2's patterns; anything else is refused rather than guessed at."""
    atoms: list[tuple[str, str]] = []  # (kind, quantifier) of the current alternative: kind "atom", "group", "check"
    i, n = 0, len(pattern)

    def alternative_problem() -> str | None:
        unbounded = [k for k, (kind, q) in enumerate(atoms) if q == "unbounded"]
        if len(unbounded) > 1:
            return "repeats two parts of one alternative without bound"
        if unbounded and any(kind != "check" for kind, _ in atoms[unbounded[0] + 1:]):
            return "has more to match after a repetition without bound"
        return None

    while i < n:
        c = pattern[i]
        if c == "|":
            if (why := alternative_problem()) is not None:
                return why
            atoms, i = [], i + 1
            continue
        if c == "(":
            end, inner = _group_end(pattern, i)
            if end is None:
                return "has a group that does not close"
            if _QUANTIFIER.search(_without_classes(inner)):
                return "repeats something inside a group"
            if "(" in _without_classes(inner):
                return "has a group inside a group"
            kind = "check" if pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i) else "group"
            i = end
        elif c == "[":
            end = _class_end(pattern, i)
            if end is None:
                return "has a character class that does not close"
            kind, i = "atom", end
        elif c == "\\":
            if i + 1 >= n:
                return "ends in a backslash"
            kind = "check" if pattern[i + 1] in "bBAzZG" else "atom"
            i += 2
            if pattern[i - 1] in "pP" and i < n and pattern[i] == "{":  # \p{L}
                close = pattern.find("}", i)
                if close < 0:
                    return "has a \\p{...} that does not close"
                i = close + 1
        elif c in "^$":
            kind, i = "check", i + 1
        elif c in "*+?{":
            if c != "{" or _QUANTIFIER.match(pattern, i):
                return "quantifies nothing"
            kind, i = "atom", i + 1  # a literal "{"
        else:
            kind, i = "atom", i + 1
        quantifier = None
        match = _QUANTIFIER.match(pattern, i)
        if match is not None:
            i = match.end()
            possessive = i < n and pattern[i] == "+"
            if i < n and pattern[i] in "?+":  # lazy or possessive
                i += 1
            if kind == "check":
                return "repeats a zero-width check"
            text = match.group(0)
            if text == "?":
                quantifier = "bounded"
            elif text in "*+" or (match.group(2) and not match.group(3)):
                quantifier = "bounded" if possessive else "unbounded"  # (a possessive one never gives back)
            else:
                most = int(match.group(3) or match.group(1) or 0)
                quantifier = "bounded" if most <= _BOUNDED_REPEAT else "unbounded"
            if kind == "group" and quantifier == "unbounded":
                return "repeats a group"
        atoms.append((kind, quantifier))
    return alternative_problem()


def _class_end(pattern: str, start: int) -> int | None:
    """The index after the [class] opening at `start` (nested classes and escapes inside), None if it never closes."""
    depth, i = 0, start
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
            if pattern.startswith("[^]", i) or pattern.startswith("[]", i):  # a "]" first is a literal
                i += 2 if pattern[i + 1] == "]" else 3
                continue
        elif c == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _group_end(pattern: str, start: int) -> tuple[int | None, str]:
    """(the index after the group opening at `start`, its body), or (None, "") if it never closes."""
    depth, i = 0, start
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            end = _class_end(pattern, i)
            if end is None:
                return None, ""
            i = end
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                body = pattern[start + 1:i]
                if body.startswith("?"):  # (?:...), (?i:...), (?=...): the flags and marks are not the body
                    body = re.sub(r"^\?(?:[a-zA-Z-]*:|=|!|<=|<!)", "", body)
                return i + 1, body
        i += 1
    return None, ""


def _without_classes(text: str) -> str:
    """`text` with its escapes and [classes] taken out (what is left says whether it quantifies or nests)."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            if text[i - 1:i] in ("p", "P") and text[i:i + 1] == "{":
                i = (text.find("}", i) + 1) or len(text)
            continue
        if c == "[":
            i = _class_end(text, i) or len(text)
            continue
        out.append(c)
        i += 1
    return "".join(out)


@contextmanager
def _backend_crash_is_the_models() -> Iterator[None]:
    """A panic inside the Rust tokenizer (pyo3's PanicException, a BaseException: a checkpoint's
    catastrophic regex, say) as an InputError naming it: the model's tokenizer failed on this text,
    which is the picked model's fault, not a task's (the plugin is not marked failing)."""
    try:
        yield
    except BaseException as err:
        if type(err).__name__ != "PanicException":
            raise
        message = str(err).splitlines()[0][:200] if str(err) else ""
        raise InputError(f"this model's tokenizer crashed on the text (PanicException: {message}); "
                         "try another text or pick another model") from None


def _normalisers(spec: Any) -> list[dict]:
    """The normaliser steps of a tokenizer.json's "normalizer" entry (a Sequence flattened)."""
    if not isinstance(spec, dict):
        return []
    if spec.get("type") == "Sequence":
        return [step for inner in spec.get("normalizers") or [] for step in _normalisers(inner)]
    return [spec]


def _growth(spec: Any) -> float:
    """How many times longer the Replace rules of a normaliser can make a text (1: none lengthens it)."""
    growth = 1.0
    for step in _normalisers(spec):
        if step.get("type") == "Replace":
            pattern, content = step.get("pattern") or {}, str(step.get("content") or "")
            shortest = len(pattern["String"]) if isinstance(pattern, dict) and isinstance(pattern.get("String"), str) else 1
            growth *= max(1.0, len(content) / max(1, shortest))
    return growth


# Letters and digits that every normaliser _keeps_words admits leaves a letter or digit (ASCII, Latin-1 and Latin
# Extended-A/B, basic Greek and Cyrillic, Hebrew, Arabic and Devanagari letters, kana, CJK ideographs, Hangul
# syllables). Not every Unicode letter: NFKC and NFKD turn some into a space and a combining mark that stripping
# accents removes (U+037A, U+FE70-FE7A: the outside check, session 55), so those count for nothing here.
_KEPT_LETTERS = ("A-Za-z0-9\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u024f\u0391-\u03a1\u03a3-\u03a9\u03b1-\u03c9\u0400-\u045f"
                 "\u05d0-\u05ea\u0621-\u063a\u0641-\u064a\u0905-\u0939\u3041-\u3096\u30a1-\u30fa"
                 "\u4e00-\u9fff\uac00-\ud7a3")
# A chunk between spaces (or tabs and line breaks, which every pre-tokeniser but Metaspace splits at; control
# characters such as U+001F, which Python counts as space, are deleted by BERT's normaliser) holding such a letter,
# found once per chunk in linear time (the lazy run stops at the chunk's first such letter, or fails at its end)
_WORDS = re.compile(f"(?:^|[ \t\n\r])[^ \t\n\r]*?[{_KEPT_LETTERS}]")
_WORDS_SPACE_ONLY = re.compile(f"(?:^| )[^ ]*?[{_KEPT_LETTERS}]")  # Metaspace splits at spaces alone
_REGEX_CLASSES = set(".[]\\^$()|{}")  # what could make a Replace rule's regex match a letter or digit
_KEEPING_NORMALISERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents", "Strip",
                        "Precompiled", "Prepend"}
_SPLITTING_PRE_TOKENISERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Metaspace", "ByteLevel",
                             "Punctuation", "Digits"}


def _keeps_words(normalizer: Any, pre_tokenizer: Any) -> bool:
    """Whether a tokenizer.json's normaliser keeps every letter and digit (its Replace rules, if any, match none)
    and its pre-tokeniser splits at whitespace, so that each whitespace-separated chunk with a letter or digit
    is at least one token. False for anything else: no bound is claimed for what is not known."""
    for step in _normalisers(normalizer):
        kind = step.get("type")
        if kind == "Replace":
            pattern = step.get("pattern") if isinstance(step.get("pattern"), dict) else {}
            literal, regex = pattern.get("String"), pattern.get("Regex")
            if isinstance(regex, str):  # a regex of literal spaces or punctuation and counts (ALBERT's " {2,}")
                literal = re.sub(r"\{\d+(,\d*)?\}", "", regex)
                if any(c in _REGEX_CLASSES for c in literal):
                    return False
            if not isinstance(literal, str) or any(c.isalnum() for c in literal):
                return False
        elif kind not in _KEEPING_NORMALISERS:
            return False
    if not isinstance(pre_tokenizer, dict):
        return False
    steps = pre_tokenizer.get("pretokenizers") if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    splits = False
    for step in steps or []:
        kind = step.get("type") if isinstance(step, dict) else None
        if kind not in _SPLITTING_PRE_TOKENISERS or (kind == "ByteLevel" and step.get("use_regex") is False) or (
                kind == "Metaspace" and step.get("split") is False):
            return False
        splits = splits or kind in ("BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Metaspace", "ByteLevel")
    return splits


def _can_grow(spec: Any) -> bool:
    return any(step.get("type") in ("Replace", "Precompiled", "NFKC", "NFKD", "Prepend") for step in _normalisers(spec))


def _clean(text: str) -> str:
    """Replace lone surrogates (valid in a Python str, not in UTF-8) by U+FFFD; same length, so offsets hold."""
    return _SURROGATES.sub("\ufffd", text)


def _as_batch(value: str | Sequence[str], name: str) -> list[str]:
    values = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if values is None:
        raise TypeError(f"{name} must be a string or a list of strings, got {type(value).__name__}")
    if not values:
        raise ValueError(f"{name} is an empty list; nothing to tokenise")
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise TypeError(f"{name}[{i}] must be a string, got {type(v).__name__}: {v!r:.60}")
    return [_clean(v) for v in values]
