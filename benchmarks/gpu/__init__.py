"""The GPU check (issue #29): ``scripts/gpu_check.sh`` runs ``python -m benchmarks.gpu.check``."""
