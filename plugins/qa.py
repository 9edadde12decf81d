"""Extractive QA: the answer span in a context, across overlapping windows, with a "no answer" score.

Long contexts are split into windows (`max_seq_len`, `doc_stride` tokens of overlap); the
question (cut to `max_question_len` tokens) and special tokens can never be an answer. Spans are
ranked across windows by start + end logits (a per-window softmax would make scores of different
windows incomparable), a start token counts only in the window where it has most context (BERT's
rule), and duplicate spans are merged. The null score comes from [CLS] (SQuAD 2.0 style).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from bert_engine import ui
from bert_engine.heads import SpanHead, SpanOutput
from bert_engine.hookspecs import ExplainTarget, TaskSpec, hookimpl
from bert_engine.progress import progress_bar
from bert_engine.tokenizer import Batch
from plugins.qa_answerability import features, no_answer_probability
from plugins.qa_data import read_data
from plugins.qa_metric import metric
from plugins.qa_options import check_options, no_answer_choice, no_answer_rule
from plugins.qa_spans import bands, whole_words
from plugins.qa_view import PIPELINE_ARGUMENTS, answer_view, candidate_bars, pipeline_output
from plugins.qa_windows import at_input, max_context_windows, preprocess, preprocess_many
from plugins.starter import starter_checkpoint

N_BEST_PER_WINDOW = 20  # best spans kept per window before merging across windows


# The task's options and their defaults, declared once: the Predictor passes every one to preprocess
# and postprocess (a caller's values over these).
OPTIONS = {"top_k": 1, "max_seq_len": None, "doc_stride": None, "max_question_len": 64, "max_answer_len": 30,
           "null_threshold": None, "no_answer": None, "answerability": None}


def postprocess(output, batch, *, top_k, max_seq_len, doc_stride, max_question_len, max_answer_len,
                null_threshold, no_answer, answerability):
    context = batch.meta["context"]
    starts, ends = output.start_logits.float().cpu(), output.end_logits.float().cpu()  # (W, T)
    W, T = starts.shape
    home = max_context_windows(batch) if W > 1 else None  # one window: every context token's home
    # (start, end) pairs that may be an answer: in the context, start <= end < start + A; a band (T x A), not T x T
    A = min(max_answer_len, T)
    spans: dict[tuple[int, int], float] = {}
    null_score = None
    # in numpy (float32, the same sums as torch's): a window's dozen small steps cost a third as much
    starts_np, ends_np = starts.numpy(), ends.numpy()
    beyond = np.full(A - 1, -np.inf, dtype=np.float32)
    for row, sequence_ids in enumerate(batch.sequence_ids):
        null = float(starts_np[row, 0] + ends_np[row, 0])
        null_score = null if null_score is None else min(null_score, null)  # SQuAD 2.0: the minimum over windows
        in_context = np.zeros(T + A - 1, dtype=bool)  # past the window: no context
        in_context[:len(sequence_ids)] = [s == 1 for s in sequence_ids]
        # A start token counts only in the window where it has most context.
        is_home = in_context[:T] if home is None else np.array(
            [s == 1 and home.get(tuple(batch.offsets[row][t])) == row for t, s in enumerate(sequence_ids)]
            + [False] * (T - len(sequence_ids)))
        band_context = bands(in_context, T, A)  # (T, A): whether start + d is in the context
        band_ends = bands(np.concatenate([ends_np[row], beyond]), T, A)  # (T, A): its end scores
        allowed = is_home[:, None] & band_context
        k = min(N_BEST_PER_WINDOW, int(allowed.sum()))
        if k == 0:
            continue
        scores = np.where(allowed, starts_np[row][:, None] + band_ends, np.float32(-np.inf))  # (T, A)
        best_scores, flat = torch.from_numpy(scores).flatten().topk(k)  # (torch's order among equal scores)
        for score, index in zip(best_scores.tolist(), flat.tolist()):
            s, d = divmod(index, A)  # a start and its end's distance from it
            char_span = whole_words(context, batch.offsets[row][s][0], batch.offsets[row][s + d][1])
            if score > spans.get(char_span, float("-inf")):
                spans[char_span] = score  # duplicates (same characters) merged, best score kept
    ranked = sorted(spans.items(), key=lambda item: -item[1])
    # Probabilities over every span considered and "no answer", so they do not depend on top_k.
    probs = torch.tensor([score for _, score in ranked] + [null_score]).softmax(0).tolist()
    # six significant digits, not six decimals: a span far behind "no answer" has a small probability, not 0
    answers = [{"answer": context[s:e], "start": s, "end": e, "field": "context", "score": float(f"{p:.6g}"),
                "logit": round(score, 4)} for ((s, e), score), p in zip(ranked[:top_k], probs)]
    best = ranked[0][1] if ranked else None
    gap = None if best is None else round(null_score - best, 4)
    verdict = {"logit": round(null_score, 4), "score": float(f"{probs[-1]:.6g}"), "null_gap": gap}
    # Who decides "no answer": a caller's raw null_threshold (on the gap) first, else the verifier.
    rule = None if null_threshold is not None else no_answer_rule(no_answer, answerability)
    if null_threshold is not None:
        predicted = best is None or gap > null_threshold
        verdict.update(rule="null gap", threshold=null_threshold)
    elif rule is not None and best is not None:
        probability = no_answer_probability(features(batch.meta["question"], context,
                                                     {"answers": answers[:1], "no_answer": verdict}), answerability)
        predicted = probability > rule
        verdict.update(rule="verifier", probability=float(f"{probability:.6g}"), threshold=rule,
                       choice=no_answer.strip().lower() if no_answer_choice(no_answer) else None)
    else:
        predicted = best is None
        verdict.update(rule="none", threshold=None)
    verdict["predicted"] = predicted
    return {
        "answer": None if predicted else answers[0]["answer"],
        "answers": answers,
        "no_answer": verdict,
        "windows": len(batch), "question_truncated": batch.meta["question_truncated"],
    }


def predict_many(predictor, items: list[dict], *, max_rows: int = 32, progress: bool = False, **options) -> list[dict]:
    """Answers for many (question, context) inputs, in order: each is windowed alone, then the windows
    of neighbouring inputs (sorted by length, so padding stays small) share forward passes of up to
    `max_rows` rows, and each input is postprocessed alone — the same answers as one `predict` each.

    Raises:
        InputError: a bad input or option, naming the input's position.
    """
    predictor = predictor.get()
    options = predictor.check_options(options)
    for i, item in enumerate(items):
        with at_input(i):
            predictor.check_fields(item)  # the options, checked once above
    batches = preprocess_many(items, predictor.tokenizer, **options)
    for i, batch in enumerate(batches):
        with at_input(i):
            predictor.check_cost(batch)  # tokens and work, per input, as one request's
    groups = window_groups(batches, max_rows)
    results: list[Any] = [None] * len(items)
    pad = predictor.tokenizer.pad_token_id
    for group in progress_bar(groups, disable=not progress, desc="qa", unit="batch"):
        rows = [batches[i] for i in group]
        output = predictor.forward_rows(Batch.stacked(rows, pad).model_inputs())
        starts, ends = output.start_logits.float().cpu(), output.end_logits.float().cpu()  # (rows, width)
        row = 0
        for i in group:
            n, t = len(batches[i]), batches[i].input_ids.shape[1]
            output = SpanOutput(starts[row:row + n, :t], ends[row:row + n, :t])
            results[i] = postprocess(output, batches[i], **options)
            row += n
    return results


def window_groups(batches: list, max_rows: int = 32) -> list[list[int]]:
    """The order predict_many runs inputs in: their indices sorted by padded width, in groups whose windows
    share one forward pass of at most `max_rows` rows (an input with more windows is a group of its own)."""
    order = sorted(range(len(batches)), key=lambda i: batches[i].input_ids.shape[1])
    groups, group, rows = [], [], 0
    for i in order:
        if group and rows + len(batches[i]) > max_rows:
            groups.append(group)
            group, rows = [], 0
        group.append(i)
        rows += len(batches[i])
    return groups + ([group] if group else [])


def evaluate(predictor, examples: list, *, progress: bool = False, **options) -> dict[str, float]:
    """Official EM / F1 over (inputs, target) examples, predicted in shared batches (predict_many)."""
    results = predict_many(predictor, [inputs for inputs, _ in examples], progress=progress, **options)
    return metric(results, [target for _, target in examples])


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


NO_ANSWER_LABELS = {  # the tab's words for NO_ANSWER_CHOICES (scripts/qa_calibrate.py sets each threshold)
    "eager": "Answer most readily (still refuses about 5-7 % of answerable questions)",
    "balanced": "Balanced (refuses about 15 %)",
    "cautious": "Cautious: “no answer” when in doubt (best on SQuAD 2.0, refuses about 40 %)",
    "never": "Never say “no answer”: always show the best span",
}


def build_tab(predictor) -> None:
    import gradio as gr  # noqa: PLC0415 - Gradio loads only where a UI is built

    question = gr.Textbox(label="Question", value=EXAMPLES[0]["question"])
    context = gr.Textbox(label="Context", lines=6, max_lines=16, value=EXAMPLES[0]["context"])
    with gr.Accordion("Options", open=False):
        top_k = gr.Slider(1, 10, value=3, step=1, label="Candidates (top-k)")  # the tab lists 3; the API default is 1
        no_answer = gr.Radio([(label, key) for key, label in NO_ANSWER_LABELS.items()], value="eager",
                             label="When to say “no answer”",
                             info="How sure the model must be that the text does not answer the question; "
                                  "calibrated on held-out SQuAD 2.0 questions")
    button = ui.run_button(gr, "Answer")
    view = gr.HTML(ui.empty_state("The answer appears here, marked in its context (or “No answer in this "
                                  "context”)."), label="Answer in its context")
    candidates = gr.HTML(label="Candidates", elem_classes=["qa-candidates-box"])
    details = ui.details(gr)

    def run(question: str, context: str, top_k: float = 3, no_answer: str = "eager"):
        """Answer a question from a context: the answer is a span of the context, or "no answer".

        Args:
            question: the question to answer.
            context: the text that may hold the answer.
            top_k: how many candidate answers to return (1-50; the page's slider stops at 10).
            no_answer: how readily to answer "no answer": "eager" (rarely), "balanced", "cautious" (when in
                doubt) or "never".
        """
        output = predictor.predict({"question": question, "context": context}, top_k=ui.whole(top_k), no_answer=no_answer)
        result = output["result"]
        return answer_view(context, result), candidate_bars(result), output

    ui.wire(gr, button, run, [question, context, top_k, no_answer], [view, candidates, details],
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


def explain(result, batch, **_options) -> list[ExplainTarget]:
    """The best answer's start and end (each a probability over the window's tokens) and the "no answer"
    decision (the null score minus the answer's, in logits: above 0 leans to "no answer"), in the window
    holding the answer; without any candidate, the null score alone."""
    if isinstance(result, list):
        return []
    if not result["answers"]:
        return [ExplainTarget("no answer", lambda out: out.start_logits.float()[:, 0] + out.end_logits.float()[:, 0],
                              "null score (logits)")]
    best = result["answers"][0]
    for row in range(len(batch)):
        positions = batch.tokens_within(row, best["start"], best["end"], sequence=1)
        spans = [batch.offsets[row][t] for t in positions]
        if positions and spans[0][0] <= best["start"] and spans[-1][1] >= best["end"]:
            break
    else:
        return []
    s, e = positions[0], positions[-1]
    shown = best["answer"] if len(best["answer"]) <= 40 else best["answer"][:39] + "…"

    def start(out) -> torch.Tensor:
        return out.start_logits.float().softmax(-1)[:, s]

    def end(out) -> torch.Tensor:
        return out.end_logits.float().softmax(-1)[:, e]

    def gap(out) -> torch.Tensor:
        starts, ends = out.start_logits.float(), out.end_logits.float()
        return starts[:, 0] + ends[:, 0] - starts[:, s] - ends[:, e]

    return [ExplainTarget(f"start of “{shown}”", start, "probability", row),
            ExplainTarget(f"end of “{shown}”", end, "probability", row),
            ExplainTarget(f"no answer rather than “{shown}”", gap, "null minus answer score (logits)", row)]


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
        explain=explain,
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
        check_options=check_options,
        tuned_options={"default_threshold": "null_threshold"},
        examples=EXAMPLES,
        read_data=read_data,
        loss=loss,
        training_batch=training_batch,
        metric=metric,
        best_metric="f1",
        aliases=("question-answering",),
        pipeline_output=pipeline_output,
        pipeline_arguments=PIPELINE_ARGUMENTS,
        evaluate=evaluate,
    ))

