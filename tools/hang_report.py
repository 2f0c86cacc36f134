"""Runs ``megatron3d.tools.hang_report``; installed, it is also the command
``megatron3d-hang-report``."""
from megatron3d.tools.hang_report import main

if __name__ == "__main__":
    raise SystemExit(main())
