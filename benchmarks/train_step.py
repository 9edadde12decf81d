"""One training step (forward + backward + AdamW): bert_engine vs transformers, with MFU.

    python -m benchmarks.train_step                                  # bert-base, 32x512 on a GPU (bf16)
    python -m benchmarks.train_step --device cpu --model minilm --shape 8x128 --precision fp32
    python -m benchmarks.train_step --device cpu --model minilm --objective classify --shape 32x64

Both sides train the same random-initialised bert-base (or the real MiniLM) on the same batch:
`--objective mlm` (default) with an MLM head, 15 % of tokens masked; `--objective classify` a
sequence-classification head (two labels, the pooled [CLS]), the fine-tuning step of the sentiment
task. Model FLOPs per step = 3 x the forward's matmul FLOPs (backward costs two forwards) + the
vocabulary projection of the masked positions; MFU is the achieved rate over the matmul peak of
the step's dtype, measured in the same run. Every row is a full batch of BxT tokens: padding
(which length bucketing in `bert-engine train` removes) is not part of this comparison.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.common import interleaved, machine, matmul_peak_gflops, median, print_table, write_json
from benchmarks.encoder import matmul_flops, model_folders

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def step_flops(config, batch: int, tokens: int, masked: int) -> float:
    forward = matmul_flops(config, batch, tokens) + masked * 2 * config.hidden_size * (config.hidden_size + config.vocab_size)
    return 3 * forward


def make_steps(folder: Path, device: str, precision: str, batch: int, tokens: int, objective: str = "mlm"):
    import transformers

    from bert_engine import load_pretrained
    from bert_engine.heads import SequenceClassificationHead

    g = torch.Generator().manual_seed(0)
    if objective == "mlm":
        ours = load_pretrained(folder, "mlm", device=device).train()
        reference = transformers.BertForMaskedLM.from_pretrained(folder, attn_implementation="sdpa")
    else:
        reference = transformers.BertForSequenceClassification.from_pretrained(folder, num_labels=2,
                                                                               attn_implementation="sdpa")
        ours = load_pretrained(folder, lambda config: SequenceClassificationHead(config.with_labels(["0", "1"])),
                               device=device)
        ours.head.classifier.load_state_dict(reference.classifier.state_dict())  # the same new head on both
        ours.train()
    reference = reference.to(device).train()
    config = ours.config
    input_ids = torch.randint(1000, config.vocab_size, (batch, tokens), generator=g).to(device)
    if objective == "classify":
        targets = torch.randint(0, 2, (batch,), generator=g).to(device)

        def classify_step(model, logits_of):
            return _stepper(model, logits_of, lambda logits: torch.nn.functional.cross_entropy(logits.float(), targets),
                            device, precision)

        return config, 0, {"engine": classify_step(ours, lambda m: m(input_ids=input_ids).logits),
                           "transformers": classify_step(reference, lambda m: m(input_ids=input_ids).logits)}
    labels = torch.full_like(input_ids, -100)
    chosen = torch.rand(batch, tokens, generator=g).to(device) < 0.15
    labels[chosen] = input_ids[chosen]
    masked = int(chosen.sum())

    def mlm_step(model):
        return _stepper(model, lambda m: m(input_ids=input_ids).logits,
                        lambda logits: torch.nn.functional.cross_entropy(logits[chosen].float(), labels[chosen]),
                        device, precision)

    # The engine as `bert-engine pretrain` runs it: vocabulary logits at the masked positions only
    # (predict_positions); "engine, all positions" is the same model computing them everywhere, as
    # BertForMaskedLM does, to show what that choice is worth.
    engine_step = _stepper(ours, lambda m: m(input_ids=input_ids, predict_positions=chosen).logits,
                           lambda logits: torch.nn.functional.cross_entropy(logits.float(), labels[chosen]),
                           device, precision)
    return config, masked, {"engine": engine_step, "engine, all positions": mlm_step(ours),
                            "transformers": mlm_step(reference)}


def _stepper(model, logits_of, loss_of, device: str, precision: str):
    """One AdamW step of `model` on the loss of its logits, under the precision's autocast."""
    autocast = torch.autocast(torch.device(device).type, dtype=DTYPES[precision], enabled=precision != "fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.device(device).type == "cuda")
    scaler = torch.amp.GradScaler(enabled=precision == "fp16")

    def step():
        with autocast:
            loss = loss_of(logits_of(model))
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
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    batch, tokens = (int(n) for n in args.shape.split("x"))
    peak = matmul_peak_gflops(DTYPES[precision], device=args.device)
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folders([args.model], Path(tmp))[args.model]
        config, masked, steps = make_steps(folder, args.device, precision, batch, tokens, args.objective)
        times = interleaved(steps, args.repeats, warmup=2, device=args.device)
    flops = step_flops(config, batch, tokens, masked)
    rows = []
    for impl, ts in times.items():
        seconds = median(ts)
        rows.append({"model": args.model, "objective": args.objective, "shape": args.shape, "impl": impl, "precision": precision, "ms": seconds * 1000,
                     "tokens_per_s": batch * tokens / seconds, "tflops": flops / seconds / 1e12,
                     "mfu": flops / seconds / 1e9 / peak})
    base = next(r["ms"] for r in rows if r["impl"] == "transformers")
    for r in rows:
        r["speedup"] = base / r["ms"]
    info = machine()
    print(f"# training step ({args.objective}, AdamW), {args.device}, {info.get('gpu', info['cpu'])} "
          f"({info['cpu_capability']}), torch {info['torch']}; "
          f"{precision} matmul peak {peak:,.0f} GFLOP/s; median of {args.repeats}")
    print_table(rows, ["model", "objective", "shape", "impl", "precision", "ms", "tokens_per_s", "speedup", "tflops", "mfu"])
    write_json(args.json, {"machine": info, "device": args.device, "matmul_peak_gflops": peak, "rows": rows})


if __name__ == "__main__":
    main()
