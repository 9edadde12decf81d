"""QA's unanswerable constructions (plugins/qa_data.py): each edit really removes the answer, the
shares and kinds a split asks for, and the committed antonym list."""

import json

import pytest

from plugins.qa_data import (
    ANTONYMS_FILE,
    CONSTRUCTIONS,
    absent_fact_context,
    antonym_question,
    antonyms,
    construction_report,
    construction_shares,
    number_question,
    read_data,
)

CONTEXT = ("Lyon is the largest city of the region. In 1998 the old bridge was rebuilt by the council, "
           "and in May the market moved north.")


def _answer(text: str, context: str = CONTEXT) -> list[dict]:
    return [{"text": text, "answer_start": context.index(text)}]


def test_the_antonym_list_is_wordnets_with_its_size_stated():
    lines = ANTONYMS_FILE.read_text(encoding="utf-8").splitlines()
    header = [line for line in lines if line.startswith("#")]
    pairs = [line for line in lines if line and not line.startswith("#")]
    assert any("WordNet 3.0" in line for line in header)
    assert any(f"{len(pairs)} pairs" in line for line in header)  # the size the header states is the size
    table = antonyms()
    assert table["largest"] == "smallest" and table["smallest"] == "largest"  # inflected forms, both ways
    assert table["north"] == "south"


def test_an_antonym_swap_needs_the_word_in_the_paragraph_and_its_antonym_absent():
    edited = antonym_question("Which is the largest city of the region?", CONTEXT, _answer("Lyon"), 0)
    assert edited == "Which is the smallest city of the region?"
    both = CONTEXT + " Vals is the smallest."
    assert antonym_question("Which is the largest city of the region?", both, _answer("Lyon", both), 0) is None
    assert antonym_question("Who rebuilt it?", CONTEXT, _answer("the council"), 0) is None  # no antonym pair
    assert antonym_question("Largest city?", CONTEXT, _answer("Lyon"), 0) == "Smallest city?"  # case kept


def test_a_number_swap_picks_a_near_value_the_paragraph_never_says():
    edited = number_question("What was rebuilt in 1998?", CONTEXT, _answer("the old bridge"), 0)
    assert edited is not None and edited != "What was rebuilt in 1998?"
    year = int(edited.split(" in ")[1].rstrip("?"))
    assert 1978 <= year <= 2018 and str(year) not in CONTEXT
    month = number_question("What moved in May?", CONTEXT, _answer("the market"), 0)
    assert month is not None and month.split(" in ")[1].rstrip("?") in ("June", "April", "July", "March")
    # a number inside the answer is what is asked for: never swapped
    assert number_question("When was the bridge rebuilt?", CONTEXT, _answer("1998"), 0) is None


def test_an_absent_fact_context_names_the_entity_but_not_the_answer():
    paragraphs = [{"context": "Lyon was founded by the Romans."},
                  {"context": "Lyon hosts a famous festival of lights in December."},
                  {"context": "Paris is the capital, founded by the Parisii."},
                  {"context": "Lyon's Romans built a theatre."}]
    answers = [{"text": "the Romans", "answer_start": 20}]
    for draw in range(6):
        other = absent_fact_context("Who founded Lyon?", 0, paragraphs, answers, draw)
        assert other == paragraphs[1]["context"]  # names Lyon; the Parisii one does not; the last says the answer
    assert absent_fact_context("who founded it?", 0, paragraphs, answers, 0) is None  # no name to keep on topic


def test_a_split_names_its_constructions_and_shares():
    assert construction_shares("train") == {}
    assert construction_shares("train+negatives:0.1+antonym") == {"negatives": 0.1, "antonym": 0.33}
    with pytest.raises(ValueError, match="adds 'synonym'"):
        construction_shares("train+synonym")
    with pytest.raises(ValueError, match="share of 'numbers' must be a number from 0 to 1, got '1.5'"):
        construction_shares("train+numbers:1.5")


def _squad(tmp_path, contexts_and_questions) -> str:
    paragraphs = [{"context": c, "qas": [{"id": f"q{i}-{k}", "question": q,
                                          "answers": [{"text": a, "answer_start": c.index(a)}]}
                                         for k, (q, a) in enumerate(qs)]}
                  for i, (c, qs) in enumerate(contexts_and_questions)]
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"data": [{"title": "t", "paragraphs": paragraphs}]}))
    return str(path)


def test_every_unanswerable_copy_says_its_kind_and_the_data_is_the_same_every_run(tmp_path):
    questions = [("Which is the largest city of the region?", "Lyon"), ("What was rebuilt in 1998?", "the old bridge"),
                 ("When did the Lyon market move north?", "May")]
    path = _squad(tmp_path, [(CONTEXT, questions * 20), ("Lyon also has a large river port.", [("What does Lyon have?", "a large river port")] * 5)])
    split = "train+" + "+".join(f"{kind}:1" for kind in CONSTRUCTIONS)
    first = list(read_data(path, split))
    assert first == list(read_data(path, split))
    kinds = {target["kind"] for _, target in first if "kind" in target}
    assert {"antonym", "numbers", "negated", "removed", "negatives"} <= kinds
    for _, target in first:
        if "kind" in target:
            assert target["answers"] == [""] and target["starts"] == [-1]
    report = construction_report(path, split, samples=2)
    assert report["counts"]["answerable"]["questions"] == 65
    assert sum(c["questions"] for c in report["counts"].values()) == report["total"] == len(first)
    assert all(len(samples) <= 2 and samples[0]["original"] for samples in report["samples"].values())
