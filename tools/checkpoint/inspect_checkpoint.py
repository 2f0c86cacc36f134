"""Runs ``megatron3d.tools.inspect_checkpoint``; installed, it is also the command
``megatron3d-inspect-checkpoint``."""
from megatron3d.tools.inspect_checkpoint import main

if __name__ == "__main__":
    raise SystemExit(main())
