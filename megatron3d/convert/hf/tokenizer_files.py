"""The tokenizer saved beside a Hugging Face model, recorded by the import.

``save_pretrained`` of a tokenizer writes ``tokenizer.json`` (a fast tokenizer, read here as
``PretrainedFromHF``), GPT-2's ``vocab.json`` and ``merges.txt`` (``GPT2BPETokenizer``) or a
SentencePiece ``tokenizer.model`` (``SentencePieceTokenizer``), the first found in that
order. Its files are copied into the checkpoint (``iter_0000000/tokenizer/``) and the run
configuration names them relative to that directory, so the checkpoint keeps its tokenizer
wherever it is moved (``standalone.checkpoint_config`` turns such paths back into real ones
for the tools that read the checkpoint; export_hf copies the tokenizer next to the exported
model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron3d.data.tokenizer import TokenizerSpec, build_tokenizer
from megatron3d.errors import Megatron3dError

DIRECTORY = "tokenizer"  # inside the checkpoint's iteration directory
_HF_SETTINGS = ("tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class FoundTokenizer:
    """``data``: the DataConfig tokenizer fields, relative to the checkpoint's iteration
    directory; ``files``: checkpoint-relative name -> the file beside the model."""

    data: dict[str, str]
    files: dict[str, Path]
    notice: str | None  # what training will need to know about it


def find(directory: Path, vocab_size: int) -> FoundTokenizer | None:
    """The tokenizer saved in ``directory`` (None when there is none); a notice when it
    cannot be loaded or has another size than the model's vocabulary."""
    kind, names = _kind(directory)
    if kind is None:
        return None
    files = {f"{DIRECTORY}/{n}": directory / n for n in names}
    if kind == "PretrainedFromHF":
        files.update({f"{DIRECTORY}/{n}": directory / n for n in _HF_SETTINGS
                      if (directory / n).is_file()})
        data = {"tokenizer_name_or_path": DIRECTORY}
    elif kind == "GPT2BPETokenizer":
        data = {"vocab_file": f"{DIRECTORY}/vocab.json", "merge_file": f"{DIRECTORY}/merges.txt"}
    else:
        data = {"tokenizer_model": f"{DIRECTORY}/tokenizer.model"}
    return FoundTokenizer({"tokenizer_type": kind, **data}, files,
                          _notice(kind, directory, names, vocab_size))


def _kind(directory: Path) -> tuple[str | None, tuple[str, ...]]:
    for kind, names in (("PretrainedFromHF", ("tokenizer.json",)),
                        ("GPT2BPETokenizer", ("vocab.json", "merges.txt")),
                        ("SentencePieceTokenizer", ("tokenizer.model",))):
        if all((directory / n).is_file() for n in names):
            return kind, names
    return None, ()


def _notice(kind: str, directory: Path, names: tuple[str, ...], vocab_size: int) -> str | None:
    """Why training will not take this tokenizer as it is, if it will not."""
    paths = {"PretrainedFromHF": {"tokenizer_name_or_path": str(directory)},
             "GPT2BPETokenizer": {"vocab_file": str(directory / "vocab.json"),
                                  "merge_file": str(directory / "merges.txt")},
             "SentencePieceTokenizer": {"tokenizer_model": str(directory / "tokenizer.model")}}
    try:
        tokens = build_tokenizer(TokenizerSpec(kind, **paths[kind])).vocab_size
    except Megatron3dError as err:
        return f"the tokenizer beside the model ({names[0]}) cannot be loaded ({err})"
    if tokens != vocab_size:
        return (f"the tokenizer beside the model ({names[0]}) has {tokens} tokens but "
                f"config.json's vocab_size is {vocab_size}: training needs a tokenizer of "
                f"{vocab_size}")
    return None

