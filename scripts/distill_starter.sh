#!/usr/bin/env bash
# Distil the starter sentiment and NER models (6-layer MiniLM + LoRA) into 3-layer students, then
# measure each student beside its teacher (python -m benchmarks.distill). Figures: benchmarks/README.md.
# Usage: scripts/distill_starter.sh [sentiment|ner ...]   (default: both). The students stay in runs/.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${BERT_ENGINE_DATA:-../shared/data}
RUNS=${BERT_ENGINE_RUNS:-runs/distil}
TASKS=("$@")
[ ${#TASKS[@]} -eq 0 ] && TASKS=(sentiment ner)
mkdir -p "$RUNS"
for task in "${TASKS[@]}"; do
  case $task in
    sentiment)
      python -m bert_engine distill sentiment --teacher plugins/starter/sentiment --student-layers 3 \
        --train-file "$DATA/sst2/train.tsv" --eval-file "$DATA/sst2/dev.tsv" --max-steps 2000 --eval-every 500 \
        --save-every 500 --batch-size 32 --lr 1e-4 --log-every 50 --output-dir "$RUNS/sentiment" > "$RUNS/sentiment.json"
      python -m benchmarks.distill --task sentiment --teacher plugins/starter/sentiment --student "$RUNS/sentiment/best" \
        --json "$RUNS/sentiment.bench.json" ;;
    ner)
      python -m bert_engine distill ner --teacher plugins/starter/ner --student-layers 3 \
        --train-file "$DATA/conll2003/eng.train" --eval-file "$DATA/conll2003/eng.testa" --eval-limit 1000 \
        --max-steps 1500 --eval-every 500 --save-every 500 --batch-size 32 --lr 1e-4 --log-every 50 \
        --output-dir "$RUNS/ner" > "$RUNS/ner.json"
      python -m benchmarks.distill --task ner --teacher plugins/starter/ner --student "$RUNS/ner/best" \
        --json "$RUNS/ner.bench.json" ;;
    *) echo "unknown task $task (sentiment or ner)" >&2; exit 2 ;;
  esac
done
