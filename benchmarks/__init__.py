"""One script per question, run from the repository root as ``python -m benchmarks.NAME``;
ratios against a baseline measured in the same invocation (``benchmarks/README.md``)."""
