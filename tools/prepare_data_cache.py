"""Runs ``megatron3d.tools.prepare_data_cache``; installed, it is also the command
``megatron3d-prepare-data-cache``."""
from megatron3d.tools.prepare_data_cache import main

if __name__ == "__main__":
    raise SystemExit(main())
