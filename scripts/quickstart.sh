#!/usr/bin/env bash
# Train a tiny GPT with 3D parallelism on this machine (CPU and gloo are fine): 8 processes,
# tensor-parallel 2 x pipeline-parallel 2 x data-parallel 2 with ZeRO-1, on a real corpus
# that every machine has (the Python standard library's source), through the real data path:
# corpus -> SentencePiece tokenizer -> Megatron .bin/.idx -> pretrain_gpt.py.
# Extra arguments go to pretrain_gpt.py and override the defaults below.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export OMP_NUM_THREADS=1
DATA=runs/quickstart/data
mkdir -p "$DATA"
if [ ! -f "$DATA/stdlib_text_document.idx" ]; then
  python tools/stdlib_corpus.py --output "$DATA/stdlib.jsonl" --max-mb 4
  python tools/train_tokenizer.py --input "$DATA/stdlib.jsonl" --model-prefix "$DATA/stdlib_sp" \
    --vocab-size 2048
  python tools/preprocess_data.py --input "$DATA/stdlib.jsonl" --output-prefix "$DATA/stdlib" \
    --json-keys text --append-eod --workers 2 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/stdlib_sp.model"
fi
torchrun --standalone --nproc-per-node 8 pretrain_gpt.py \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --zero-stage 1 \
  --pp-partition-method type:transformer\|embedding \
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
  --seq-length 64 --max-position-embeddings 64 \
  --micro-batch-size 4 --global-batch-size 32 --rampup-batch-size 16 16 1600 \
  --train-iters 120 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10 \
  --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 \
  --data-path "$DATA/stdlib_text_document" --split 969,30,1 \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/stdlib_sp.model" \
  --seed 1234 --log-interval 10 --eval-interval 60 --eval-iters 2 \
  --tensorboard-dir runs/quickstart/tensorboard \
  "$@"
