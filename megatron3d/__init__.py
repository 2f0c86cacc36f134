"""megatron3d: Megatron-style 3D-parallel GPT training on PyTorch."""
__version__ = "0.1.0"
