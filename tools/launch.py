"""Runs ``megatron3d.tools.launch`` (torchrun whose exit code is the failing rank's);
installed, it is also the command ``megatron3d-launch``."""
from megatron3d.tools.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
