"""Runs ``megatron3d.tools.reshape``; installed, it is also the command
``megatron3d-reshape``."""
from megatron3d.tools.reshape import main

if __name__ == "__main__":
    raise SystemExit(main())
