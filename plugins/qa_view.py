"""The QA tab's views of a result: the answer marked inline in its context (an excerpt around it for a
long context, cut at word boundaries) and the candidates for the bars; and the result in the transformers
question-answering pipeline's shape, with that pipeline's arguments read as this task's options."""

from __future__ import annotations

from bert_engine.hookspecs import InputError
from bert_engine.ui import bar, percent, user_text

EXCERPT_CHARS = 600  # a longer context shows this much around the answer, the whole text one click away


def _excerpt(context: str, start: int, end: int, mark: str) -> str:
    """The context as HTML with `mark` in place of [start, end); a long one cut to EXCERPT_CHARS around
    it at word boundaries, the whole text one click away."""
    if len(context) <= EXCERPT_CHARS:
        return user_text(context[:start]) + mark + user_text(context[end:])
    lo, hi = max(0, start - EXCERPT_CHARS // 2), min(len(context), end + EXCERPT_CHARS // 2)
    lo = context.rfind(" ", 0, lo) + 1 if lo else 0  # never cut inside a word
    hi = hi if hi == len(context) or context.find(" ", hi) < 0 else context.find(" ", hi)
    body = ("… " if lo else "") + user_text(context[lo:start]) + mark + user_text(context[end:hi]) + (" …" if hi < len(context) else "")
    return body + (f'<details class="qa-whole"><summary>The whole context ({len(context):,} characters)</summary>'
                   f'{user_text(context[:start])}{mark}{user_text(context[end:])}</details>')


def answer_view(context: str, result: dict) -> str:
    """The headline ("Answer: ... - 88 %" or "No answer in this context") over the context with the
    answer (or, for "no answer", the best candidate) marked inline; a long context shows an excerpt
    around it, cut at word boundaries, and the rest on demand."""
    answers, null = result["answers"], result["no_answer"]
    style = ('style="background:{bg};color:#1f2937;padding:0 .15em;border-radius:3px;overflow-wrap:anywhere"')
    if null["predicted"] or not answers:
        if not answers:
            why = "no span fits"
        elif null.get("rule") == "verifier":
            why = (f"the model is {percent(null['probability'])} sure the text does not say it; the best candidate "
                   f"is marked")
        else:
            why = (f"the best span, “{user_text(answers[0]['answer'])}” ({percent(answers[0]['score'])}), "
                   f"is weaker than “no answer” by more than the threshold")
        head = (f'<p class="qa-headline qa-none"><b>No answer in this context</b> '
                f'<span class="qa-why">({why})</span></p>')
        if answers:
            best = answers[0]
            mark = f'<mark class="be-mark qa-candidate" {style.format(bg="#e5e7eb")}>{user_text(best["answer"])}</mark>'
            body = _excerpt(context, best["start"], best["end"], mark)
        else:
            body = _excerpt(context, 0, 0, "")
        return (f'<div class="qa-view">{head}<div class="qa-context" style="white-space:pre-wrap;line-height:1.6">'
                f'{body}</div></div>')
    best = answers[0]
    start, end, score = best["start"], best["end"], percent(best["score"])
    mark = (f'<mark class="be-mark qa-answer" {style.format(bg="#fde68a")}>{user_text(context[start:end])}'
            f'<sup class="qa-score" style="color:#1f2937"> {score}</sup></mark>')
    guess = ""
    if null.get("rule") == "verifier" and null.get("probability") is not None and null["probability"] >= 0.5:
        # answered although "no answer" is likelier: the setting (eager) answers below its threshold; say so
        setting = f"“{null['choice']}” answers" if null.get("choice") else "this setting answers"
        sure, below = percent(null["probability"]), percent(null["threshold"]) if null.get("threshold") is not None else None
        if sure == below:  # (74.51 % under 74.52 % both read "75 %")
            sure, below = f"{100 * null['probability']:.2f} %", f"{100 * null['threshold']:.2f} %"
        guess = (f' <span class="qa-why">(a guess: the model is {sure} sure the text does not say it'
                 + (f"; {setting} below {below}" if below is not None else "") + ")</span>")
    return (f'<div class="qa-view"><p class="qa-headline">Answer: <b>{user_text(best["answer"])}</b> – {score}{guess}</p>'
            f'<div class="qa-context" style="white-space:pre-wrap;line-height:1.6">'
            f'{_excerpt(context, start, end, mark)}</div></div>')


def candidate_bars(result: dict) -> str:
    """The candidates as bars (the span head's probabilities), under a line saying how the "no answer" decision
    went. No headline of its own: a bar chart whose tallest bar was "(no answer)" read as the answer beside an
    answer line that gave a span, because the verifier's probability decides against its own threshold, not
    against the spans' (the session-52 browser audit)."""
    null = result["no_answer"]
    if null.get("rule") == "verifier":
        decision = (f"“No answer”: {percent(null['probability'])} sure the text does not say it (this setting "
                    f"says “no answer” above {percent(null['threshold'])})" if null.get("threshold") is not None else "")
    elif null.get("rule") == "null gap":
        decision = f"“No answer” by the null gap {null['null_gap']} against the threshold {null['threshold']}"
    else:
        decision = ""
    rows = "".join(bar(a["score"], a["answer"] if len(a["answer"]) <= 60 else a["answer"][:57] + "…")
                   for a in result["answers"])
    note = f'<p class="qa-decision" style="opacity:.85;margin:.4em 0 0">{user_text(decision)}</p>' if decision else ""
    return f'<div class="qa-candidates">{rows or user_text("No span fits.")}{note}</div>'


def pipeline_output(result: dict, options, single: bool):
    """The question-answering pipeline's shape (transformers v4): {"score", "start", "end", "answer"},
    a list of them with top_k > 1; "no answer" is {"score": its probability, "start": 0, "end": 0,
    "answer": ""} as with handle_impossible_answer=True. Its probability is the one that decided: the
    verifier's P(no answer) where the verifier refused (the span head's null share can be 0.3 % then),
    else the span head's."""
    answers = [{"score": a["score"], "start": a["start"], "end": a["end"], "answer": a["answer"]}
               for a in result["answers"]]
    verdict = result["no_answer"]
    if verdict["predicted"] or not answers:
        score = verdict["probability"] if verdict.get("rule") == "verifier" else verdict["score"]
        answers = [{"score": score, "start": 0, "end": 0, "answer": ""}, *answers]
    top_k = options.get("top_k") or 1
    return answers[0] if top_k == 1 else answers[:top_k]


def _handle_impossible_answer(value) -> dict:
    if not isinstance(value, bool):
        raise InputError(f"qa: handle_impossible_answer must be True or False, got {value!r:.80}")
    # True: transformers' rule, "no answer" where its score beats the best span's (the span head's null gap past
    # 0; it was the default "eager" verifier, which answered where the null score was 0.99996); False: never
    # (True also clears no_answer, so that a no_answer= beside it is refused as a conflict, not silently overridden)
    return {"null_threshold": 0.0, "no_answer": None} if value else {"no_answer": "never"}


# transformers' question-answering arguments read under this task's names (TaskSpec.pipeline_arguments)
PIPELINE_ARGUMENTS = {"handle_impossible_answer": _handle_impossible_answer, "topk": lambda value: {"top_k": value}}
