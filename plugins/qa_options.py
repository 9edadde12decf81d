"""QA's option values that need no tokenizer, and the "no answer" choices a visitor makes (eager, balanced,
cautious, never, or a probability), checked when a pipeline is made and again per request."""

from __future__ import annotations

import math

from bert_engine.hookspecs import InputError, check_int
from plugins.qa_answerability import verifier_problem

# How readily "no answer" is said, in a visitor's terms: each a threshold on the answerability verifier's
# P(no answer), calibrated per model (scripts/qa_calibrate.py writes them into the pack's verifier record).
NO_ANSWER_CHOICES = ("eager", "balanced", "cautious", "never")


def check_options(options) -> None:
    """The option values that need no tokenizer, checked when a pipeline is made and again per request:
    `pipeline("qa", null_threshold=float("nan"))` fails where it is written, not at its first call."""
    for name, low, high in (("top_k", 1, 50), ("max_question_len", 4, 256), ("max_answer_len", 1, 512)):
        check_int("qa", name, options[name], low, high)
    null_threshold = options["null_threshold"]
    if null_threshold is not None and (isinstance(null_threshold, bool) or not isinstance(null_threshold, (int, float))
                                       or not math.isfinite(null_threshold)):
        raise InputError(f"qa: null_threshold must be a finite number or None, got {null_threshold!r}")
    answerability = options["answerability"]
    if answerability is not None and (problem := verifier_problem(answerability)) is not None:
        raise InputError(f"qa: answerability must be a verifier record as scripts/qa_calibrate.py writes into a model's "
                         f"manifest, or None, but {problem}: got {answerability!r:.80}")
    no_answer_rule(options["no_answer"], answerability)  # refuses a bad choice before any work
    if null_threshold is not None and isinstance(options["no_answer"], str) and options["no_answer"].strip().lower() == "never":
        raise InputError(f"qa: null_threshold={null_threshold!r} refuses where the null gap passes it, and "
                         "no_answer='never' never refuses; give one of them")


def no_answer_rule(no_answer, answerability) -> float | None:
    """The P(no answer) above which the verifier's answer is "no answer", for a choice (a name of
    NO_ANSWER_CHOICES or a probability from 0 to 1; None: "eager"), or None
    for "never" or a model without a verifier.

    Raises:
        InputError: an unknown choice, naming it.
    """
    if no_answer_choice(no_answer):
        no_answer = no_answer.strip().lower()
    elif isinstance(no_answer, str) and (value := _probability_text(no_answer)) is not None:
        no_answer = value  # "0.5": as `-o no_answer=0.5` and an MCP client send it
    elif no_answer is not None and (isinstance(no_answer, bool) or not isinstance(no_answer, (int, float))
                                    or not 0.0 <= no_answer <= 1.0):
        raise InputError(f"qa: no_answer must be one of {', '.join(NO_ANSWER_CHOICES)} or a probability from 0 "
                         f"to 1, got {no_answer!r}")
    if answerability is None or no_answer == "never":
        return None
    if isinstance(no_answer, (int, float)):
        return float(no_answer)
    return float(answerability.get("presets", {}).get(no_answer or "eager", 0.5))


def no_answer_choice(no_answer) -> bool:
    """Whether `no_answer` names one of NO_ANSWER_CHOICES (any case), not a probability."""
    return isinstance(no_answer, str) and no_answer.strip().lower() in NO_ANSWER_CHOICES


def _probability_text(text: str) -> float | None:
    """A probability written as text ("0.5", " 1 "), else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 <= value <= 1.0 else None
