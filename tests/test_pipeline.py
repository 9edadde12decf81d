"""`bert_engine.pipeline`: any registered task as a callable, shaped like the transformers pipelines and
compared with them on the same weights."""

import pytest
import transformers
from conftest import reference_checkpoint

from bert_engine import pipeline
from bert_engine.hookspecs import InputError
from bert_engine.tasks.registry import load_registry

REVIEWS = ["A gorgeous, witty, seductive movie.", "The plot is predictable and the acting is wooden.", "Fine."]


@pytest.fixture(scope="module")
def sentiment_folder(tmp_path_factory):
    return reference_checkpoint(tmp_path_factory.mktemp("sst"), "BertForSequenceClassification",
                                id2label={0: "NEGATIVE", 1: "POSITIVE"})


def test_text_classification_matches_transformers_on_the_same_weights(sentiment_folder):
    ours = pipeline("text-classification", model=str(sentiment_folder), device="cpu")  # fp32, as theirs
    theirs = transformers.pipeline("text-classification", model=str(sentiment_folder), device="cpu")
    for got, want in zip(ours(REVIEWS), theirs(REVIEWS)):
        assert got["label"] == want["label"] and got["score"] == pytest.approx(want["score"], abs=1e-4)
    one = ours(REVIEWS[0])  # one text: a one-element list, as transformers answers
    assert len(one) == 1 and one[0]["label"] == theirs(REVIEWS[0])[0]["label"]


def test_fill_mask_matches_transformers_on_the_same_weights(tmp_path):
    folder = reference_checkpoint(tmp_path / "mlm", "BertForMaskedLM")
    text = "The capital of France is [MASK]."
    ours = pipeline("fill-mask", model=str(folder), device="cpu", top_k=5)(text)  # fp32, as theirs
    theirs = transformers.pipeline("fill-mask", model=str(folder), device="cpu")(text, top_k=20)
    by_token = {c["token"]: c for c in theirs}
    for candidate in ours:  # the engine leaves out special tokens; every candidate it gives agrees
        want = by_token[candidate["token"]]
        assert candidate["token_str"] == want["token_str"]
        assert candidate["score"] == pytest.approx(want["score"], rel=1e-3)
    assert set(ours[0]) == {"score", "token", "token_str", "sequence"}
    targets = ["paris", "london", "berlin"]
    ours = pipeline("fill-mask", model=str(folder), device="cpu")(text, targets=targets, top_k=2)
    theirs = transformers.pipeline("fill-mask", model=str(folder), device="cpu")(text, targets=targets, top_k=2)
    assert [(c["token"], c["token_str"], c["sequence"].lower()) for c in ours] == [  # theirs: decoded, lowercased
        (c["token"], c["token_str"], c["sequence"]) for c in theirs]
    assert [c["score"] for c in ours] == pytest.approx([c["score"] for c in theirs], rel=1e-3)


def test_token_classification_matches_transformers_simple_aggregation(tmp_path):
    """The real starter NER model merged into one checkpoint, argmax decoding on both sides."""
    from benchmarks.workloads import merged_folder

    folder = merged_folder("ner", tmp_path)
    text = "Angela Merkel met Emmanuel Macron in Paris on Tuesday."
    ours = pipeline("token-classification", model=str(folder), constrained=False)(text)
    theirs = transformers.pipeline("token-classification", model=str(folder), aggregation_strategy="simple",
                                   device="cpu")(text)
    assert [(e["entity_group"], e["word"], e["start"], e["end"]) for e in ours] == [
        (e["entity_group"], text[e["start"]:e["end"]], e["start"], e["end"]) for e in theirs]


def test_question_answering_has_the_v4_pipeline_shape():
    qa = pipeline("question-answering")
    context = "Moby-Dick was written by Herman Melville."
    answer = qa(question="Who wrote Moby-Dick?", context=context)
    assert set(answer) == {"score", "start", "end", "answer"} and answer["answer"] == context[answer["start"]:answer["end"]]
    several = qa({"question": "Who wrote it?", "context": context}, top_k=2)
    assert isinstance(several, list) and len(several) == 2
    batch = qa(question=["Who wrote it?", "What was written?"], context=[context, context])
    assert len(batch) == 2 and all(set(a) == {"score", "start", "end", "answer"} for a in batch)
    stream = qa(iter([{"question": "Who wrote it?", "context": context}, {"question": " ", "context": context}]))
    assert next(stream)["answer"]  # a task answered one input at a time names a bad one's place too
    with pytest.raises(InputError, match="qa: inputs\\[1\\]: the question is empty") as caught:
        next(stream)
    assert caught.value.position == 1


def test_a_refusal_scores_the_probability_that_decided_it():
    """The verifier refuses at its own P(no answer); the answer's score is that, not the span head's null share
    (0.3 % for this one), which read as "almost sure there is an answer" beside a refusal."""
    qa = pipeline("qa", no_answer=0.01)  # refuse whatever the verifier gives over 1 %
    question, context = "Where is Paris?", "Paris is in France."
    raw = qa(question=question, context=context, raw=True)["result"]["no_answer"]
    assert raw["predicted"] and raw["rule"] == "verifier" and raw["probability"] != raw["score"]
    assert qa(question=question, context=context) == {"score": raw["probability"], "start": 0, "end": 0, "answer": ""}
    # the raw null-gap rule decides on the span head's scores, so that is its probability
    by_gap = pipeline("qa", null_threshold=-1000.0)
    gap = by_gap(question=question, context=context, raw=True)["result"]["no_answer"]
    assert by_gap(question=question, context=context)["score"] == gap["score"] and gap["rule"] == "null gap"
    # a preset typed in capitals is that preset, and the result names it as the docs spell it
    assert pipeline("qa", no_answer=" Balanced")(question=question, context=context, raw=True)["result"]["no_answer"][
        "choice"] == "balanced"
    # a probability as text (as the CLI's -o and an MCP client send it) is that probability, not a refused choice
    as_text = pipeline("qa", no_answer="0.01")(question=question, context=context, raw=True)["result"]["no_answer"]
    assert as_text["threshold"] == 0.01 and as_text["predicted"] and as_text["choice"] is None


def test_a_bad_option_value_fails_where_the_pipeline_is_made():
    """QA checks the values that need no tokenizer when the pipeline is made (its check_options hook), and
    again on each call's own options; before, `null_threshold=nan` was refused only at the first call."""
    for bad, named in ((float("nan"), "null_threshold must be a finite number"),
                       ({"null_threshold": None, "no_answer": "sometimes"}, "no_answer must be one of"),
                       ({"top_k": 0}, "top_k")):
        options = bad if isinstance(bad, dict) else {"null_threshold": bad}
        with pytest.raises(InputError, match=named):
            pipeline("qa", **options)
    qa = pipeline("qa")
    with pytest.raises(InputError, match="no_answer must be one of .* got 1.5"):
        qa(question="Where is Paris?", context="Paris is in France.", no_answer=1.5)
    # every built-in task checks its tokenizer-free values there too
    for task, options, named in (("sentiment", {"temperature": float("nan")}, "temperature must be a number"),
                                 ("sentiment", {"long_input": "skim"}, "long_input 'skim'"),
                                 ("ner", {"nbest": 0}, "nbest"), ("ner", {"scheme": "XYZ"}, "scheme 'XYZ'"),
                                 ("fill_mask", {"beam_width": 0}, "beam_width"), ("fill_mask", {"mode": "guess"}, "mode"),
                                 ("summary", {"ratio": 0}, "ratio must lie"), ("summary", {"mmr_lambda": 2}, "mmr_lambda")):
        with pytest.raises(InputError, match=named):
            pipeline(task, **options)
    assert pipeline("ner", nbest=2)("Ada Lovelace lived in London.")  # a good value still answers
    # a bool is not a count, as everywhere else (True was read as a stride of 1: session 57's audit)
    with pytest.raises(InputError, match="stride must be a whole number of tokens, got True"):
        pipeline("sentiment")("A fine film.", stride=True)
    with pytest.raises(InputError, match="doc_stride must be an integer .* got True"):
        qa(question="Where is Paris?", context="Paris is in France.", doc_stride=True)


def test_a_bad_option_fails_before_any_model_loads(monkeypatch):
    """The caller's options are checked against the task's declared ones and its check_options before the
    model loads (2-5 s), not after; a good option still reaches the model."""
    from bert_engine.runtime.inference import Predictor

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded for a pipeline whose options are bad")

    with monkeypatch.context() as patched:
        patched.setattr(Predictor, "load", no_loading)
        with pytest.raises(InputError, match="unknown option"):
            pipeline("sentiment", colour="blue")
        with pytest.raises(InputError, match="top_k"):
            pipeline("qa", top_k=0)
    assert pipeline("sentiment", top_k=2)(REVIEWS[0])[0:2]


def test_lists_generators_options_and_errors():
    classify = pipeline("sentiment", top_k=None)
    texts = (t for t in REVIEWS)  # any iterable: a generator of results
    streamed = classify(texts)
    assert not isinstance(streamed, list) and len(list(streamed)) == 3
    assert len(classify(REVIEWS[0], top_k=2)[0:2]) == 2  # per-call options
    raw = pipeline("sentiment", raw=True)(REVIEWS[0])
    assert {"label", "labels", "long_input"} <= set(raw["result"]) and raw["provenance"]["model"]
    assert classify(REVIEWS[0], raw=True)["result"]["label"] == raw["result"]["label"]  # raw at call time too
    batched = classify(REVIEWS, raw=True)
    assert [r["result"]["label"] for r in batched] == [classify(t)[0]["label"] for t in REVIEWS]
    assert all(r["provenance"]["latency_ms"] > 0 for r in batched)
    pair = classify(("A fine film.", "I agree."), raw=True)  # a (text, text_pair) tuple is one input
    assert pair["result"]["label"] == classify({"text": "A fine film.", "text_pair": "I agree."}, raw=True)["result"]["label"]
    with pytest.raises(InputError, match="unknown option\\(s\\) colour"):
        pipeline("sentiment", colour="red")
    with pytest.raises(KeyError, match="no task named 'translation'; known: .*sentiment-analysis") as unknown:
        pipeline("translation")
    assert str(unknown.value).startswith("no task named")  # as it reads, not in a KeyError's quotes
    with pytest.raises(InputError, match="the text is empty"):
        classify("   ")
    # a bad input in a stream: the answers before it come first, then its error, numbered in the stream
    small = pipeline("sentiment", batch_size=4)
    stream = small(iter([*REVIEWS, "fine", "", "never reached"]))
    got = [next(stream) for _ in range(4)]
    assert got == small([*REVIEWS, "fine"])
    with pytest.raises(InputError, match="^sentiment: inputs\\[4\\]: the text is empty$"):  # (was "input 4: empty or not text")
        next(stream)
    with pytest.raises(TypeError, match="expected text, got bytes; decode it first"):
        classify(b"hello")
    # whichever check finds it (the type, the length limit, a missing field), the stream names its place
    from bert_engine.runtime.inference import MAX_INPUT_CHARS

    for bad, detail in ((5, "each input must be a text"), ("x" * (MAX_INPUT_CHARS + 1), "characters; the limit"),
                        ({"txt": "a"}, "unknown field\\(s\\) txt; the task's: text, text_pair")):
        stream = small(iter([*REVIEWS, "fine", "good", "bad", bad, "never reached"]))
        assert len([next(stream) for _ in range(6)]) == 6
        with pytest.raises(InputError, match=f"inputs\\[6\\]: .*{detail}") as caught:
            next(stream)
        assert caught.value.position == 6


def test_a_model_or_device_that_is_not_there_is_named_before_anything_loads():
    import torch

    with pytest.raises(TypeError, match="the model must be a folder or a Hub id \\(text\\), got int"):
        pipeline("sentiment", model=123)
    with pytest.raises(ValueError, match="the model is empty"):
        pipeline("sentiment", model=" ")
    with pytest.raises(ValueError, match="'cuda:x' is not a device name"):
        pipeline("sentiment", device="cuda:x")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda': (this torch is a CPU build|no CUDA GPU is visible)"):
            pipeline("sentiment", device="cuda")
        with pytest.raises(ValueError, match="device 'cuda:0'"):  # 0 is a device, not "pick one"
            pipeline("sentiment", device=0)
    assert pipeline("sentiment", device=-1).predictor.device.type == "cpu"  # transformers' CPU


def test_every_task_is_reachable_by_name_and_alias():
    registry = load_registry(entry_points=False)
    names = {n for t in registry.tasks.values() for n in (t.spec.name, *t.spec.aliases)}
    import plugins

    assert {module.rsplit(".", 1)[-1] for module in plugins.BUILTIN} <= names  # every built-in, by name
    assert {"question-answering", "fill-mask", "token-classification", "summarization"} <= names  # transformers' names


def test_an_alias_another_task_owns_is_refused():
    import torch

    from bert_engine.hookspecs import TaskSpec, hookimpl

    class Clash:
        @hookimpl
        def register_tasks(self, register):
            register(TaskSpec(name="my_ner", title="Mine", build_head=lambda c: torch.nn.Identity(),
                              preprocess=lambda i, t: t(i["text"]), postprocess=lambda o, b: {},
                              aliases=("token-classification",)))

    registry = load_registry(entry_points=False)
    assert not registry.load_plugin("clash", "0", "test", Clash)
    assert "['token-classification'] are already taken" in registry.failures[-1].message


def test_a_task_whose_plugin_failed_to_load_says_which_plugin_and_why(tmp_path, monkeypatch):
    (tmp_path / "needs_missing.py").write_text("import a_module_nobody_installed  # noqa\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from bert_engine.serving.pipeline import find_task

    registry = load_registry(builtins=("plugins.sentiment", "needs_missing"), entry_points=False)
    with pytest.raises(KeyError, match=r"no task named 'needs_missing' \(plugin needs_missing failed at import: "
                                       r"ModuleNotFoundError.*a_module_nobody_installed"):
        find_task(registry, "needs_missing")
    with pytest.raises(KeyError, match=r"failed at import.*registered: sentiment"):
        registry.task("needs_missing")


def test_pipelines_own_arguments_and_non_text_fields_are_refused_naming_them():
    """batch_size, raw and compile are checked where the pipeline is made (batch_size="abc" failed at the first
    call with a bare TypeError, compile="bogus" ran torch.compile); a field that is not text is a TypeError
    naming it, as a positional input that is not text is."""
    for arguments, message in (({"batch_size": 0}, "batch_size must be an integer in \\[1, 4096\\], got 0"),
                               ({"batch_size": "abc"}, "batch_size must be an integer"),
                               ({"batch_size": 2.5}, "batch_size must be an integer"),
                               ({"compile": "bogus"}, "compile must be True or False, got 'bogus'"),
                               ({"raw": "yes"}, "raw must be True or False, got 'yes'")):
        with pytest.raises(InputError, match=f"^pipeline: {message}"):
            pipeline("sentiment", **arguments)
    ask = pipeline("qa")
    with pytest.raises(InputError, match="raw must be True or False"):
        ask(question="Who?", context="Ann wrote it.", raw=1)
    for value, message in ((42, "input 'question' must be a text or a list of texts, got int"),
                           (b"who", "input 'question' is bytes, not text; decode it first"),
                           ({"a": 1}, "got dict")):
        with pytest.raises(TypeError, match=f"^qa: .*{message}"):
            ask(question=value, context="Ann wrote it.")
    # one question over several contexts (or several over one): the text goes with each row, as in transformers
    many = ask(question="Who wrote it?", context=["Ann wrote it.", "It was written by Bob."])
    assert [a["answer"] for a in many] == ["Ann", "Bob"]
    assert len(ask(question=["Who wrote it?", "Who?"], context="Ann wrote it.")) == 2
    with pytest.raises(InputError, match="lists of the same length .*got question: a list of 2, context: a list of 3"):
        ask(question=["a", "b"], context=["x", "y", "z"])
    for texts in (("Who?", "Ann wrote it.", "extra"), ("Who?",)):  # a tuple is one input's two fields: not a batch
        with pytest.raises(TypeError, match=f"^qa: a tuple of texts is one input's \\(question, context\\), so it "
                                            f"holds two; got {len(texts)}. Give many inputs as a list"):
            ask(texts)
    with pytest.raises(TypeError, match="sentiment: a tuple of texts is one input's \\(text, text_pair\\)"):
        pipeline("sentiment")(("good", "bad", "ugly"))


def test_a_hub_revision_is_loaded_and_a_bad_one_refused(fake_hub, tmp_path, tiny_tokenizer):
    """`pipeline(task, "owner/name", revision=...)` loads that branch from the Hub (a loopback server, named by
    HF_ENDPOINT as a user would), as the CLI's --revision does; a revision that is not text is refused before
    anything loads."""
    import json
    import os
    import subprocess
    import sys

    import torch

    from bert_engine import PRESETS, BertWithHead, save_pretrained

    config = PRESETS["tiny"].with_labels(["NEGATIVE", "POSITIVE"])
    for revision, seed in (("main", 0), ("v2", 1)):
        torch.manual_seed(seed)
        model = BertWithHead(config, "sequence").eval()
        fake_hub.repos[("owner/tiny", revision)] = save_pretrained(model, tmp_path / revision, tiny_tokenizer)
    script = """if True:
        import json, sys
        from bert_engine import pipeline
        out = {}
        for name, model, revision in (("main", "owner/tiny", None), ("v2", "owner/tiny", "v2"),
                                      ("main-local", sys.argv[1] + "/main", None), ("v2-local", sys.argv[1] + "/v2", None)):
            top = pipeline("sentiment", model, revision=revision, device="cpu")("A gorgeous, witty, seductive movie.")[0]
            out[name] = top["score"] if top["label"] == "POSITIVE" else 1 - top["score"]  # P(POSITIVE)
        print(json.dumps(out))
    """
    env = {**os.environ, "HF_ENDPOINT": fake_hub.endpoint, "HF_HUB_CACHE": str(tmp_path / "cache")}
    env.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    scores = json.loads(done.stdout.strip().splitlines()[-1])
    assert scores["main"] == pytest.approx(scores["main-local"], abs=1e-6)
    assert scores["v2"] == pytest.approx(scores["v2-local"], abs=1e-6)
    assert scores["main"] != pytest.approx(scores["v2"], abs=1e-4)
    for bad in (2, "", b"v2"):
        with pytest.raises(TypeError, match="revision must be a Hub branch, tag or commit"):
            pipeline("sentiment", "owner/tiny", revision=bad)


def _labels(answer):
    """A text-classification answer's shape with its labels (lists nest as the pipeline nests them)."""
    return [_labels(a) for a in answer] if isinstance(answer, list) else (answer["label"], sorted(answer))


def _scores(answer) -> list[float]:
    return [s for a in answer for s in _scores(a)] if isinstance(answer, list) else [answer["score"]]


def test_transformers_arguments_are_read_under_the_tasks_own_names(sentiment_folder):
    """Arguments of the transformers pipelines a port brings along (TaskSpec.pipeline_arguments): read as the
    task's own options where the engine has them, accepted where they ask for what it does anyway, refused
    naming what it does instead; where the pipeline is made and per call alike."""
    ours = pipeline("text-classification", model=str(sentiment_folder), device="cpu")
    theirs = transformers.pipeline("text-classification", model=str(sentiment_folder), device="cpu")
    for kwargs in ({"function_to_apply": "sigmoid"}, {"truncation": True}, {"function_to_apply": "none"}):
        got, want = ours(REVIEWS, **kwargs), theirs(REVIEWS, **kwargs)
        assert [g["label"] for g in got] == [w["label"] for w in want]
        assert [g["score"] for g in got] == pytest.approx([w["score"] for w in want], abs=1e-4)
    every = ours(REVIEWS[0], return_all_scores=True)
    assert sorted(label["label"] for label in every) == ["NEGATIVE", "POSITIVE"]
    assert pipeline("sentiment", model=str(sentiment_folder), function_to_apply="sigmoid")(REVIEWS[0])[0]["score"] == \
        pytest.approx(ours(REVIEWS[0], function_to_apply="sigmoid")[0]["score"])
    with pytest.raises(InputError, match="function_to_apply='sigmoid' and function='softmax' ask for different "
                                         "'function'; give one of them"):  # (one of them silently won)
        ours(REVIEWS[0], function_to_apply="sigmoid", function="softmax")
    assert ours(REVIEWS[0], function_to_apply="softmax", function="softmax") == ours(REVIEWS[0])  # the same: fine
    # truncation=False keeps all of a long text: read in windows (it was taken and dropped: the text still cut)
    long = "The acting is wooden but the score is lovely. " * 200
    assert ours(long, truncation=False, raw=True)["result"]["long_input"] == \
        ours(long, long_input="windows", raw=True)["result"]["long_input"]
    assert ours(long, truncation=False, raw=True)["result"]["long_input"]["windows"] > 1
    assert ours(long, truncation=True, raw=True)["result"]["long_input"]["truncated"] is True
    with pytest.raises(InputError, match="truncation=True and long_input='windows' ask for different 'long_input'"):
        ours(long, truncation=True, long_input="windows")
    # top_k=None, given, is every label (transformers' replacement for return_all_scores); left out, the top one
    for kwargs in ({"top_k": None}, {"top_k": 2}, {"top_k": 1}, {}):
        got, want = ours(REVIEWS[0], **kwargs), theirs(REVIEWS[0], **kwargs)
        assert [g["label"] for g in got] == [w["label"] for w in want], kwargs
        assert [g["score"] for g in got] == pytest.approx([w["score"] for w in want], abs=1e-4)
        got, want = ours(REVIEWS, **kwargs), theirs(REVIEWS, **kwargs)  # (a list of texts: nested per text)
        assert _labels(got) == _labels(want) and _scores(got) == pytest.approx(_scores(want), abs=1e-4), kwargs
    assert len(pipeline("sentiment", model=str(sentiment_folder), top_k=None)(REVIEWS[0])) == 2
    with pytest.raises(InputError, match="return_all_scores=True and top_k=1 ask for different 'top_k'"):
        ours(REVIEWS[0], return_all_scores=True, top_k=1)
    with pytest.raises(InputError, match="qa: handle_impossible_answer=False and no_answer='eager' ask for different"):
        pipeline("qa")(question="Who?", context="Bob lives in London.", handle_impossible_answer=False,
                       no_answer="eager")
    # True beside a choice of the verifier's: transformers' rule (the null gap) would silently win over it
    with pytest.raises(InputError, match="qa: handle_impossible_answer=True and no_answer='cautious' ask for different"):
        pipeline("qa")(question="Who?", context="Bob lives in London.", handle_impossible_answer=True,
                       no_answer="cautious")
    with pytest.raises(InputError, match="qa: null_threshold=5.0 refuses .* and no_answer='never' never refuses"):
        pipeline("qa")(question="Who?", context="Bob lives in London.", null_threshold=5.0, no_answer="never")
    # transformers' summarization reads max_length as the generated summary's length; here it was silently the rows'
    # token window: refused under that name (per call or when made), taken under the task's own
    with pytest.raises(InputError, match="summary: max_length= in transformers' summarization it is the generated"):
        pipeline("summarization")("One sentence here. Another one there.", max_length=130)
    with pytest.raises(InputError, match="summary: max_length= in transformers' summarization"):
        pipeline("summarization", max_length=130)
    assert pipeline("summary", max_length=256)("One sentence here. Another one there.")
    with pytest.raises(TypeError, match="qa: give one input, not 2 positional arguments: a \\(question, context\\) tuple"):
        pipeline("qa")("Who wrote it?", "Moby-Dick was written by Herman Melville.")  # transformers v4's form
    with pytest.raises(InputError, match="sentiment: function_to_apply must be one of"):
        ours(REVIEWS[0], function_to_apply="relu")
    with pytest.raises(InputError, match="ner: aggregation_strategy 'max' is not offered: .*'simple'"):
        pipeline("ner", aggregation_strategy="max")
    ask = pipeline("qa")
    plain = ask(question="Who?", context="Bob lives in London.", handle_impossible_answer=True)
    assert plain == ask(question="Who?", context="Bob lives in London.", null_threshold=0.0)  # transformers' rule
    never = ask(question="Who?", context="Bob lives in London.", handle_impossible_answer=False)
    assert never == ask(question="Who?", context="Bob lives in London.", no_answer="never") and never["answer"]
    assert len(ask(question="Who lives in London?", context="Bob lives in London.", topk=2)) == 2
    with pytest.raises(InputError, match="unknown option\\(s\\) not_an_argument"):
        ask(question="Who?", context="Bob.", not_an_argument=1)


def test_a_text_pair_keyword_beside_a_positional_text_and_unknown_fields(sentiment_folder):
    """clf("a text", text_pair="another") was refused as "positionally or as text, text_pair=, not both" (the
    caller gave the first field positionally only); transformers reads it as one pair. A mapping's misspelt field
    was dropped unread; it is refused as `predict --file` and the API refuse it."""
    classify = pipeline("sentiment", model=str(sentiment_folder))
    assert classify("A fine film.", text_pair="I liked it.") == classify(("A fine film.", "I liked it."))
    assert classify(REVIEWS[:2], text_pair=["Yes.", "No."]) == classify([(REVIEWS[0], "Yes."), (REVIEWS[1], "No.")])
    with pytest.raises(TypeError, match="not both \\(got a positional input and text=\\)"):
        classify("A fine film.", text="Another.")
    with pytest.raises(InputError, match="sentiment: unknown field\\(s\\) txt_pair; the task's: text, text_pair"):
        classify({"text": "A fine film.", "txt_pair": "I liked it."})


def test_transformers_dtype_batch_size_and_arguments_no_task_takes(sentiment_folder):
    """dtype= / torch_dtype= pick the precision (a port's `torch_dtype=torch.float32` was "unknown option"),
    batch_size= per call as in transformers, and an argument of transformers' pipelines no task takes is refused
    saying what the engine does instead (it was "unknown option(s) ignore_labels" alone)."""
    import torch

    classify = pipeline("sentiment", model=str(sentiment_folder), dtype=torch.float32)
    assert classify.predictor.provenance()["dtype"] == "float32"
    assert pipeline("sentiment", model=str(sentiment_folder), torch_dtype="auto").predictor.provenance()["dtype"] == \
        "float32"  # (auto on a CPU: fp32)
    with pytest.raises(TypeError, match="torch_dtype=torch.float64 is not a dtype the engine runs"):
        pipeline("sentiment", model=str(sentiment_folder), torch_dtype=torch.float64)
    with pytest.raises(TypeError, match="precision='fp32' and dtype='bfloat16' ask for different precisions"):
        pipeline("sentiment", model=str(sentiment_folder), dtype="bfloat16", precision="fp32")
    assert classify(REVIEWS, batch_size=1) == classify(REVIEWS)
    with pytest.raises(InputError, match="batch_size"):
        classify(REVIEWS, batch_size=0)
    with pytest.raises(InputError, match="ner: ignore_labels= is an argument of transformers' pipelines that "
                                         "bert_engine does not take: the answer lists every entity and never "
                                         "the tokens outside them \\('O'\\); to leave out a type, drop the answers "
                                         "whose 'entity_group' is it"):
        pipeline("ner")("Bob lives in Paris.", ignore_labels=[])
    ner = pipeline("ner")  # transformers' own default, given: what the engine does anyway
    assert ner("Bob lives in Paris.", ignore_labels=["O"]) == ner("Bob lives in Paris.")
    # a port's harmless settings are taken (session 57's fresh-clone trial: trust_remote_code=False was refused)...
    assert pipeline("sentiment", model=str(sentiment_folder), trust_remote_code=False, use_fast=True, framework="pt",
                    tokenizer=None)(REVIEWS[0]) == classify(REVIEWS[0])
    # ...and those it cannot honour say what runs instead (tokenizer= was "unknown option(s) tokenizer")
    for name, value, instead in (("tokenizer", "bert-base-uncased", "holds its tokenizer"),
                                 ("trust_remote_code", True, "no code is loaded from a checkpoint")):
        with pytest.raises(InputError, match=f"{name}= is an argument of transformers' pipelines .*{instead}"):
            pipeline("sentiment", model=str(sentiment_folder), **{name: value})
    # padding changes no answer (rows are masked): taken; a value it does not know is refused, naming the ones taken
    assert classify(REVIEWS[0], padding=True) == classify(REVIEWS[0], padding="max_length") == classify(REVIEWS[0])
    with pytest.raises(InputError, match="padding= takes True, False, 'longest', 'max_length' or 'do_not_pad', got "
                                         "'yes'; rows are padded as the engine batches them"):
        classify(REVIEWS[0], padding="yes")
    # an unknown option lists the transformers arguments the task reads beside its own (truncation was left out)
    with pytest.raises(InputError, match="unknown option\\(s\\) paddin; known: top_k, .*, truncation"):
        classify(REVIEWS[0], paddin=True)


def test_a_text_cut_to_its_first_window_says_so_in_the_log(caplog, monkeypatch):
    import plugins.sentiment as sentiment

    monkeypatch.setattr(sentiment, "_CUT_WARNED", False)
    classify = pipeline("sentiment")
    with caplog.at_level("DEBUG", logger="plugins.sentiment"):
        classify(REVIEWS[0])
        assert not caplog.records  # a text the model reads whole: nothing to say
        long = "The acting is wooden but the score is lovely. " * 200  # about 2,000 tokens; the model reads 512
        assert classify(long)[0]["label"] in {"POSITIVE", "NEGATIVE"}  # the transformers shape, unchanged
        assert classify(long, long_input="windows", raw=True)["result"]["long_input"]["truncated"] is False
        classify([long, long])
    levels = [r.levelname for r in caplog.records]
    assert levels == ["WARNING", "DEBUG", "DEBUG"], levels  # once loudly per process, then quietly
    assert "long_input=\"windows\"" in caplog.records[0].getMessage()


def test_a_packed_folder_names_its_task_when_pipeline_is_given_none(tmp_path):
    """transformers' pipeline(model=...) reads the task from the model; here a packed folder's manifest.json says it
    (it was a bare "missing 1 required positional argument: 'task'")."""
    from plugins.starter import STARTER_ROOT

    folder = STARTER_ROOT / "sentiment"
    assert pipeline(model=str(folder))(REVIEWS[0]) == pipeline("sentiment", model=str(folder))(REVIEWS[0])
    with pytest.raises(TypeError, match=f"the folder '{tmp_path}' does not say which"):
        pipeline(model=str(tmp_path))
    with pytest.raises(TypeError, match="pipeline\\(\\) needs a task"):
        pipeline()
