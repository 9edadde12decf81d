"""Extractive summary: sentence spans, centroid + MMR on MiniLM, the BertSum scorer, ROUGE and baselines."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import fit_tiny_model

from bert_engine.checkpoints.loader import load_tokenizer
from bert_engine.checkpoints.loading import save_pretrained
from bert_engine.hookspecs import InputError
from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from plugins.sentences import split_sentences
from plugins.summary import (
    OPTIONS,
    SentenceScorerHead,
    body_start,
    evaluate,
    lead,
    loss,
    mmr_select,
    oracle_labels,
    pipeline_output,
    preprocess,
    read_data,
    split_of,
    training_batch,
)

FIXTURE = Path(__file__).parent.parent / "fixtures" / "bbc_tiny.jsonl"
DOC = ("Dr. Smith paid $3.50 for it on Jan. 5. \"Is it done?\" she asked. The U.S. economy grew 2.5 per cent.\n"
       "A title line without a full stop\nMr. Brown left at 10 p.m. and did not return.")


@pytest.fixture(scope="module")
def task():
    return load_registry(entry_points=False).task("summary")


@pytest.fixture(scope="module")
def minilm(task, minilm_dir):
    return Predictor.load(task, str(minilm_dir))


def test_centroid_mode_on_minilm_returns_spans_scores_and_document_order(minilm):
    text = list(read_data(FIXTURE, "all"))[0][0]["text"]
    result = minilm.predict({"text": text}, num_sentences=2)["result"]
    assert result["mode"] == "centroid"  # MiniLM has no trained scorer: "auto" falls back
    assert len(result["selected"]) == 2 and result["selected"] == sorted(result["selected"])
    assert result["summary"] == " ".join(result["sentences"][k]["text"] for k in result["selected"])
    for sentence in result["sentences"]:
        assert text[sentence["start"]:sentence["end"]] == sentence["text"]
        assert 0.0 <= sentence["score"] <= 1.0
    ratio = minilm.predict({"text": text}, ratio=0.5)["result"]
    # the BBC article opens with its headline, never a summary sentence: ceil(0.5 * 7) sentences, all from the body
    assert ratio["lead"] == 1 and ratio["dropped"][0]["index"] == 0 and ratio["dropped"][0]["reason"].startswith("the headline")
    assert len(ratio["selected"]) == 4 and 0 not in ratio["selected"]


@pytest.mark.parametrize(("text", "start"), [
    ("Yukos loses US bankruptcy battle\n\nA judge has dismissed it. It was late.", 1),
    ("Results\nThe team won. Then it lost.", 1),
    ("A judge has dismissed it.\n\nIt was late. Nobody came.", 0),  # a first line that ends like a sentence
    ("Yukos loses US bankruptcy battle and a judge dismissed it. It was late.", 0),  # no line of its own
    ('He said "it is over!"\nThen he left. Nobody came.', 0),
    ("Only a headline", 0),
])
def test_the_lead_is_the_first_sentence_after_a_headline(text, start):
    from plugins.sentences import split_sentences
    from plugins.summary import body_start, lead

    spans = split_sentences(text)
    assert body_start(text, spans) == start
    assert lead(text, 1) == text[spans[start][0]:spans[start][1]]


def test_centroid_scores_are_cosines_to_the_mean_embedding(minilm, minilm_dir):
    """Recompute the scores independently: each sentence through the encoder alone, mean-pooled."""
    text = DOC
    result = minilm.predict({"text": text}, min_words=0)["result"]
    sentences = [s["text"] for s in result["sentences"]]
    tokenizer = load_tokenizer(minilm_dir)
    vectors = []
    with torch.no_grad():
        for sentence in sentences:
            batch = tokenizer(sentence)
            states = minilm.model.encoder(**batch.model_inputs()).last_hidden_state[0]
            vectors.append(states.mean(0))
    unit = torch.nn.functional.normalize(torch.stack(vectors), dim=-1)
    centroid = torch.nn.functional.normalize(unit.mean(0), dim=-1)
    expected = (unit @ centroid).tolist()
    assert [s["score"] for s in result["sentences"]] == pytest.approx(expected, abs=1e-5)


def test_mmr_avoids_picking_a_near_duplicate_twice():
    embeddings = torch.tensor([[1.0, 0.0], [0.99, 0.01], [0.0, 1.0]])
    scores = torch.tensor([0.9, 0.89, 0.5])
    assert mmr_select(scores, embeddings, [0, 1, 2], 2, mmr_lambda=1.0) == [0, 1]
    assert mmr_select(scores, embeddings, [0, 1, 2], 2, mmr_lambda=0.5) == [0, 2]


def test_length_filter_lists_dropped_sentences_and_explains_an_empty_summary(minilm):
    result = minilm.predict({"text": DOC}, min_words=8)["result"]
    assert [d["text"] for d in result["dropped"]] == ["\"Is it done?\" she asked.", "The U.S. economy grew 2.5 per cent.",
                                                      "A title line without a full stop"]
    assert all("min_words=8" in d["reason"] for d in result["dropped"])
    empty = minilm.predict({"text": "Too short. Also short."}, min_words=5)["result"]
    assert empty["summary"] == "" and "min_words=5" in empty["explanation"]
    # the pipeline's shape carries the reason too, not an empty string alone
    assert pipeline_output(empty, {}, True) == [{"summary_text": "", "explanation": empty["explanation"]}]
    assert pipeline_output(result, {}, False) == {"summary_text": result["summary"]}


def test_long_document_is_embedded_sentence_by_sentence(minilm):
    text = " ".join(f"Sentence number {i} talks about topic {i % 7} in some detail." for i in range(300))
    result = minilm.predict({"text": text}, num_sentences=5)["result"]
    assert len(result["sentences"]) == 300 and len(result["selected"]) == 5


def test_layer_option_changes_the_embeddings_and_checks_the_range(minilm):
    last = minilm.predict({"text": DOC}, min_words=0)["result"]
    first = minilm.predict({"text": DOC}, min_words=0, layer=1)["result"]
    assert [s["score"] for s in last["sentences"]] != [s["score"] for s in first["sentences"]]
    with pytest.raises(InputError, match="layer 9 does not exist"):
        minilm.predict({"text": DOC}, mode="centroid", layer=9)


def test_bad_input_and_options_name_the_value(minilm):
    with pytest.raises(InputError, match="empty"):
        minilm.predict({"text": "  "})
    with pytest.raises(InputError, match="ratio.*1.5"):
        minilm.predict({"text": DOC}, ratio=1.5)
    with pytest.raises(InputError, match="mode 'abstractive'"):
        minilm.predict({"text": DOC}, mode="abstractive")


def test_training_batch_packs_sentences_bertsum_style(minilm_dir):
    tokenizer = load_tokenizer(minilm_dir)
    examples = list(read_data(FIXTURE, "all"))
    batch, targets = training_batch(examples, tokenizer, max_length=64)
    cls_id = tokenizer.token_id("cls_token")
    assert batch.input_ids.shape[1] <= 64 and len(batch) > len(examples)  # documents spill over several rows
    sep_id = tokenizer.token_id("sep_token")
    for r, row in enumerate(batch.meta["cls"]):
        positions = [start for start, *_ in row]
        assert all(int(batch.input_ids[r, p]) == cls_id for p in positions)
        assert all(int(batch.input_ids[r, end - 1]) == sep_id for _, end, *_ in row)
        assert [end for _, end, *_ in row[:-1]] == positions[1:]  # spans tile the row
        segments = [int(batch.token_type_ids[r, p]) for p in positions]
        assert segments == [k % 2 for k in range(len(positions))]  # interval segment ids
    labels = [y for row in targets for *_, y in row]
    assert sum(labels) == 6  # two reference sentences per fixture document


def test_the_scorer_never_sees_a_headline(minilm_dir):
    # trained with BBC headlines as each row's first sentence (always label 0), the scorer learned to
    # drop the first sentence, and with it the lead of every article that has no headline
    tokenizer = load_tokenizer(minilm_dir)
    examples = list(read_data(FIXTURE, "all"))
    batch, _ = training_batch(examples, tokenizer, max_length=512)
    packed = {(d, k) for row in batch.meta["cls"] for *_, d, k in row}
    texts = [inputs["text"] for inputs, _ in examples]
    for d, text in enumerate(texts):
        spans = split_sentences(text)
        assert body_start(text, spans) == 1  # the fixture's articles open with a headline line
        assert {k for doc, k in packed if doc == d} == set(range(1, len(spans)))
    plain = preprocess({"text": "No headline here. The lead comes first. Then the rest follows."}, tokenizer,
                       **{**OPTIONS, "mode": "supervised", "max_length": 512})
    assert [k for row in plain.meta["cls"] for *_, k in row] == [0, 1, 2]


def test_sentence_logits_are_the_linear_scorer_on_mean_pooled_sentences():
    from plugins.summary import sentence_logits

    torch.manual_seed(0)
    states, scorer = torch.randn(2, 9, 8), torch.nn.Linear(8, 1)
    rows = [[(0, 4, 0, 0), (4, 9, 0, 1)], [(0, 3, 1, 0)]]
    logits = sentence_logits(scorer(states).squeeze(-1), rows)
    expected = [scorer(states[0, :4].mean(0)), scorer(states[0, 4:9].mean(0)), scorer(states[1, :3].mean(0))]
    torch.testing.assert_close(torch.cat(logits), torch.cat(expected).detach(), atol=1e-6, rtol=0)


def test_oracle_labels_find_sentences_joined_without_separator():
    text = "Title here\n\nFirst point is made. Second point follows. Third one ends."
    spans = split_sentences(text)
    assert oracle_labels(text, spans, "First point is made.Third one ends.") == [0, 1, 0, 1]


def test_scorer_trains_saves_and_is_used_in_auto_mode(task, minilm_dir, tmp_path):
    tokenizer = load_tokenizer(minilm_dir)
    examples = list(read_data(FIXTURE, "all"))
    batch, targets = training_batch(examples, tokenizer)
    model, losses = fit_tiny_model(SentenceScorerHead, batch, targets, loss, steps=40, lr=3e-3)
    assert losses[-1] < losses[0] * 0.3
    save_pretrained(model, tmp_path, tokenizer)
    predictor = Predictor.load(task, str(tmp_path))
    assert predictor.untrained_head is False
    inputs, target = examples[0]
    result = predictor.predict(inputs, num_sentences=2, mode="supervised")["result"]
    assert result["summary"].replace(" ", "") == target["summary"].replace(" ", "")
    auto = predictor.predict(inputs, num_sentences=2)["result"]  # a trained scorer: auto is hybrid
    assert auto["mode"] == "hybrid" and len(auto["selected"]) == 2
    scorer_only = predictor.predict(inputs, num_sentences=2, mode="hybrid", hybrid_weight=1.0)["result"]
    assert [s["score"] for s in scorer_only["sentences"]] == [s["score"] for s in result["sentences"]]
    centroid = predictor.predict(inputs, num_sentences=2, mode="centroid")["result"]
    centroid_only = predictor.predict(inputs, num_sentences=2, mode="hybrid", hybrid_weight=0.0)["result"]
    assert [s["score"] for s in centroid_only["sentences"]] == pytest.approx(
        [s["score"] for s in centroid["sentences"]], abs=1e-5)


def test_lead_baseline():
    assert lead(DOC, 2) == "Dr. Smith paid $3.50 for it on Jan. 5. \"Is it done?\" she asked."


def test_evaluate_reports_model_lead3_and_first_k(minilm):
    table = evaluate(minilm, list(read_data(FIXTURE, "all")), progress=False, num_sentences=2)
    assert table["documents"] == 3
    assert set(table["rouge_f1"]) == {"model (centroid)", "lead-3", "first-k (k as the model)"}
    for scores in table["rouge_f1"].values():
        assert 0 < scores["rouge2"] <= scores["rouge1"] <= 100
    shares = table["first_sentence_kept"]
    assert set(shares) == {"model (centroid)", "references"} and table["lead_kept"] == shares["model (centroid)"]
    assert all(0 <= v <= 1 for v in shares.values())


def test_lead_shares_count_the_first_sentence_in_summaries_and_references():
    from plugins.summary import keeps_lead, references_with_lead

    results = [{"selected": [0, 2], "sentences": [{"text": "First one here."}]},
               {"selected": [1], "sentences": [{"text": "Lead  of two."}]}]
    assert keeps_lead(results) == 0.5
    assert references_with_lead(results, ["First one here.Other.", "Something else."]) == 0.5
    assert references_with_lead(results, ["x", "Lead of two. More."]) == 0.5  # spacing ignored


def test_split_is_fixed_and_bad_lines_name_the_line(tmp_path):
    assert split_of("business/001") == split_of("business/001")
    ids = [f"sport/{i:03d}" for i in range(1000)]
    share = sum(split_of(i) == "test" for i in ids) / len(ids)
    assert 0.07 < share < 0.13
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a/1", "article": "x", "summary": "y"}\n{"id": "a/2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        list(read_data(bad, "all"))


def test_cli_predicts_a_summary_with_provenance(minilm_dir):
    out = subprocess.run([sys.executable, "-m", "bert_engine", "predict", "summary", "-i", f"text={DOC}",
                          "-o", "num_sentences=2"], capture_output=True, text=True, check=True)
    payload = json.loads(out.stdout)
    assert payload["task"] == "summary" and len(payload["result"]["selected"]) == 2
    assert "latency_ms" in payload["provenance"]


def test_the_brief_answer_of_a_long_summary_is_its_first_sentences_and_their_count():
    """All tasks put a 50,000-character paste's whole 175-sentence summary on its card (the browser audit)."""
    from plugins.summary import BRIEF_SENTENCES, brief

    sentences = [{"text": f"Sentence {i}.", "selected": i % 2 == 0} for i in range(20)]
    chosen = [s["text"] for s in sentences if s["selected"]]
    result = {"summary": " ".join(chosen), "sentences": sentences}
    assert brief(result) == " ".join(chosen[:BRIEF_SENTENCES]) + " … (10 of the text's 20 sentences chosen; the Summary tab sets the length)"
    short = {"summary": "Sentence 0. Sentence 2.", "sentences": sentences[:3]}
    assert brief(short) == "Sentence 0. Sentence 2."
    assert brief({"summary": "", "explanation": "no sentence was long enough"}).startswith("no sentence chosen")


def test_a_sentence_repeated_word_for_word_is_picked_once():
    """A paragraph pasted twice: the shipped (hybrid) model scored each copy alike and MMR does not temper its
    scores, so the summary read one sentence seven times (session 58). A repeat is dropped, saying of which."""
    from bert_engine import pipeline

    paragraph = ("The council approved the new budget on Monday after a long debate. Officials said the plan would "
                 "fund schools and roads across the region. Critics argued that local taxes would rise next year. ")
    text = paragraph + paragraph.replace("Officials said", "officials  said").upper().lower().capitalize() + paragraph
    result = pipeline("summary")(text, raw=True)["result"]
    chosen = [result["sentences"][k]["text"].casefold() for k in result["selected"]]
    assert result["selected"] and len(chosen) == len(set(chosen)), chosen
    repeats = [d for d in result["dropped"] if "word for word" in d["reason"]]
    assert [d["index"] for d in repeats] == [3, 4, 5, 6, 7, 8]
    assert repeats[0]["reason"] == "repeats sentence 0 word for word"


def test_mmr_lambda_given_applies_in_every_mode_and_the_result_says_which_was_used():
    """mmr_lambda was taken and ignored outside centroid mode: the shipped model (hybrid) chose the same sentences
    at 0.0 as at 1.0 (session 58). Left out, each mode keeps its own (centroid 0.7; the trained modes none)."""
    from bert_engine import pipeline

    text = ("The council approved the new budget for schools on Monday after a long debate. "
            "On Monday the council approved a new school budget after long debate. "
            "Officials said the plan would also fund roads and bridges across the region. "
            "Critics argued that local taxes would rise sharply next year as a result. "
            "The council approved the budget for the schools on Monday after the debate. "
            "A final vote on the transport plan is expected in the spring.")
    summarise = pipeline("summary")
    default = summarise(text, raw=True, num_sentences=3)["result"]
    assert default["mode"] == "hybrid" and default["mmr_lambda"] == 1.0
    diverse = summarise(text, raw=True, num_sentences=3, mmr_lambda=0.0)["result"]  # redundancy alone after the first
    assert diverse["mmr_lambda"] == 0.0 and diverse["selected"] != default["selected"], (default["selected"],
                                                                                         diverse["selected"])
    assert summarise(text, raw=True, mode="centroid")["result"]["mmr_lambda"] == 0.7
