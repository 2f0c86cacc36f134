"""Install megatron3d. CI and the scripts pin torch==2.13.0 (a local CPU wheel); the range
below is what the code supports."""

from setuptools import find_packages, setup

setup(
    name="megatron3d",
    version="0.1.0",
    description="Megatron-style 3D-parallel GPT training on PyTorch",
    packages=find_packages(include=["megatron3d", "megatron3d.*"]),
    py_modules=["pretrain_gpt"],
    # tools/*.py run the same functions (the paths Megatron users type)
    entry_points={
        "console_scripts": [
            "megatron3d-pretrain-gpt = pretrain_gpt:main",
            "megatron3d-consolidate = megatron3d.tools.consolidate:main",
            "megatron3d-export-hf = megatron3d.tools.export_hf:main",
            "megatron3d-generate = megatron3d.tools.generate:main",
            "megatron3d-hang-report = megatron3d.tools.hang_report:main",
            "megatron3d-import-hf = megatron3d.tools.import_hf:main",
            "megatron3d-import-megatron = megatron3d.tools.import_megatron:main",
            "megatron3d-inspect-checkpoint = megatron3d.tools.inspect_checkpoint:main",
            "megatron3d-launch = megatron3d.tools.launch:main",
            "megatron3d-plan-topology = megatron3d.tools.plan_topology:main",
            "megatron3d-prepare-data-cache = megatron3d.tools.prepare_data_cache:main",
            "megatron3d-preprocess-data = megatron3d.tools.preprocess_data:main",
            "megatron3d-reshape = megatron3d.tools.reshape:main",
            "megatron3d-stdlib-corpus = megatron3d.tools.stdlib_corpus:main",
            "megatron3d-train-tokenizer = megatron3d.tools.train_tokenizer:main",
        ],
    },
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.5",  # SDPA's grouped-query attention (enable_gqa)
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
