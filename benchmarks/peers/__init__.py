"""Side-by-side comparison with peer frameworks: same model, weights, batches and optimizer.

Optional: the peers (``requirements.txt``) are installed in a venv of their own, never by
``setup.py``; ``python -m benchmarks.peers.compare [--quick]`` is the entry."""
