"""NER: valid tag sequences from a no-CRF checkpoint, CRF save/load, offsets, windows, training data, F1."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import SENTENCES, fit_tiny_model, reference_checkpoint

import plugins.ner as ner
from bert_engine.checkpoints.loader import load, load_pretrained, load_tokenizer
from bert_engine.checkpoints.loading import save_pretrained
from bert_engine.hookspecs import InputError
from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from plugins.ner import NerHead, is_valid, loss, metric, read_data, training_batch, transition_table
from plugins.tagging import allowed_transitions, chunks, convert, entity_scores

FIXTURE = Path(__file__).parent.parent / "fixtures" / "conll_tiny.txt"
BIO = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-ORG", 4: "I-ORG", 5: "B-LOC", 6: "I-LOC", 7: "B-MISC", 8: "I-MISC"}
TEXTS = [
    "Angela Merkel met Emmanuel Macron in Paris to discuss the European Union budget.",
    "Apple opened a new office in Berlin, said Tim Cook on Tuesday.",
    "The U.S. Federal Reserve left rates unchanged; Jerome Powell spoke in Washington D.C. later.",
] + SENTENCES


@pytest.fixture(scope="module")
def task():
    return load_registry(entry_points=False).task("ner")


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory):
    """A BertForTokenClassification saved by transformers: no CRF weights at all.

    Its classifier is re-drawn without a bias so the random argmax varies across words (and breaks BIO).
    """
    from safetensors.torch import load_file, save_file

    folder = reference_checkpoint(tmp_path_factory.mktemp("ner"), "BertForTokenClassification", id2label=BIO)
    state = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    state["classifier.weight"] = torch.randn(state["classifier.weight"].shape, generator=generator) * 3
    state["classifier.bias"] = torch.zeros_like(state["classifier.bias"])
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_no_crf_checkpoint_never_yields_an_invalid_sequence(task, plain_checkpoint):
    predictor = Predictor.load(task, str(plain_checkpoint))
    assert predictor.untrained_head is False  # the CRF is optional: constraint-only transitions
    assert predictor.loaded.report.defaulted == ["head.crf.transitions", "head.crf.start_transitions",
                                                     "head.crf.end_transitions"]
    labels = list(BIO.values())
    invalid_argmax = 0
    for text in TEXTS:
        result = predictor.predict({"text": text})["result"]
        viterbi = [w["tag"] for w in result["words"]]
        argmax = [w["argmax"] for w in result["words"]]
        assert is_valid(viterbi, labels, "BIO"), viterbi
        invalid_argmax += not is_valid(argmax, labels, "BIO")
        assert result["argmax_valid"] == is_valid(argmax, labels, "BIO")
        for path in result["nbest"]:
            assert is_valid(path["tags"], labels, "BIO")
    assert invalid_argmax > 0  # the random head's argmax does break BIO, so the check above has teeth


def test_without_constraints_viterbi_equals_argmax_for_an_untrained_crf(task, plain_checkpoint):
    predictor = Predictor.load(task, str(plain_checkpoint))
    for text in TEXTS[:3]:
        result = predictor.predict({"text": text}, constrained=False)["result"]
        assert [w["tag"] for w in result["words"]] == [w["argmax"] for w in result["words"]]


def test_emissions_match_the_reference_model(task, plain_checkpoint):
    predictor = Predictor.load(task, str(plain_checkpoint))
    reference = transformers.AutoModelForTokenClassification.from_pretrained(str(plain_checkpoint)).eval()
    batch = predictor.tokenizer(TEXTS[0])
    with torch.no_grad():
        ours = predictor.model(**batch.model_inputs()).logits
        theirs = reference(**batch.model_inputs()).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_crf_is_saved_and_loaded_with_the_checkpoint(task, plain_checkpoint, tmp_path):
    model = load_pretrained(plain_checkpoint, NerHead)
    with torch.no_grad():
        model.head.crf.transitions.normal_()
        model.head.crf.start_transitions.normal_()
    save_pretrained(model, tmp_path, load_tokenizer(plain_checkpoint))
    loaded = load(tmp_path, NerHead)
    again = loaded.model
    assert loaded.report.missing == [] and loaded.report.defaulted == []
    torch.testing.assert_close(again.head.crf.transitions, model.head.crf.transitions)
    assert transition_table(again.head)["trained"] is True
    # The reference implementation still reads it as a token-classification checkpoint.
    reference = transformers.AutoModelForTokenClassification.from_pretrained(str(tmp_path)).eval()
    ids = torch.tensor([[101, 7592, 2088, 102]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-4)


def test_entities_and_words_carry_exact_offsets_on_minilm(task, minilm_dir):
    predictor = Predictor.load(task, str(minilm_dir))
    text = "  Dr. Müller visited Zürich — and 東京 — with ACME Corp.\nThen he left. "
    result = predictor.predict({"text": text})["result"]
    assert [w["word"] for w in result["words"]] == ["Dr", ".", "Müller", "visited", "Zürich", "—", "and", "東", "京",
                                                    "—", "with", "ACME", "Corp", ".", "Then", "he", "left", "."]
    for item in result["words"] + result["entities"]:
        key = "word" if "word" in item else "text"
        assert text[item["start"]:item["end"]] == item[key]
        assert 0.0 <= item["score"] <= 1.0
    assert sum(p["probability"] for p in result["nbest"]) <= 1.0 + 1e-6


def test_long_text_windows_cover_every_word_once(task, plain_checkpoint):
    predictor = Predictor.load(task, str(plain_checkpoint))
    words = [f"Name{i % 13}" if i % 5 == 0 else f"word{i % 31}" for i in range(600)]
    text = " ".join(words)
    result = predictor.predict({"text": text}, max_length=48, stride=16)["result"]
    assert result["windows"] > 10
    starts = [w["start"] for w in result["words"]]
    assert starts == sorted(set(starts))
    assert len({w["start"] for w in result["words"] if text[w["start"]:w["end"]] in words}) == len(words)
    spans = [(e["start"], e["end"]) for e in result["entities"]]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlapping entities
    word_starts, word_ends = {w["start"] for w in result["words"]}, {w["end"] for w in result["words"]}
    assert spans and all(start in word_starts and end in word_ends for start, end in spans)  # whole words only


def test_training_batch_tags_the_first_piece_of_every_word(plain_checkpoint):
    tokenizer = load_tokenizer(plain_checkpoint)
    examples = list(read_data(FIXTURE))
    batch, targets = training_batch(examples[:1], tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(batch.input_ids[0].tolist())
    tagged = [(tok, tag) for tok, tag in zip(tokens, targets["tags"][0]) if tag is not None]
    assert ("##kel", None) in list(zip(tokens, targets["tags"][0]))  # later wordpieces are not tagged
    assert tagged == [("angela", "B-PER"), ("mer", "I-PER"), ("visited", "O"), ("the", "O"), ("u", "B-LOC"),
                      (".", "I-LOC"), ("s", "I-LOC"), (".", "I-LOC"), ("on", "O"), ("monday", "O"), (".", "O")]
    assert targets["begins"].tolist() == [True] and targets["ends"].tolist() == [True]


def test_casing_marks_capitalised_words_the_same_in_training_and_prediction(task, minilm_dir):
    tokenizer = load_tokenizer(minilm_dir)
    text = "Angela Merkel visited the U.S. on monday with eBay and NATO."
    batch = ner.preprocess({"text": text}, tokenizer, **{**ner.OPTIONS, "casing": True})
    tokens = tokenizer.convert_ids_to_tokens(batch.input_ids[0].tolist())
    marked = [tok for tok, segment in zip(tokens, batch.token_type_ids[0].tolist()) if segment == 1]
    # every piece of a capitalised word; "." and "ebay" (lower-case first letter) are not
    assert marked == ["angela", "mer", "##kel", "u", "s", "nato"]
    plain = ner.preprocess({"text": text}, tokenizer, **ner.OPTIONS)
    assert plain.token_type_ids.eq(0).all() and torch.equal(plain.input_ids, batch.input_ids)
    # training sees exactly what prediction sees, window by window
    examples = [({"text": text}, {"words": text.split(), "tags": ["O"] * len(text.split())})]
    trained, _ = training_batch(examples, tokenizer, casing=True, max_length=16, stride=4)
    windows = ner.preprocess({"text": text}, tokenizer, **{**ner.OPTIONS, "casing": True, "max_length": 16, "stride": 4})
    assert len(windows) > 1 and torch.equal(trained.token_type_ids, windows.token_type_ids)
    assert training_batch(examples, tokenizer)[0].token_type_ids.eq(0).all()
    # casing_dropout: that share of the training sentences keeps no marks, as if typed in lower case
    many = examples * 200
    dropped, _ = training_batch(many, tokenizer, casing=True, casing_dropout=0.25,
                                generator=torch.Generator().manual_seed(0))
    unmarked = dropped.token_type_ids.eq(0).all(1).float().mean().item()
    full = training_batch(examples, tokenizer, casing=True)[0].token_type_ids[0]
    assert 0.18 < unmarked < 0.32 and dropped.token_type_ids[dropped.token_type_ids.any(1)].eq(full).all()
    # the encoder reads the mark: a model's emissions change with it
    predictor = Predictor.load(task, str(minilm_dir))
    with torch.no_grad():
        on, off = (predictor.model(**b.model_inputs()).logits for b in (batch, plain))
    assert (on - off).abs().amax() > 1e-3
    with pytest.raises(InputError, match="casing must be true or false, got 'yes'"):
        predictor.predict({"text": text}, casing="yes")


def test_loss_trains_a_tiny_model_to_fit_the_fixture(task, minilm_dir):
    tokenizer = load_tokenizer(minilm_dir)
    examples = list(read_data(FIXTURE))
    batch, targets = training_batch(examples, tokenizer)
    model, losses = fit_tiny_model(NerHead, batch, targets, loss, steps=60, lr=1e-2)
    assert losses[-1] < losses[0] * 0.05
    predictor = Predictor(task, model, tokenizer, model_id="fitted")
    results = [predictor.predict(inputs)["result"] for inputs, _ in examples]
    scores = metric(results, [target for _, target in examples])
    assert scores["f1"] == 100.0


def test_read_data_converts_iob1_to_bio():
    examples = list(read_data(FIXTURE))
    lower = list(read_data(FIXTURE, "test+lower"))
    assert [x[1]["tags"] for x in lower] == [x[1]["tags"] for x in examples]
    assert [x[0]["text"] for x in lower] == [x[0]["text"].lower() for x in examples] != [x[0]["text"] for x in examples]
    assert len(examples) == 3
    assert examples[1][1]["tags"][3:5] == ["B-LOC", "B-LOC"]  # IOB1 "I-LOC B-LOC": two adjacent places
    assert examples[1][0]["text"].split() == examples[1][1]["words"]


def test_conlleval_chunks_and_conversions():
    iob1 = "I-ORG O I-PER I-PER B-PER I-LOC I-ORG".split()
    assert chunks(iob1) == [(0, 1, "ORG"), (2, 4, "PER"), (4, 5, "PER"), (5, 6, "LOC"), (6, 7, "ORG")]
    bio = convert(iob1, "BIO")
    assert bio == "B-ORG O B-PER I-PER B-PER B-LOC B-ORG".split()
    assert convert(bio, "IOB1") == iob1
    assert convert(bio, "BIOES") == "S-ORG O B-PER E-PER S-PER S-LOC S-ORG".split()
    assert chunks("O I-PER I-PER O B-LOC I-ORG".split()) == [(1, 3, "PER"), (4, 5, "LOC"), (5, 6, "ORG")]


def test_entity_scores_follow_exact_match_semantics():
    gold = [chunks("B-PER I-PER O B-LOC".split()), chunks("B-ORG O".split())]
    predicted = [chunks("B-PER O O B-LOC".split()), chunks("B-ORG O".split())]  # one boundary error
    scores = entity_scores(gold, predicted)
    assert scores["precision"] == pytest.approx(200 / 3) and scores["recall"] == pytest.approx(200 / 3)
    assert scores["per_type"]["PER"]["f1"] == 0.0 and scores["per_type"]["LOC"]["f1"] == 100.0


def test_bad_input_and_options_name_the_value(task, plain_checkpoint):
    predictor = Predictor.load(task, str(plain_checkpoint))
    with pytest.raises(InputError, match="empty"):
        predictor.predict({"text": "   "})
    with pytest.raises(InputError, match="nbest.*99"):
        predictor.predict({"text": "Paris"}, nbest=99)
    with pytest.raises(InputError, match="scheme 'BILOU'"):
        predictor.predict({"text": "Paris"}, scheme="BILOU")
    # a text far over the window limit: refused from a count of its words, before it is tokenised
    with pytest.MonkeyPatch.context() as untokenised:
        untokenised.setattr(type(predictor.tokenizer), "__call__", lambda *a, **k: pytest.fail("tokenised"))
        with pytest.raises(InputError, match=r"^ner: the text needs at least [\d,]+ windows of \d+ tokens; the limit "
                                             r"is 256"):
            predictor.predict({"text": "Paris " * 160_000})
    with pytest.raises(ValueError, match="'PERSON'"):
        NerHead(predictor.model.config.with_labels(["O", "PERSON"]))


@pytest.mark.parametrize("scheme", ["BIO", "IOB1"])
def test_every_tag_scheme_the_labels_fit_decodes_on_the_starter(task, scheme):
    """A scheme other than the head's builds a CRF copy in the request's inference_mode (it crashed before)."""
    predictor = Predictor.load(task)
    result = predictor.predict({"text": "Tim Cook visited Berlin."}, scheme=scheme)["result"]
    assert result["scheme"] == scheme and len(result["words"]) == 5
    labels = list(predictor.model.head.labels)
    allowed, first, last = allowed_transitions(labels, scheme)
    tags = [labels.index(w["tag"]) for w in result["words"]]
    assert first[tags[0]] and last[tags[-1]] and all(allowed[a, b] for a, b in zip(tags, tags[1:]))
    # IOB1 reads B- as "a second entity of the same type right after one": BIO's B-LOC after O breaks it
    want = ["Tim Cook", "Berlin"] if scheme == "BIO" else ["Tim Cook"]
    assert [e["text"] for e in result["entities"]] == want


def test_a_scheme_the_labels_cannot_be_read_in_is_refused_naming_it(task, tmp_path):
    """BIOES over B-/I- labels could end no entity (every word came back "O", silently); BIO over BIOES labels
    has no reading of E- and S-."""
    with pytest.raises(InputError, match="scheme 'BIOES' does not fit this model's labels"):
        Predictor.load(task).predict({"text": "Tim Cook visited Berlin."}, scheme="BIOES")
    bioes = {0: "O", 1: "B-PER", 2: "I-PER", 3: "E-PER", 4: "S-PER"}
    folder = reference_checkpoint(tmp_path, "BertForTokenClassification", id2label=bioes)
    predictor = Predictor.load(task, str(folder))
    assert predictor.predict({"text": "Tim Cook"})["result"]["scheme"] == "BIOES"
    for scheme in ("BIO", "IOB1"):
        with pytest.raises(InputError, match=f"scheme '{scheme}' does not fit this model's labels"):
            predictor.predict({"text": "Tim Cook"}, scheme=scheme)


def test_cli_predicts_ner_with_provenance(plain_checkpoint):
    out = subprocess.run([sys.executable, "-m", "bert_engine", "predict", "ner", "--model", str(plain_checkpoint),
                          "-i", "text=Tim Cook visited Berlin."], capture_output=True, text=True, check=True)
    payload = json.loads(out.stdout)
    assert payload["task"] == "ner" and payload["provenance"]["model"] == str(plain_checkpoint)
    assert [w["word"] for w in payload["result"]["words"]] == ["Tim", "Cook", "visited", "Berlin", "."]


def test_special_tokens_typed_into_the_text_are_never_entities(task):
    starter = Predictor.load(task)  # the trained starter: it tagged "[MASK]" as a person before
    for text in ("[MASK] lives in Paris with Marie Curie.", "Angela Merkel [SEP] visited [MASK] in Berlin."):
        result = starter.predict({"text": text})["result"]
        assert all("[" not in e["text"] and "]" not in e["text"] for e in result["entities"]), result["entities"]
        assert all(w["word"] not in ("[MASK]", "[SEP]") for w in result["words"])
        assert {e["type"] for e in result["entities"]} & {"PER", "LOC"}  # the real names still are


def test_the_nbest_table_lines_each_path_up_with_the_words():
    result = {"words": [{"word": "Angela"}, {"word": "Merkel"}, {"word": "spoke"}],
              "nbest": [{"tags": ["B-PER", "I-PER", "O"], "probability": 0.9},
                        {"tags": ["B-ORG", "I-ORG", "O"], "probability": 0.05}]}
    table = ner.nbest_table(result)
    assert table["headers"] == ["word", "path 1 (90 %)", "path 2 (5.0 %)"]
    assert table["data"] == [["Angela", "B-PER", "B-ORG"], ["Merkel", "I-PER", "I-ORG"], ["spoke", "O", "O"]]


def test_every_coloured_cell_and_tag_reads_at_4_5_to_1_in_either_theme():
    import re

    from bert_engine import ui

    def rgb(value: str) -> tuple[int, int, int]:
        return tuple(int(value[i:i + 2], 16) for i in (1, 3, 5))

    labels = ["O", "B-PER", "I-PER"]
    table = {"labels": labels, "trained": True,
             "transitions": [[3.0, -2.0, -1e4], [0.5, 1.0, 2.9], [-3.0, 0.01, 1.5]]}
    html = ner.transition_heatmap(table) + ner.render_entities(
        "Angela Merkel visited Paris.", [{"type": "PER", "start": 0, "end": 13, "score": 0.9, "text": "Angela Merkel"}])
    pairs = re.findall(r"background:(#[0-9a-f]{6});color:(#[0-9a-f]{6})", html)
    assert len(pairs) >= 9
    for background, text in pairs:
        assert ui.contrast(rgb(background), rgb(text)) >= 4.5, (background, text)
    assert all("color:" in tag for tag in re.findall(r"<(?:th|sup)[^>]*>", html))  # never the theme's text colour


def test_another_tasks_file_is_named_with_its_line(tmp_path):
    from plugins.tagging import read_conll

    data = tmp_path / "sst.tsv"
    data.write_text("sentence\tlabel\ngood film\t1\n")
    with pytest.raises(ValueError, match=r"sst.tsv:1: tag 'label' is not 'O' or PREFIX-TYPE.*'TOKEN POS CHUNK TAG'"):
        list(read_conll(data))


def test_the_brief_answer_of_many_entities_is_capped_and_counted():
    """All tasks' NER card listed all 242 entities of a long paste (the session-52 check)."""
    from plugins.ner import BRIEF_ENTITIES, brief

    entities = [{"text": f"Paris{i}", "type": "LOC", "score": 0.99} for i in range(BRIEF_ENTITIES + 5)]
    line = brief({"entities": entities})
    assert line.count("(LOC") == BRIEF_ENTITIES and line.endswith("… and 5 more (the Named entities tab shows them all)")
    assert brief({"entities": entities[:2]}) == "Paris0 (LOC 99 %), Paris1 (LOC 99 %)"
    assert brief({"entities": []}) == "no entities found"
