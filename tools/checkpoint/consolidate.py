"""Runs ``megatron3d.tools.consolidate``; installed, it is also the command
``megatron3d-consolidate``."""
from megatron3d.tools.consolidate import main

if __name__ == "__main__":
    raise SystemExit(main())
