"""Runs ``megatron3d.tools.generate``; installed, it is also the command
``megatron3d-generate``."""
from megatron3d.tools.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
