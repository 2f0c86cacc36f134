"""Runs ``megatron3d.tools.train_tokenizer``; installed, it is also the command
``megatron3d-train-tokenizer``."""
from megatron3d.tools.train_tokenizer import main

if __name__ == "__main__":
    raise SystemExit(main())
