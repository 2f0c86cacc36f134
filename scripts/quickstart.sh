#!/usr/bin/env bash
# Train a tiny GPT with 3D parallelism on this machine (CPU and gloo are fine): 8 processes,
# tensor-parallel 2 x pipeline-parallel 2 x data-parallel 2 with ZeRO-1, on a real corpus
# that every machine has (the Python standard library's source), through the real data path:
# corpus -> SentencePiece tokenizer -> Megatron .bin/.idx -> pretrain_gpt.py. It saves the
# trained model in runs/quickstart/checkpoints (each run starts a new series there). When
# transformers and safetensors are installed (pip install -e '.[hf]'), it exports the model to
# runs/quickstart/hf (checking transformers' logits against its own). It ends by continuing a
# prompt with tools/generate.py, and again with transformers' generate on the export (the
# SentencePiece tokenizer has no transformers class that reads it as training did, so the
# run's tokenizer turns the text into ids and back).
# Extra arguments go to pretrain_gpt.py and override the defaults below.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export OMP_NUM_THREADS=1
DATA=runs/quickstart/data
CKPT=runs/quickstart/checkpoints
CORPUS=(--max-mb 4 --seed 1234)
mkdir -p "$DATA"
# The data is rebuilt when the corpus flags change; the stamp is written last.
if [ "$(cat "$DATA/corpus.flags" 2>/dev/null)" != "${CORPUS[*]}" ]; then
  python tools/stdlib_corpus.py --output "$DATA/stdlib.jsonl" "${CORPUS[@]}"
  python tools/train_tokenizer.py --input "$DATA/stdlib.jsonl" --model-prefix "$DATA/stdlib_sp" \
    --vocab-size 2048
  python tools/preprocess_data.py --input "$DATA/stdlib.jsonl" --output-prefix "$DATA/stdlib" \
    --json-keys text --append-eod --workers 2 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/stdlib_sp.model"
  echo "${CORPUS[*]}" > "$DATA/corpus.flags"
fi
torchrun --standalone --nproc-per-node 8 pretrain_gpt.py \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --zero-stage 1 \
  --pp-partition-method type:transformer\|embedding \
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
  --seq-length 64 --max-position-embeddings 64 \
  --micro-batch-size 4 --global-batch-size 32 --rampup-batch-size 16 16 1600 \
  --train-iters 120 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-fraction 0.08 \
  --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 \
  --data-path "$DATA/stdlib_text_document" --split 969,30,1 \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/stdlib_sp.model" \
  --seed 1234 --log-interval 10 --eval-interval 60 --eval-iters 2 \
  --tensorboard-dir runs/quickstart/tensorboard --save "$CKPT" --new-series \
  "$@"
PROMPT="def __init__(self"
HF=runs/quickstart/hf
if python -c "import transformers, safetensors" 2>/dev/null; then
  rm -rf "$HF"
  python tools/checkpoint/export_hf.py --load "$CKPT" --output "$HF"
else
  HF=
fi
echo "megatron3d (tools/generate.py) continues '$PROMPT' (greedy):"
python tools/generate.py --load "$CKPT" --prompt "$PROMPT" --max-new-tokens 24
if [ -n "$HF" ]; then
  echo "transformers (generate on the export in $HF, through tools/generate.py --hf) continues it:"
  python tools/generate.py --load "$CKPT" --hf "$HF" --prompt "$PROMPT" --max-new-tokens 24
else
  echo "skipping the Hugging Face export and transformers' generate: pip install -e '.[hf]'"
fi
