"""Our tokenizer against the reference fast tokenizer, plus windows, padding and bad input."""

import random
from pathlib import Path

import pytest
import torch
import transformers

from bert_engine import Tokenizer
from bert_engine.tokenizer import BACKENDS_KEPT

TEXTS = [
    "Hello, world!",
    "Café déjà vu — naïve résumé façade.",
    "北京大学 is in 中国; 東京 too.",
    "Emoji 🤗🚀 and ZWJ 👩‍👩‍👧 families.",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism " + "x" * 150,
    "tabs\tand\nnewlines  and   spaces",
    "Punctuation!!! (nested [brackets] {braces}) 'quotes' \"double\" ... ?!",
    "U.S.A. e-mail 3.14159 $100 50% #hashtag @user",
    "",
    "   ",
    "a literal [MASK] and [SEP] inside text",
    "combining: e\u0301 and zero\u200bwidth and RTL שלום عربي",
]
PAIRS = [("What is BERT?", "BERT is a bidirectional encoder from 2018."),
         ("¿Dónde está?", "Está en 北京 🤗."), ("", "second only"), ("first only", "")]


@pytest.fixture(scope="module")
def ours(minilm_dir):
    return Tokenizer.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def reference(minilm_dir):
    return transformers.AutoTokenizer.from_pretrained(str(minilm_dir))


def _assert_rows_equal(batch, expected, rows):
    for r in range(rows):
        n = int(batch.attention_mask[r].sum())
        assert batch.input_ids[r, :n].tolist() == expected["input_ids"][r]
        assert batch.token_type_ids[r, :n].tolist() == expected["token_type_ids"][r]
        assert [tuple(o) for o in batch.offsets[r]] == [tuple(o) for o in expected["offset_mapping"][r]]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_single_texts_match_reference(ours, reference, text):
    _assert_rows_equal(ours(text), reference([text], return_offsets_mapping=True), 1)


def test_pairs_match_reference(ours, reference):
    firsts, seconds = [p[0] for p in PAIRS], [p[1] for p in PAIRS]
    batch = ours(firsts, seconds)
    _assert_rows_equal(batch, reference(firsts, seconds, return_offsets_mapping=True), len(PAIRS))
    assert batch.sequence_ids[0][0] is None and 1 in batch.sequence_ids[0]


def test_vocab_txt_build_matches_reference_tokenizer_json(minilm_dir, reference):
    from_vocab = Tokenizer.from_vocab(minilm_dir / "vocab.txt", lowercase=True)
    expected = reference(TEXTS, return_offsets_mapping=True)
    _assert_rows_equal(from_vocab(TEXTS), expected, len(TEXTS))


@pytest.mark.parametrize("strategy", ["longest_first", "only_first", "only_second"])
def test_truncation_matches_reference(ours, reference, strategy):
    first, second = "a fairly long question about many things " * 3, "the context " * 40
    if strategy == "only_first":
        first, second = second, first
    batch = ours(first, second, max_length=40, truncation=strategy)
    expected = reference(first, second, max_length=40, truncation=strategy, return_offsets_mapping=True)
    _assert_rows_equal(batch, {k: [v] for k, v in expected.items()}, 1)
    assert batch.truncated == [True]


def test_overflowing_windows_with_stride_match_reference(ours, reference):
    question = "Where did the fox jump?"
    context = " ".join(f"The fox number {i} jumped over fence {i}." for i in range(30))
    batch = ours([question, "short?"], [context, "tiny context"], max_length=48, truncation="only_second",
                 stride=12, return_overflowing=True)
    expected = reference([question, "short?"], [context, "tiny context"], max_length=48, truncation="only_second",
                         stride=12, return_overflowing_tokens=True, return_offsets_mapping=True)
    assert batch.sample_index == expected["overflow_to_sample_mapping"]
    assert len(batch) > 3
    _assert_rows_equal(batch, expected, len(batch))
    assert batch.truncated == [False, False]  # nothing was dropped: it went into windows
    # consecutive windows of the context share `stride` tokens
    first = [t for t, s in zip(batch.input_ids[0].tolist(), batch.sequence_ids[0]) if s == 1]
    second = [t for t, s in zip(batch.input_ids[1].tolist(), batch.sequence_ids[1]) if s == 1]
    assert first[-12:] == second[:12]


def test_offsets_point_into_the_original_text(ours):
    text = "Ünïcödé CAFÉ 北京 🤗 don't"
    batch = ours(text)
    pieces = [text[s:e] for (s, e), seq in zip(batch.offsets[0], batch.sequence_ids[0]) if seq == 0]
    assert pieces == ["Ünïcödé", "CAFÉ", "北", "京", "🤗", "don", "'", "t"]


def test_padding_and_masks(tiny_tokenizer):
    batch = tiny_tokenizer(["the cat sat", "the"], pad_to_multiple_of=8)
    assert batch.input_ids.shape == (2, 8) and batch.input_ids.dtype == torch.int64
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    assert (batch.input_ids[batch.attention_mask == 0] == tiny_tokenizer.pad_token_id).all()
    fixed = tiny_tokenizer("the", padding="max_length", max_length=16)
    assert fixed.input_ids.shape == (1, 16)


def test_special_tokens_and_decode(tiny_tokenizer):
    assert tiny_tokenizer.tokenize("the cat played [MASK]") == ["the", "cat", "[UNK]", "[MASK]"]
    assert tiny_tokenizer.tokenize("The dog sat, unable!") == ["the", "dog", "sat", ",", "un", "##able", "!"]
    ids = tiny_tokenizer("hello world").input_ids[0].tolist()
    assert ids[0] == tiny_tokenizer.token_id("cls_token") and ids[-1] == tiny_tokenizer.token_id("sep_token")
    assert tiny_tokenizer.decode(ids) == "hello world"
    assert tiny_tokenizer.convert_tokens_to_ids(["cat", "zebra"]) == [
        tiny_tokenizer.backend.token_to_id("cat"), tiny_tokenizer.token_id("unk_token")]


def test_lone_surrogates_are_replaced_without_moving_offsets(ours):
    text = "bad \ud800 surrogate"
    batch = ours(text)
    offsets = [o for o, seq in zip(batch.offsets[0], batch.sequence_ids[0]) if seq == 0]
    assert text[slice(*offsets[0])] == "bad"
    assert text[offsets[1][0]:offsets[-1][1]] == "surrogate"


def test_huge_text_is_truncated_and_says_so(ours):
    batch = ours("word " * 200_000)
    assert batch.input_ids.shape == (1, 512) and batch.truncated == [True]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda t: t(123), TypeError, "text must be a string or a list of strings, got int"),
        (lambda t: t(["ok", None]), TypeError, r"text\[1\] must be a string, got NoneType"),
        (lambda t: t([]), ValueError, "text is an empty list"),
        (lambda t: t(["a", "b"], ["c"]), ValueError, "got 2 texts but 1 text pairs"),
        (lambda t: t("a", max_length=2), ValueError, "max_length 2 leaves no room"),
        (lambda t: t("a", stride=100, max_length=20, return_overflowing=True), ValueError, "stride 100 must lie"),
    ],
)
def test_bad_arguments_raise_clear_errors(tiny_tokenizer, call, error, message):
    with pytest.raises(error, match=message):
        call(tiny_tokenizer)


def test_question_too_long_for_only_second(ours):
    with pytest.raises(ValueError, match="cannot tokenise with max_length=16"):
        ours("a very long question " * 10, "context", max_length=16, truncation="only_second")


def test_save_round_trip_and_reference_reads_it(ours, tmp_path):
    ours.save(tmp_path)
    again = Tokenizer.from_pretrained(tmp_path)
    assert again("Café 北京 🤗").input_ids.tolist() == ours("Café 北京 🤗").input_ids.tolist()
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert reference("Café 北京 🤗")["input_ids"] == ours("Café 北京 🤗").input_ids[0].tolist()


def test_missing_tokenizer_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer found"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "vocab.txt").write_text("hello\nworld\n")
    with pytest.raises(ValueError, match="vocabulary lacks the special tokens"):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "vocab.txt", "tokenizer_config.json"])
def test_tokenizer_files_linking_outside_the_folder_are_refused_unread(ours, tmp_path, name):
    folder = tmp_path / "model"
    ours.save(folder)
    if name == "vocab.txt":
        (folder / "tokenizer.json").unlink()  # vocab.txt is read only without a tokenizer.json
    outside = tmp_path / "secret.txt"
    outside.write_bytes((folder / name).read_bytes())
    (folder / name).unlink()
    (folder / name).symlink_to(outside)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        Tokenizer.from_pretrained(folder)
    outside.write_text("[]")
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").write_text("[]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        Tokenizer.from_pretrained(folder)


def test_a_wrong_truncation_value_is_named():
    from bert_engine.checkpoints.hub import default_backbone
    from bert_engine.checkpoints.loader import load_tokenizer

    tokenizer = load_tokenizer(default_backbone())
    with pytest.raises(TypeError, match=r"truncation must be one of 'longest_first'.*got True; for transformers'"):
        tokenizer("hello", truncation=True)
    with pytest.raises(TypeError, match="got 'only_third'"):
        tokenizer("hello", truncation="only_third")
    assert tokenizer("hello", truncation=None).input_ids.shape[0] == 1


def test_word_targets_put_each_word_label_on_its_first_piece(ours):
    """The token-task helper (issue 39): a word's label on its first word piece, -100 on later pieces,
    specials and padding, however the data splits words ("U.S." one word here) and across windows."""
    from bert_engine.tokenizer import whitespace_words

    texts = ["Angela Merkel visited Washingtonville .", "U.S. troops"]
    batch = ours(texts)
    spans = [whitespace_words(t) for t in texts]
    tokens = [ours.convert_ids_to_tokens(batch.input_ids[r].tolist()) for r in range(2)]
    assert tokens[0][:7] == ["[CLS]", "angela", "mer", "##kel", "visited", "washington", "##ville"]
    targets = batch.word_targets(spans, [[1, 2, 0, 3, 0], [3, 0]])
    assert targets[0].tolist() == [-100, 1, 2, -100, 0, 3, -100, 0, -100]
    assert targets[1].tolist()[:6] == [-100, 3, -100, -100, -100, 0]  # "u . s ." is one data word
    assert all(v == -100 for v in targets[1].tolist()[6:])  # [SEP] and padding
    # windows: a long text cut with stride gives each window the first pieces of the words it holds
    long = " ".join(f"word{k}" for k in range(40))
    windows = ours([long], max_length=16, stride=4, return_overflowing=True)
    starts = windows.word_starts([whitespace_words(long)])
    assert len(starts) > 1 and {w for row in starts for _, w in row} == set(range(40))
    for r, row in enumerate(starts):
        pieces = ours.convert_ids_to_tokens(windows.input_ids[r].tolist())
        assert all(not pieces[t].startswith("##") for t, _ in row)


def test_word_starts_read_the_second_text_of_a_pair(ours):
    from bert_engine.tokenizer import whitespace_words

    batch = ours(["Who wrote it?"], ["Herman Melville wrote it ."])
    starts = batch.word_starts([whitespace_words("Herman Melville wrote it .")], sequence=1)
    assert [w for _, w in starts[0]] == [0, 1, 2, 3, 4]
    assert all(batch.sequence_ids[0][t] == 1 for t, _ in starts[0])


def test_stacked_batches_keep_each_part_and_number_the_inputs_in_order(tiny_tokenizer):
    """Batch.stacked: a windowed input (two rows) and a short one become one padded batch; rows, offsets and
    sample_index follow the parts in order, and each part is kept whole."""
    from bert_engine.tokenizer import Batch

    long = tiny_tokenizer("word " * 40, max_length=24, stride=8, return_overflowing=True)
    short = tiny_tokenizer("a short one")
    assert len(long) > 1 and long.input_ids.shape[1] > short.input_ids.shape[1]
    both = Batch.stacked([long, short], tiny_tokenizer.pad_token_id)
    width = long.input_ids.shape[1]
    assert both.input_ids.shape == (len(long) + 1, width) and both.meta["parts"] == [long, short]
    assert both.sample_index == [0] * len(long) + [1] and both.truncated == long.truncated + short.truncated
    n = short.input_ids.shape[1]
    assert both.input_ids[-1, :n].tolist() == short.input_ids[0].tolist()
    assert set(both.input_ids[-1, n:].tolist()) == {tiny_tokenizer.pad_token_id} and both.attention_mask[-1, n:].sum() == 0
    assert both.offsets[-1] == short.offsets[0] + [(0, 0)] * (width - n) and len(both.word_ids[-1]) == width


FAMILY_TOKENIZERS = Path(__file__).parent / "fixtures" / "tokenizers"


@pytest.mark.parametrize("source", ["minilm", "roberta", "albert", "distilbert"])
def test_a_long_text_cut_by_truncation_is_read_from_its_start_with_the_same_tokens(source, minilm_dir, monkeypatch):
    """A truncated text longer than START_CHARS is tokenised from its start in growing pieces (a 1,000,000-
    character text cut to 512 tokens took seconds): the same ids, offsets, word ids and truncated flags as the
    whole text tokenised, on WordPiece, byte-level BPE and Unigram, in a batch beside short texts, at two lengths."""
    from bert_engine import tokenizer as module

    tokenizer = Tokenizer.from_pretrained(minilm_dir if source == "minilm" else FAMILY_TOKENIZERS / source)
    words = " ".join(TEXTS[:8] + TEXTS[10:]).split()
    rng = random.Random(0)
    long_texts = [" ".join(rng.choice(words) for _ in range(n)) for n in (3_000, 40_000)]
    long_texts += ["中" * 30_000, "x" * 20_000 + " tail", "   " * 5_000 + "late start"]  # (one 20,000-character word)
    long_texts += [" ".join(f"{'x' * (k % 40)}{k}" for k in range(2_000))]  # a piece cut ends near the kept tokens
    texts = ["a short one", *long_texts, "another short one"]
    for max_length in (128, 512):
        read = tokenizer(texts, max_length=max_length, truncation="longest_first")
        with monkeypatch.context() as whole_text:
            whole_text.setattr(module, "START_CHARS", 10**9)
            whole = tokenizer(texts, max_length=max_length, truncation="longest_first")
        assert torch.equal(read.input_ids, whole.input_ids) and torch.equal(read.attention_mask, whole.attention_mask)
        assert read.offsets == whole.offsets and read.word_ids == whole.word_ids
        assert read.truncated == whole.truncated and read.truncated[:3] == [False, True, True]
        assert len(read) == len(texts)


def test_calls_with_different_truncation_run_at_once(ours):
    """Each truncation setting has its own copy of the backend, set once: a long text being tokenised does not
    hold a short one with another setting behind a lock (one visitor's 1,000,000 characters held every request of
    the task for seconds; a hostile-visitor audit)."""
    import threading
    import time

    text = "中 " * 400_000  # windows: the whole text is read
    done = threading.Event()

    def heavy():
        ours(text, max_length=128, truncation="longest_first", stride=16, return_overflowing=True)
        done.set()

    worker = threading.Thread(target=heavy)
    worker.start()
    time.sleep(0.05)
    answered_while_heavy = 0
    while not done.is_set():
        ours("a nice film", max_length=512, truncation="longest_first")
        answered_while_heavy += 1
    worker.join()
    assert answered_while_heavy > 10
    assert len(ours._backends) <= BACKENDS_KEPT
    assert ours.backend.truncation is None  # the shared one never truncates (a saved tokenizer.json says none)


@pytest.mark.parametrize("source", ["minilm", "roberta", "albert", "distilbert"])
def test_windows_counted_from_below_never_exceed_the_windows_made(source, minilm_dir):
    """windows_at_least (a text far over a request's window limit refused without tokenising it) is a lower bound
    on every tokenizer kind: texts of words, unknown symbols, CJK, punctuation runs, zero-width characters and
    one long word, alone and as the second text of a pair, at three window lengths and strides."""
    tokenizer = Tokenizer.from_pretrained(minilm_dir if source == "minilm" else FAMILY_TOKENIZERS / source)
    assert tokenizer.counts_words
    rng = random.Random(1)
    words = " ".join(TEXTS).split() + ["©©", "...", "a-b-c", "東京都", "\u200b", "——", "x" * 300, "12,345.6", "e.g.",
                                       "!!!", "\u0301", "\t", "👩‍👩‍👧", "a\x1fb\x1fc", "a\x85b", "\u037a", "\ufe70"]
    texts = [" ".join(rng.choice(words) for _ in range(n)) for n in (5, 400, 3_000, 9_000)]
    texts += ["\u200b " * 2_000 + "word", "!" * 5_000, "中" * 4_000, "x" * 3_000]
    # what the outside check found counted as words: control characters Python reads as space (BERT's normaliser
    # deletes them), letters NFKC / NFKD turn into a space and a mark that stripping accents removes (ALBERT)
    texts += ["a\x1f" * 3_000, "Ada\x1f" * 2_000, "\u037a " * 3_000, "\ufe70 " * 3_000, "a\x85b\x1cc " * 1_000]
    seen = 0
    for text in texts:
        assert tokenizer.words_at_least(text) <= len(tokenizer.tokenize(text))
        for question in (None, "Which river joins the sea?"):
            for max_length, stride in ((64, 0), (128, 60), (384, 128)):
                batch = (tokenizer(text, max_length=max_length, stride=stride, return_overflowing=True)
                         if question is None else
                         tokenizer(question, text, max_length=max_length, truncation="only_second", stride=stride,
                                   return_overflowing=True))
                least = tokenizer.windows_at_least(*([text] if question is None else [question, text]),
                                                   max_length=max_length, stride=stride)
                assert 1 <= least <= len(batch), (text[:40], question, max_length, stride, least, len(batch))
                seen += least > 1
    assert seen >= 10  # the bound is not the trivial 1


def test_no_bound_is_claimed_for_a_tokenizer_that_could_drop_words(minilm_dir, tmp_path):
    """A normaliser rule that removes letters, or a pre-tokeniser that does not split at whitespace: a chunk of
    text may then be no token at all, so no count from below is made (0 words, 1 window: the check after
    tokenising decides). The count itself is linear: a million characters of punctuation, no backtracking."""
    import json
    import shutil

    for name, change in [("letters removed", lambda spec: spec.update(normalizer={
                             "type": "Sequence", "normalizers": [spec["normalizer"], {
                                 "type": "Replace", "pattern": {"String": "e"}, "content": ""}]})),
                         ("a regex rule", lambda spec: spec.update(normalizer={
                             "type": "Replace", "pattern": {"Regex": "[a-z]+"}, "content": ""})),
                         ("no whitespace split", lambda spec: spec.update(pre_tokenizer={"type": "Digits",
                                                                                          "individual_digits": True}))]:
        folder = tmp_path / name.replace(" ", "_")
        shutil.copytree(minilm_dir, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.onnx", "*.h5",
                                                                          "*.ot", "onnx", "openvino"))
        spec = json.loads((folder / "tokenizer.json").read_text())
        change(spec)
        (folder / "tokenizer.json").write_text(json.dumps(spec))
        tokenizer = Tokenizer.from_pretrained(folder)
        assert not tokenizer.counts_words, name
        assert tokenizer.words_at_least("three plain words") == 0
        assert tokenizer.windows_at_least("word " * 100_000, max_length=64) == 1
    ours = Tokenizer.from_pretrained(minilm_dir)
    assert ours.words_at_least("!" * 1_000_000 + " a") == 1 and ours.words_at_least("(a) b. ,,, 1") == 3


@pytest.mark.parametrize("source", ["minilm", "roberta", "albert"])
def test_the_span_around_a_place_holds_every_window_that_can_reach_it(source, minilm_dir):
    """span_around (fill-mask tokenises that part of a long text, not all of it): every run of `tokens` tokens
    that includes the place lies inside the span, on texts with unknown symbols, punctuation runs and CJK."""
    tokenizer = Tokenizer.from_pretrained(minilm_dir if source == "minilm" else FAMILY_TOKENIZERS / source)
    rng = random.Random(2)
    words = " ".join(TEXTS).split() + ["©©", "...", "a-b-c", "東京都", "\u200b", "!!!", "x" * 300]
    text = " ".join(rng.choice(words) for _ in range(6_000))
    pieces = tokenizer.pieces([text])[0]
    offsets = [o for o in pieces.offsets if o[1] > o[0]]
    cut = 0
    for _ in range(40):
        first = rng.randrange(len(offsets))
        last = min(len(offsets) - 1, first + rng.randrange(3))
        tokens = rng.choice([16, 64, 128])
        lo, hi = tokenizer.span_around(text, offsets[first][0], offsets[last][1], tokens)
        assert lo <= offsets[max(0, last - tokens + 1)][0] and offsets[min(len(offsets) - 1, first + tokens - 1)][1] <= hi
        cut += hi - lo < len(text) // 4
    assert cut >= 30  # and it is a small part of the text


def test_every_letter_counted_as_a_word_is_a_token_on_every_tokenizer_kind(minilm_dir):
    """Each of the 33,061 letters and digits words_at_least counts (_KEPT_LETTERS) is at least one token alone and
    between control characters and a combining mark, on WordPiece (MiniLM, DistilBERT), byte-level BPE and Unigram
    with NFKD and stripped accents (ALBERT): a text is never refused for windows it does not need."""
    import re

    from bert_engine.tokenizer import _KEPT_LETTERS

    kept = re.compile(f"[{_KEPT_LETTERS}]")
    letters = [chr(c) for c in range(0x20, 0x10000) if kept.match(chr(c))]
    assert len(letters) == 33_061
    for source in ("minilm", "roberta", "albert", "distilbert"):
        tokenizer = Tokenizer.from_pretrained(minilm_dir if source == "minilm" else FAMILY_TOKENIZERS / source)
        for form in ("{}", "\x1f{}\u0301\x1f"):
            encodings = tokenizer.backend.encode_batch([form.format(c) for c in letters], add_special_tokens=False)
            assert not [c for c, e in zip(letters, encodings) if not e.ids], source
