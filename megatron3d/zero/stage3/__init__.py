"""ZeRO-3: parameters sharded over data parallelism, gathered one unit at a time by a plan."""
