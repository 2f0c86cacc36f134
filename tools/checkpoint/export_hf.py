"""Runs ``megatron3d.tools.export_hf``; installed, it is also the command
``megatron3d-export-hf``."""
from megatron3d.tools.export_hf import main

if __name__ == "__main__":
    raise SystemExit(main())
