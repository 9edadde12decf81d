#!/usr/bin/env bash
# What a rented GPU machine runs in one call (here: 64 MiB of files in, at most 10 minutes, no network): a
# starter trained further (issue 35; TASK=fill_mask, the default, or TASK=qa), timed to fit, then for fill-mask
# the GPU benchmarks of issue 40.
#
# Before, here (the carried files live in .devcarry/, which git ignores):
#   python scripts/compact_base.py pack default .devcarry/minilm-compact    # 90 MB -> 34 MB (see its docstring)
#   fill_mask: the corpus (15 MB)
#     mkdir -p STAGE/corpus; cp -r ../shared/data/gutenberg ../shared/data/wikitext2/wiki.valid.tokens STAGE/corpus/
#     cp ../shared/data/sst2/dev.tsv STAGE/corpus/sst2-dev.tsv
#     python scripts/squad_contexts.py "../shared/data/squad/train-v1.1.part0*of08.json" STAGE/corpus/squad-train.txt
#     python scripts/bbc_corpus.py ../shared/data/bbc_news_summary/bbc_news_summary.jsonl STAGE/corpus/bbc-train.txt
#     tar cf - -C STAGE corpus | xz -9 > .devcarry/corpus.tar.xz
#   qa: SQuAD 1.1 train, QED train and SQuAD 2.0 dev (8 MB), and pysbd (pure Python; the lent image lacks it)
#     mkdir -p STAGE/qa-data; cp ../shared/data/squad/train-v1.1.part0*of08.json ../shared/data/qed/qed-train.squad.part*of2.json \
#       ../shared/data/squad/dev-v2.0.json STAGE/qa-data/; tar cf - -C STAGE qa-data | xz -9 > .devcarry/qa-data.tar.xz
#     mkdir -p .devcarry/py; cp -r "$(python -c 'import pysbd, os; print(os.path.dirname(pysbd.__file__))')" .devcarry/py/
#   every task: httpx2, httpcore2 and truststore (pure Python, each with its dist-info: httpx2 reads its version from
#   it), which bert_engine.checkpoints.hub imports and the lent image lacks (session 56's first two calls ended there):
#     SP=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
#     for p in httpx2 httpcore2 truststore; do cp -r $SP/$p $SP/$p-*.dist-info .devcarry/py/; done
# There, in the repository, with those .devcarry/ paths carried along (session 27's two calls):
#   pip install --no-deps --no-build-isolation -e . && TRAIN_MINUTES=3.5 OUT=... bash scripts/gpu_lease.sh
#   pip install ... && PYTHONPATH=$PWD/.devcarry/py TASK=qa TRAIN_MINUTES=4 OUT=... bash scripts/gpu_lease.sh
# Session 31's one call (carry .devcarry/lease, laid out as below): `python3 -m pip install ...` (there, plain `pip`
# belonged to another Python: the built-in tasks' entry points were missing), then with PYTHONPATH=.devcarry/lease/py
# CARRY=.devcarry/lease SKIP_SMOKE=1 BENCH=none: TASK=qa TRAIN_MINUTES=3 SEED=49 WORK=/tmp/lq OUT=$OUT/qa, then
# TASK=fill_mask TRAIN_MINUTES=2.6 SEED=47 WORK=/tmp/lf OUT=$OUT/fm (8 min 4 s in all).
# After, here: untar OUT's best.tar or last.tar, `compact_base.py rebase` it onto default, cast its tensors back
# to float32, put logs.tar's train_config.json, run.json and metrics.jsonl beside it as the run folder, and
# `bert-engine pack` it with the evaluation data (MODEL_CARD.md gives the commands; QA then qa_calibrate.py).
#
# Both tasks in one call (session 31): the carry folder holds compact.safetensors.xz (34 -> 27 MB) and a corpus
# without squad-train.txt, which is then written there from qa-data.tar.xz (the same bytes); SKIP_SMOKE=1 skips
# the smoke stage (the CPU dry run in tests/test_gpu_lease.py covers the same stages). KINDS="last" sends back the
# last checkpoint only (one file fewer of the 8 a call returns; scripts/gpu_call.sh runs both tasks so).
# SMOKE=1: a CPU dry run of the same stages, tiny. STEPS=N: train N steps instead of TRAIN_MINUTES (default 5,
# `--max-minutes`); session 26 ran STEPS=3000 (3 min 31 s on an H200). RANK: the adapter's rank (default 40, what
# a starter folder stores); SEED. corpus/ holds the fill-mask starter's
# training text (MODEL_CARD.md): gutenberg/ (the train split is taken by hash at read time), wiki.valid.tokens,
# squad-train.txt (scripts/squad_contexts.py), bbc-train.txt (scripts/bbc_corpus.py), and sst2-dev.tsv for the
# padding-free benchmark. Small files go back as one logs.tar, refreshed at each stage; a failed smoke run ends
# the call at once (time left to rerun), a failed benchmark does not stop the next, and the training stops
# itself in time, at worst on SIGINT, which writes a resumable checkpoint. The adapters come back in float16
# (a file of at most 16 MiB): rebase them with compact_base.py and score them on the real MiniLM.
set -uo pipefail
OUT=${OUT:?set OUT to the folder that comes back}
CARRY=${CARRY:-.devcarry}
WORK=${WORK:-/tmp/lease}
TRAIN_MINUTES=${TRAIN_MINUTES:-5}
TASK=${TASK:-fill_mask}   # or qa
RANK=${RANK:-40}          # the adapter's rank: 40 is what a starter folder stores (session 26 trained at 128)
case $TASK in fill_mask) DATA_TAR=corpus.tar.xz ;; qa) DATA_TAR=qa-data.tar.xz ;; *) echo "TASK: fill_mask or qa, not $TASK"; exit 2 ;; esac
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
PY=${PY:-python3}
LOGS=$WORK/logs  # small files, sent back as one logs.tar (8 files come back at most)
mkdir -p "$WORK" "$OUT" "$LOGS"
device=cuda precision=bf16
# The CPU dry run trains in fp32 ("auto" on a CPU): bf16 is refused on a CPU without native bf16 (an AVX2-only one)
[ -n "${SMOKE:-}" ] && device=cpu precision=auto
stage() { [ -d "$LOGS" ] && tar cf "$OUT/logs.tar" -C "$LOGS" .; echo "== $(date +%T) $*"; }

stage setup
$PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
    "$CARRY/$DATA_TAR" "$WORK"  # Python's own xz: no xz program needed there
COMPACT=$CARRY/minilm-compact
if [ -f "$COMPACT/compact.safetensors.xz" ]; then  # xz'd to fit both tasks' data in one call's 64 MiB
  mkdir -p "$WORK/compact"; cp "$COMPACT"/*.json "$COMPACT"/vocab.txt "$WORK/compact/"
  $PY -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
      "$COMPACT/compact.safetensors.xz" "$WORK/compact/compact.safetensors"
  COMPACT=$WORK/compact
fi
$PY scripts/compact_base.py expand "$COMPACT" "$WORK/minilm" > "$LOGS/base.json"
# INIT: the adapter to continue from (default the shipped starter), a folder on the real MiniLM as `rebase` writes
# it; session 51 kept a run that its shipping rule did not ship in .devcarry/lease/fm-init, for the next loan
$PY scripts/compact_base.py rebase "${INIT:-plugins/starter/$TASK}" --base default --copy "$WORK/minilm" \
    --out "$WORK/init" > "$LOGS/rebase.json" || exit 1
$PY - <<'EOF' > "$LOGS/machine.json"
import json, platform, torch
info = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda}
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name()
print(json.dumps(info))
EOF
cat "$LOGS/machine.json"
$PY -c "import sys; from bert_engine.tasks.registry import load_registry; load_registry().task(sys.argv[1])" "$TASK" \
  || { echo "the $TASK task is not registered: install the package with the Python that runs this (\$PY -m pip)"; stage failed; exit 1; }

C=$WORK/corpus
if [ "$TASK" = fill_mask ] && [ ! -f "$C/squad-train.txt" ] && [ -f "$CARRY/qa-data.tar.xz" ]; then
  # a corpus carried without SQuAD's paragraphs: the same bytes, written from the QA data's SQuAD train
  $PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" "$CARRY/qa-data.tar.xz" "$WORK"
  $PY scripts/squad_contexts.py "$WORK/qa-data/train-v1.1.part0*of08.json" "$C/squad-train.txt" || exit 1
fi
if [ "$TASK" = fill_mask ]; then
  train=(--train-file "$C/gutenberg,$C/wiki.valid.tokens,$C/squad-train.txt,$C/bbc-train.txt" --train-split train
         --eval-file "$C/gutenberg" --eval-split test --eval-limit 300 -o whole_word=true)
  batch=256 rates=(--lr 1e-3 --head-lr 2e-3) seed=${SEED:-46}
else  # the shipped pack's part 7 (MODEL_CARD.md, qa): part 5's data and split at four times its batch
  Q=$WORK/qa-data
  train=(--train-file "$(ls $Q/train-v1.1.part0*of08.json | paste -sd,),$Q/qed-train.squad.part1of2.json,$Q/qed-train.squad.part2of2.json,$Q/qed-train.squad.part1of2.json,$Q/qed-train.squad.part2of2.json"
         --train-split "train+negatives:0.1+absent:0.15+removed:0.15+swapped+antonym+numbers+negated:0.25"
         --eval-file "$Q/dev-v2.0.json" --eval-split dev --eval-limit 400 --best-metric best_f1)
  batch=64 rates=(--lr 6e-4 --head-lr 3e-3) seed=${SEED:-48}
fi
train+=(--model "$WORK/minilm" --init-adapter "$WORK/init" --lora-rank "$RANK" --lora-alpha "$RANK"
        --lora-targets query,key,value,attention_output,ffn_up,ffn_down
        --precision $precision --length-buckets 50 --log-every 50 --device $device)

rm -rf "$WORK/smoke" "$WORK/run"  # a warm machine keeps /tmp: the last call's run is not this one's
if [ -z "${SKIP_SMOKE:-}" ]; then
stage "smoke: 12 steps of the $TASK training on $device"
# 150 s bounds a lent GPU's time; the CPU dry run (CI, beside other tests on 2 cores) once needed 155 s
if [ -n "${SMOKE:-}" ]; then sizes=(--batch-size 4); smoke_s=600; else sizes=(--batch-size $batch); smoke_s=150; fi
[ "$TASK" = qa ] && sizes+=(--train-limit 2000)  # reading all of SQuAD twice would cost a minute
timeout -s INT $smoke_s $PY -m bert_engine train $TASK "${train[@]}" "${sizes[@]}" --output-dir "$WORK/smoke" \
    --max-steps 12 --eval-every 12 --eval-limit 20 --save-every 12 > "$LOGS/smoke.json" 2> "$LOGS/smoke.log" \
  || { echo "the smoke run failed:"; tail -30 "$LOGS/smoke.log"; stage failed; exit 1; }
tail -3 "$LOGS/smoke.log"
fi

stage "$TASK training, about $TRAIN_MINUTES minutes"
if [ -n "${SMOKE:-}" ]; then long=(--batch-size 4 --max-steps 60 --eval-every 30 --eval-limit 20 --save-every 30)
else long=(--batch-size $batch --max-steps ${STEPS:-100000} --eval-every 1000 --save-every 500); fi
# the CPU dry run gets 600 s, as its smoke stage does: on 2 shared cores it once ran 9 s a step and was cut at step 9
train_s=$($PY -c "print(int($TRAIN_MINUTES * 60 + 90))"); [ -n "${SMOKE:-}" ] && train_s=$(( train_s > 600 ? train_s : 600 ))
timeout -s INT $train_s $PY -m bert_engine train $TASK "${train[@]}" \
    "${long[@]}" ${STEPS:+--warmup-ratio 0.03} $([ -z "${STEPS:-}" ] && echo --max-minutes "$TRAIN_MINUTES") "${rates[@]}" --seed $seed --output-dir "$WORK/run" \
    > "$LOGS/train.json" 2> "$LOGS/train.log"
echo "training exit $?"; grep -E "max_minutes|best so far|Error|error" "$LOGS/train.log" | tail -12
cp "$WORK/run/metrics.jsonl" "$WORK/run/run.json" "$WORK/run/train_config.json" "$LOGS/" 2>/dev/null  # what `pack` reads
stage "the adapters"
for kind in ${KINDS:-best last}; do  # the adapter alone in float16 (16 MiB a file comes back), not the optimizer state
  [ -d "$WORK/run/$kind" ] || continue
  $PY -c "import sys; from safetensors.torch import load_file, save_file; p = sys.argv[1]; \
save_file({k: v.half() if v.is_floating_point() else v for k, v in load_file(p).items()}, p)" \
      "$WORK/run/$kind/adapter.safetensors"
  tar cf "$OUT/$kind.tar" -C "$WORK/run/$kind" $(cd "$WORK/run/$kind" && ls | grep -v trainer_state.pt)
done
BENCH=${BENCH:-real}  # real: the padding-free step on SST-2 lengths only; all: session 26's too; none
if [ -z "${SMOKE:-}" ] && [ "$BENCH" != none ] && [ "$TASK" = fill_mask ]; then
  stage "benchmarks (GPU, bert-base in its shape with random weights)"
  if [ "${BENCH}" = all ]; then  # session 26's figures (benchmarks/results/gpu/)
    timeout 50 $PY -m benchmarks.encoder --device cuda --models bert-base --shapes 32x128,32x512 \
        --precisions bf16 --no-onnx --repeats 20 --json "$LOGS/encoder_cuda.json" > "$LOGS/bench.log" 2>&1
    timeout 50 $PY -m benchmarks.train_step --device cuda --model bert-base --shape 32x512 --precision bf16 \
        --json "$LOGS/train_step_cuda.json" >> "$LOGS/bench.log" 2>&1
  fi
  timeout 50 $PY -m benchmarks.train_step --device cuda --model bert-base --shape 32x128 --precision bf16 \
      --objective classify --data "$C/sst2-dev.tsv" --tokenizer "$WORK/minilm" --json "$LOGS/train_step_cuda_sst2.json" >> "$LOGS/bench.log" 2>&1
  grep -v "^\s*$" "$LOGS/bench.log" | tail -40
fi

ls -la "$OUT"
stage done
