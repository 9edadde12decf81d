"""Real workloads end to end (tokenise -> encode -> postprocess): bert_engine vs the peers a user
would pick instead.

    python -m benchmarks.workloads                          # sentiment, ner, qa on ../shared/data
    python -m benchmarks.workloads --tasks sentiment --repeats 3 --json out.json
    python -m benchmarks.workloads --precisions fp32,int8   # also the engine's faster CPU modes
    python -m benchmarks.workloads --peers ../venv-peers/bin/python --modes batched,single \
        --tasks sentiment,ner,qa,fill_mask,summary --json benchmarks/results/avx512/workloads.json
    python -m benchmarks.workloads --device cuda --precisions bf16,fp16 --modes batched,single   # on a GPU

Every side runs the same weights: each starter model (LoRA adapter + head on MiniLM) is merged
and saved once in the Hugging Face layout, and every implementation loads that folder. `--starters DIR`
takes each task's model from DIR/<task> instead (a pack rebased onto another copy of its base, say).

On a GPU (`--device cuda`) the in-process transformers reference runs at each precision the engine
runs (fp32, bf16, fp16: the same dtype on both sides); ONNX Runtime's peers stay CPU-only.

Contenders. Without --peers: transformers (the suite's 5.x) in this process. With --peers (the python
of the venv `python -m benchmarks.peers --setup` makes): transformers 4.57's task pipelines, and the
same pipelines on optimum's ONNX Runtime models (ORTModelFor..., `export=True`), the pair a user
picks instead (optimum-onnx needs transformers < 4.58; see benchmarks/peers.py).

- sentiment: SST-2 dev (872 sentences); reference: `pipeline("text-classification")`.
- ner: CoNLL-2003 eng.testb (3,453 sentences); reference: `pipeline("token-classification",
  aggregation_strategy="first")`. Its argmax decoding is compared with the engine's argmax
  tags (`words[*].argmax`) grouped the same way; the engine's default CRF decoding is a different
  algorithm, so its entity F1 is reported beside it rather than compared. The starter's `casing`
  marks (segment ids on capitalised words) are left off on both sides: transformers' pipeline
  cannot add them, so the F1 here is that model reading text without them, not its testb figure.
- qa: the first N questions of SQuAD dev-v1.1 (default 1,000); the peers' `pipeline("question-
  answering")` (windows of 384 tokens, stride 128, answers of at most 30 tokens); transformers 5
  dropped that pipeline, so in-process the reference is BertForQuestionAnswering with the decoding of
  transformers' `run_qa` example.
- fill_mask: 1,000 words of WikiText-2 test (seed 0) that are one WordPiece, each behind one [MASK]
  in a window of 60 words; reference: `pipeline("fill-mask")`, its first word compared with the
  engine's first candidate (the engine skips word pieces and punctuation, the pipeline does not).
- summary: the BBC News test split (the task's hash split, 205 articles); no transformers or optimum
  pipeline summarises by extraction, so each peer runs the glue a user would write around its encoder,
  taken from plugins/summary.py itself (benchmarks/summary_reference.py: the same sentences, windows,
  scorer weights and options, transformers' BertModel or optimum's ORTModelForFeatureExtraction as the
  encoder); the sentences chosen are compared, ROUGE-2 reported. A file: 8 articles per call on every side.

Modes: "batched" (a file: every item in one call, batches of 32) and "single" (a visitor: one request
at a time, the first --single-limit items, each request's latency; p50 / p95 reported; with --peers the
engine and each peer take turns of 10 requests, so a slow spell of the machine falls on all). Reported:
seconds (median of the repeats, contenders run in turn), items/s, tokens/s (the items' WordPiece
tokens), the speed-up over each peer, the share of predictions identical to the engine's, and each
side's task metric.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import interleaved, machine, median, print_table, write_json

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
BATCH = 32
# Each task's held-out file under the shared data folder (--data)
DATA_FILES = {"sentiment": "sst2/dev.tsv", "ner": "conll2003/eng.testb", "qa": "squad/dev-v1.1.json",
              "fill_mask": "wikitext2/wiki.test.tokens", "summary": "bbc_news_summary/bbc_news_summary.jsonl"}


def merged_folder(task_name: str, workdir: Path, starters: Path | None = None) -> Path:
    """The task's starter model (adapter merged into MiniLM; from `starters`/<task> where given) saved in the
    Hugging Face layout."""
    from bert_engine.checkpoints.loader import load
    from bert_engine.checkpoints.loading import save_pretrained
    from bert_engine.tasks.registry import load_registry

    task = load_registry(entry_points=False).task(task_name)
    checkpoint = str(starters / task_name) if starters is not None else task.spec.default_checkpoint
    if checkpoint is None:
        raise SystemExit(f"task {task_name!r} has no starter model in plugins/starter/; build it first")
    folder = workdir / task_name
    model, tokenizer = load(checkpoint, task.spec.build_head)
    save_pretrained(model, folder, tokenizer)
    return folder


# -- sentiment ---------------------------------------------------------------------------------------

def sentiment(folder: Path, data: Path, precision: str, limit: int | None, device: str = "cpu"):
    import transformers

    from bert_engine.runtime.inference import Predictor, predict_texts
    from bert_engine.tasks.registry import load_registry

    task = load_registry(entry_points=False).task("sentiment")
    examples = list(task.spec.read_data(str(data / DATA_FILES["sentiment"]), "test"))[:limit]
    texts, gold = [x["text"] for x, _ in examples], [t for _, t in examples]
    engine = Predictor.load(task, str(folder), device=device, precision=precision)
    reference = transformers.pipeline("text-classification", model=str(folder), batch_size=BATCH, **_reference_place(device, precision))
    out = {}

    def run_engine():
        out["engine"] = [r["label_id"] for r in predict_texts(engine, texts, batch_size=BATCH)]

    def run_reference():
        label2id = reference.model.config.label2id
        out["reference"] = [label2id[r["label"]] for r in reference(texts, truncation=True)]

    def accuracy(label_ids):
        return 100 * sum(label == g for label, g in zip(label_ids, gold)) / len(gold)

    return len(texts), run_engine, run_reference, out, lambda side: {"accuracy": accuracy(out[side])}


# -- ner -----------------------------------------------------------------------------------------------

def ner(folder: Path, data: Path, precision: str, limit: int | None, device: str = "cpu"):
    import transformers

    from bert_engine.runtime.inference import Predictor, predict_texts
    from bert_engine.tasks.registry import load_registry
    task = load_registry(entry_points=False).task("ner")
    examples = list(task.spec.read_data(str(data / DATA_FILES["ner"]), "test"))[:limit]
    texts = [x["text"] for x, _ in examples]
    engine = Predictor.load(task, str(folder), device=device, precision=precision)
    reference = transformers.pipeline("token-classification", model=str(folder), batch_size=BATCH, **_reference_place(device, precision),
                                      aggregation_strategy="first")
    out = {}

    def run_engine():
        results = predict_texts(engine, texts, batch_size=BATCH)
        out["engine_crf"] = [sorted((e["start"], e["end"], e["type"]) for e in r["entities"]) for r in results]
        out["engine"] = [_argmax_entities(r["words"]) for r in results]

    def run_reference():
        out["reference"] = [sorted((e["start"], e["end"], e["entity_group"]) for e in r) for r in reference(texts)]

    def score(side):
        report = {}
        for key in (side, "engine_crf") if side == "engine" else (side,):
            found = [{tuple(e) for e in p} for p in out[key]]
            gold = [set(_gold_entities(x, t)) for x, t in examples]
            tp = sum(len(f & g) for f, g in zip(found, gold))
            p, r = tp / max(1, sum(map(len, found))), tp / max(1, sum(map(len, gold)))
            report["f1" if key != "engine_crf" else "crf_f1"] = 100 * 2 * p * r / max(p + r, 1e-9)
        return report

    return len(texts), run_engine, run_reference, out, score


def _argmax_entities(words: list[dict]) -> list[tuple[int, int, str]]:
    """Entities from per-word argmax tags, grouped as the pipeline's aggregation does: a B- or a new type
    starts an entity, I- of the same type continues it (an I- after O or another type starts one)."""
    entities, current = [], None
    for w in words:
        tag = w["argmax"]
        if tag == "O":
            current = None
            continue
        prefix, kind = tag.split("-", 1)
        if current is not None and prefix == "I" and current[2] == kind:
            current[1] = w["end"]
        else:
            current = [w["start"], w["end"], kind]
            entities.append(current)
    return sorted(tuple(e) for e in entities)


def _gold_entities(inputs: dict, target) -> list[tuple[int, int, str]]:
    """The gold entities of a read_data example as (start, end, type) character spans."""
    from plugins.tagging import chunks

    spans, start = [], 0
    for word in target["words"]:  # read_data joins the words with single spaces
        spans.append((start, start + len(word)))
        start += len(word) + 1
    assert " ".join(target["words"]) == inputs["text"]
    return [(spans[b][0], spans[e - 1][1], kind) for b, e, kind in chunks(target["tags"])]


# -- qa ------------------------------------------------------------------------------------------------

def qa(folder: Path, data: Path, precision: str, limit: int | None, device: str = "cpu"):
    import transformers

    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry
    from plugins.qa import predict_many
    from plugins.qa_metric import squad_scores

    task = load_registry(entry_points=False).task("qa")
    examples = list(task.spec.read_data(str(data / DATA_FILES["qa"])))[:limit or 1000]
    items, golds = [x for x, _ in examples], [t["answers"] for _, t in examples]
    engine = Predictor.load(task, str(folder), device=device, precision=precision)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    place = _reference_place(device, precision)
    model = transformers.BertForQuestionAnswering.from_pretrained(str(folder), attn_implementation="sdpa",
                                                                  dtype=place["dtype"]).to(place["device"]).eval()
    out = {}

    def run_engine():
        out["engine"] = [r["answer"] or "" for r in predict_many(engine, items, max_rows=BATCH)]

    def run_reference():
        out["reference"] = reference_qa(model, tokenizer, items)

    return len(items), run_engine, run_reference, out, lambda side: {"f1": squad_scores(out[side], golds)["f1"]}


def reference_qa(model, tokenizer, items, max_length=384, stride=128, max_answer_len=30, n_best=20) -> list[str]:
    """transformers' run_qa decoding: windows per question, windows batched 32 at a time in input
    order, the best start + end logit sum over every window of a question."""
    encoded = tokenizer([x["question"] for x in items], [x["context"] for x in items], truncation="only_second",
                        max_length=max_length, stride=stride, return_overflowing_tokens=True,
                        return_offsets_mapping=True, padding="longest")
    starts, ends = [], []
    with torch.inference_mode():
        for i in range(0, len(encoded["input_ids"]), BATCH):
            batch = {k: torch.tensor(encoded[k][i:i + BATCH], device=model.device)
                     for k in ("input_ids", "attention_mask", "token_type_ids")}
            output = model(**batch)
            starts += output.start_logits.float().tolist()
            ends += output.end_logits.float().tolist()
    best: dict[int, tuple[float, str]] = {}
    for row, sample in enumerate(encoded["overflow_to_sample_mapping"]):
        offsets, sequence_ids = encoded["offset_mapping"][row], encoded.sequence_ids(row)
        s_top = sorted(range(len(offsets)), key=lambda t: -starts[row][t])[:n_best]
        e_top = sorted(range(len(offsets)), key=lambda t: -ends[row][t])[:n_best]
        for s in s_top:
            for e in e_top:
                if sequence_ids[s] != 1 or sequence_ids[e] != 1 or e < s or e - s + 1 > max_answer_len:
                    continue
                score = starts[row][s] + ends[row][e]
                if sample not in best or score > best[sample][0]:
                    context = items[sample]["context"]
                    best[sample] = (score, context[offsets[s][0]:offsets[e][1]])
    return [best.get(i, (0.0, ""))[1] for i in range(len(items))]


# -- fill-mask -----------------------------------------------------------------------------------------

def mask_items(data: Path, tokenizer, count: int = 1000, seed: int = 0, width: int = 30) -> list[tuple[str, str]]:
    """(text with one [MASK], the hidden word): words of WikiText-2 test that the tokenizer keeps whole,
    drawn uniformly (seed 0), each in a window of `width` words either side."""
    import random
    import re

    from plugins import fill_mask as plugin

    passages = [inputs["text"] for inputs, _ in plugin.read_data(str(data / DATA_FILES["fill_mask"]), "all")]
    slots = [(p, i) for p, text in enumerate(passages) for i, word in enumerate(text.split())
             if re.fullmatch(r"[A-Za-z]+", word)]
    rng, items = random.Random(seed), []
    while len(items) < count and slots:
        p, i = slots.pop(rng.randrange(len(slots)))
        words = passages[p].split()
        if len(tokenizer.tokenize(words[i])) != 1:
            continue
        items.append((" ".join(words[max(0, i - width):i] + ["[MASK]"] + words[i + 1:i + 1 + width]), words[i].lower()))
    return items


def fill_mask(folder: Path, data: Path, precision: str, limit: int | None, device: str = "cpu"):
    import transformers

    from bert_engine.runtime.inference import Predictor, predict_texts
    from bert_engine.tasks.registry import load_registry

    task = load_registry(entry_points=False).task("fill_mask")
    engine = Predictor.load(task, str(folder), device=device, precision=precision)
    pairs = mask_items(data, engine.tokenizer, limit or 1000)
    texts, gold = [t for t, _ in pairs], [w for _, w in pairs]
    reference = transformers.pipeline("fill-mask", model=str(folder), batch_size=BATCH, **_reference_place(device, precision), top_k=1)
    out = {}

    def run_engine():  # predict_many (batches of BATCH) where the task has one, else one text at a time
        results = (predict_texts(engine, texts, batch_size=BATCH) if task.spec.predict_many is not None
                   else [engine.predict({"text": t})["result"] for t in texts])
        out["engine"] = [r["predictions"][0]["candidates"][0]["token"].lower() for r in results]

    def run_reference():
        out["reference"] = [(r[0] if isinstance(r, list) else r)["token_str"].strip().lower() for r in reference(texts)]

    def top1(words):
        return {"top1": 100 * sum(w == g for w, g in zip(words, gold)) / len(gold)}

    return len(texts), run_engine, run_reference, out, lambda side: top1(out[side])


# -- summary -------------------------------------------------------------------------------------------

def summary(folder: Path, data: Path, precision: str, limit: int | None, device: str = "cpu"):
    import transformers

    from benchmarks.summary_reference import DOCUMENTS, SummaryReference, torch_encoder
    from bert_engine.runtime.inference import Predictor, predict_texts
    from bert_engine.tasks.registry import load_registry
    from plugins.rouge import rouge
    from plugins.sentences import split_sentences

    task = load_registry(entry_points=False).task("summary")
    examples = list(task.spec.read_data(str(data / DATA_FILES["summary"]), "test"))[:limit]
    texts, references = [x["text"] for x, _ in examples], [t["summary"] for _, t in examples]
    engine = Predictor.load(task, str(folder), device=device, precision=precision)
    place = _reference_place(device, precision)
    model = transformers.BertModel.from_pretrained(str(folder), attn_implementation="sdpa", dtype=place["dtype"],
                                                   add_pooling_layer=False).to(place["device"]).eval()
    reference = SummaryReference(folder, torch_encoder(model), engine.check_options({}))
    out = {}

    def run_engine():
        out["engine"] = [r["selected"] for r in predict_texts(engine, texts, batch_size=DOCUMENTS)]

    def run_reference():
        out["reference"] = [r["selected"] for r in reference.many(texts)]

    def rouge2(side):
        # a summary rebuilt from the sentence indices a contender chose (plugins/summary.py reads the same spans)
        chosen = [" ".join(text[a:b] for k, (a, b) in enumerate(split_sentences(text)) if k in selected)
                  for text, selected in zip(texts, out[side])]
        try:
            return {"rouge2": rouge(chosen, references[:len(chosen)])["rouge2"]}
        except ModuleNotFoundError as err:  # a lent GPU's image has no rouge_score: the timings and "identical" stand
            logging.getLogger(__name__).warning("summary: no ROUGE-2 column (%s is not installed)", err.name)
            return {}

    return len(texts), run_engine, run_reference, out, rouge2


def _reference_precision(device: str, precision: str) -> str:
    """The precision transformers' in-process side runs at beside the engine's `precision`."""
    return "fp32" if device == "cpu" or precision not in ("bf16", "fp16") else precision


def _reference_place(device: str, precision: str) -> dict:
    """Where and in which dtype transformers' side runs: the engine's device, and on a GPU its precision too
    (on the CPU the reference is fp32 only)."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    return {"device": torch.device(device), "dtype": dtypes[_reference_precision(device, precision)]}


TASKS = {"sentiment": sentiment, "ner": ner, "qa": qa, "fill_mask": fill_mask, "summary": summary}


def _items(name: str, data: Path, limit: int | None, tokenizer) -> list[dict]:
    """The task's inputs as the peers receive them (dicts keyed by the task's fields)."""
    from bert_engine.tasks.registry import load_registry

    if name == "fill_mask":
        return [{"text": t} for t, _ in mask_items(data, tokenizer, limit or 1000)]
    task = load_registry(entry_points=False).task(name)
    examples = list(task.spec.read_data(str(data / DATA_FILES[name]), "test"))[:limit or (1000 if name == "qa" else None)]
    return [dict(x) for x, _ in examples]


def _engine_single(name: str, engine):
    """One visitor's request through the engine's Predictor, normalised like the batched predictions."""
    def predict(item: dict):
        result = engine.predict(item)["result"]
        if name == "sentiment":
            return result["label_id"]
        if name == "ner":
            return [list(e) for e in _argmax_entities(result["words"])]
        if name == "qa":
            return result["answer"] or ""
        if name == "summary":
            return result["selected"]
        return result["predictions"][0]["candidates"][0]["token"].lower()
    return predict


# Visitors' requests go to the contenders in turns of VISITOR_TURN requests, each turn after a pause of PAUSE_S: an ONNX
# Runtime process's threads keep spinning for a while after its request, and the engine's next request ran up to 2x
# slower beside them when the turns were one request each with no pause (QA, the Cascade Lake Xeon, session 42);
# after 0.2 s, within 5 % of alone. The engine's forwards run on the CPUs other work left free over the last 0.1 s or
# more (runtime/cpu_load.py): a reading at the pause's start keeps the peer's turn out of the engine's next window.
VISITOR_TURN = 10
PAUSE_S = 0.2


def visitors_in_turn(single, peer, items: list[dict], repeats: int, latencies: dict[str, list[float]],
                     answers: dict[str, list]) -> dict[str, list[float]]:
    """A visitor's requests, the engine and each peer taking turns of VISITOR_TURN requests (who goes first
    rotates), each request timed on its own side's clock: a slow spell of the machine falls on every contender
    alike, where 100 requests of one and then 100 of the next saw their ratio move 10-40 % between runs (session
    41). Seconds per contender for each of `repeats` rounds over `items` (after a warm-up round); the last
    round's latencies and answers go into `latencies` and `answers`."""
    from benchmarks.peers import CONTENDERS
    from bert_engine.runtime.cpu_load import FREE_CPUS

    names = ("engine", *CONTENDERS)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(1 + repeats):
        lat: dict[str, list[float]] = {name: [] for name in names}
        got: dict[str, list] = {name: [] for name in names}
        for turn, first in enumerate(range(0, len(items), VISITOR_TURN)):
            for k in range(len(names)):
                name = names[(turn + k) % len(names)]
                FREE_CPUS.free()  # the engine's reading of other work starts anew: the pause, not the peer's turn
                time.sleep(PAUSE_S)
                for i in range(first, min(first + VISITOR_TURN, len(items))):
                    if name == "engine":
                        start = time.perf_counter()
                        got[name].append(single(items[i]))
                        lat[name].append(time.perf_counter() - start)
                    else:
                        reply = peer.ask(op="one", contender=name, index=i)
                        lat[name].append(reply["seconds"])
                        got[name].append(reply["prediction"])
        if round_:
            for name in names:
                times[name].append(sum(lat[name]))
    latencies.update(lat)
    answers.update(got)
    return times


def _same(a, b) -> bool:
    def norm(v):
        return [list(x) if isinstance(x, (list, tuple)) else x for x in v] if isinstance(v, (list, tuple)) else v
    return norm(a) == norm(b)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _tokens(tokenizer, items: list[dict]) -> int:
    return sum(len(tokenizer.tokenize(" ".join(str(v) for v in x.values()))) for x in items)


def measure(name: str, mode: str, precision: str, workload: tuple, items: list[dict], repeats: int,
            peer=None, reference: bool = False, reference_precision: str = "fp32") -> list[dict]:
    """Rows for one task in one mode: the engine, and each peer (or the in-process reference), run in
    turn `repeats` times after a warm-up round."""
    from benchmarks.peers import CONTENDERS

    count, run_engine, run_reference, out, score = workload
    engine = _engine_of(run_engine)
    subset = items if mode == "batched" else items[:count]
    tokens = _tokens(engine.tokenizer, subset)
    answers: dict[str, list] = {}
    latencies: dict[str, list[float]] = {}
    peer_seconds: dict[str, list[float]] = {}
    single = _engine_single(name, engine)

    def engine_batched():
        run_engine()
        answers["engine"] = out["engine"]

    def engine_single():
        lat, preds = [], []
        for item in subset:
            t = time.perf_counter()
            preds.append(single(item))
            lat.append(time.perf_counter() - t)
        latencies["engine"] = lat
        answers["engine"] = preds

    def peer_call(impl: str):
        def call():
            reply = peer.ask(op="run", contender=impl, mode=mode, batch=BATCH, limit=len(subset))
            peer_seconds.setdefault(impl, []).append(reply["seconds"])
            latencies[impl] = reply["latencies"]
            answers[impl] = reply["predictions"][:len(subset)]
        return call

    def in_process():
        run_reference()
        answers["transformers"] = out["reference"]

    contenders = {"engine": engine_batched if mode == "batched" else engine_single}
    if peer is not None:
        contenders.update({impl: peer_call(impl) for impl in CONTENDERS})
    elif reference:
        contenders["transformers"] = in_process
    if mode == "single" and peer is not None:
        times = visitors_in_turn(single, peer, subset, repeats, latencies, answers)
    else:
        times = interleaved(contenders, repeats, warmup=1)
        times.update({impl: seconds[-repeats:] for impl, seconds in peer_seconds.items()})  # the peer's own clock
    rows = []
    for impl, ts in times.items():
        s, lat = median(ts), latencies.get(impl, [])
        row = {"task": name, "mode": mode, "impl": impl,
               "precision": precision if impl == "engine" else reference_precision if impl == "transformers" and peer is None
               else "fp32",
               "items": len(subset), "tokens": tokens, "s": s, "items_per_s": len(subset) / s, "tokens_per_s": tokens / s,
               "p50_ms": 1000 * percentile(lat, 50) if lat else None,
               "p95_ms": 1000 * percentile(lat, 95) if lat else None}
        if impl != "engine":
            row["identical"] = 100 * sum(_same(a, b) for a, b in zip(answers["engine"], answers[impl])) / len(subset)
        if mode == "batched":
            if impl != "engine":
                out["reference"] = answers[impl]
            row.update({k: round(v, 2) for k, v in score("engine" if impl == "engine" else "reference").items()})
        rows.append(row)
    return rows


def run(tasks: list[str], precisions: list[str], repeats: int, data: Path, limit: int | None, workdir: Path,
        peers: str | None = None, modes: tuple[str, ...] = ("batched",), single_limit: int = 200,
        device: str = "cpu", starters: Path | None = None) -> dict:
    from benchmarks.peers import PeerProcess

    rows = []
    peer = PeerProcess(peers) if peers else None
    try:
        for name in tasks:
            folder = merged_folder(name, workdir, starters)
            for precision in precisions:
                workload = TASKS[name](folder, data, precision, limit, device)
                items = _items(name, data, limit, _engine_of(workload[1]).tokenizer)
                with_peers = peer is not None and precision == precisions[0]
                if with_peers:
                    export = peer.ask(op="load", task=name, folder=str(folder), cache=str(workdir), items=items,
                                      threads=torch.get_num_threads(),
                                      options=_engine_of(workload[1]).check_options({}) if name == "summary" else None
                                      )["export_s"]
                for mode in modes:
                    shaped = workload if mode == "batched" else (single_limit, *workload[1:])
                    # in process, transformers runs beside the engine's fp32 on the CPU, and beside each precision
                    # (in the same dtype) on a GPU
                    new = measure(name, mode, precision, shaped, items, repeats, peer if with_peers else None,
                                  reference=peer is None and mode == "batched" and (precision == "fp32" or device != "cpu"),
                                  reference_precision=_reference_precision(device, precision))
                    for row in new:
                        if row["impl"] == "onnxruntime":
                            row["export_s"] = round(export, 1)
                    rows += new
    finally:
        if peer is not None:
            peer.close()
    compare(rows)
    result = {"machine": machine(), "device": device, "repeats": repeats, "batch_size": BATCH, "rows": rows}
    if peer is not None:
        result["peers"] = peer.versions()
    return result


def compare(rows: list[dict]) -> None:
    """Each engine row against each peer of its task and mode: the peer's row at the engine's precision where
    there is one (a GPU's transformers runs at each), else its fp32 row (the CPU's peers run fp32 only)."""
    for r in rows:
        if r["impl"] != "engine":
            continue
        peers: dict[str, dict] = {}
        for other in rows:
            if (other["task"], other["mode"]) != (r["task"], r["mode"]) or other["impl"] == "engine":
                continue
            kept = peers.get(other["impl"])
            if kept is None or (other["precision"] == r["precision"] and kept["precision"] != r["precision"]):
                peers[other["impl"]] = other
        for impl, other in peers.items():
            r[f"vs_{impl}"] = other["s"] / r["s"]


def _engine_of(run_engine):
    """The Predictor a task's run_engine closes over (every task function builds one named `engine`)."""
    for cell in run_engine.__closure__ or ():
        value = cell.cell_contents
        if hasattr(value, "tokenizer") and hasattr(value, "predict"):
            return value
    raise RuntimeError("run_engine holds no Predictor")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="sentiment,ner,qa")
    parser.add_argument("--precisions", default="fp32", help="engine precisions besides fp32 (always run): bf16, "
                        "int8 (CPU), fp16 (GPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per contender, run in turn")
    parser.add_argument("--data", default=str(DATA), help="the shared data folder (default: shared/data beside the "
                        f"repository, {DATA})")
    parser.add_argument("--limit", type=int, default=None, help="only the first N items per task (qa, fill_mask: "
                        "default 1000)")
    parser.add_argument("--peers", default=None, help="python of the peers' venv (python -m benchmarks.peers "
                        "--setup VENV): transformers 4.57 pipelines and optimum + ONNX Runtime as contenders")
    parser.add_argument("--modes", default="batched", help="batched (a file), single (a visitor: one request at "
                        "a time, p50/p95 latency), or both")
    parser.add_argument("--single-limit", type=int, default=200, help="requests per task in the single mode")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]: where the engine and the "
                        "in-process transformers reference run")
    parser.add_argument("--starters", default=None, help="a folder holding one model folder per task (DIR/<task>) "
                        "to run instead of the shipped starters")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--merge", action="store_true", help="with --json: replace the file's rows of the tasks "
                        "and modes this run measures, keep its others (each kept row says the run it came from)")
    args = parser.parse_args(argv)
    if args.merge and not args.json:
        parser.error("--merge needs --json FILE")
    if args.device != "cpu" and args.peers:
        parser.error("--peers runs ONNX Runtime and transformers 4.57 on the CPU: not with --device " + args.device)
    unknown = [t for t in args.tasks.split(",") if t not in DATA_FILES]
    if unknown:
        parser.error(f"--tasks: unknown {', '.join(unknown)}; known: {', '.join(DATA_FILES)}")
    missing = [str(Path(args.data) / DATA_FILES[t]) for t in args.tasks.split(",")
               if not (Path(args.data) / DATA_FILES[t]).is_file()]
    if missing:
        parser.error(f"the workloads' data is not there: {', '.join(missing)}; pass --data FOLDER (the shared data folder)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA GPU is visible to this torch ({torch.__version__})")
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    precisions = ["fp32"] + [p for p in args.precisions.split(",") if p and p != "fp32"]
    modes = tuple(m for m in args.modes.split(",") if m)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.tasks.split(","), precisions, args.repeats, Path(args.data), args.limit, Path(tmp),
                     peers=args.peers, modes=modes, single_limit=args.single_limit, device=args.device,
                     starters=Path(args.starters) if args.starters else None)
    info = result["machine"]
    peers = result.get("peers")
    where = f"{info['gpu']} ({args.device}), " if args.device != "cpu" else ""
    print(f"# end-to-end workloads, {where}{info['cpu']}, {info['threads']} threads, torch {info['torch']}, "
          + (f"peers: transformers {peers['transformers']}, optimum {peers['optimum']}, onnxruntime "
             f"{peers['onnxruntime']}" if peers else f"transformers {info.get('transformers')}")
          + f"; batch {BATCH}; median of {args.repeats}")
    print_table(result["rows"], ["task", "mode", "impl", "precision", "items", "s", "items_per_s", "tokens_per_s",
                                 "p50_ms", "p95_ms", "vs_transformers", "vs_onnxruntime", "identical", "accuracy",
                                 "f1", "crf_f1", "top1", "rouge2"])
    if args.merge:
        result = merged(Path(args.json), result)
    write_json(args.json, result)


def merged(path: Path, result: dict) -> dict:
    """`result` with the rows of `path` (an earlier run's JSON) for the tasks and modes it did not measure; each
    kept row names its run ("from": that run's command and machine, as its file said)."""
    if not path.is_file():
        return result
    earlier = json.loads(path.read_text(encoding="utf-8"))
    measured = {(r["task"], r["mode"]) for r in result["rows"]}
    origin = {"command": earlier.get("command"), "cpu": earlier.get("machine", {}).get("cpu")}
    kept = [r if "from" in r else {**r, "from": origin} for r in earlier["rows"] if (r["task"], r["mode"]) not in measured]
    order: dict[tuple[str, str], int] = {}
    for r in earlier["rows"]:  # each task and mode where it first stood; a new one after them all
        order.setdefault((r["task"], r["mode"]), len(order))
    rows = sorted(kept + result["rows"], key=lambda r: order.get((r["task"], r["mode"]), len(order)))
    return {**result, "rows": rows, **({"peers": earlier["peers"]} if "peers" in earlier and "peers" not in result else {})}


if __name__ == "__main__":
    main()
