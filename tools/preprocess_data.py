"""Runs ``megatron3d.tools.preprocess_data``; installed, it is also the command
``megatron3d-preprocess-data``."""
from megatron3d.tools.preprocess_data import main

if __name__ == "__main__":
    raise SystemExit(main())
