"""Runs ``megatron3d.tools.stdlib_corpus``; installed, it is also the command
``megatron3d-stdlib-corpus``."""
from megatron3d.tools.stdlib_corpus import main

if __name__ == "__main__":
    raise SystemExit(main())
