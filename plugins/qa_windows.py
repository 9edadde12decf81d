"""QA's inputs as model rows: the question cut to `max_question_len` word pieces, then the question and its
context in windows of `max_seq_len` tokens overlapping by `doc_stride`, each input's windows a Batch of its own
(`preprocess` for one input, `preprocess_many` for a file's worth with two tokenizer calls in all), and the
window where each context token has most context (BERT's rule for where a start counts)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bert_engine.hookspecs import InputError, length_option
from bert_engine.tokenizer import Batch
from plugins.qa_options import check_options

MAX_WINDOWS = 256


def preprocess(inputs, tokenizer, *, top_k, max_seq_len, doc_stride, max_question_len, max_answer_len,
               null_threshold, no_answer, answerability):
    max_seq_len = _check_options(tokenizer, top_k, max_seq_len, max_question_len, max_answer_len, null_threshold,
                                 no_answer, answerability)
    _check_texts(inputs)
    question, cut, stride = _question_plan(inputs["question"], tokenizer.pieces([inputs["question"]])[0], max_seq_len,
                                           max_question_len, doc_stride)
    _check_windows_at_least(tokenizer, question, inputs["context"], max_seq_len, stride)
    batch = tokenizer(question, inputs["context"], max_length=max_seq_len, truncation="only_second", stride=stride,
                      return_overflowing=True)
    return _windows(batch, inputs, cut, max_seq_len, stride)


def preprocess_many(items, tokenizer, *, top_k, max_seq_len, doc_stride, max_question_len, max_answer_len,
                    null_threshold, no_answer, answerability) -> list[Batch]:
    """preprocess of each item, the same batches, with the tokenizer called twice for them all (the questions,
    then the question + context pairs of each window stride) instead of twice per item: the Rust library
    works on the whole list at once, on every core.

    Raises:
        InputError: a bad option, or an item's error with its position (InputError.at).
    """
    max_seq_len = _check_options(tokenizer, top_k, max_seq_len, max_question_len, max_answer_len, null_threshold,
                                 no_answer, answerability)
    for i, inputs in enumerate(items):
        with at_input(i):
            _check_texts(inputs)
    plans = []
    for i, pieces in enumerate(tokenizer.pieces([inputs["question"] for inputs in items])):
        with at_input(i):
            plans.append(_question_plan(items[i]["question"], pieces, max_seq_len, max_question_len, doc_stride))
            _check_windows_at_least(tokenizer, plans[i][0], items[i]["context"], max_seq_len, plans[i][2])
    batches: list[Any] = [None] * len(items)
    for stride in sorted({plan[2] for plan in plans}):  # one call per stride (a long question shortens it)
        chosen = [i for i, plan in enumerate(plans) if plan[2] == stride]
        try:
            batch = tokenizer([plans[i][0] for i in chosen], [items[i]["context"] for i in chosen],
                              max_length=max_seq_len, truncation="only_second", stride=stride, return_overflowing=True)
        except ValueError:  # the library refused the list: one item at a time says which
            parts = [tokenizer(plans[i][0], items[i]["context"], max_length=max_seq_len, truncation="only_second",
                               stride=stride, return_overflowing=True) for i in chosen]
        else:
            parts = batch.split()
        for i, part in zip(chosen, parts):
            with at_input(i):
                batches[i] = _windows(part, items[i], plans[i][1], max_seq_len, stride)
    return batches


@contextmanager
def at_input(position: int) -> Iterator[None]:
    """An InputError raised inside says which input it is about ("qa: input 3: ...")."""
    try:
        yield
    except InputError as err:
        raise InputError.at("qa", position, str(err).removeprefix("qa: ")) from None


def _check_options(tokenizer, top_k, max_seq_len, max_question_len, max_answer_len, null_threshold, no_answer,
                   answerability) -> int:
    """The options checked; the window length they give (max_seq_len, or the model's default)."""
    max_seq_len = length_option("qa", "max_seq_len", max_seq_len, 384, 32, tokenizer)
    check_options({"top_k": top_k, "max_question_len": max_question_len, "max_answer_len": max_answer_len,
                   "null_threshold": null_threshold, "no_answer": no_answer, "answerability": answerability})
    return max_seq_len


def _check_texts(inputs) -> None:
    if not inputs["question"].strip():
        raise InputError("qa: the question is empty; ask something about the context")
    if not inputs["context"].strip():
        raise InputError("qa: the context is empty; paste the text that holds the answer")


def _question_plan(question: str, pieces, max_seq_len: int, max_question_len: int,
                   doc_stride: int | None) -> tuple[str, bool, int]:
    """The question cut to max_question_len word pieces (at a character boundary of the original: `pieces` is
    its encoding without special tokens), whether it was cut, and the windows' stride."""
    offsets = pieces.offsets
    question_cut = len(offsets) > max_question_len
    if question_cut:
        question = question[:offsets[max_question_len - 1][1]]
    room = max_seq_len - min(len(offsets), max_question_len) - 3
    if room < 8:
        raise InputError(f"qa: the question takes {min(len(offsets), max_question_len)} of the {max_seq_len} tokens "
                         "a window holds, leaving no room for the context; ask a shorter question")
    doc_stride = min(128, room // 2) if doc_stride is None else doc_stride
    if not isinstance(doc_stride, int) or isinstance(doc_stride, bool) or not 0 <= doc_stride < room:
        raise InputError(f"qa: doc_stride must be an integer in [0, {room}) for max_seq_len {max_seq_len} "
                         f"and this question, got {doc_stride!r}")
    return question, question_cut, doc_stride


def _check_windows_at_least(tokenizer, question: str, context: str, max_seq_len: int, stride: int) -> None:
    """InputError when the context needs more than MAX_WINDOWS windows by a count from below that tokenises
    nothing (Tokenizer.windows_at_least): a context far over the limit is refused in milliseconds, not after
    seconds of tokenising all of it. A tokenizer without that count is checked after tokenising (_windows)."""
    counted = getattr(tokenizer, "windows_at_least", None)
    least = counted(question, context, max_length=max_seq_len, stride=stride) if counted is not None else 0
    if least > MAX_WINDOWS:
        raise InputError(f"qa: the context needs at least {least:,} windows of {max_seq_len} tokens; the limit is "
                         f"{MAX_WINDOWS}: shorten it to the part that holds the answer")


def _windows(batch: Batch, inputs, question_cut: bool, max_seq_len: int, stride: int) -> Batch:
    """One input's windows, checked, with what postprocess reads in their meta."""
    if not any(s == 1 for s in batch.sequence_ids[0]):
        raise InputError("qa: the context has no readable text (only control or invisible characters)")
    if len(batch) > MAX_WINDOWS:
        room = max_seq_len - sum(s == 0 for s in batch.sequence_ids[0]) - 3
        raise InputError(f"qa: the context needs {len(batch)} windows of {max_seq_len} tokens; "
                         f"the limit is {MAX_WINDOWS} (about {MAX_WINDOWS * (room - stride):,} tokens)")
    batch.meta.update(context=inputs["context"], question=inputs["question"], question_truncated=question_cut)
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
