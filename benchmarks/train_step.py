"""One training step (forward + backward + AdamW): bert_engine vs transformers, with MFU.

    python -m benchmarks.train_step                                  # bert-base, 32x512 on a GPU (bf16)
    python -m benchmarks.train_step --device cpu --model minilm --shape 8x128 --precision fp32
    python -m benchmarks.train_step --device cpu --model minilm --objective classify --shape 32x64

Both sides train the same random-initialised bert-base (or the real MiniLM) on the same batch:
`--objective mlm` (default) with an MLM head, 15 % of tokens masked; `--objective classify` a
sequence-classification head (two labels, the pooled [CLS]), the fine-tuning step of the sentiment
task. Model FLOPs per step = 3 x the forward's matmul FLOPs (backward costs two forwards) + the
vocabulary projection of the masked positions; MFU is the achieved rate over the matmul peak of
the step's dtype, measured in the same run. By default every row is a full batch of BxT tokens.

`--data FILE` (the sentiment task's format, e.g. ../shared/data/sst2/train.tsv) instead trains on real
sentences: `--batches` batches of B drawn at random, as a shuffled loader draws them, each padded to
its longest sentence on both sides. The engine's layers then skip the padding (model.Unpadded; it
trains padding-free by default), transformers computes it; "engine, padded" is the engine made to
compute it too, to show what that choice is worth. Tokens/s and MFU count the real tokens only.

    python -m benchmarks.train_step --device cpu --model minilm --objective classify --data ../shared/data/sst2/train.tsv
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.common import interleaved, machine, matmul_peak_gflops, median, print_table, write_json
from benchmarks.encoder import matmul_flops, model_folders

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def step_flops(config, lengths: list[int], masked: int) -> float:
    """Useful FLOPs of a step over sequences of these real lengths (padding does not count)."""
    forward = sum(matmul_flops(config, 1, n) for n in lengths)
    return 3 * (forward + masked * 2 * config.hidden_size * (config.hidden_size + config.vocab_size))


def real_batches(path: str, count: int, batch: int, tokens: int, seed: int = 0, tokenizer_folder: str | None = None) -> list[dict]:
    """`count` batches of `batch` sentences of the sentiment file at `path`, drawn at random, tokenised
    with MiniLM's tokenizer (bert-base-uncased's vocabulary; or the one in `tokenizer_folder`), each padded to its
    longest (at most `tokens`)."""
    from bert_engine.checkpoints.hub import default_backbone
    from bert_engine.tasks.registry import load_registry
    from bert_engine.tokenizer import Tokenizer

    texts = [inputs["text"] for inputs, _ in load_registry(entry_points=False).task("sentiment").spec.read_data(path, "all")]
    if len(texts) < batch:
        raise SystemExit(f"{path} has {len(texts)} sentences; a batch needs {batch}")
    tokenizer = Tokenizer.from_pretrained(tokenizer_folder or default_backbone())
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        chosen = torch.randperm(len(texts), generator=g)[:batch].tolist()
        encoded = tokenizer([texts[i] for i in chosen], max_length=tokens)
        batches.append({"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask})
    return batches


def full_batches(config, batch: int, tokens: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1000, config.vocab_size, (batch, tokens), generator=g)
    return [{"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}]


def make_steps(folder: Path, device: str, precision: str, batches_of, objective: str = "mlm"):
    """(config, batches, masked positions, {contender: step}); `batches_of(config)` gives the batches,
    and one step of a contender is one optimizer step on each of them."""
    import transformers

    from bert_engine import load_pretrained
    from bert_engine.heads import SequenceClassificationHead

    g = torch.Generator().manual_seed(0)
    if objective == "mlm":
        head = "mlm"
        reference = transformers.BertForMaskedLM.from_pretrained(folder, attn_implementation="sdpa")
    else:
        def head(config):
            return SequenceClassificationHead(config.with_labels(["0", "1"]))
        reference = transformers.BertForSequenceClassification.from_pretrained(folder, num_labels=2,
                                                                               attn_implementation="sdpa")
    ours = load_pretrained(folder, head, device=device)
    if objective == "classify":
        ours.head.classifier.load_state_dict(reference.classifier.state_dict())  # the same new head on both
    ours.train()
    reference = reference.to(device).train()
    config = ours.config
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches_of(config)]
    plain = None
    if any(not bool(b["attention_mask"].all()) for b in batches):
        # The engine made to compute the padding as transformers does, to show what skipping it is worth.
        plain = load_pretrained(folder, head, device=device)
        plain.load_state_dict(ours.state_dict())
        plain.encoder.padding_free = False
        plain.train()
    if objective == "classify":
        targets = [torch.randint(0, 2, (b["input_ids"].shape[0],), generator=g).to(device) for b in batches]

        def classify_step(model):
            return _stepper(model, batches, lambda m, b, i: m(**b).logits,
                            lambda logits, i: torch.nn.functional.cross_entropy(logits.float(), targets[i]),
                            device, precision)

        steps = {"engine": classify_step(ours), "transformers": classify_step(reference)}
        if plain is not None:
            steps["engine, padded"] = classify_step(plain)
        return config, batches, 0, steps
    chosen, labels = [], []
    for b in batches:
        pick = (torch.rand(b["input_ids"].shape, generator=g).to(device) < 0.15) & b["attention_mask"].bool()
        chosen.append(pick)
        labels.append(b["input_ids"][pick])
    masked = sum(int(c.sum()) for c in chosen)

    def mlm_step(model):
        return _stepper(model, batches, lambda m, b, i: m(**b).logits,
                        lambda logits, i: torch.nn.functional.cross_entropy(logits[chosen[i]].float(), labels[i]),
                        device, precision)

    # The engine as `bert-engine pretrain` runs it: vocabulary logits at the masked positions only
    # (predict_positions); "engine, all positions" is the same model computing them everywhere, as
    # BertForMaskedLM does, to show what that choice is worth.
    def engine_step(model):
        return _stepper(model, batches, lambda m, b, i: m(**b, predict_positions=chosen[i]).logits,
                        lambda logits, i: torch.nn.functional.cross_entropy(logits.float(), labels[i]),
                        device, precision)

    steps = {"engine": engine_step(ours), "engine, all positions": mlm_step(ours), "transformers": mlm_step(reference)}
    if plain is not None:
        steps["engine, padded"] = engine_step(plain)
    return config, batches, masked, steps


def _stepper(model, batches, logits_of, loss_of, device: str, precision: str):
    """One AdamW step of `model` per batch on the loss of its logits, under the precision's autocast."""
    autocast = torch.autocast(torch.device(device).type, dtype=DTYPES[precision], enabled=precision != "fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.device(device).type == "cuda")
    scaler = torch.amp.GradScaler(enabled=precision == "fp16")

    def step():
        for i, batch in enumerate(batches):
            with autocast:
                loss = loss_of(logits_of(model, batch, i), i)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert-base", help="bert-base (random weights) or minilm")
    parser.add_argument("--shape", default="32x512", help="batch x tokens")
    parser.add_argument("--objective", default="mlm", choices=("mlm", "classify"),
                        help="mlm (pretraining step) or classify (a fine-tuning step, sequence classification)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default=None, help="fp32, bf16 or fp16 autocast (default: bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--data", default=None,
                        help="train on real sentences of this sentiment-format file (e.g. ../shared/data/sst2/train.tsv), "
                             "B per batch, each batch padded to its longest (--shape's T is the cap)")
    parser.add_argument("--batches", type=int, default=4, help="with --data: batches per timed step")
    parser.add_argument("--tokenizer", default=None,
                        help="with --data: a tokenizer folder (default: the installed MiniLM's; any bert-base-uncased "
                             "vocabulary, e.g. a folder written by scripts/compact_base.py)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    batch, tokens = (int(n) for n in args.shape.split("x"))
    peak = matmul_peak_gflops(DTYPES[precision], device=args.device)
    if args.data:
        def batches_of(config):
            return real_batches(args.data, args.batches, batch, tokens, tokenizer_folder=args.tokenizer)
    else:
        def batches_of(config):
            return full_batches(config, batch, tokens)
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folders([args.model], Path(tmp))[args.model]
        config, batches, masked, steps = make_steps(folder, args.device, precision, batches_of, args.objective)
        times = interleaved(steps, args.repeats, warmup=2, device=args.device)
    lengths = [int(n) for b in batches for n in b["attention_mask"].sum(1).tolist()]
    padded_tokens = sum(b["attention_mask"].numel() for b in batches)
    flops = step_flops(config, lengths, masked)
    shape = f"{len(batches)} x {batch} sentences, padded {1 - sum(lengths) / padded_tokens:.0%}" if args.data else args.shape
    rows = []
    for impl, ts in times.items():
        seconds = median(ts)
        rows.append({"model": args.model, "objective": args.objective, "shape": shape, "impl": impl, "precision": precision,
                     "ms": seconds * 1000, "tokens_per_s": sum(lengths) / seconds, "tflops": flops / seconds / 1e12,
                     "mfu": flops / seconds / 1e9 / peak})
    base = next(r["ms"] for r in rows if r["impl"] == "transformers")
    for r in rows:
        r["speedup"] = base / r["ms"]
    info = machine()
    print(f"# training step ({args.objective}, AdamW), {args.device}, {info.get('gpu', info['cpu'])} "
          f"({info['cpu_capability']}), torch {info['torch']}; "
          f"{precision} matmul peak {peak:,.0f} GFLOP/s; median of {args.repeats}"
          + (f"; {args.data}: {sum(lengths):,} real tokens in {padded_tokens:,} padded" if args.data else ""))
    print_table(rows, ["model", "objective", "shape", "impl", "precision", "ms", "tokens_per_s", "speedup", "tflops", "mfu"])
    write_json(args.json, {"machine": info, "device": args.device, "matmul_peak_gflops": peak, "data": args.data,
                           "rows": rows})


if __name__ == "__main__":
    main()
