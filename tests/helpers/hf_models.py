"""Tiny transformers models made from a config (no downloads), for the import tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def saved_hf_model(config: dict[str, Any], directory: Path, vocab: int, init_range: float):
    """The model of ``config`` (with its ``model_type``), drawn from seed 0 at std
    ``init_range``, saved under ``directory``. Biases are drawn too: transformers starts them
    at zero, where a misplaced one would not show."""
    import transformers

    settings = dict(config)
    kind = settings.pop("model_type")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.CONFIG_MAPPING[kind](
        vocab_size=vocab, initializer_range=init_range, **settings)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, init_range)
    model.save_pretrained(directory)
    return model
