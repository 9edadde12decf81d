"""Train the small real tokenizers of the family tests: RoBERTa's byte-level BPE, ALBERT's Unigram
(SentencePiece style) and DistilBERT's WordPiece, on Gutenberg books from the shared data, with the
`tokenizers` library and each family's special tokens and post-processor. They are committed under
tests/fixtures/tokenizers/<family>/ (a few hundred kB in all), so the tests run where ../shared is absent.

    python scripts/train_family_tokenizers.py [--data ../shared/data/gutenberg] [--vocab 2000]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

BOOKS = ("pg11_alices_adventures_in_wonderland.txt", "pg120_treasure_island.txt", "pg105_persuasion.txt")
OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tokenizers"


def lines(folder: Path):
    for name in BOOKS:
        for line in (folder / name).read_text(encoding="utf-8").splitlines():
            if line.strip():
                yield line


def roberta(folder: Path, vocab: int) -> tuple[Backend, dict]:
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # ids 0..4, as roberta-base numbers them
    backend = Backend(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(lines(folder), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=True,
                                                          add_prefix_space=False)
    backend.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    config = {"tokenizer_class": "RobertaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "cls_token": "<s>",
              "sep_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}
    return backend, config


def albert(folder: Path, vocab: int) -> tuple[Backend, dict]:
    specials = ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]  # ids 0..4, as albert-base-v2 numbers them
    backend = Backend(models.Unigram())
    backend.normalizer = normalizers.Sequence([normalizers.Replace("``", '"'), normalizers.Replace("''", '"'),
                                               normalizers.NFKD(), normalizers.StripAccents(), normalizers.Lowercase(),
                                               normalizers.Replace(Regex(" {2,}"), " ")])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    backend.train_from_iterator(lines(folder), trainers.UnigramTrainer(
        vocab_size=vocab, special_tokens=specials, unk_token="<unk>"))
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", backend.token_to_id("[CLS]")), ("[SEP]", backend.token_to_id("[SEP]"))])
    backend.add_special_tokens([AddedToken("[MASK]", lstrip=True, normalized=False, special=True)])
    config = {"tokenizer_class": "AlbertTokenizer", "do_lower_case": True, "cls_token": "[CLS]", "sep_token": "[SEP]",
              "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "[MASK]"}
    return backend, config


def distilbert(folder: Path, vocab: int) -> tuple[Backend, dict]:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    backend = Backend(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    backend.train_from_iterator(lines(folder), trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=specials))
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", backend.token_to_id("[CLS]")), ("[SEP]", backend.token_to_id("[SEP]"))])
    config = {"tokenizer_class": "DistilBertTokenizer", "do_lower_case": True, "cls_token": "[CLS]",
              "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]"}
    return backend, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/gutenberg"))
    parser.add_argument("--vocab", type=int, default=2000)
    args = parser.parse_args()
    for name, build in (("roberta", roberta), ("albert", albert), ("distilbert", distilbert)):
        backend, config = build(args.data, args.vocab)
        folder = OUT / name
        folder.mkdir(parents=True, exist_ok=True)
        backend.save(str(folder / "tokenizer.json"))
        config["model_max_length"] = 512
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        print(f"{name}: {backend.get_vocab_size()} tokens, {(folder / 'tokenizer.json').stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
