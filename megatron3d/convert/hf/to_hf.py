"""Write a checkpoint as a Hugging Face transformers model directory, one layer at a time.

The weights go into safetensors shards, one per transformer layer plus one for the
embeddings and head, listed in ``model.safetensors.index.json`` (transformers' sharded
format), so only one layer's tensors are in memory at once. Everything that can be refused
is checked before anything is written: the packages, the checkpoint's contents (every tensor
whole, ``contents.check_contents``), the architecture and the output path. The directory is
written under a fresh name of its own (``OUTPUT.<pid>.<random>.tmp``, created by this export, so
no file of the user's is ever replaced or removed), verified there (transformers' logits
against ours) and renamed only then, so a failure at any point leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from megatron3d.checkpoint.reader import CheckpointReader
from megatron3d.config import TrainConfig
from megatron3d.convert.contents import Owned, check_contents, model_tensors
from megatron3d.convert.hf import mapping, tensor_map
from megatron3d.convert.staging import staging_path
from megatron3d.convert.standalone import checkpoint_config, model_of, tokenizer_spec
from megatron3d.convert.streaming import PeakMemory, logical_tensors
from megatron3d.data.tokenizer import build_tokenizer
from megatron3d.errors import CheckpointError, ConfigError, TrainingError
from megatron3d.log import get_logger

logger = get_logger(__name__)
INDEX = "model.safetensors.index.json"
TOLERANCE = 1e-4  # of the largest |logit|: fp32 sums in another order differ by ~1e-6
_INSTALL = "pip install -e '.[hf]'"


@dataclass(frozen=True)
class Agreement:
    max_abs_diff: float
    max_abs_logit: float
    top1_agreement: float  # fraction of positions with the same argmax


@dataclass(frozen=True)
class ExportReport:
    output: Path
    tensors: int
    largest_layer_bytes: int  # the most tensor bytes held at once while writing (one shard)
    largest_bytes: int  # the largest single tensor
    written_peak_bytes: int  # measured growth of resident memory while writing
    peak_bytes: int  # the same, verification included (two whole models)
    agreement: Agreement | None  # None with verify off


@dataclass(frozen=True)
class ExportPlan:
    """An export checked in full, with nothing written yet (``plan_export``)."""

    reader: CheckpointReader
    cfg: TrainConfig
    config: dict[str, Any]  # config.json
    owned: list[Owned]
    output: Path
    created: Path | None  # the outermost missing directory above ``output``
    save_file: Callable[..., None]
    transformers: ModuleType | None  # None: no verification


def plan_export(load: str, output: str, verify: bool = True,
                family: str | None = None) -> ExportPlan:
    """Everything an export of the newest checkpoint in ``load`` to the new directory
    ``output`` (as transformers' ``family``, ``mapping.family_of``) can be refused for: the
    packages, the checkpoint and its contents, the architecture, an existing output. Writes
    nothing."""
    save_file = _safetensors_writer()
    transformers = _transformers() if verify else None
    reader = CheckpointReader.latest(load)
    cfg = checkpoint_config(reader)
    config = mapping.hf_config(cfg.model, _eod(cfg), family)  # refuses a model no class holds
    owned = model_tensors(cfg.model)
    check_contents(reader, [(p, "weight") for p in owned])
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--output {output} already exists and is not an empty directory: "
                          "choose a new path, nothing was written")
    return ExportPlan(reader, cfg, config, owned, out, _outermost_missing(out), save_file,
                      transformers)


def export(plan: ExportPlan) -> ExportReport:
    """Write ``plan``'s directory (and verify it there, when asked) under a staging name, then
    rename it; a failure removes what was written (and the directories made for it)."""
    out = plan.output
    peak = PeakMemory()
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staged = staging_path(out)
        staged.mkdir()  # FileExistsError rather than a user's directory
        tmp = staged
        sizes = _write(plan.reader, plan.cfg, plan.owned, tmp, plan.save_file)
        (tmp / "config.json").write_text(json.dumps(plan.config, indent=1, sort_keys=True))
        logger.info("tokenizer: %s", export_tokenizer(plan.cfg, tmp))
        written = peak.growth
        agreement = (None if plan.transformers is None
                     else _checked(plan.reader, tmp, plan.transformers))
        if out.is_dir():
            out.rmdir()  # empty, as the plan found it; fails if anything arrived since
        tmp.rename(out)
    except OSError as err:
        _remove(plan.created or tmp)
        raise CheckpointError(f"cannot write {out} ({err.strerror or err}): free space or "
                              "choose another --output; nothing was written") from None
    except BaseException:
        _remove(plan.created or tmp)
        raise
    return ExportReport(out, sizes.tensors, sizes.layer, sizes.largest, written, peak.growth,
                        agreement)


@dataclass(frozen=True)
class _Sizes:
    tensors: int
    layer: int
    largest: int


def _write(reader: CheckpointReader, cfg: TrainConfig, owned: list[Owned], directory: Path,
           save_file: Callable[..., None]) -> _Sizes:
    """The safetensors shards (one per layer) and their index, streamed from ``reader``."""
    shards = tensor_map.pieces_by_layer([p.meta.name for p in owned])
    index: dict[str, str] = {}
    layer = largest = 0
    for number, names in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = dict(pair for name, _, logical in
                       logical_tensors(reader, ((n, "weight") for n in names))
                       for pair in tensor_map.to_hf(cfg.model, name, logical))
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        layer, largest = max(layer, sum(sizes)), max(largest, *sizes)
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, file))
    total = sum((directory / f).stat().st_size for f in set(index.values()))
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                               "weight_map": dict(sorted(index.items()))},
                                              indent=1))
    return _Sizes(len(index), layer, largest)


def _outermost_missing(path: Path) -> Path | None:
    """The outermost directory above ``path`` that does not exist yet: the export creates
    it, and removes it again if it fails."""
    missing = None
    for parent in path.absolute().parents:
        if parent.exists():
            break
        missing = parent
    return missing


def _remove(path: Path | None) -> None:
    """What this export created (its own staging directory, or the directories it made for
    ``--output``), never a path of the same name that was there before."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


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
                "that reads it exactly as megatron3d does (tools/generate.py --hf tokenizes "
                "with it and generates with transformers)")
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


def _safetensors_writer() -> Callable[..., None]:
    """safetensors' ``save_file``, raising OSError for its own error type (a full disk
    surfaces as ``SafetensorError``), so a failed write is the export's one line."""
    try:
        from safetensors import SafetensorError
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError(f"exporting needs the safetensors package: {_INSTALL}") from None

    def write(tensors: dict[str, torch.Tensor], path: str, **kwargs: Any) -> None:
        try:
            save_file(tensors, path, **kwargs)
        except SafetensorError as err:
            raise OSError(f"safetensors: {str(err).strip().splitlines()[0][:160]}") from None
    return write


def _transformers() -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"verifying the export needs the transformers package: {_INSTALL}, "
                          "or pass --no-verify") from None
    return transformers


def _checked(reader: CheckpointReader, directory: Path, transformers: ModuleType) -> Agreement:
    """``verify``, refusing an export whose logits are not the checkpoint's."""
    agreement = verify(reader, directory, transformers)
    logger.info("transformers vs megatron3d logits: max abs difference %.3g (largest |logit| "
                "%.3g), top-1 agreement %.1f%%", agreement.max_abs_diff,
                agreement.max_abs_logit, 100 * agreement.top1_agreement)
    if agreement.max_abs_diff > TOLERANCE * max(1.0, agreement.max_abs_logit):
        raise TrainingError(f"the export does not reproduce the checkpoint's logits (max abs "
                            f"difference {agreement.max_abs_diff:.3g}): nothing was written; "
                            "please report this (--no-verify writes it unchecked)")
    return agreement


def verify(reader: CheckpointReader, directory: Path, transformers: ModuleType,
           tokens: int = 32, seed: int = 0) -> Agreement:
    """Logits of the model in ``directory`` under transformers against megatron3d's own
    forward of the checkpoint ``reader`` has open, on fixed random token ids (2 sequences)."""
    ours = model_of(reader)
    length = min(tokens, ours.config.model.seq_length)
    ids = torch.randint(0, ours.config.model.vocab_size, (2, length),
                        generator=torch.Generator().manual_seed(seed))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True).float()
    with torch.no_grad():
        expected = theirs.eval()(ids).logits.float()
    actual = ours.logits(ids)
    return Agreement(max_abs_diff=float((actual - expected).abs().max()),
                     max_abs_logit=float(expected.abs().max()),
                     top1_agreement=float((actual.argmax(-1) == expected.argmax(-1))
                                          .float().mean()))
