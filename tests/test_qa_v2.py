"""SQuAD 2.0 for the QA task: unanswerable training examples built from SQuAD 1.1, and the official v2 figures."""

import json
import random
from pathlib import Path

import pytest

from plugins.qa_data import NEGATIVE_SHARE, negated_question, read_data
from plugins.qa_metric import best_threshold, cautious_threshold, metric, normalize_answer, v2_scores


def _result(answer: str, gap: float | None, predicted: bool = False) -> dict:
    return {"answer": None if predicted else answer, "answers": [{"answer": answer, "score": 0.5}] if answer else [],
            "no_answer": {"null_gap": gap, "predicted": predicted}}


def _target(*answers: str) -> dict:
    return {"answers": list(answers) or [""], "starts": [0] * len(answers) or [-1]}


def test_best_threshold_is_the_official_find_best_thresh():
    # two answerable (span F1 1.0 and 0.5), two unanswerable; gaps -5, 1 and -2, 3
    results = [_result("Paris", -5.0), _result("in 1889 then", 1.0), _result("London", -2.0), _result("Rome", 3.0)]
    targets = [_target("Paris"), _target("in 1889"), _target(), _target()]
    scores = v2_scores(results, targets)
    # the best: answer only the first (gap -5), say "no answer" to the rest: 1 + 0 + 1 + 1 of 4
    assert scores["best_f1"] == pytest.approx(75.0) and scores["best_f1_thresh"] == -5.0
    assert scores["HasAns_total"] == 2 and scores["NoAns_total"] == 2
    assert scores["NoAns_f1"] == 0.0 and scores["HasAns_exact"] == 50.0  # as predicted: every span answered
    assert best_threshold([(float("inf"), 0.0, 0.0, 1.0)]) == (100.0, -1.0)  # no span at all: no answer


def test_the_honest_threshold_is_tuned_on_one_half_and_scored_on_the_other():
    results = [_result("a", 2.0), _result("b", -1.0), _result("c", 0.5), _result("d", -3.0)]
    targets = [_target(), _target("b"), _target(), _target("d")]
    scores = v2_scores(results, targets)
    assert scores["tuned_threshold"] == -1.0  # from the first two: answer gaps <= -1
    assert scores["heldout_total"] == 2 and scores["heldout_f1"] == pytest.approx(100.0)  # c: none (0.5 > -1); d: d


def test_the_default_threshold_refuses_at_most_the_allowed_share_of_answerable_questions():
    # 20 answerable questions with gaps -20..-1, 4 unanswerable with gaps 0, 5, -30, 2
    scored = [(float(-g), 1.0, 1.0, 0.0) for g in range(20, 0, -1)] + [(g, 0.0, 0.0, 1.0) for g in (0.0, 5.0, -30.0, 2.0)]
    threshold = cautious_threshold(scored, refusal=0.05)
    assert threshold == -2.0  # only the answerable gap -1 exceeds it: 1 of 20 refused
    assert sum(q[0] > threshold for q in scored if not q[3]) == 1
    assert sum(q[0] > threshold for q in scored if q[3]) == 3  # the unanswerable -30 is still answered
    assert cautious_threshold(scored, refusal=0.0) == -1.0  # refuse none
    assert cautious_threshold([(1.0, 0.0, 0.0, 1.0)]) is None  # no answerable question to calibrate on
    results = [_result("a", -4.0), _result("", 3.0), _result("c", -5.0), _result("", 2.0)]
    scores = v2_scores(results, [_target("a"), _target(), _target("c"), _target()])
    assert scores["default_threshold"] == -4.0  # from the first half's answerable gap
    assert scores["default_heldout_HasAns_refused"] == 0.0 and scores["default_heldout_NoAns_caught"] == 1.0


def test_metric_adds_the_v2_figures_only_on_data_with_unanswerable_questions():
    v1 = metric([_result("Paris", -5.0), _result("x", 4.0, predicted=True)], [_target("Paris"), _target("Rome")])
    assert set(v1) == {"exact_match", "f1", "no_answer_rate"}
    assert v1["no_answer_rate"] == 50.0 and v1["f1"] == 50.0  # an answerable question refused scores 0
    v2 = metric([_result("Paris", -5.0), _result("x", 4.0, predicted=True)], [_target("Paris"), _target()])
    assert v2["f1"] == 100.0 and v2["NoAns_f1"] == 100.0 and "best_f1_thresh" in v2


def _squad(path, articles: int = 6, paragraphs: int = 3, questions: int = 4):
    data = {"data": [{"title": f"a{a}", "paragraphs": [
        {"context": f"Paragraph {p} of article {a} says " + " ".join(f"word{a}x{p}q{k}." for k in range(questions)),
         "qas": [{"id": f"{a}-{p}-{q}", "question": f"What does paragraph {p} of {a} say, {q}?",
                  "answers": [{"text": f"word{a}x{p}q{q}", "answer_start": 0}]} for q in range(questions)]}
        for p in range(paragraphs)]} for a in range(articles)]}
    path.write_text(json.dumps(data))
    return path


def test_negatives_pair_a_question_with_another_paragraph_of_its_article(tmp_path):
    path = _squad(tmp_path / "train.json")
    plain = list(read_data(path, "train"))
    mixed = list(read_data(path, "train+negatives"))
    negatives = [(inputs, target) for inputs, target in mixed if target["answers"] == [""]]
    assert len(plain) == 72 and len(mixed) == len(plain) + len(negatives)
    assert abs(len(negatives) / len(plain) - NEGATIVE_SHARE) < 0.15
    by_question = {inputs["question"]: (inputs, target) for inputs, target in plain}
    for inputs, target in negatives:
        original_inputs, original = by_question[inputs["question"]]
        assert inputs["context"] != original_inputs["context"]  # another paragraph ...
        article = original_inputs["context"].split("article ")[1].split(" ")[0]
        assert f"article {article} " in inputs["context"]  # ... of the same article
        assert normalize_answer(original["answers"][0]) not in normalize_answer(inputs["context"])
        assert target["starts"] == [-1]
    assert negatives == [x for x in read_data(path, "train+negatives") if x[1]["answers"] == [""]]  # the same ones


def test_removed_negatives_drop_the_sentence_that_holds_the_answer(tmp_path):
    context = "The Eiffel Tower is in Paris. It was completed in 1889. Gustave Eiffel's company built it."
    when = {"text": "1889", "answer_start": context.index("1889")}
    who = {"text": "Eiffel", "answer_start": context.index("Eiffel's")}  # "Eiffel" is in another sentence too
    qas = [{"id": f"w{k}", "question": f"When was it completed ({k})?", "answers": [when]} for k in range(60)]
    qas += [{"id": f"c{k}", "question": f"Whose company built it ({k})?", "answers": [who]} for k in range(60)]
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}))
    examples = list(read_data(path, "train+removed"))
    negatives = [(inputs, target) for inputs, target in examples if target["answers"] == [""]]
    assert negatives and abs(len(negatives) / 60 - NEGATIVE_SHARE) < 0.15
    for inputs, target in negatives:
        assert inputs["question"].startswith("When was it completed")  # never where the answer's text is left
        assert inputs["context"] == "The Eiffel Tower is in Paris. Gustave Eiffel's company built it."
        assert target["starts"] == [-1]
    # the other-paragraph kind needs a second paragraph; both kinds together are the union
    assert list(read_data(path, "train+negatives+removed")) == examples
    with pytest.raises(ValueError, match=r"adds 'bogus'"):
        list(read_data(path, "train+bogus"))


def test_swapped_negatives_ask_about_a_name_or_number_the_paragraph_never_says(tmp_path):
    first = "Beyonce left Destiny's Child in 2004 and released Dangerously in Love."
    second = "In 2008 Beyonce married Jay Z; Def Jam released her album in 2011."
    when = {"text": "2004", "answer_start": first.index("2004")}
    what = {"text": "Dangerously in Love", "answer_start": first.index("Dangerously")}
    qas = [{"id": f"a{k}", "question": "When did Beyonce leave Destiny's Child?", "answers": [when]}
           for k in range(40)]
    qas += [{"id": f"b{k}", "question": "What did Beyonce release?", "answers": [what]} for k in range(40)]
    other = [{"id": "c", "question": "Whom did Beyonce marry in 2008?",
              "answers": [{"text": "Jay Z", "answer_start": second.index("Jay Z")}]},
             {"id": "d", "question": "Which label released her album in 2011?",
              "answers": [{"text": "Def Jam", "answer_start": second.index("Def Jam")}]}]
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [{"context": first, "qas": qas},
                                                                       {"context": second, "qas": other}]}]}))
    examples = list(read_data(path, "train+swapped"))
    negatives = [(inputs, target) for inputs, target in examples if target["answers"] == [""]]
    assert negatives and abs(len(negatives) / 80 - NEGATIVE_SHARE) < 0.15
    assert all(target["starts"] == [-1] for _, target in negatives)
    negatives = [(inputs, target) for inputs, target in negatives if inputs["context"] != second]
    for inputs, _ in negatives:
        assert inputs["context"] == first  # the same paragraph ...
        # ... asked about a name it never says, in place of one it does (from the article's questions, and
        # its answers that are one name); never the question's first word, never a word of the answer
        assert inputs["question"] in {f"When did {a} leave {b}?" for a, b in (
            ("Jay Z", "Destiny's Child"), ("Def Jam", "Destiny's Child"), ("Beyonce", "Jay Z"), ("Beyonce", "Def Jam"))
        } | {"What did Jay Z release?", "What did Def Jam release?"}, inputs["question"]
    assert len({inputs["question"] for inputs, _ in negatives}) > 1  # the choice varies by question
    assert list(read_data(path, "train+swapped")) == examples  # the same every run
    asked = {qa["question"] for qa in qas + other}  # with the other kind too, the same swapped ones
    assert [x for x in read_data(path, "train+negatives+swapped") if x[0]["question"] not in asked] == [
        x for x in examples if x[0]["question"] not in asked]


@pytest.mark.parametrize(("question", "negated"), [
    ("When did Beyonce leave Destiny's Child?", "When did Beyonce not leave Destiny's Child?"),
    ("Who did the British East India Company hire?", "Who did the British East India Company not hire?"),
    ("Why was he indentured for life?", "Why was he not indentured for life?"),
    ("Where was the Manchester Machine built?", "Where was the Manchester Machine not built?"),
    ("Who was the first president?", "Who was not the first president?"),
    ("Who was Beyonce's first husband?", "Who was not Beyonce's first husband?"),
    ("In what year were the games held?", "In what year were not the games held?"),
    ("How many awards has Boston won?", "How many awards has Boston not won?"),
    ("What did the government ban?", None),  # a lower-case subject: no verb boundary without a parser
    ("What sort of machine did Bell and Gray patent?", None),  # "and" is no verb
    ("Who founded the city?", None),  # no auxiliary or copula
    ("Which team did not win?", None),  # negative already
    ("Why can't it fly?", None),
])
def test_negated_questions_put_not_where_a_writer_would(question, negated):
    assert negated_question(question) == negated


def test_negated_negatives_ask_the_negated_question_over_the_same_paragraph(tmp_path):
    context = "Beyonce left Destiny's Child in 2004. The group was formed in Houston."
    when = {"text": "2004", "answer_start": context.index("2004")}
    where = {"text": "Houston", "answer_start": context.index("Houston")}
    qas = [{"id": f"a{k}", "question": "When did Beyonce leave Destiny's Child?", "answers": [when]} for k in range(40)]
    qas += [{"id": f"b{k}", "question": "Where was the group not formed?", "answers": [where]} for k in range(40)]
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}))
    examples = list(read_data(path, "train+negated"))
    negatives = [(inputs, target) for inputs, target in examples if target["starts"] == [-1]]
    assert negatives and abs(len(negatives) / 40 - NEGATIVE_SHARE) < 0.15  # only the first kind can be negated
    assert {inputs["question"] for inputs, _ in negatives} == {"When did Beyonce not leave Destiny's Child?"}
    assert all(inputs["context"] == context and target["answers"] == [""] for inputs, target in negatives)
    assert len(examples) == 80 + len(negatives) and list(read_data(path, "train+negated")) == examples


def test_squad_v2_unanswerable_questions_read_as_no_answer(tmp_path):
    path = tmp_path / "dev-v2.json"
    path.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [{"context": "Paris is in France.", "qas": [
        {"id": "1", "question": "Where is Paris?", "answers": [{"text": "France", "answer_start": 12}],
         "is_impossible": False},
        {"id": "2", "question": "Where is Rome?", "answers": [], "plausible_answers": [{"text": "France",
                                                                                       "answer_start": 12}],
         "is_impossible": True}]}]}]}))
    (_, first), (_, second) = read_data(path, "dev")
    assert first == {"answers": ["France"], "starts": [12]} and second == {"answers": [""], "starts": [-1]}


def test_a_model_folder_s_calibrated_threshold_is_the_default_of_the_api_and_the_tab(tmp_path, caplog):
    import shutil

    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry
    from plugins.starter import STARTER_ROOT

    folder = tmp_path / "qa"
    shutil.copytree(STARTER_ROOT / "qa", folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["options"] = {"null_threshold": -1000.0, "beam_width": 4}  # any gap exceeds it: always "no answer"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    task = load_registry(entry_points=False).task("qa")
    predictor = Predictor.load(task, str(folder))
    assert predictor.model_options == {"null_threshold": -1000.0} and "beam_width" in caplog.text
    inputs = {"question": "Who wrote the book?", "context": "The book was written by Herman Melville in 1851."}
    calibrated = predictor.predict(inputs)["result"]
    assert calibrated["answer"] is None and calibrated["no_answer"] == {**calibrated["no_answer"], "threshold": -1000.0,
                                                                       "predicted": True}
    assert predictor.predict(inputs, null_threshold=None)["result"]["answer"] == "Herman Melville"  # the caller's own
    broken = tmp_path / "broken"
    shutil.copytree(STARTER_ROOT / "qa", broken)
    (broken / "manifest.json").write_text("{not json")
    assert Predictor.load(task, str(broken)).model_options == {}


def test_a_predictor_built_from_a_loaded_one_keeps_its_calibrated_defaults_when_passed_on():
    from bert_engine.runtime.fast import quantize_int8
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry

    task = load_registry(entry_points=False).task("qa")
    loaded = Predictor.load(task, device="cpu", precision="fp32", pack=False)  # int8 below is CPU-only
    assert loaded.model_options.get("answerability") is not None  # the starter's calibrated verifier
    model = quantize_int8(loaded.model)
    passed_on = Predictor(task, model, loaded.tokenizer, model_id=loaded.model_id, model_options=loaded.model_options)
    inputs = {"question": "Who is the president of France?",
              "context": "Florida is a state in the southeastern United States. Its capital is Tallahassee."}
    verdict = passed_on.predict(inputs)["result"]["no_answer"]
    assert verdict["rule"] == "verifier"
    assert verdict["threshold"] == loaded.model_options["answerability"]["presets"][loaded.model_options["no_answer"]]
    # without them the task's defaults apply (no threshold): the reason the int8 benchmark passes them on
    assert Predictor(task, model, loaded.tokenizer, model_id="m").predict(inputs)["result"]["no_answer"]["rule"] == "none"
    with pytest.raises(ValueError, match=r"\['beam_width'\]"):
        Predictor(task, model, loaded.tokenizer, model_id="m", model_options={"beam_width": 4})


def _v2_file(path, sizes: list[int]) -> None:
    """A SQuAD 2.0 file of articles "a0", "a1", ... holding `sizes` questions each (every other unanswerable)."""
    articles = [{"title": f"a{k}", "paragraphs": [{"context": "Paris is in France.", "qas": [
        {"id": f"{k}-{q}", "question": "Where is Paris?", "is_impossible": bool(q % 2),
         "answers": [] if q % 2 else [{"text": "France", "answer_start": 12}]} for q in range(size)]}]}
        for k, size in enumerate(sizes)]
    path.write_text(json.dumps({"version": "v2.0", "data": articles}))


def test_the_v2_dev_parts_keep_every_training_article_in_the_first_half(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = root / "scripts" / "squad_v2_parts.py"
    dev = tmp_path / "dev-v2.0.json"
    _v2_file(dev, [3, 4, 2, 3, 6, 2])  # 20 questions, half 10: a3 ends at 12, so it straddles the middle
    done = subprocess.run([sys.executable, str(script), str(dev), str(tmp_path / "out"), "--articles", "2"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    titles = {name: [a["title"] for a in json.loads((tmp_path / "out" / name).read_text())["data"]]
              for name in ("dev-v2-train.json", "dev-v2-calibrate.json")}
    assert titles == {"dev-v2-train.json": ["a0", "a1"], "dev-v2-calibrate.json": ["a2"]}  # a3 reaches half B
    heldout = json.loads((tmp_path / "out" / "dev-v2-heldout.json").read_text())["data"]
    assert [qa["id"] for a in heldout for p in a["paragraphs"] for qa in p["qas"]] == \
        ["3-1", "3-2"] + [f"4-{q}" for q in range(6)] + ["5-0", "5-1"]  # questions 10..19: a3's last two on
    v1 = tmp_path / "dev-v1.1.json"
    _v2_file(v1, [1, 1, 1, 1, 1, 1])
    subprocess.run([sys.executable, str(script), str(dev), str(tmp_path / "out"), "--articles", "2", "--v1", str(v1)],
                   check=True, capture_output=True)
    untrained = json.loads((tmp_path / "out" / "dev-v1.1-untrained.json").read_text())["data"]
    assert [a["title"] for a in untrained] == ["a2", "a3", "a4", "a5"]
    # training articles reaching into the second half, or none left to calibrate on: refused, one line naming it
    for articles in ("4", "3"):
        refused = subprocess.run([sys.executable, str(script), str(dev), str(tmp_path / "no"), "--articles", articles],
                                 capture_output=True, text=True)
        assert refused.returncode == 2 and f"--articles {articles}" in refused.stderr
        assert "Traceback" not in refused.stderr and not (tmp_path / "no").exists()


def test_calibration_leaves_out_what_the_model_trained_on(tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "qa_calibrate", Path(__file__).resolve().parents[1] / "scripts" / "qa_calibrate.py")
    calibrate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibrate)
    trained = tmp_path / "train.json"
    _v2_file(trained, [2, 3])
    ids, titles = calibrate.trained_on([trained])
    assert ids == {"0-0", "0-1", "1-0", "1-1", "1-2"} and titles == {"a0", "a1"}
    # the keys follow read_data's order, one per question, so rows and keys pair up
    assert [key for key, _ in calibrate.question_keys(trained)] == ["0-0", "0-1", "1-0", "1-1", "1-2"]
    assert len(list(read_data(trained, "dev"))) == 5


def test_the_long_document_sample_is_seeded_and_split_by_document(tmp_path):
    """The COVID-QA sample of qa_calibrate.py: the same questions every run, and a paper's questions all on one side,
    so the even papers can inform a choice while the odd ones stay held out."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "qa_calibrate", Path(__file__).resolve().parents[1] / "scripts" / "qa_calibrate.py")
    calibrate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibrate)
    papers = tmp_path / "papers.json"
    _v2_file(papers, [3, 4, 2, 5])  # documents 0-3: question ids "<document>-<question>"
    cache = tmp_path / "cache.json"
    cache.write_text(json.dumps([{"answer": "France", "id": k} for k in range(9)]))  # predictions as cached: none run
    halves = calibrate.long_document_sample(None, papers, 9, cache)
    even, odd = halves["papers sample, even documents"], halves["papers sample, odd documents"]
    assert len(even) + len(odd) == 9 and even and odd
    assert calibrate.long_document_sample(None, papers, 9, cache) == halves  # seeded: the same draw again
    # each cached result k answers the k-th drawn question; its document (the id's first part) sets its side
    drawn = sorted(random.Random(0).sample(range(14), 9))
    documents = [int(key.split("-")[0]) for key, _ in calibrate.question_keys(papers)]
    assert {documents[drawn[r["id"]]] % 2 for _, _, r in even} == {0}
    assert {documents[drawn[r["id"]]] % 2 for _, _, r in odd} == {1}


@pytest.mark.parametrize("script, missing", [("qa_calibrate", "squad/dev-v2.0.json"), ("qa_null_auc", "dev-v2.0.json"),
                                             ("qa_cls_verifier", "squad/dev-v2.0.json"),
                                             ("qa_verifier_features", "squad/dev-v2.0.json")])
def test_the_qa_analysis_scripts_name_a_missing_data_file_in_one_line(tmp_path, script, missing):
    """From a checkout without ../shared beside it: one line naming the file, before any model loads (it was a
    FileNotFoundError traceback after the model)."""
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    done = subprocess.run([sys.executable, str(root / "scripts" / f"{script}.py"), "--model", "plugins/starter/qa",
                           "--data", str(tmp_path)], capture_output=True, text=True, cwd=root, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"--data: no {tmp_path / missing} (point --data at the folder that holds {missing})" in done.stderr


def test_the_verifier_probe_fits_on_half_a_and_reports_half_b(monkeypatch):
    """scripts/qa_verifier_probe.py's fit: a column that tells unanswerable questions apart is found by the
    cross-validated regression and scores its AUC on half B; a noise column alone scores about 0.5."""
    import importlib

    import numpy as np

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    probe = importlib.import_module("qa_verifier_probe")
    rng = np.random.default_rng(0)

    def rows(n):
        out, x = [], []
        for i in range(n):
            none = i % 2 == 0
            target = {"answers": [""] if none else ["paris"], "starts": [-1] if none else [0]}
            out.append(({"question": "q", "context": "paris"}, target,
                        {"answers": [{"answer": "paris", "start": 0, "end": 5}]}))
            x.append([float(none) + rng.normal(0, 0.7), rng.normal()])
        return out, np.asarray(x)

    sets = {name: rows(n) for name, n in (("v2", 400), ("v1", 50), ("qed", 50))}
    for name in ("v1", "qed"):  # every one answerable
        sets[name] = ([r for r in sets[name][0] if r[1]["answers"] != [""]],
                      sets[name][1][[r[1]["answers"] != [""] for r in sets[name][0]]])
    told = probe.probe("signal", lambda x: x, sets, half=200)
    noise = probe.probe("noise", lambda x: x[:, 1:], sets, half=200)
    assert told["half_B_auc"] > 0.8 and 0.35 < noise["half_B_auc"] < 0.65, (told, noise)
    assert told["eager"]["answerable refused %"] <= 15 and told["cautious"]["half B F1"] > 70
