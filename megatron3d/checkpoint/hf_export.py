"""Write a checkpoint as a Hugging Face transformers model directory, one layer at a time.

The weights go into safetensors shards, one per transformer layer plus one for the
embeddings and head, listed in ``model.safetensors.index.json`` (transformers' sharded
format), so only one layer's tensors are in memory at once. Everything is written into
``OUTPUT.tmp`` and renamed at the end: a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron3d.checkpoint import hf
from megatron3d.checkpoint.reader import CheckpointReader
from megatron3d.checkpoint.standalone import load_model, saved_config, tokenizer_spec
from megatron3d.config import TrainConfig
from megatron3d.data.tokenizer import build_tokenizer
from megatron3d.errors import ConfigError
from megatron3d.log import get_logger

logger = get_logger(__name__)
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ExportReport:
    output: Path
    tensors: int
    peak_bytes: int  # the most tensor bytes held at once (one shard)
    largest_bytes: int  # the largest single tensor


def export(load: str, output: str) -> ExportReport:
    """The newest checkpoint in ``load`` -> a transformers model directory ``output``."""
    save_file = _safetensors_writer()
    reader = CheckpointReader.latest(load)
    cfg = saved_config(reader.meta)
    config = hf.hf_config(cfg.model, _eod(cfg))  # refuses a model no transformers class holds
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--output {output} already exists and is not an empty directory: "
                          "choose a new path, nothing was written")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards = hf.pieces_by_layer(reader.names())
    index: dict[str, str] = {}
    peak = largest = 0
    for number, names in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = dict(pair for name in names
                       for pair in hf.to_hf(cfg.model, name, reader.tensor(name)))
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        peak, largest = max(peak, sum(sizes)), max(largest, *sizes)
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, file))
    total = sum((tmp / f).stat().st_size for f in set(index.values()))
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                         "weight_map": dict(sorted(index.items()))}, indent=1))
    (tmp / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    logger.info("tokenizer: %s", export_tokenizer(cfg, tmp))
    shutil.rmtree(out, ignore_errors=True)  # an empty directory, checked above
    tmp.rename(out)
    return ExportReport(out, len(index), peak, largest)


def export_tokenizer(cfg: TrainConfig, directory: Path) -> str:
    """Copy the run's tokenizer files where transformers' AutoTokenizer finds them, when
    transformers has a tokenizer that reads them as the run did; say what was done."""
    spec = tokenizer_spec(cfg)
    kind = spec.tokenizer_type if spec else None
    if kind == "GPT2BPETokenizer":
        files = {spec.vocab_file: "vocab.json", spec.merge_file: "merges.txt"}
        settings = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": cfg.model.seq_length}
    elif kind == "PretrainedFromHF":
        source = Path(spec.tokenizer_name_or_path)
        source = source if source.is_dir() else source.parent
        files = {str(source / n): n for n in _HF_TOKENIZER_FILES if (source / n).is_file()}
        settings = None if "tokenizer_config.json" in files.values() else {
            "tokenizer_class": "PreTrainedTokenizerFast"}
    else:
        return (f"not exported ({kind or 'none: mock data'}): transformers has no tokenizer "
                "that reads it exactly as megatron3d does")
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        return f"not exported: {missing[0]} is not here (the paths are the ones training used)"
    for source, name in files.items():
        shutil.copyfile(source, directory / name)
    if settings is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
    return "copied " + ", ".join(sorted(files.values()))


_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _eod(cfg: TrainConfig) -> int | None:
    """The run's end-of-document token, when its tokenizer can be loaded from here."""
    spec = tokenizer_spec(cfg)
    if spec is None:
        return None
    try:
        return build_tokenizer(spec).eod
    except ConfigError as err:
        logger.info("the run's tokenizer cannot be loaded from here (%s): config.json gets no "
                    "end-of-document token", err)
        return None


def _safetensors_writer():
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError("exporting needs the safetensors package: pip install -e '.[hf]'") \
            from None
    return save_file


@dataclass(frozen=True)
class Agreement:
    max_abs_diff: float
    max_abs_logit: float
    top1_agreement: float  # fraction of positions with the same argmax


def verify(load: str, output: Path, tokens: int = 32, seed: int = 0) -> Agreement:
    """Logits of the exported model under transformers against megatron3d's own forward,
    on fixed random token ids (2 sequences)."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("verifying the export needs transformers: pip install -e '.[hf]', "
                          "or pass --no-verify") from None
    ours = load_model(load)
    length = min(tokens, ours.config.model.seq_length)
    ids = torch.randint(0, ours.config.model.vocab_size, (2, length),
                        generator=torch.Generator().manual_seed(seed))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(output).float()
    with torch.no_grad():
        expected = theirs.eval()(ids).logits.float()
    actual = ours.logits(ids)
    return Agreement(max_abs_diff=float((actual - expected).abs().max()),
                     max_abs_logit=float(expected.abs().max()),
                     top1_agreement=float((actual.argmax(-1) == expected.argmax(-1))
                                          .float().mean()))
