"""Runs ``megatron3d.tools.import_megatron``; installed, it is also the command
``megatron3d-import-megatron``."""
from megatron3d.tools.import_megatron import main

if __name__ == "__main__":
    raise SystemExit(main())
