"""RoBERTa, ALBERT and DistilBERT: parity with transformers on identical weights, both ways.

Random tiny configs with odd sizes (hidden 36 over 4 heads of 9, intermediate 37, ALBERT's embeddings 20
wide and its layers shared in groups), every head each family has, both attention backends, padded rows.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import randomised

from bert_engine import BertConfig, BertModel, BertWithHead, load_pretrained, save_pretrained
from bert_engine.checkpoints.loading import CheckpointError
from bert_engine.tokenizer import Tokenizer
from bert_engine.training.pretraining import continuation_mask, mask_tokens

T = transformers
FAMILIES = {
    "roberta": dict(
        config=lambda **kw: T.RobertaConfig(vocab_size=101, hidden_size=36, num_hidden_layers=3, num_attention_heads=4,
                                            intermediate_size=37, max_position_embeddings=42, type_vocab_size=1,
                                            pad_token_id=1, bos_token_id=0, eos_token_id=2, **kw),
        ours=BertConfig(model_type="roberta", vocab_size=101, hidden_size=36, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=37, max_position_embeddings=42, type_vocab_size=1, pad_token_id=1,
                        layer_norm_eps=1e-5),
        heads={None: (T.RobertaModel, [("last_hidden_state", "last_hidden_state"), ("pooled", "pooler_output")]),
               "mlm": (T.RobertaForMaskedLM, [("logits", "logits")]),
               "sequence": (T.RobertaForSequenceClassification, [("logits", "logits")]),
               "token": (T.RobertaForTokenClassification, [("logits", "logits")]),
               "span": (T.RobertaForQuestionAnswering, [("start_logits", "start_logits"), ("end_logits", "end_logits")])},
    ),
    "albert": dict(
        config=lambda **kw: T.AlbertConfig(**{**dict(vocab_size=101, embedding_size=20, hidden_size=36,
                                                     num_hidden_layers=4, num_hidden_groups=2, inner_group_num=1,
                                                     num_attention_heads=4, intermediate_size=37,
                                                     max_position_embeddings=40, type_vocab_size=2, pad_token_id=0,
                                                     hidden_act="gelu_new"), **kw}),
        ours=BertConfig(model_type="albert", vocab_size=101, embedding_size=20, hidden_size=36, num_hidden_layers=4,
                        num_hidden_groups=2, inner_group_num=1, num_attention_heads=4, intermediate_size=37,
                        max_position_embeddings=40, hidden_act="gelu_new"),
        heads={None: (T.AlbertModel, [("last_hidden_state", "last_hidden_state"), ("pooled", "pooler_output")]),
               "mlm": (T.AlbertForMaskedLM, [("logits", "logits")]),
               "pretraining": (T.AlbertForPreTraining, [("mlm_logits", "prediction_logits"),
                                                        ("nsp_logits", "sop_logits")]),
               "sequence": (T.AlbertForSequenceClassification, [("logits", "logits")]),
               "token": (T.AlbertForTokenClassification, [("logits", "logits")]),
               "span": (T.AlbertForQuestionAnswering, [("start_logits", "start_logits"), ("end_logits", "end_logits")])},
    ),
    "distilbert": dict(
        config=lambda **kw: T.DistilBertConfig(vocab_size=101, dim=36, n_layers=3, n_heads=4, hidden_dim=37,
                                               max_position_embeddings=40, pad_token_id=0, **kw),
        ours=BertConfig(model_type="distilbert", vocab_size=101, hidden_size=36, num_hidden_layers=3,
                        num_attention_heads=4, intermediate_size=37, max_position_embeddings=40, type_vocab_size=0),
        heads={None: (T.DistilBertModel, [("last_hidden_state", "last_hidden_state")]),
               "mlm": (T.DistilBertForMaskedLM, [("logits", "logits")]),
               "sequence": (T.DistilBertForSequenceClassification, [("logits", "logits")]),
               "token": (T.DistilBertForTokenClassification, [("logits", "logits")]),
               "span": (T.DistilBertForQuestionAnswering, [("start_logits", "start_logits"), ("end_logits", "end_logits")])},
    ),
}
CASES = [(family, head) for family, spec in FAMILIES.items() for head in spec["heads"]]
IDS = [f"{family}-{head}" for family, head in CASES]


def _batch(family: str) -> tuple[dict, dict]:
    """Padded rows (13, 9, 4 and 1 real tokens) for our model and for the reference (DistilBERT's takes no
    segment ids; RoBERTa has one segment and pads with id 1)."""
    pad = 1 if family == "roberta" else 0
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 101, (4, 13), generator=g)
    attention_mask = torch.ones(4, 13, dtype=torch.long)
    for row, length in enumerate([13, 9, 4, 1]):
        attention_mask[row, length:] = 0
    input_ids[attention_mask == 0] = pad
    segments = 1 if family == "roberta" else 2
    token_type_ids = torch.randint(0, segments, (4, 13), generator=g) * attention_mask
    ours = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    theirs = {k: v for k, v in ours.items() if not (family == "distilbert" and k == "token_type_ids")}
    return ours, theirs


def _reference(family: str, head, attn_implementation: str = "eager"):
    cls, _ = FAMILIES[family]["heads"][head]
    labels = 2 if head in ("span", "pretraining") else 5  # ALBERT sizes its sentence-order classifier by num_labels
    config = FAMILIES[family]["config"](num_labels=labels, attn_implementation=attn_implementation)
    torch.manual_seed(0)
    model = cls(config).eval()
    randomised(model)
    return model


def _assert_same(ours, reference, family, head, atol=1e-5):
    mine_inputs, their_inputs = _batch(family)
    with torch.no_grad():
        mine, theirs = ours(**mine_inputs), reference(**their_inputs)
    for our_name, ref_name in FAMILIES[family]["heads"][head][1]:
        torch.testing.assert_close(getattr(mine, our_name), getattr(theirs, ref_name), atol=atol, rtol=1e-5,
                                   msg=lambda m, names=(our_name, ref_name): f"{names[0]} vs {names[1]}: {m}")


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("family, head", CASES, ids=IDS)
def test_reference_checkpoint_loads_with_identical_outputs(tmp_path, family, head, backend):
    reference = _reference(family, head, attn_implementation=backend)
    reference.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, head, attn_backend=backend, strict=True)
    assert ours.config.model_type == family if head is None else ours.encoder.config.model_type == family
    _assert_same(ours, reference, family, head)


@pytest.mark.parametrize("family, head", CASES, ids=IDS)
def test_our_save_loads_in_reference_with_identical_outputs(tmp_path, family, head):
    config = FAMILIES[family]["ours"].with_labels(["a", "b"] if head in ("span", "pretraining") else list("abcde"))
    torch.manual_seed(0)
    ours = (BertModel(config) if head is None else BertWithHead(config, head)).eval()
    randomised(ours)
    save_pretrained(ours, tmp_path)
    cls, _ = FAMILIES[family]["heads"][head]
    reference = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(reference.config).__name__.lower().startswith(family)
    _assert_same(ours, reference, family, head)
    _assert_same(load_pretrained(tmp_path, head, strict=True), reference, family, head)  # and our loader reads it


def test_albert_runs_its_shared_layer_groups_in_transformers_order(tmp_path):
    """Three layers from one group of two inner layers: six layer applications, four weights sets fewer."""
    config = FAMILIES["albert"]["config"](num_hidden_layers=3, num_hidden_groups=1, inner_group_num=2)
    torch.manual_seed(0)
    reference = T.AlbertModel(config).eval()
    randomised(reference)
    reference.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, strict=True)
    assert len(ours.layers) == 2 and ours.schedule == [0, 1, 0, 1, 0, 1]
    _assert_same(ours, reference, "albert", None)


def test_a_roberta_base_checkpoint_starts_a_classifier_with_a_fresh_pooler(tmp_path):
    """RoBERTa's classification head owns the dense + tanh BERT calls the pooler: from a bare RobertaModel the
    sequence head (pooler included) starts fresh instead of the load failing for a missing encoder weight."""
    _reference("roberta", None).save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "sequence", labels=["NEGATIVE", "POSITIVE"])
    assert model.encoder.pooler is not None


def test_a_family_without_next_sentence_prediction_refuses_that_head(tmp_path):
    _reference("roberta", None).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="roberta model has no next-sentence head"):
        load_pretrained(tmp_path, "nsp")


@pytest.mark.parametrize("changes, message", [
    (dict(model_type="gpt2"), "model_type 'gpt2' is not one of"),
    (dict(model_type="bert", embedding_size=20), "embedding_size, num_hidden_groups and inner_group_num are ALBERT's"),
    (dict(model_type="distilbert", type_vocab_size=2), "type_vocab_size must be 0 for distilbert"),
    (dict(model_type="roberta", pad_token_id=1, max_position_embeddings=2), "leaves no position after"),
])
def test_impossible_family_configs_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BertConfig(), **changes)


def test_roberta_counts_positions_from_after_the_padding_id():
    config = FAMILIES["roberta"]["ours"]
    assert config.position_offset == 2 and config.max_tokens == 40
    with pytest.raises(ValueError, match="exceeds max_position_embeddings 42 less RoBERTa's offset of 2"):
        BertModel(config)(torch.full((1, 41), 5))


# -- tokenizers and tasks on every family ----------------------------------------------------------------

TOKENIZERS = Path(__file__).parent / "fixtures" / "tokenizers"  # scripts/train_family_tokenizers.py made them
KINDS = {"roberta": ("BPE", 4, "<mask>"), "albert": ("Unigram", 3, "[MASK]"), "distilbert": ("WordPiece", 3, "[MASK]")}
TEXT = "Alice was beginning to get very tired of sitting by her sister on the bank."


@pytest.mark.parametrize("family", KINDS)
def test_each_family_tokenizer_keeps_offsets_pairs_and_its_mask(family, tmp_path):
    tokenizer = Tokenizer.from_pretrained(TOKENIZERS / family)
    kind, pair_specials, mask = KINDS[family]
    assert tokenizer.kind == kind and tokenizer.mask_token == mask
    batch = tokenizer(TEXT, "Once or twice she had peeped into the book.")
    assert int(batch.attention_mask.sum()) == len(tokenizer.tokenize(TEXT)) + len(
        tokenizer.tokenize("Once or twice she had peeped into the book.")) + pair_specials
    for (start, end), sequence, token_id in zip(batch.offsets[0], batch.sequence_ids[0], batch.input_ids[0].tolist()):
        if sequence == 0 and end > start:  # every piece's span is its own text, no leading space
            assert not TEXT[start].isspace()
            assert TEXT[start:end].lower() == tokenizer.piece_text(token_id).lower()
    masked = tokenizer(f"She was {mask} tired.")
    assert (masked.input_ids[0] == tokenizer.mask_token_id).sum() == 1  # the mask is one token
    tokenizer.save(tmp_path)
    again = Tokenizer.from_pretrained(tmp_path)
    assert again.tokenizer_class == tokenizer.tokenizer_class and (tmp_path / "vocab.txt").exists() == (kind == "WordPiece")
    assert torch.equal(again(TEXT).input_ids, tokenizer(TEXT).input_ids)


@pytest.mark.parametrize("family", KINDS)
def test_whole_word_masking_follows_each_family_word_marks(family):
    tokenizer = Tokenizer.from_pretrained(TOKENIZERS / family)
    batch = tokenizer([" ".join([TEXT] * 3)])
    continuation = continuation_mask(batch.input_ids, tokenizer)[0]
    pieces = tokenizer.convert_ids_to_tokens(batch.input_ids[0].tolist())
    words = batch.word_ids[0]
    for i in range(2, len(pieces) - 1):  # a piece continues a word exactly when it has the word of the piece before
        # (punctuation glued to a word, "bank.", goes with it: BPE's pre-tokeniser alone splits it off)
        if words[i] is not None and words[i - 1] is not None and tokenizer.piece_text(batch.input_ids[0, i]).isalnum():
            assert bool(continuation[i]) == (words[i] == words[i - 1]), (pieces[i - 1], pieces[i])
    masked, labels = mask_tokens(batch.input_ids, tokenizer, mlm_prob=0.5, whole_word=True,
                                 generator=torch.Generator().manual_seed(0))
    chosen = labels[0] != -100
    specials = set(tokenizer.special_tokens.values())
    for i in range(2, len(pieces)):  # (the text's first piece starts a word whatever its mark; specials never masked)
        if continuation[i] and pieces[i] not in specials:
            assert chosen[i] == chosen[i - 1]  # a word is masked whole or not at all


def _family_checkpoint(family: str, folder: Path) -> Path:
    tokenizer = Tokenizer.from_pretrained(TOKENIZERS / family)
    base = FAMILIES[family]["ours"]
    config = dataclasses.replace(base, vocab_size=tokenizer.vocab_size,
                                 max_position_embeddings=514 if family == "roberta" else 512)
    torch.manual_seed(0)
    save_pretrained(BertModel(config), folder, tokenizer)
    return folder


TASK_INPUTS = {"sentiment": {"text": "Alice was happy."}, "ner": {"text": "Alice met the Queen in London."},
               "qa": {"question": "Who was tired?", "context": "Alice was tired of sitting by her sister."},
               "summary": {"text": "Alice was tired. She sat by her sister on the bank. The book had no pictures."},
               "fill_mask": {"text": "Alice was [MASK] of sitting by her sister."}}


@pytest.mark.parametrize("kernels", ["packed", "tiled"])
@pytest.mark.parametrize("family", KINDS)
def test_every_task_answers_on_every_family(family, kernels, tmp_path, monkeypatch):
    """A task's head sees an encoder output, never the family: each task answers on a RoBERTa-, ALBERT-
    and DistilBERT-shaped checkpoint (random weights, a real tokenizer); the tab's "[MASK]" works with
    RoBERTa's "<mask>", and candidates read without their "Ġ"/"▁" marks. Under both kernel choices (which
    "auto" makes per machine by timing): "tiled" runs the fused C embeddings and layers where they apply."""
    from bert_engine.serving.predictors import LazyPredictor
    from bert_engine.tasks.registry import load_registry

    monkeypatch.setenv("BERT_ENGINE_KERNELS", kernels)

    folder = _family_checkpoint(family, tmp_path / family)
    registry = load_registry(entry_points=False)
    for name, inputs in TASK_INPUTS.items():
        output = LazyPredictor(registry.tasks[name], str(folder)).predict(inputs)
        assert output["provenance"]["family"] == family, name
        result = output["result"]
        if name == "qa":
            assert result["answers"] and result["answers"][0]["answer"] == result["answers"][0]["answer"].strip()
        if name == "fill_mask":
            candidates = result["predictions"][0]["candidates"]
            assert len(candidates) == 5 and not any(c["token"].startswith(("Ġ", "▁")) for c in candidates)
            assert all("[MASK]" not in c["sequence"] and "<mask>" not in c["sequence"] for c in candidates)


# -- pretraining objectives per family ------------------------------------------------------------------

def _book_corpus(path: Path, documents: int = 60) -> Path:
    """Real text: the committed tokenizer-fixture texts are not at hand here, so paragraphs of a fixed
    public-domain passage, shuffled per document (documents of several lines, blank lines between)."""
    import random

    lines = ["Alice was beginning to get very tired of sitting by her sister on the bank.",
             "Once or twice she had peeped into the book her sister was reading.",
             "It had no pictures or conversations in it, and what is the use of a book, thought Alice.",
             "So she was considering in her own mind whether the pleasure of making a daisy chain was worth it.",
             "Suddenly a White Rabbit with pink eyes ran close by her.",
             "There was nothing so very remarkable in that, nor did Alice think it so very much out of the way.",
             "The Rabbit actually took a watch out of its waistcoat pocket, and looked at it, and hurried on."]
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(documents):
            start = rng.randrange(len(lines))
            handle.write("\n".join(lines[(start + k) % len(lines)] for k in range(rng.randint(3, 6))) + "\n\n")
    return path


def test_sentence_order_pairs_are_true_continuations_half_swapped(tmp_path):
    from bert_engine.training.pretraining import PairBuilder, collate_pairs, read_documents, tokenize_documents

    tokenizer = Tokenizer.from_pretrained(TOKENIZERS / "albert")
    documents = tokenize_documents(read_documents(_book_corpus(tmp_path / "corpus.txt")), tokenizer)
    pairs = PairBuilder(documents, max_seq_len=64, objective="mlm+sop").pairs(seed=0)
    assert len(pairs) > 50 and sum(p.is_random_next for p in pairs) / len(pairs) == pytest.approx(0.5, abs=0.1)
    streams = [[t for unit in d for t in unit] for d in documents]

    def follows(first, second):  # `second` comes after `first` in one document
        return any(_find(s, first) >= 0 and _find(s[_find(s, first) + len(first):], second) >= 0 for s in streams)

    for pair in pairs[:40]:  # in order: B follows A; swapped: A follows B; never another document's text
        assert follows(pair.b, pair.a) if pair.is_random_next else follows(pair.a, pair.b)
    batch, labels = collate_pairs(pairs[:4], tokenizer)
    assert labels.tolist() == [int(p.is_random_next) for p in pairs[:4]]


def test_roberta_rows_are_one_segment_packed_from_one_document(tmp_path):
    from bert_engine.training.pretraining import PairBuilder, collate_pairs, read_documents, tokenize_documents

    tokenizer = Tokenizer.from_pretrained(TOKENIZERS / "roberta")
    documents = tokenize_documents(read_documents(_book_corpus(tmp_path / "corpus.txt")), tokenizer)
    rows = PairBuilder(documents, max_seq_len=40, short_seq_prob=0.0, objective="mlm").pairs(seed=0)
    assert all(not row.b and 0 < len(row.a) <= 38 for row in rows)
    assert sum(len(row.a) == 38 for row in rows) > len(rows) / 2  # packed full, the document's tail shorter
    batch, _ = collate_pairs(rows[:3], tokenizer)
    assert batch.input_ids[0, 0] == tokenizer.token_id("cls_token") and int(batch.token_type_ids.max()) == 0
    assert batch.input_ids[0, len(rows[0].a) + 1] == tokenizer.token_id("sep_token")


def _find(stream, piece):
    n = len(piece)
    return next((i for i in range(len(stream) - n + 1) if stream[i:i + n] == piece), -1)


@pytest.mark.parametrize("family, objective, head_class", [
    ("roberta", "mlm", T.RobertaForMaskedLM), ("albert", "mlm+sop", T.AlbertForPreTraining),
    ("distilbert", "mlm", T.DistilBertForMaskedLM)])
def test_each_family_pretrains_with_its_objective_and_falling_loss(tmp_path, family, objective, head_class):
    from bert_engine.training.jobs import PretrainJob
    from bert_engine.training.loop import train
    from bert_engine.training.train_config import TrainConfig

    corpus = _book_corpus(tmp_path / "corpus.txt", 40)
    cfg = TrainConfig(preset="tiny", family=family, tokenizer=str(TOKENIZERS / family), train_file=str(corpus),
                      eval_file=str(corpus), output_dir=str(tmp_path / "run"), max_steps=40, batch_size=16, lr=5e-3,
                      max_seq_len=48, log_every=10, warmup_ratio=0.1)
    job = PretrainJob(cfg)
    assert job.objective == objective
    result = train(job, cfg)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [line["loss"] for line in lines if "loss" in line]
    assert losses[-1] < losses[0] * 0.8, losses
    expected = {"mlm_accuracy", "perplexity"} | ({"sop_accuracy"} if objective == "mlm+sop" else set())
    assert expected <= set(result["last_eval"]) and "nsp_accuracy" not in result["last_eval"]
    reference = head_class.from_pretrained(str(tmp_path / "run" / "best"))  # a standard checkpoint of the family
    assert reference.config.model_type == family


@pytest.mark.parametrize("family, objective, message", [
    ("roberta", "mlm+nsp", "mlm\\+nsp needs BERT's next-sentence head; a roberta model has none"),
    ("bert", "mlm+sop", "mlm\\+sop needs ALBERT's sentence-order head; a bert model has none"),
    ("gpt2", None, "family 'gpt2' is not one of")])
def test_an_objective_the_family_cannot_train_is_refused(tmp_path, family, objective, message):
    from bert_engine.training.jobs import PretrainJob
    from bert_engine.training.train_config import TrainConfig

    cfg = TrainConfig(preset="tiny", family=family, objective=objective, train_file=str(_book_corpus(tmp_path / "c.txt")),
                      tokenizer=str(TOKENIZERS / "roberta"), output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=message):
        PretrainJob(cfg)


@pytest.mark.parametrize("family", KINDS)
def test_lora_fine_tuning_runs_and_loads_back_on_every_family(family, tmp_path):
    """`bert-engine train` with LoRA on a family checkpoint: the adapter (ALBERT's on its shared layers)
    and head load back to the live model's outputs, and the merged copy is a checkpoint of the family."""
    from bert_engine import load
    from bert_engine.tasks.registry import load_registry
    from bert_engine.training.jobs import TaskJob
    from bert_engine.training.loop import train
    from bert_engine.training.train_config import TrainConfig

    folder = _family_checkpoint(family, tmp_path / family)
    task = load_registry(entry_points=False).task("sentiment")
    sst = Path(__file__).parent / "fixtures" / "sst_tiny.tsv"
    cfg = TrainConfig(task="sentiment", model=str(folder), train_file=str(sst), eval_file=str(sst),
                      output_dir=str(tmp_path / "run"), max_steps=6, batch_size=8, lr=1e-2, log_every=2,
                      save_every=100, lora_rank=4, lora_targets="query,value,ffn_down", merge_lora=True,
                      device="cpu")  # compared at 1e-5 with the reloaded copies, on the CPU (a GPU would be picked)
    job = TaskJob(task, cfg)
    train(job, cfg)
    adapted, tokenizer = load(tmp_path / "run" / "last", task.spec.build_head)
    merged, _ = load(tmp_path / "run" / "last" / "merged", task.spec.build_head)
    batch = tokenizer(["Alice was happy.", "The Queen was very angry indeed."])
    job.model.eval()
    with torch.no_grad():
        live = job.model(**batch.model_inputs()).logits
        torch.testing.assert_close(adapted(**batch.model_inputs()).logits, live, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(merged(**batch.model_inputs()).logits, live, atol=1e-5, rtol=1e-4)
    assert merged.encoder.config.model_type == family


def test_the_model_picker_names_each_family(tmp_path):
    from playground.app import family_label

    for family, shown in (("roberta", "RoBERTa"), ("albert", "ALBERT"), ("distilbert", "DistilBERT")):
        assert family_label(_family_checkpoint(family, tmp_path / family)) == shown
    assert family_label(tmp_path / "nothing here") == "?"


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_padding_free_encoder_gives_the_reference_real_token_outputs(tmp_path, family, backend):
    # Inference and training run the layers on the real tokens alone (model.Unpadded); each family's
    # real tokens keep the reference's values, padding reads zero.
    reference = _reference(family, None, attn_implementation=backend)
    reference.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, None, attn_backend=backend, strict=True)
    ours.padding_free = True
    mine_inputs, their_inputs = _batch(family)
    real = mine_inputs["attention_mask"].bool()
    with torch.no_grad():
        mine, theirs = ours(**mine_inputs), reference(**their_inputs)
    torch.testing.assert_close(mine.last_hidden_state[real], theirs.last_hidden_state[real], atol=1e-5, rtol=1e-5)
    assert not mine.last_hidden_state[~real].any()
    if family != "distilbert":
        torch.testing.assert_close(mine.pooled, theirs.pooler_output, atol=1e-5, rtol=1e-5)
