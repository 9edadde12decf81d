"""ROUGE-1/2/L F1 of summaries against references, with the `rouge-score` package (Porter stemming)."""

from __future__ import annotations


def rouge(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F1 (in percent, Porter stemming) with the `rouge-score` package."""
    from rouge_score import rouge_scorer  # noqa: PLC0415 - it loads nltk (~1 s): only when scoring

    if not references:
        raise ValueError("no reference summaries to score")
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for prediction, reference in zip(predictions, references):
        for name, score in scorer.score(reference, prediction).items():
            totals[name] += score.fmeasure
    return {name: 100.0 * value / len(references) for name, value in totals.items()}
