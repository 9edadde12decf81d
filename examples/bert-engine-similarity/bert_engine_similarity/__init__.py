"""Semantic similarity of two texts: a bi-encoder (mean-pooled token vectors) scored by cosine.

A complete third-party task for bert_engine, written as the tutorial in docs/plugins.md
describes. With a sentence-embedding checkpoint such as all-MiniLM-L6-v2 (the engine's
offline default) it gives meaningful scores without any training.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch
from torch import Tensor, nn

from bert_engine.hookspecs import InputError, TaskSpec, hookimpl, length_option
from bert_engine.model import mean_pool


class MeanPoolingHead(nn.Module):
    """Average of the real tokens' hidden states: one vector per text. No parameters to train."""

    needs_pooler = False

    def __init__(self, config) -> None:
        super().__init__()

    def forward(self, encoded) -> Tensor:
        return mean_pool(encoded.last_hidden_state, encoded.attention_mask)  # (B, H): the sentence vector


def preprocess(inputs, tokenizer, *, max_length: int | None):
    texts = [inputs["text_a"], inputs["text_b"]]
    for field, text in zip(("text_a", "text_b"), texts):
        if not text.strip():
            raise InputError(f"similarity: {field} is empty; type some text")
    # None: 256 tokens, or fewer if the model has fewer positions; an explicit value is checked
    max_length = length_option("similarity", "max_length", max_length, 256, 8, tokenizer)
    batch = tokenizer(texts, max_length=max_length, truncation="longest_first")
    batch.meta["texts"] = texts
    return batch


def postprocess(embeddings: Tensor, batch, *, max_length: int | None):
    a, b = embeddings.float()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).clamp(-1.0, 1.0).item()
    truncated = [name for name, cut in zip(("text_a", "text_b"), batch.truncated) if cut]
    return {
        "cosine": round(cosine, 6),
        "score": round((cosine + 1.0) / 2.0, 6),  # mapped to [0, 1]
        "truncated": truncated,  # inputs cut to max_length tokens; empty when nothing was cut
    }


def read_data(path, split: str = "train"):
    """TSV with a header `text_a<TAB>text_b<TAB>score`, score in [0, 1]; yields (inputs, score)."""
    with Path(path).open(encoding="utf-8", newline="") as handle:
        for row in csv.DictReader(handle, delimiter="\t"):
            yield {"text_a": row["text_a"], "text_b": row["text_b"]}, float(row["score"])


def loss(embeddings: Tensor, targets: list[float]) -> Tensor:
    """Pairs are consecutive rows: mean squared error between (cosine+1)/2 and the gold score."""
    a, b = embeddings[0::2], embeddings[1::2]
    predicted = (torch.nn.functional.cosine_similarity(a, b, dim=-1) + 1.0) / 2.0
    return torch.nn.functional.mse_loss(predicted, torch.tensor(targets, dtype=predicted.dtype))


def training_batch(examples, tokenizer, generator=None, max_length: int = 256):
    """Both texts of each pair as consecutive rows (the layout `loss` reads), and the gold scores."""
    texts = [text for inputs, _ in examples for text in (inputs["text_a"], inputs["text_b"])]
    return tokenizer(texts, max_length=min(max_length, tokenizer.model_max_length)), [score for _, score in examples]


def metric(results: list[dict], targets: list[float]) -> dict[str, float]:
    """Spearman rank correlation (the STS benchmark's metric) and Pearson correlation of the scores."""
    predictions = [r["score"] for r in results]
    x, y = torch.tensor(predictions, dtype=torch.float64), torch.tensor(targets, dtype=torch.float64)
    if len(x) < 2:
        raise ValueError(f"need at least 2 predictions for a correlation, got {len(x)}")

    def pearson(u, v):
        u, v = u - u.mean(), v - v.mean()
        return float((u * v).sum() / (u.norm() * v.norm()).clamp(min=1e-12))

    def ranks(u):
        return u.argsort().argsort().to(torch.float64)

    return {"spearman": pearson(ranks(x), ranks(y)), "pearson": pearson(x, y)}


def build_tab(predictor) -> None:
    import gradio as gr

    from bert_engine import ui  # the playground's tab layout: run button, examples that run, details

    with gr.Row():
        text_a = gr.Textbox(label="Text A", lines=3)
        text_b = gr.Textbox(label="Text B", lines=3)
    button = ui.run_button(gr, "Compare")
    score = gr.Label(label="Similarity")
    details = ui.details(gr)

    def run(text_a: str, text_b: str):
        """How similar two texts are in meaning: the cosine of their sentence embeddings, as a score from 0 to 1.

        Args:
            text_a: the first text.
            text_b: the second text.
        """
        output = predictor.predict({"text_a": text_a, "text_b": text_b})
        result = output["result"]
        scores = {"similar": result["score"], "different": 1.0 - result["score"]}
        # a text read only in part says so where the answer is, not only in the closed details' JSON
        cut = " and ".join({"text_a": "Text A", "text_b": "Text B"}[name] for name in result["truncated"])
        label = f"Similarity of the start of {cut} only (a long text is cut to the model's window)" if cut else "Similarity"
        return gr.Label(value=scores, label=label), output

    ui.wire(gr, button, run, [text_a, text_b], [score, details], api_name="similarity",
            examples=[[e["text_a"], e["text_b"]] for e in EXAMPLES])


EXAMPLES = (
    {"text_a": "A man is playing a guitar.", "text_b": "Someone plays an instrument."},
    {"text_a": "The stock market fell sharply today.", "text_b": "A cat is sleeping on the sofa."},
)


@hookimpl
def register_tasks(register):
    register(TaskSpec(
        name="similarity",
        title="Similarity",
        description="How close in meaning are two texts? Cosine of mean-pooled BERT vectors.",
        build_head=MeanPoolingHead,
        preprocess=preprocess,
        postprocess=postprocess,
        build_tab=build_tab,
        input_fields=("text_a", "text_b"),
        options={"max_length": None},
        examples=EXAMPLES,
        read_data=read_data,
        training_batch=training_batch,
        loss=loss,
        metric=metric,
        best_metric="spearman",
    ))
