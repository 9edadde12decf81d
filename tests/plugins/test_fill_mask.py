"""Fill-mask: parity with the transformers pipeline, targets, joint beam decoding, bad input."""

import math
from pathlib import Path

import pytest
import torch
import transformers
from conftest import reference_checkpoint

from bert_engine.hookspecs import InputError
from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from bert_engine.tokenizer import Tokenizer
from plugins.fill_mask import candidate_bars, word_piece_blocks
from plugins.starter import STARTER_ROOT

TOKENIZERS = Path(__file__).parents[1] / "fixtures" / "tokenizers"

TEXTS = [
    "The capital of France is [MASK].",
    "She plays the [MASK] in an orchestra, and Ünïcödé 🤗 too.",
    "[MASK] is the first word here.",
]


@pytest.fixture(scope="module")
def task():
    return load_registry(entry_points=False).task("fill_mask")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return reference_checkpoint(tmp_path_factory.mktemp("mlm"), "BertForMaskedLM")


@pytest.fixture(scope="module")
def predictor(task, checkpoint):
    return Predictor.load(task, str(checkpoint), strict=True)


@pytest.fixture(scope="module")
def pipeline(checkpoint):
    return transformers.pipeline("fill-mask", model=str(checkpoint))


def _reference_top(pipeline, text, k, specials):
    """The pipeline's top-k without special tokens (we never propose [CLS], [SEP], [PAD], [MASK])."""
    ranked = pipeline(text, top_k=k + len(specials))
    return [r for r in ranked if r["token"] not in specials][:k]


def test_single_mask_matches_the_reference_pipeline(predictor, pipeline):
    tokenizer = predictor.tokenizer
    specials = {tokenizer.token_id(n) for n in ("cls_token", "sep_token", "pad_token", "mask_token")}
    for text in TEXTS:
        # subwords=True: the reference ranks the whole vocabulary, word pieces included
        ours = predictor.predict({"text": text}, top_k=5, subwords=True)["result"]["predictions"][0]["candidates"]
        theirs = _reference_top(pipeline, text, 5, specials)
        assert [c["token_id"] for c in ours] == [r["token"] for r in theirs]
        for mine, ref in zip(ours, theirs):
            assert mine["score"] == pytest.approx(ref["score"], abs=1e-5)


def test_candidates_complete_the_original_text(predictor):
    result = predictor.predict({"text": TEXTS[1]}, top_k=3)["result"]
    mask = result["predictions"][0]
    assert TEXTS[1][mask["start"]:mask["end"]] == "[MASK]"
    for candidate in mask["candidates"]:
        token = candidate["token"]
        expected = TEXTS[1].replace(" [MASK]", token[2:]) if token.startswith("##") else TEXTS[1].replace("[MASK]", token)
        assert candidate["sequence"] == expected


def test_several_masks_independent_match_the_pipeline_per_mask(predictor, pipeline):
    text = "I [MASK] to the [MASK] to buy some bread."
    tokenizer = predictor.tokenizer
    specials = {tokenizer.token_id(n) for n in ("cls_token", "sep_token", "pad_token", "mask_token")}
    ours = predictor.predict({"text": text}, top_k=3, subwords=True)["result"]["predictions"]
    theirs = pipeline(text, top_k=3 + len(specials))
    assert len(ours) == len(theirs) == 2
    for mine, ref in zip(ours, theirs):
        ref = [r for r in ref if r["token"] not in specials][:3]
        assert [c["token_id"] for c in mine["candidates"]] == [r["token"] for r in ref]


def test_targets_match_the_pipeline_and_split_words_are_said(predictor, pipeline):
    tokenizer = predictor.tokenizer
    words = ["paris", "london", "the"]
    ours = {c["word"]: c for c in predictor.predict({"text": TEXTS[0]}, targets=words)["result"]["candidates"]}
    theirs = {r["token_str"]: r for r in pipeline(TEXTS[0], targets=words)}
    for word in words:
        assert ours[word]["score"] == pytest.approx(theirs[word]["score"], abs=1e-5)
    long_word = "antidisestablishmentarianism"
    pieces = tokenizer.tokenize(long_word)
    assert len(pieces) > 1
    split = predictor.predict({"text": TEXTS[0]}, targets=[long_word])["result"]["candidates"][0]
    assert f"{len(pieces)} word pieces" in split["note"] and 0 < split["score"] < 1
    assert split["sequence"] == TEXTS[0].replace("[MASK]", long_word)
    repeated = predictor.predict({"text": TEXTS[0]}, targets=["paris", " paris ", "london", "paris"])["result"]
    assert [c["word"] for c in repeated["candidates"]] == [c["word"] for c in sorted(
        (ours["paris"], ours["london"]), key=lambda c: -c["score"])]  # a word given twice is scored once
    assert {c["word"]: c["score"] for c in repeated["candidates"]} == {w: ours[w]["score"] for w in ("paris", "london")}
    # one text is comma-separated words, as the tab's box and the CLI's -o targets=paris,london give them
    typed = predictor.predict({"text": TEXTS[0]}, targets="paris, london")["result"]["candidates"]
    assert {c["word"]: c["score"] for c in typed} == {w: ours[w]["score"] for w in ("paris", "london")}
    assert [c["word"] for c in predictor.predict({"text": TEXTS[0]}, targets="paris,")["result"]["candidates"]] == ["paris"]
    with pytest.raises(InputError, match="targets must be a non-empty list of words, got \\[\\]"):
        predictor.predict({"text": TEXTS[0]}, targets=" , ")


def test_joint_beam_with_width_one_is_greedy_left_to_right(predictor):
    text = "I [MASK] to the [MASK] to buy some bread."
    joint = predictor.predict({"text": text}, mode="joint", top_k=1, beam_width=1)["result"]["candidates"][0]
    # greedy: fill the first mask with its best token, re-encode, fill the second
    model, tokenizer = predictor.model, predictor.tokenizer
    batch = tokenizer(text)
    ids = batch.input_ids.clone()
    positions = (ids[0] == tokenizer.mask_token_id).nonzero().squeeze(-1).tolist()
    specials = [tokenizer.token_id(n) for n in ("cls_token", "sep_token", "pad_token", "mask_token")]
    total = 0.0
    chosen = []
    with torch.inference_mode():
        for position in positions:
            encoded = model.encoder(ids, torch.ones_like(ids), torch.zeros_like(ids))  # a plain re-encode, by hand
            log_probs = model.head.logits(encoded.last_hidden_state[0, position]).float().log_softmax(-1)
            log_probs[specials] = -math.inf
            best = int(log_probs.argmax())
            total += float(log_probs[best])
            ids[0, position] = best
            chosen.append(best)
    assert joint["token_ids"] == chosen
    assert joint["score"] == pytest.approx(math.exp(total), rel=1e-4)


def test_joint_beam_ranks_by_joint_probability(predictor):
    text = "I [MASK] to the [MASK] to buy some bread."
    candidates = predictor.predict({"text": text}, mode="joint", top_k=4, beam_width=6)["result"]["candidates"]
    scores = [c["score"] for c in candidates]
    assert scores == sorted(scores, reverse=True) and len(candidates) == 4
    assert all("[MASK]" not in c["sequence"] for c in candidates)
    view = candidate_bars({"mode": "joint", "candidates": candidates})  # the tab: one bar per filling, best first
    assert "All masks together" in view and view.count('class="be-bar"') == 4
    assert view.index(" + ".join(candidates[0]["tokens"])) < view.index(" + ".join(candidates[1]["tokens"]))
    assert view.index('class="be-bar"') < view.index('class="fm-sentence"')  # the answer first, the filling after


def test_mask_far_into_a_long_text_uses_the_window_around_it(predictor):
    text = "filler words here . " * 400 + "The capital of France is [MASK]. " + "more filler . " * 50
    result = predictor.predict({"text": text})["result"]
    assert result["windowed"] is True
    mask = result["predictions"][0]
    assert text[mask["start"]:mask["end"]] == "[MASK]"
    # each candidate's sequence is an excerpt around the mask, not the 8,700-character text again per candidate
    start, end = result["sequence_excerpt"]
    best = mask["candidates"][0]
    assert 0 < start < mask["start"] < mask["end"] < end < len(text) and end - start <= 2 * 2000 + 6
    assert text[start - 1].isspace() and text[end].isspace()  # whole words at both cuts, not a word's end
    assert best["sequence"] == "…" + text[start:mask["start"]] + best["token"] + text[mask["end"]:end] + "…"
    for options in ({"targets": ["paris"]}, {"mode": "joint"}):
        other = predictor.predict({"text": text}, **options)["result"]
        sequences = [c["sequence"] for c in other["candidates"]] if "candidates" in other else []
        assert other["sequence_excerpt"] == [start, end] and all(len(q) < end - start + 20 for q in sequences)
    card = candidate_bars(result)  # the tab shows the filled word with a few hundred characters around it
    shown = card.split('class="fm-sentence"')[1].split(">", 1)[1].split("</p>")[0]
    assert "The capital of France is " + best["token"] in shown and len(shown) < 2 * 240 + 10
    short = predictor.predict({"text": "The capital of France is [MASK]."})["result"]
    assert "sequence_excerpt" not in short and short["predictions"][0]["candidates"][0]["sequence"].startswith("The ")


def test_a_long_texts_excerpt_starts_and_ends_with_whole_words(predictor):
    """The excerpt was cut EXCERPT_CHARS // 2 characters either side of the masks, wherever that fell: it could open
    with the end of a word ("…ller words here")."""
    for lead in ("", "x", "xy ", "abc"):
        text = lead + "filler words here . " * 400 + "The capital of France is [MASK]. " + "more filler . " * 300
        start, end = predictor.predict({"text": text})["result"]["sequence_excerpt"]
        assert text[start - 1].isspace() and text[end].isspace(), (lead, text[start - 5:start + 5], text[end - 5:end + 5])


def test_a_long_texts_window_is_centred_on_its_masks_whether_the_text_was_cut_or_not(predictor):
    """A text longer than one window is read in the window with its masks in the middle: the same window, so the same
    answer, for a text of 14,000 characters and for one of 97,000 (cut to a region around the masks first). Windows
    of half overlap aligned from where the region began gave a mask at the end 309 tokens of left context cut and 495
    uncut (RoBERTa, an audit in session 55)."""
    from plugins import fill_mask

    head = "Some words written before it . " * 300
    tail = "The capital of France is [MASK]. " + "more filler words here . " * 300
    short, long_ = head + tail, head * 12 + tail
    assert len(short) < fill_mask.REGION_CHARS < len(long_)
    answers = [predictor.predict({"text": text}, top_k=5)["result"] for text in (short, long_)]
    assert all(answer["windowed"] for answer in answers)
    (a,), (b,) = (answer["predictions"] for answer in answers)
    assert [c["token"] for c in a["candidates"]] == [c["token"] for c in b["candidates"]]
    assert [c["score"] for c in a["candidates"]] == pytest.approx([c["score"] for c in b["candidates"]], abs=1e-5)
    spec, options = predictor.task.spec, predictor.check_options({})
    for text in (short, long_, head + "The capital of France is [MASK]."):  # centred; at the end, all before it
        batch = spec.preprocess({"text": text}, predictor.tokenizer, **options)
        row = batch.input_ids[0].tolist()
        at = row.index(predictor.tokenizer.mask_token_id)
        assert len(row) == 512 and (abs(at - 255) <= 8 if text != text.split("[MASK]")[0] + "[MASK]." else at >= 505), at


@pytest.mark.parametrize("family", ["roberta", "albert"])
def test_the_centred_window_is_the_same_cut_or_not_for_other_tokenizers(task, family):
    """Byte-level BPE (a word's piece carries its leading space) and SentencePiece: the row read around a mask far
    into a text is the same for the whole text and for the text cut first."""
    from bert_engine.runtime.inference import check_task_options

    tokenizer = Tokenizer.from_pretrained(TOKENIZERS / family)
    mask = tokenizer.mask_token
    head, tail = "Some words written before it. " * 300, f"The capital of France is {mask}. " + "More words. " * 400
    options = check_task_options(task.spec, {})
    rows = [task.spec.preprocess({"text": text}, tokenizer, **options).input_ids[0].tolist()
            for text in (head + tail, head * 12 + tail)]
    assert rows[0] == rows[1] and len(rows[0]) == 512
    assert abs(rows[0].index(tokenizer.mask_token_id) - 255) <= 8


def test_a_very_long_text_is_tokenised_only_around_its_masks(predictor, monkeypatch):
    """Past REGION_CHARS the text is cut, from counted words, to the part a window holding the masks can reach
    before it is tokenised (1,000,000 characters took 1.2 s to tokenise whole for the one window read); offsets,
    excerpt and sequences still refer to the whole text. Masks far apart are still refused by name."""
    from bert_engine.tokenizer import Tokenizer
    from plugins import fill_mask

    text = "filler words here . " * 4_000 + "The capital of France is [MASK]. " + "more filler . " * 4_000
    assert len(text) > fill_mask.REGION_CHARS
    read = []
    plain = Tokenizer.__call__
    monkeypatch.setattr(Tokenizer, "__call__", lambda self, t, *a, **k: read.append(len(t)) or plain(self, t, *a, **k))
    result = predictor.predict({"text": text})["result"]
    assert read and max(read) < 12_000, read  # about 512 counted words either side, not 136,000 characters
    mask = result["predictions"][0]
    assert result["windowed"] is True and text[mask["start"]:mask["end"]] == "[MASK]"
    start, end = result["sequence_excerpt"]
    best = mask["candidates"][0]
    assert best["sequence"] == "…" + text[start:mask["start"]] + best["token"] + text[mask["end"]:end] + "…"
    joint = predictor.predict({"text": text.replace("is [MASK]", "is [MASK] [MASK]")}, mode="joint")["result"]
    assert joint["sequence_excerpt"][0] > 70_000 and joint["candidates"]
    with pytest.raises(InputError, match="further apart than 512 tokens"):
        predictor.predict({"text": "[MASK] " + text + "[MASK]"})


@pytest.mark.parametrize(
    ("text", "options", "message"),
    [
        ("no mask here", {}, "has no \\[MASK\\] token"),
        ("", {}, "the text is empty; type a sentence with \\[MASK\\]"),
        (" \n\t", {}, "the text is empty"),
        ("[MASK] " * 6, {}, "has 6 \\[MASK\\] tokens; at most 5 are allowed \\(the option max_masks raises that, up to 50: max_masks= in "
         "Python and the API, -o max_masks=N on the command line\\)"),
        ("a [MASK] b [MASK]", {"targets": ["x"]}, "targets work with exactly one"),
        ("a [MASK]", {"top_k": 0}, "top_k must be an integer in \\[1, 100\\]"),
        ("a [MASK]", {"mode": "greedy"}, "mode 'greedy' is not one of"),
        ("[MASK] " + "word " * 800 + "[MASK]", {}, "further apart than 512 tokens"),
        ("a [MASK]", {"max_masks": "abc"}, "max_masks must be an integer in \\[1, 50\\], got 'abc'"),
        ("a [MASK]", {"max_masks": 10**12}, "max_masks must be an integer in \\[1, 50\\]"),
        ("a [MASK]", {"max_masks": float("nan")}, "max_masks must be an integer"),
        (" ".join(["word [MASK]"] * 30), {"mode": "joint", "max_masks": 50, "beam_width": 64, "top_k": 100},
         "mode joint over 30 masks re-reads the text's 62 tokens up to 100 times a mask .* 179,862 tokens of work; "
         "the limit per request is 65,536"),
        ("Paris is the [MASK].", {"targets": ["\U0001F60D", "paris", "\U0001F642"]},
         "the targets '\U0001F60D', '\U0001F642' are not in the model's vocabulary \\(read as \\[UNK\\]\\)"),
        # no word piece at all: a product over no masks scored 1.0, first among the words (an outside test)
        ("Paris is the [MASK].", {"targets": ["\u200b", "paris"]}, "the target '\\\\u200b' holds no word piece"),
        ("Paris is the [MASK].", {"targets": ["paris", "\u0301"]}, "the target '\\\\u0301' holds no word piece"),
        ("Paris is the [MASK].", {"targets": ["[MASK]"]}, "the target '\\[MASK\\]' is a special token of the model"),
    ],
)
def test_bad_input_is_a_clear_input_error(predictor, text, options, message):
    with pytest.raises(InputError, match=message):
        predictor.predict({"text": text}, **options)


def test_spellings_of_one_target_are_scored_once(predictor):
    # an uncased model reads Paris, paris and PARIS as one piece: one candidate, under the first spelling given
    assert predictor.tokenizer.tokenize("PARIS") == predictor.tokenizer.tokenize("paris")
    result = predictor.predict({"text": TEXTS[0]}, targets=["paris", "Paris", "PARIS", "city"])["result"]
    assert sorted(c["word"] for c in result["candidates"]) == ["city", "paris"]


def _same_answer(a, b, where="result"):
    """Equal but for the last digits of scores (a batch pads rows, so sums round in another order)."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _same_answer(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_answer(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-7), where
    else:
        assert a == b, where


@pytest.mark.parametrize("options", [{}, {"mode": "joint", "beam_width": 3}, {"targets": ["paris", "london"]}])
def test_a_list_is_answered_in_one_batch_as_each_text_alone(predictor, options):
    """predict_many (files, pipeline lists, a Space's merged requests) pads the texts into one forward
    pass and reads every mask's logits in one pass of the head: the same answers as one request each."""
    from bert_engine.runtime.inference import predict_texts

    texts = [*TEXTS, "filler words here . " * 300 + "The capital of France is [MASK]. ", "Short [MASK]."]
    if "targets" not in options:
        texts.append("The [MASK] of France is [MASK] and the [MASK] river runs through it.")
    alone = [predictor.predict({"text": t}, **options)["result"] for t in texts]
    calls = []
    head = predictor.model.head
    original = head.logits
    head.logits = lambda hidden: calls.append(hidden.shape[0]) or original(hidden)
    try:
        batched = predict_texts(predictor, texts, batch_size=len(texts), **options)
    finally:
        del head.logits
    assert len(batched) == len(texts)
    for one, many in zip(alone, batched):
        _same_answer(one, many)
    if not options:  # independent: one pass of the head per batch (the long text runs in a batch of its own)
        assert sum(calls) == sum(t.count("[MASK]") for t in texts) and len(calls) == 2, calls
    with pytest.raises(InputError, match="fill_mask: inputs\\[1\\]: the text has no \\[MASK\\] token"):
        predict_texts(predictor, [TEXTS[0], "no mask here"], batch_size=2, **options)


def test_a_bad_text_in_a_long_list_or_a_stream_is_named_by_its_place_in_the_callers_list(predictor):
    """Lists longer than a batch are sorted by length and split, streams are cut into batch_size chunks:
    the error still names the text's own position, not its place in the batch it landed in."""
    from bert_engine.runtime.inference import predict_texts
    from bert_engine.serving.pipeline import Pipeline

    texts = [f"{'Some words here. ' * (i % 7)}The capital of France is [MASK]." for i in range(40)]
    texts[37] = "no mask here"
    with pytest.raises(InputError, match="^fill_mask: inputs\\[37\\]: the text has no \\[MASK\\] token"):
        predict_texts(predictor, texts, batch_size=8)
    stream = Pipeline(predictor, batch_size=4)
    with pytest.raises(InputError, match="^fill_mask: inputs\\[37\\]: the text has no \\[MASK\\] token"):
        list(stream(iter(texts)))
    assert len(list(stream(iter(texts[:37])))) == 37


def test_loads_from_a_hub_id_served_locally(task, checkpoint, fake_hub, tmp_path):
    fake_hub.repos[("owner/mlm", "main")] = checkpoint
    hub = Predictor.load(task, "owner/mlm", endpoint=fake_hub.endpoint, cache_dir=tmp_path / "cache")
    local = Predictor.load(task, str(checkpoint))
    assert hub.predict({"text": TEXTS[0]})["result"] == local.predict({"text": TEXTS[0]})["result"]


def test_minilm_encoder_with_a_fresh_head_gives_valid_offsets(task, minilm_dir):
    predictor = Predictor.load(task, str(minilm_dir))  # MiniLM ships no MLM head: a fresh one, said in the provenance
    text = "Ünïcödé 🤗 and a [MASK] in 北京."
    output = predictor.predict({"text": text}, top_k=3)
    mask = output["result"]["predictions"][0]
    assert text[mask["start"]:mask["end"]] == "[MASK]" and len(mask["candidates"]) == 3
    assert output["provenance"]["untrained_head"] is True


# -- whole-word masks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["distilbert", "roberta", "albert"])
def test_only_a_mask_standing_alone_blocks_word_pieces(family):
    tokenizer = Tokenizer.from_pretrained(TOKENIZERS / family)
    mask = tokenizer.mask_token
    text = f"It was a {mask}. Un{mask}able, {mask}ly and ({mask})."
    spans, start = [], 0
    while (start := text.find(mask, start)) >= 0:
        spans.append((start, start + len(mask)))
        start += len(mask)
    blocked = dict(word_piece_blocks(tokenizer, text, spans))
    # "a <mask>." is a whole word, "(<mask>)" too where punctuation splits words (WordPiece); never parts
    # of a word ("Un<mask>able", " <mask>ly")
    assert set(blocked) == ({0, 3} if tokenizer.kind == "WordPiece" else {0})
    pieces = set(tokenizer.convert_ids_to_tokens(blocked[0].tolist()))
    assert pieces and not any(tokenizer.starts_word(p) for p in pieces)
    words = {t for t in tokenizer.backend.get_vocab() if tokenizer.starts_word(t)}
    assert not pieces & words


@pytest.mark.skipif(not (STARTER_ROOT / "fill_mask" / "manifest.json").is_file(), reason="no fill-mask starter")
def test_the_starter_never_offers_a_word_piece_for_a_whole_word_unless_asked():
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry

    predictor = Predictor.load(load_registry(entry_points=False).task("fill_mask"))
    # The model sees no spaces: after "play" it wants "##s" most of all, which a mask standing alone must not get.
    for text in ("It was a dark and stormy [MASK].", "The play [MASK] were tired after the game."):
        tokens = [c["token"] for c in predictor.predict({"text": text}, top_k=100)["result"]["predictions"][0]["candidates"]]
        assert len(tokens) == 100 and not any(t.startswith("##") for t in tokens), text
    asked = predictor.predict({"text": "The play [MASK] were tired after the game."}, top_k=5,
                              subwords=True)["result"]["predictions"][0]["candidates"]
    assert any(c["token"].startswith("##") for c in asked)  # "##s", "##men", "##rs" rank first when allowed


def test_whole_word_training_masks_every_piece_of_a_chosen_word(predictor):
    from plugins.fill_mask import training_batch

    tokenizer = predictor.tokenizer
    text = "unbelievably " * 15  # inside max_length: the batch is not cut
    pieces = tokenizer.pieces([text])[0].tokens
    assert len([p for p in pieces if p.startswith("##")]) > 10  # the word really splits into pieces
    examples = [({"text": text}, None)] * 4
    for whole, expect_partial in ((True, False), (False, True)):
        batch, labels = training_batch(examples, tokenizer, generator=torch.Generator().manual_seed(0),
                                       mlm_prob=0.3, whole_word=whole)
        continuation = torch.tensor([[t.startswith("##") for t in tokenizer.convert_ids_to_tokens(row.tolist())]
                                     for row in tokenizer([text] * 4).input_ids])
        labelled = labels != -100
        starts = labelled & ~continuation
        partial = False
        for row in range(4):
            word_start = None
            for t in range(labels.shape[1]):
                if not continuation[row, t]:
                    word_start = t
                elif word_start is not None and labelled[row, t] != labelled[row, word_start]:
                    partial = True
        assert starts.any()
        assert partial == expect_partial


def test_whole_words_are_drawn_from_words_only_and_reproducibly():
    from plugins.fill_mask_words import draw_words

    passages = ["The cat , sat @-@ on 42 mats .", "Dogs bark ; loudly !"]
    items = draw_words(passages, 100, seed=0)
    assert sorted(word for _, word in items) == sorted(["The", "cat", "sat", "on", "42", "mats", "Dogs", "bark",
                                                          "loudly"])  # every word once, no punctuation or "@-@"
    assert all(text.count("[MASK]") == 1 for text, _ in items)
    assert ("The cat , sat @-@ on 42 [MASK] .", "mats") in items
    assert draw_words(passages, 3, seed=5) == draw_words(passages, 3, seed=5) != draw_words(passages, 3, seed=6)


@pytest.mark.skipif(not (STARTER_ROOT / "fill_mask" / "manifest.json").is_file(), reason="no fill-mask starter")
def test_whole_word_scores_count_what_the_tab_answers_per_kind():
    from plugins.fill_mask import evaluate
    from plugins.fill_mask_words import kind_of, score_words

    predictor = Predictor.load(load_registry(entry_points=False).task("fill_mask"))

    def five(text):
        return [c["token"] for c in predictor.predict({"text": text}, top_k=5)["result"]["predictions"][0]["candidates"]]

    night, week, tea = ("It was a dark and stormy [MASK].", "A week has seven [MASK].", "She drank a cup of hot [MASK].")
    items = [(night, five(night)[0]),             # the model's first guess
             (week, five(week)[4].upper()),       # its fifth, not its first (case ignored)
             (tea, "lava"),                       # none of its five
             ("She drank a cup [MASK] hot tea.", "of")]  # a function word
    assert "lava" not in five(tea) and all(kind_of(w) == "content" for _, w in items[:3])
    scores = score_words(predictor, items)
    assert scores["content"] == {"words": 3, "top1": 1 / 3, "top5": 2 / 3}
    assert scores["function"]["words"] == 1 and scores["all"]["words"] == 4
    assert scores["all"]["top1"] == pytest.approx((1 + scores["function"]["top1"]) / 4)
    # evaluate reports them beside the token-level figures, drawn from its own passages
    figures = evaluate(predictor, [({"text": "It was a dark and stormy night and the rain fell in torrents ."}, None)],
                       words=5)
    assert figures["words"] == 5 and figures["content_words"] + figures["function_words"] == 5
    assert 0 <= figures["content_top1"] <= figures["content_top5"] <= 1 and "top1" in figures
    assert "words_top1" not in evaluate(predictor, [({"text": "It was a dark and stormy night ."}, None)], words=0)


def test_the_whole_word_script_names_a_missing_data_file_in_one_line(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).parents[2] / "scripts" / "fill_mask_whole_words.py"
    done = subprocess.run([sys.executable, str(script), "--data", str(tmp_path / "absent.tokens")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"no text file or folder at {tmp_path / 'absent.tokens'}" in done.stderr
