"""Runs ``megatron3d.tools.plan_topology``; installed, it is also the command
``megatron3d-plan-topology``."""
from megatron3d.tools.plan_topology import main

if __name__ == "__main__":
    raise SystemExit(main())
