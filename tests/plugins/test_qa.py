"""QA: parity with the transformers pipeline on one window, windows and max context, null answers, SQuAD."""

from pathlib import Path

import pytest
import torch
import transformers
from conftest import reference_checkpoint

from bert_engine.hookspecs import InputError
from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from plugins.qa import evaluate, max_context_windows, predict_many
from plugins.qa_data import read_data
from plugins.qa_metric import metric, normalize_answer, squad_scores

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "squad_tiny.json"
LONG_CONTEXT = " ".join(
    f"Section {i}: the river number {i} flows {i * 3} kilometres through the valley of town {i} before it "
    f"joins the sea near the harbour built in {1800 + i}." for i in range(60))


@pytest.fixture(scope="module")
def task():
    return load_registry(entry_points=False).task("qa")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return reference_checkpoint(tmp_path_factory.mktemp("qa"), "BertForQuestionAnswering")


@pytest.fixture(scope="module")
def predictor(task, checkpoint):
    return Predictor.load(task, str(checkpoint), strict=True)


def _reference_answers(checkpoint, question, context, top_k, max_answer_len):
    """The reference model's logits and tokenizer, decoded by a brute-force search over every
    (start, end) pair of context tokens (transformers 5 no longer ships a QA pipeline)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    model = transformers.BertForQuestionAnswering.from_pretrained(str(checkpoint)).eval()
    encoded = tokenizer(question, context, return_offsets_mapping=True, return_tensors="pt")
    sequence_ids = encoded.sequence_ids(0)
    offsets = encoded.pop("offset_mapping")[0].tolist()
    with torch.no_grad():
        out = model(**encoded)
    start, end = out.start_logits[0].tolist(), out.end_logits[0].tolist()
    spans = {}
    for s in range(len(start)):
        for e in range(s, min(s + max_answer_len, len(end))):
            if sequence_ids[s] == 1 and sequence_ids[e] == 1:
                key = (offsets[s][0], offsets[e][1])
                spans[key] = max(spans.get(key, -1e9), start[s] + end[e])
    ranked = sorted(spans.items(), key=lambda item: -item[1])[:top_k]
    return [(s, e, context[s:e]) for (s, e), _ in ranked]


def test_single_window_answers_match_the_reference(predictor, checkpoint):
    for inputs, _ in read_data(FIXTURE):
        ours = predictor.predict(inputs, top_k=3, max_answer_len=15)["result"]
        assert ours["windows"] == 1
        assert [(a["start"], a["end"], a["answer"]) for a in ours["answers"]] == \
            _reference_answers(checkpoint, inputs["question"], inputs["context"], 3, 15)


def test_long_context_spans_index_the_original_text(predictor):
    question = "Which harbour was built in 1830?"
    result = predictor.predict({"question": question, "context": LONG_CONTEXT}, top_k=10,
                               max_seq_len=128, doc_stride=48)["result"]
    assert result["windows"] > 5
    spans = [(a["start"], a["end"]) for a in result["answers"]]
    assert len(spans) == len(set(spans)) == 10  # duplicates across windows are merged
    for answer in result["answers"]:
        assert LONG_CONTEXT[answer["start"]:answer["end"]] == answer["answer"]
        assert 0 <= answer["start"] < answer["end"] <= len(LONG_CONTEXT)
    scores = [a["score"] for a in result["answers"]]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)


def test_each_token_has_one_home_window_with_most_context(predictor):
    from plugins.qa import OPTIONS, preprocess

    batch = preprocess({"question": "Where?", "context": LONG_CONTEXT}, predictor.tokenizer,
                       **{**OPTIONS, "max_seq_len": 64, "doc_stride": 24})
    home = max_context_windows(batch)
    for span, row in home.items():
        rows = [r for r in range(len(batch)) if span in [tuple(o) for o, s in zip(batch.offsets[r], batch.sequence_ids[r]) if s == 1]]
        assert row in rows

        def context_around(r, span=span):
            positions = [t for t, s in enumerate(batch.sequence_ids[r]) if s == 1]
            t = [tuple(batch.offsets[r][p]) for p in positions].index(span)
            return min(t, len(positions) - 1 - t)

        assert context_around(row) == max(context_around(r) for r in rows)


def test_null_threshold_and_gap(predictor):
    inputs = {"question": "When was Moby-Dick published?", "context": "Moby-Dick was published in 1851."}
    base = predictor.predict(inputs)["result"]
    gap = base["no_answer"]["null_gap"]
    assert gap == pytest.approx(base["no_answer"]["logit"] - base["answers"][0]["logit"], abs=1e-3)
    refuse = predictor.predict(inputs, null_threshold=gap - 1.0)["result"]
    accept = predictor.predict(inputs, null_threshold=gap + 1.0)["result"]
    assert refuse["answer"] is None and refuse["no_answer"]["predicted"]
    assert accept["answer"] == base["answers"][0]["answer"]


def test_scores_do_not_depend_on_top_k(predictor):
    inputs = next(read_data(FIXTURE))[0]
    one = predictor.predict(inputs, top_k=1)["result"]["answers"][0]
    five = predictor.predict(inputs, top_k=5)["result"]["answers"][0]
    assert one == five


def test_long_question_is_cut_and_never_answered_from(predictor):
    question = "what " * 100 + "is it?"
    result = predictor.predict({"question": question, "context": "It is a small red box."}, top_k=5)["result"]
    assert result["question_truncated"] is True
    assert all(0 <= a["start"] < a["end"] <= len("It is a small red box.") for a in result["answers"])


@pytest.mark.parametrize(
    ("inputs", "options", "message"),
    [
        ({"question": " ", "context": "text"}, {}, "the question is empty"),
        ({"question": "why?", "context": ""}, {}, "the context is empty"),
        ({"question": "why?", "context": "\u200b\u0000"}, {}, "no readable text"),
        ({"question": "why?", "context": "text"}, {"doc_stride": 500}, "doc_stride must be an integer in"),
        ({"question": "why?", "context": "text"}, {"max_seq_len": 4096}, "max_seq_len must be an integer in"),
        ({"question": "why?", "context": "word " * 200_000}, {}, "windows of 384 tokens; the limit is 256"),
        ({"question": "why?", "context": "text"}, {"null_threshold": float("nan")}, "must be a finite number or None, got nan"),
        ({"question": "why?", "context": "text"}, {"null_threshold": float("-inf")}, "must be a finite number or None, got -inf"),
    ],
)
def test_bad_input_is_a_clear_input_error(predictor, inputs, options, message):
    with pytest.raises(InputError, match=message):
        predictor.predict(inputs, **options)


def test_official_squad_normalisation_and_metric():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert squad_scores(["the South America"], [["South America", "S. America"]]) == {"exact_match": 100.0, "f1": 100.0}
    assert metric([{"answer": "S. America"}], [{"answers": ["South America", "S. America"]}])["exact_match"] == 100.0
    partial = squad_scores(["seven million"], [["seven million square kilometres"]])
    assert partial["exact_match"] == 0.0 and partial["f1"] == pytest.approx(100 * 2 * (1 * 0.5) / 1.5)


def test_evaluate_squad_file(predictor):
    examples = list(read_data(FIXTURE))
    report = evaluate(predictor, examples)
    assert len(examples) == 3 and 0.0 <= report["exact_match"] <= report["f1"] <= 100.0


def test_batched_answers_equal_one_by_one_predictions(predictor):
    items = [inputs for inputs, _ in read_data(FIXTURE)]
    items += [{"question": "Which town has the harbour built in 1847?", "context": LONG_CONTEXT},
              {"question": "How far does river 7 flow?", "context": LONG_CONTEXT[:400]},
              {"question": "Who?", "context": "Ada Lovelace wrote the first program."}]
    alone = [predictor.predict(item, top_k=3)["result"] for item in items]
    # max_rows 4 forces groups that mix short inputs and split the long one's windows across passes
    together = predict_many(predictor, items, max_rows=4, top_k=3)
    assert [r["windows"] for r in together] == [r["windows"] for r in alone] and alone[3]["windows"] > 4
    for a, b in zip(alone, together):
        assert [x["answer"] for x in a["answers"]] == [x["answer"] for x in b["answers"]]
        assert [x["start"] for x in a["answers"]] == [x["start"] for x in b["answers"]]
        for x, y in zip(a["answers"], b["answers"]):
            assert x["logit"] == pytest.approx(y["logit"], abs=1e-3)


TOKENIZERS = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizers"


@pytest.mark.parametrize("kind", ["model", "roberta", "albert"])
def test_preprocessing_many_gives_each_inputs_own_windows(predictor, kind):
    """predict_many tokenises every question in one call and every (question, context) pair of a stride in
    another: each input's batch must be the one tokenising it alone gives (windows, widths, offsets, cuts),
    on WordPiece, byte-level BPE and Unigram (whose offsets are moved off the leading space)."""
    from bert_engine.tokenizer import Tokenizer
    from plugins.qa import preprocess, preprocess_many

    tokenizer = predictor.tokenizer if kind == "model" else Tokenizer.from_pretrained(TOKENIZERS / kind)
    long_question = " ".join(["which river of the valley"] * 60) + "?"  # cut at 200 pieces: room 181, stride 90
    items = [{"question": "Who wrote it?", "context": "Ada Lovelace wrote the first program."},
             {"question": "Which river joins the sea?", "context": LONG_CONTEXT},  # windows
             {"question": long_question, "context": LONG_CONTEXT[:900]},  # cut, and another stride
             {"question": "  Where?  ", "context": "  Héllo wörld, 北京 🤗 harbour.  "}]
    options = {**predictor.check_options({}), "max_question_len": 200}  # the others: stride 128, one call
    together = preprocess_many(items, tokenizer, **options)
    for item, batch in zip(items, together):
        alone = preprocess(item, tokenizer, **options)
        assert torch.equal(batch.input_ids, alone.input_ids) and torch.equal(batch.attention_mask, alone.attention_mask)
        assert torch.equal(batch.token_type_ids, alone.token_type_ids)
        assert (batch.offsets, batch.sequence_ids, batch.word_ids, batch.sample_index, batch.truncated, batch.meta) == \
            (alone.offsets, alone.sequence_ids, alone.word_ids, alone.sample_index, alone.truncated, alone.meta)
    assert len(together[1]) > 1 and together[2].meta["question_truncated"] and len(together[2]) > 1
    assert len({batch.input_ids.shape[1] for batch in together}) == 3  # the short ones narrower than the windows
    with pytest.raises(InputError, match=r"^qa: inputs\[2\]: the context needs at least [\d,]+ windows"):
        preprocess_many([*items[:2], {"question": "Why?", "context": LONG_CONTEXT * 40}], tokenizer,
                        **{**options, "max_seq_len": 64})


def test_a_context_far_over_the_window_limit_is_refused_before_it_is_tokenised(predictor, monkeypatch):
    """Counted from below (a word is at least one token), nothing tokenised: 1,000,000 characters took seconds to
    tokenise only to be refused. Words of many pieces, under that count, are still refused after tokenising."""
    from plugins import qa_windows

    tokenizer, options = predictor.tokenizer, {**predictor.check_options({}), "max_seq_len": 64, "doc_stride": None}
    calls = []
    monkeypatch.setattr(type(tokenizer), "__call__", lambda *a, **k: calls.append(a) or pytest.fail("tokenised"))
    for run in (qa_windows.preprocess, lambda item, tok, **o: qa_windows.preprocess_many([item], tok, **o)):
        with pytest.raises(InputError, match=r"the context needs at least 3\d,\d{3} windows of 64 tokens; the limit "
                                             r"is 256: shorten it"):
            run({"question": "Why?", "context": "word " * 1_000_000}, tokenizer, **options)
    assert not calls
    monkeypatch.undo()
    rare = "xqzvbnmkl " * 4_000  # about four pieces a word: 134 windows counted from below, over 256 in fact
    assert tokenizer.windows_at_least("Why?", rare, max_length=64, stride=29) <= 256
    with pytest.raises(InputError, match=r"^qa: the context needs \d+ windows of 64 tokens; the limit is 256 "):
        qa_windows.preprocess({"question": "Why?", "context": rare}, tokenizer, **options)


def test_batched_prediction_names_the_bad_input(predictor):
    with pytest.raises(InputError, match="^qa: inputs\\[1\\]: the question is empty") as caught:  # the task named once
        predict_many(predictor, [{"question": "Who?", "context": "Ada."}, {"question": " ", "context": "x"}])
    assert caught.value.position == 1  # for a caller that renumbers it to its own list (pipeline streams)


def test_loads_from_a_hub_id_served_locally(task, checkpoint, fake_hub, tmp_path):
    fake_hub.repos[("owner/qa", "main")] = checkpoint
    hub = Predictor.load(task, "owner/qa", endpoint=fake_hub.endpoint, cache_dir=tmp_path / "cache")
    local = Predictor.load(task, str(checkpoint))
    inputs = next(read_data(FIXTURE))[0]
    assert hub.predict(inputs)["result"] == local.predict(inputs)["result"]


def test_minilm_encoder_with_a_fresh_head_gives_valid_offsets(task, minilm_dir):
    predictor = Predictor.load(task, str(minilm_dir))
    inputs = {"question": "Who wrote it?", "context": "Ünïcödé text 🤗 written by Herman Melville in 北京."}
    result = predictor.predict(inputs, top_k=5)["result"]
    for answer in result["answers"]:
        assert inputs["context"][answer["start"]:answer["end"]] == answer["answer"]


def _reference_long_context_best(checkpoint, question, context, max_seq_len, doc_stride, max_answer_len):
    """The classic BERT/SQuAD n-best decoding, written independently over the reference tokenizer's
    own windows and the reference model's logits: spans ranked by start + end logit across windows,
    a start token taken only from the window where it has most context."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    model = transformers.BertForQuestionAnswering.from_pretrained(str(checkpoint)).eval()
    encoded = tokenizer(question, context, truncation="only_second", max_length=max_seq_len, stride=doc_stride,
                        return_overflowing_tokens=True, return_offsets_mapping=True, padding="longest",
                        return_tensors="pt")
    offsets = encoded.pop("offset_mapping").tolist()
    encoded.pop("overflow_to_sample_mapping")
    with torch.no_grad():
        out = model(**encoded)
    windows = []
    for w in range(len(offsets)):
        ids = encoded.sequence_ids(w)
        context_positions = [t for t, s in enumerate(ids) if s == 1]
        windows.append((ids, context_positions))
    # where each context token (by character span) has the most context
    best_home = {}
    for w, (_, positions) in enumerate(windows):
        for rank, t in enumerate(positions):
            score = min(rank, len(positions) - 1 - rank) + 0.01 * len(positions)
            key = tuple(offsets[w][t])
            if key not in best_home or score > best_home[key][0]:
                best_home[key] = (score, w)
    best = (None, -1e18)
    for w, (_, positions) in enumerate(windows):
        start, end = out.start_logits[w].tolist(), out.end_logits[w].tolist()
        for s in positions:
            if best_home[tuple(offsets[w][s])][1] != w:
                continue
            for e in positions:
                if s <= e < s + max_answer_len and start[s] + end[e] > best[1]:
                    best = ((offsets[w][s][0], offsets[w][e][1]), start[s] + end[e])
    return best[0]


def test_long_context_best_answer_matches_the_reference_decoding(predictor, checkpoint):
    prefix, suffix = LONG_CONTEXT[:2500], LONG_CONTEXT[2500:6000]
    for inputs, _ in read_data(FIXTURE):
        context = prefix + " " + inputs["context"] + " " + suffix
        ours = predictor.predict({"question": inputs["question"], "context": context}, max_seq_len=128,
                                 doc_stride=48, max_answer_len=15)["result"]
        assert ours["windows"] > 5
        expected = _reference_long_context_best(checkpoint, inputs["question"], context, 128, 48, 15)
        assert (ours["answers"][0]["start"], ours["answers"][0]["end"]) == expected


def test_the_answer_view_marks_the_answer_inline_and_says_no_answer():
    from plugins.qa import answer_view, whole_words

    context = "The launch was at 20:17 UTC on a clear day.\nNobody <b>saw</b> it."
    start = context.index("20:17")
    assert whole_words(context, start, start + 4) == (start, start + 5)  # a word piece edge takes the whole word
    result = {"answers": [{"answer": "20:17", "start": start, "end": start + 5, "score": 0.876}],
              "no_answer": {"predicted": False, "score": 0.01}}
    view = answer_view(context, result)
    assert "Answer: <b><bdi style=\"color:inherit\">20:17</bdi></b> – 88 %" in view
    mark = view[view.index("<mark"):view.index("</mark>")]
    assert "overflow-wrap:anywhere" in mark and ">20:17</bdi><sup" in mark and "\n" not in mark  # (wraps on a phone)
    assert "at </bdi><mark" in view and '</mark><bdi style="color:inherit"> UTC' in view  # inline: no break around it
    assert "&lt;b&gt;saw&lt;/b&gt;" in view  # the context is text, never markup
    assert "a guess" not in view
    # answered while "no answer" is likelier (eager answers below its threshold): the headline says it is a guess
    unsure = {"predicted": False, "rule": "verifier", "probability": 0.714, "threshold": 0.738, "choice": "eager"}
    guess = answer_view(context, {**result, "no_answer": unsure})
    assert ("– 88 % <span class=\"qa-why\">(a guess: the model is 71 % sure the text does not say it; “eager” answers "
            "below 74 %)</span></p>") in guess and "qa-answer" in guess
    assert "a guess" not in answer_view(context, {**result, "no_answer": {**unsure, "probability": 0.2}})
    close = answer_view(context, {**result, "no_answer": {**unsure, "probability": 0.7451, "threshold": 0.7452}})
    assert "74.51 % sure the text does not say it; “eager” answers below 74.52 %" in close  # not "75 %" under "75 %"
    none = answer_view(context, {**result, "no_answer": {"predicted": True, "score": 0.7}})
    assert "No answer in this context" in none and "qa-answer" not in none
    assert "Nobody" in none and 'class="be-mark qa-candidate"' in none  # the context stays, the candidate greyed
    long_context = "Filler sentence here. " * 200 + context
    start = long_context.index("20:17")
    view = answer_view(long_context, {**result, "answers": [{**result["answers"][0], "start": start,
                                                             "end": start + 5}]})
    shown = view.split("<details")[0]
    assert "<mark" in shown and len(shown) < 2000 and "The whole context (" in view  # an excerpt around it first
    assert shown.split("</p>", 1)[1].startswith('<div class="qa-context" style="white-space:pre-wrap;line-height:1.6">… <bdi style=\"color:inherit\">Filler')
