#!/usr/bin/env bash
# Train a tiny GPT end to end on this machine (CPU is fine) and print Megatron log lines.
# Extra arguments are passed to pretrain_gpt.py and override the defaults below.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
python pretrain_gpt.py \
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
  --seq-length 64 --max-position-embeddings 64 \
  --micro-batch-size 4 --global-batch-size 16 --rampup-batch-size 8 8 800 \
  --train-iters 200 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10 \
  --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 \
  --mock-data --vocab-size 512 --seed 1234 \
  --log-interval 20 --eval-interval 100 --eval-iters 4 \
  --tensorboard-dir runs/quickstart/tensorboard \
  "$@"
