"""Install megatron3d. CI and the scripts pin torch==2.13.0 (a local CPU wheel); the range
below is what the code supports."""

from setuptools import find_packages, setup

setup(
    name="megatron3d",
    version="0.1.0",
    description="Megatron-style 3D-parallel GPT training on PyTorch",
    packages=find_packages(include=["megatron3d", "megatron3d.*"]),
    py_modules=["pretrain_gpt"],
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.3",
        "numpy",
        "pyyaml",
        "sentencepiece",
        "tensorboard",
        "tqdm",
    ],
    extras_require={
        # tokenizers: the PretrainedFromHF tests; transformers: the model is checked against
        # it; hypothesis: the bad-input fuzz suite
        "test": ["pytest>=7", "tokenizers", "transformers", "safetensors", "hypothesis"],
        "hf": ["transformers", "safetensors", "tokenizers"],
        "dev": ["ruff"],
    },
)
