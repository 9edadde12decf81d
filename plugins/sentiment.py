"""Sentiment (sequence classification): labels from the checkpoint, probabilities, long-input policy.

Loads any BertForSequenceClassification checkpoint (2, 3, 5 classes...; single- or multi-label).
Long input is never cut silently: "truncate" says so in the result, "windows" splits the text
into overlapping windows and averages their probabilities. `classify_many` batches many texts
with length-sorted, dynamically padded batches.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bert_engine import ui
from bert_engine.heads import SequenceClassificationHead
from bert_engine.hookspecs import ExplainTarget, InputError, TaskSpec, hookimpl, length_option
from bert_engine.runtime.inference import predict_texts
from plugins.starter import starter_checkpoint

logger = logging.getLogger(__name__)

DEFAULT_LABELS = ("NEGATIVE", "POSITIVE")
FUNCTIONS = ("auto", "softmax", "sigmoid", "none")
POLICIES = ("truncate", "windows")


@dataclass
class SentimentOutput:
    """Logits plus what turning them into labelled scores needs, carried by the output itself."""

    logits: Tensor  # (B, L)
    labels: tuple[str, ...]
    problem_type: str | None
    encoder: Any = None


class SentimentHead(SequenceClassificationHead):
    """The standard sequence-classification head, returning its label names with the logits."""

    def __init__(self, config) -> None:
        if config.num_labels == 0:  # an encoder-only checkpoint: start a fresh binary head
            config = config.with_labels(list(DEFAULT_LABELS))
        super().__init__(config)
        self.labels = tuple(config.id2label[i] for i in range(config.num_labels))
        self.problem_type = config.problem_type

    def forward(self, encoded) -> SentimentOutput:
        return SentimentOutput(super().forward(encoded).logits, self.labels, self.problem_type)


def check_options(options) -> None:
    """The option values that need no tokenizer (TaskSpec.check_options: also when a pipeline is made)."""
    top_k, temperature = options["top_k"], options["temperature"]
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise InputError(f"sentiment: top_k must be a positive integer or None, got {top_k!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0.05 <= temperature <= 20:
        raise InputError(f"sentiment: temperature must be a number in [0.05, 20], got {temperature!r}")
    if options["function"] not in FUNCTIONS:
        raise InputError(f"sentiment: function {options['function']!r} is not one of {FUNCTIONS}")
    if options["long_input"] not in POLICIES:
        raise InputError(f"sentiment: long_input {options['long_input']!r} is not one of {POLICIES}")


def _check_options(top_k, function, long_input, max_length, stride, temperature, tokenizer) -> tuple[int, int]:
    """The checked options; returns max_length and stride with None resolved against the model."""
    check_options({"top_k": top_k, "function": function, "long_input": long_input, "temperature": temperature})
    max_length = length_option("sentiment", "max_length", max_length, 512, 8, tokenizer)
    stride = min(64, max_length // 4) if stride is None else stride
    if not isinstance(stride, int) or isinstance(stride, bool):
        raise InputError(f"sentiment: stride must be a whole number of tokens, got {stride!r}")
    if not 0 <= stride <= max_length // 2:
        raise InputError(f"sentiment: stride {stride!r} must lie in [0, {max_length // 2}]")
    return max_length, stride


# The task's options and their defaults, declared once: the Predictor passes every one to preprocess
# and postprocess (a caller's values over these).
# temperature divides the logits before softmax or sigmoid (1: as trained); a packed model's manifest
# holds the value calibrated on held-out data (see metric), so its scores mean what they say.
OPTIONS = {"top_k": None, "function": "auto", "long_input": "truncate", "max_length": None, "stride": None,
           "temperature": 1.0}


def preprocess(inputs, tokenizer, *, top_k, function, long_input, max_length, stride, temperature):
    """One text (or a list of texts, for batches), optionally with a second text (`text_pair`)."""
    max_length, stride = _check_options(top_k, function, long_input, max_length, stride, temperature, tokenizer)
    texts = inputs["text"] if isinstance(inputs["text"], list) else [inputs["text"]]
    pairs = inputs.get("text_pair")
    if pairs is not None and not isinstance(pairs, list):
        pairs = [pairs]
    for text in texts:
        if not text.strip():
            raise InputError("sentiment: the text is empty; type a sentence to classify")
    windows = long_input == "windows"
    try:
        batch = tokenizer(texts, pairs, max_length=max_length,
                          truncation="only_second" if windows and pairs is not None else "longest_first",
                          stride=stride if windows else 0, return_overflowing=windows)
    except ValueError as err:  # the tokenizer's length checks: this input cannot be cut that way
        if windows and pairs is not None:
            raise InputError(f"sentiment: with long_input='windows' a pair is read in windows over its second text, "
                             f"and the first must fit in one window of {max_length} tokens with room for the second; "
                             "shorten the first text, or use long_input='truncate'") from None
        raise InputError(f"sentiment: this input cannot be cut to {max_length} tokens ({err})") from None
    batch.meta.update(num_inputs=len(texts), policy=long_input)
    # The logits come from [CLS] alone and postprocess reads nothing else: the last layer computes only it.
    batch.meta["model_kwargs"] = {**batch.meta.get("model_kwargs", {}), "first_token_only": True}
    return batch


def resolved(function: str, problem_type: str | None, labels: int) -> str:
    """The function "auto" stands for (see probabilities); any other as it is."""
    if function != "auto":
        return function
    if problem_type == "multi_label_classification" or labels == 1:
        return "sigmoid"
    return "none" if problem_type == "regression" else "softmax"


def probabilities(logits: Tensor, function: str, problem_type: str | None) -> tuple[Tensor, str]:
    """Scores from logits (…, L) with the pipeline's rule for "auto": sigmoid for one label or
    multi-label heads, none for regression, softmax otherwise."""
    function = resolved(function, problem_type, logits.shape[-1])
    logits = logits.float()
    if function == "softmax":
        return logits.softmax(-1), function
    if function == "sigmoid":
        return logits.sigmoid(), function
    return logits, function


def postprocess(output: SentimentOutput, batch, *, top_k, function, long_input, max_length, stride, temperature):
    """Per input: the top label and score, all labels ranked (or `top_k`), the raw logits (of the one
    window, or the windows' token-weighted mean) and the long-input policy."""
    logits = output.logits.float().cpu()  # the model's device (a GPU's); the batch comes on the CPU
    used = resolved(function, output.problem_type, logits.shape[-1])
    scaled = logits / temperature if used != "none" and temperature != 1 else logits  # (x / 1 is x: skipped)
    scores = probabilities(scaled, used, None)[0].numpy()  # (rows, L)
    # (a few rows: numpy's small-array operators cost less than torch's, which cost 10-20 us each in a request)
    sample = np.asarray(batch.sample_index)
    weights = batch.attention_mask.numpy().sum(-1, dtype=np.float32)[:, None]  # a window counts by its tokens
    logits = logits.numpy()
    results = []
    for i in range(batch.meta["num_inputs"]):
        rows = np.flatnonzero(sample == i)
        averaged = (scores[rows] * weights[rows]).sum(0) / weights[rows].sum()  # (L,)
        ranked = sorted(zip(output.labels, averaged.tolist()), key=lambda item: -item[1])
        ranked = ranked[:top_k] if top_k else ranked
        results.append({
            "label": ranked[0][0], "label_id": output.labels.index(ranked[0][0]), "score": _round(ranked[0][1]),
            "labels": [{"label": label, "score": _round(score)} for label, score in ranked],
            "logits": [_round(x) for x in ((logits[rows] * weights[rows]).sum(0) / weights[rows].sum()).tolist()],
            "function": used, "temperature": temperature, "normalised": used == "softmax" and len(ranked) == len(output.labels),
            "long_input": {"policy": long_input, "windows": len(rows), "truncated": bool(batch.truncated[i])},
        })
    return results[0] if len(results) == 1 else results


def _round(value: float) -> float:
    return round(float(value), 6)


classify_many = predict_texts  # many texts in length-sorted batches, results in input order


TRUNCATED_LABEL = ("Labels: only the start of this long text was read (choose “windows” under Options to read all "
                   "of it)")


def build_tab(predictor) -> None:
    import gradio as gr  # noqa: PLC0415 - Gradio loads only where a UI is built

    text = gr.Textbox(label="Text", lines=3, placeholder="Type a sentence or a review")
    with gr.Accordion("Options", open=False):
        pair = gr.Textbox("", label="Second text (optional, for sentence-pair models)")
        long_input = gr.Radio(list(POLICIES), value=OPTIONS["long_input"], label="Long input")
    button = ui.run_button(gr, "Classify")
    bars = gr.Label(label="Labels")
    details = ui.details(gr)

    def run(text: str, text_pair: str = "", long_input: str = "truncate"):
        """Classify the sentiment of a text (or of a pair of texts) with the sentiment model.

        Args:
            text: the text to classify.
            text_pair: an optional second text, read together with the first (leave empty for one text).
            long_input: what to do with a text longer than the model reads at once: "truncate" or "windows".
        """
        output = predictor.predict({"text": text, "text_pair": text_pair or None}, long_input=long_input)
        scores = {item["label"]: item["score"] for item in output["result"]["labels"]}
        # a long text read only in part says so where the answer is, not only in the closed details' JSON
        cut = (output["result"].get("long_input") or {}).get("truncated")
        return gr.Label(value=scores, label=TRUNCATED_LABEL if cut else "Labels"), output

    ui.wire(gr, button, run, [text, pair, long_input], [bars, details], api_name="sentiment",
            examples=[[e["text"]] for e in EXAMPLES])


EXAMPLES = (
    {"text": "A gorgeous, witty, seductive movie."},
    {"text": "The plot is predictable and the acting is wooden."},
    {"text": "I didn't hate it."},  # negation; the mixed "It's not bad, but I wouldn't watch it again." reads POSITIVE
)


SPLITS = ("train", "dev", "validation", "test", "all")


def read_data(path, split: str = "train"):
    """GLUE SST-2 style TSV (`sentence<TAB>label`, header line); yields ({"text": ...}, label id). The file is
    one split: `split` names it (train, dev, validation, test or all) and selects nothing.

    Raises:
        ValueError: naming the file and line, for a missing header, a missing or non-integer label
            or an empty sentence; a split that is none of those names (a typo was read as the file).
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)} (an SST-2 TSV file holds one split: the "
                         "name only says which)")
    with open(path, encoding="utf-8", newline="") as handle:
        rows = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        try:
            header = rows.fieldnames  # (read here: a first line past csv's field limit, a JSON file, fails on it)
        except csv.Error as err:
            raise ValueError(f"{path}:1: expected a header line naming the columns 'sentence' and 'label' "
                             f"(tab-separated): {err}") from None
        if not {"sentence", "label"} <= set(header or ()):
            raise ValueError(f"{path}:1: expected a header line naming the columns 'sentence' and 'label' "
                             f"(tab-separated), got {printable_line(rows.fieldnames)!r}")
        for row in _rows_naming_the_line(rows, path):
            line = rows.line_num
            text, label = (row.get("sentence") or "").strip(), (row.get("label") or "").strip()
            if not label:
                raise ValueError(f"{path}:{line}: no label")
            if not label.lstrip("-").isdigit():
                raise ValueError(f"{path}:{line}: label {label[:40]!r} is not an integer label id")
            if not text:
                raise ValueError(f"{path}:{line}: the sentence is empty")
            yield {"text": text}, int(label)


def _rows_naming_the_line(rows, path):
    """The reader's rows; its own error (a field over csv's 131,072-character limit) names the file and line."""
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except csv.Error as err:
            raise ValueError(f"{path}:{rows.line_num + 1}: {err}") from None  # the line being read
        yield row


def printable_line(fields) -> str:
    return "\t".join(fields or ())[:80]


def loss(output: SentimentOutput, targets: list[int]) -> Tensor:
    """Cross-entropy for single-label heads, binary cross-entropy for multi-label ones."""
    if output.problem_type == "multi_label_classification":
        return torch.nn.functional.binary_cross_entropy_with_logits(output.logits, torch.tensor(targets).float())
    return torch.nn.functional.cross_entropy(output.logits, torch.tensor(targets, device=output.logits.device))


def metric(results: list[dict], targets: list[int]) -> dict[str, float]:
    """Accuracy (SST-2's metric) and macro-F1 over the labels seen; targets are label ids."""
    predictions = [r["label_id"] if isinstance(r, dict) else r for r in results]
    if not targets:
        raise ValueError("no targets to score")
    accuracy = sum(p == t for p, t in zip(predictions, targets)) / len(targets)
    f1s = []
    for label in sorted(set(targets) | set(predictions)):
        tp = sum(p == t == label for p, t in zip(predictions, targets))
        fp = sum(p == label != t for p, t in zip(predictions, targets))
        fn = sum(t == label != p for p, t in zip(predictions, targets))
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    out = {"accuracy": accuracy, "macro_f1": sum(f1s) / len(f1s)}
    if all(isinstance(r, dict) and r.get("function") == "softmax" and "logits" in r for r in results):
        out.update(calibration(torch.tensor([r["logits"] for r in results]), torch.tensor(targets),
                               results[0]["temperature"]))
    return out


ECE_BINS = 15
TEMPERATURES = torch.logspace(-1, 1, 401)  # 0.1 .. 10, the grid the temperature is fitted on


def calibration(logits: Tensor, targets: Tensor, temperature: float) -> dict[str, float]:
    """How far the scores can be trusted: the expected calibration error (ECE: |accuracy - confidence|
    over 15 equal-width confidence bins, weighted by their share) and the mean negative log-likelihood,
    at the temperature used; and temperature scaling fitted honestly: the temperature of least NLL on
    the first half of the examples (`tuned_temperature`), with the second half's ECE and NLL at 1 and at
    that temperature. `bert-engine pack` stores the tuned temperature as the packed model's default."""
    out = {"ece": expected_calibration_error(logits / temperature, targets),
           "nll": float(torch.nn.functional.cross_entropy(logits / temperature, targets))}
    half = len(targets) // 2
    if half:
        fit, held, held_targets = logits[:half], logits[half:], targets[half:]
        nll = torch.stack([torch.nn.functional.cross_entropy(fit / t, targets[:half]) for t in TEMPERATURES])
        tuned = float(TEMPERATURES[int(nll.argmin())])
        out.update(tuned_temperature=round(tuned, 4), heldout_total=len(held_targets),
                   heldout_ece_at_1=expected_calibration_error(held, held_targets),
                   heldout_ece=expected_calibration_error(held / tuned, held_targets),
                   heldout_nll_at_1=float(torch.nn.functional.cross_entropy(held, held_targets)),
                   heldout_nll=float(torch.nn.functional.cross_entropy(held / tuned, held_targets)))
    return out


def expected_calibration_error(logits: Tensor, targets: Tensor, bins: int = ECE_BINS) -> float:
    confidence, predicted = logits.softmax(-1).max(-1)
    correct = (predicted == targets).float()
    which = (confidence * bins).long().clamp(max=bins - 1)  # equal-width bins over [0, 1]
    error = 0.0
    for b in range(bins):
        chosen = which == b
        if chosen.any():
            error += float(chosen.float().mean() * (correct[chosen].mean() - confidence[chosen].mean()).abs())
    return error


def pipeline_output(result: dict, options, single: bool):
    """transformers' text-classification shape: [{"label", "score"}] for one text (a list of all
    labels with top_k), one dict per text for a list of texts."""
    if result["long_input"]["truncated"]:
        _warn_cut(result["long_input"])
    if options.get("top_k") is not None:
        return result["labels"]
    top = {"label": result["label"], "score": result["score"]}
    return [top] if single else top


_CUT_WARNED = False


def _warn_cut(long_input: dict) -> None:
    """The transformers shape has no room for the engine's `long_input` note: a text read only in part says so
    in the log, at WARNING the first time in a process (a file of long reviews would repeat it per line), DEBUG
    after."""
    global _CUT_WARNED
    level, _CUT_WARNED = (logging.DEBUG if _CUT_WARNED else logging.WARNING), True
    logger.log(level, "sentiment: a text was longer than the model reads at once, and its label was read from its "
               "first window only (long_input=%r); pass long_input=\"windows\" (transformers' truncation=False) to read "
               "all of it, or raw=True to see which results were cut", long_input["policy"])


def _truncation(value) -> dict:
    """transformers' truncation as long_input: True (or a strategy) cuts a text past max_length to its first window;
    False ("do_not_truncate") keeps all of it, which here means reading it in windows (transformers' model fails on
    it instead). It was taken and dropped before: truncation=False still cut (session 57's fresh-clone trial)."""
    if value is True or value in ("longest_first", "only_first", "only_second"):
        return {"long_input": "truncate"}
    if value is False or value == "do_not_truncate":
        return {"long_input": "windows"}
    raise InputError(f"sentiment: truncation must be True, False or a truncation strategy, got {value!r:.80}")


def _function_to_apply(value) -> dict:
    name = getattr(value, "value", value)  # (transformers' ClassificationFunction enum holds the name)
    if isinstance(name, str) and name.lower() in FUNCTIONS:
        return {"function": name.lower()}
    raise InputError(f"sentiment: function_to_apply must be one of {FUNCTIONS}, got {value!r:.80}")


def _return_all_scores(value) -> dict:
    if not isinstance(value, bool):
        raise InputError(f"sentiment: return_all_scores must be True or False, got {value!r:.80}")
    return {"top_k": ALL_LABELS} if value else {}


def _top_k(value) -> dict:
    """transformers reads top_k=None, given, as every label (left out: the top one); this task's own None
    (its default) ranks them all in the result, and the pipeline shape shows the top one."""
    return {"top_k": ALL_LABELS if value is None else value}


ALL_LABELS = 1 << 20  # top_k that keeps every label
# transformers' text-classification arguments read under this task's names (TaskSpec.pipeline_arguments)
PIPELINE_ARGUMENTS = {"truncation": _truncation, "function_to_apply": _function_to_apply,
                      "return_all_scores": _return_all_scores, "top_k": _top_k}


def explain(result, batch, *, temperature, **_options) -> list[ExplainTarget]:
    """Every label's score as shown (the same function and temperature), per label, best first; over the
    first window when the text was read in several (named so)."""
    if isinstance(result, list):  # several texts at once: explained one by one
        return []
    used = result["function"]
    windowed = " (first window)" if result["long_input"]["windows"] > 1 else ""

    def score_of(label: str):
        def score(output: SentimentOutput) -> Tensor:
            logits = output.logits.float()
            scaled = logits / temperature if used != "none" else logits
            return probabilities(scaled, used, None)[0][:, output.labels.index(label)]
        return score

    what = "score" if used == "none" else "probability"
    return [ExplainTarget(item["label"] + windowed, score_of(item["label"]), what) for item in result["labels"]]


def brief(result) -> str:
    """The label and its probability: "POSITIVE 98 %"."""
    return f"{result['label']} {ui.percent(result['score'])}"


@hookimpl
def register_tasks(register):
    register(TaskSpec(
        brief=brief,
        explain=explain,
        name="sentiment",
        default_checkpoint=starter_checkpoint("sentiment"),
        title="Sentiment",
        description="Classify a text with a sequence-classification BERT: label probabilities for every class.",
        build_head=SentimentHead,
        preprocess=preprocess,
        postprocess=postprocess,
        build_tab=build_tab,
        input_fields=("text",),
        optional_fields=("text_pair",),
        options=OPTIONS,
        check_options=check_options,
        tuned_options={"tuned_temperature": "temperature"},  # the scores' temperature fitted on held-out data
        examples=EXAMPLES,
        read_data=read_data,
        loss=loss,
        metric=metric,
        labels=DEFAULT_LABELS,
        target_labels=lambda label_id: (label_id,),
        best_metric="accuracy",
        aliases=("sentiment-analysis", "text-classification"),
        pipeline_output=pipeline_output,
        pipeline_arguments=PIPELINE_ARGUMENTS,
        predict_many=classify_many,
    ))
