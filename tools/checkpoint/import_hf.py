"""Runs ``megatron3d.tools.import_hf``; installed, it is also the command
``megatron3d-import-hf``."""
from megatron3d.tools.import_hf import main

if __name__ == "__main__":
    raise SystemExit(main())
