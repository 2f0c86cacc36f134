"""Text generation from a loaded checkpoint: greedy or sampled, one sequence, one process.

``tools/generate.py`` is a thin command line over this; with ``--hf`` it runs an export of
the checkpoint with transformers' ``generate`` instead (``generate_with_transformers``), still
tokenizing with the run's tokenizer, which transformers may have no class for.

``generate`` runs the whole sequence through the model for every new token (no key/value
cache): the models a checkpoint tool meets on a CPU are small, and the same forward as
training keeps generation trivially correct. The context is the model's ``seq_length`` (the
rotary tables and learned positions are built for it): a prompt plus new tokens longer than
that is refused, never silently cut, by both.

The tokenizer recorded in a checkpoint holds the paths training was given, which may be
relative to where training ran; ``resolve_tokenizer`` takes flag overrides for them.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from megatron3d.config import ModelConfig, TrainConfig
from megatron3d.convert.standalone import LoadedModel, tokenizer_spec
from megatron3d.data.tokenizer import Tokenizer, TokenizerSpec, build_tokenizer
from megatron3d.errors import ConfigError

TOKENIZER_FLAGS = ("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file",
                   "--tokenizer-name-or-path")
DEFAULT_SEED = 1234


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: the argmax when neither ``top_k`` nor ``temperature``
    is set; otherwise a draw from the ``top_k`` most likely tokens (all when None) at
    ``temperature`` (1 when None), from a generator seeded with ``seed``."""

    top_k: int | None = None
    temperature: float | None = None
    seed: int = DEFAULT_SEED

    @property
    def greedy(self) -> bool:
        return self.top_k is None and self.temperature is None


GREEDY = Sampling()


def generate(loaded: LoadedModel, prompt: Sequence[int], max_new_tokens: int | None = None,
             *, eod: int | None = None, sampling: Sampling = GREEDY) -> list[int]:
    """The token ids that follow ``prompt``: ``max_new_tokens`` of them (default: until the
    context is full), fewer when ``eod`` comes (it is not returned). ConfigError for ids
    outside the vocabulary or a request longer than the context."""
    budget = _budget(loaded.config.model, list(prompt), max_new_tokens, sampling)
    generator = torch.Generator().manual_seed(sampling.seed)
    tokens = torch.tensor([list(prompt)], dtype=torch.long)  # [1, s]
    new: list[int] = []
    for _ in range(budget):
        last = loaded.logits(tokens)[0, -1].cpu()  # [V], where the generator draws
        token = _pick(last, sampling, generator)
        if token == eod:
            break
        new.append(token)
        tokens = torch.cat([tokens, torch.tensor([[token]])], dim=1)
    return new


def generate_with_transformers(hf_dir: str, model: ModelConfig, prompt: Sequence[int],
                               max_new_tokens: int | None = None, *, eod: int | None = None,
                               sampling: Sampling = GREEDY) -> list[int]:
    """What ``generate`` returns, computed by transformers' ``generate`` on ``hf_dir`` (an
    export of the checkpoint whose model is ``model``): the same greedy tokens; sampled ones
    come from transformers' own draws (torch's global generator, seeded and restored)."""
    budget = _budget(model, list(prompt), max_new_tokens, sampling)
    theirs = _transformers_model(hf_dir, model.vocab_size)
    options = {"do_sample": not sampling.greedy, "max_new_tokens": budget,
               "eos_token_id": eod, "pad_token_id": 0 if eod is None else eod}
    if not sampling.greedy:
        options.update(top_k=sampling.top_k or 0, temperature=sampling.temperature or 1.0,
                       top_p=1.0)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(sampling.seed)
        new = theirs.generate(torch.tensor([list(prompt)]), **options)[0, len(prompt):]
    tokens = new.tolist()
    return tokens[:tokens.index(eod)] if eod in tokens else tokens


def _transformers_model(hf_dir: str, vocab: int) -> torch.nn.Module:
    """The transformers model in ``hf_dir`` (fp32, eval mode); ConfigError when transformers
    is missing, cannot load it, or its vocabulary is not the checkpoint's."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("--hf needs the transformers package: pip install -e '.[hf]'") \
            from None
    if not (Path(hf_dir) / "config.json").is_file():
        raise ConfigError(f"--hf {hf_dir} holds no config.json: pass the directory "
                          "tools/checkpoint/export_hf.py wrote")
    theirs = _quietly_load(transformers, hf_dir)
    if theirs.config.vocab_size != vocab:
        raise ConfigError(f"--hf {hf_dir} has a vocabulary of {theirs.config.vocab_size} "
                          f"tokens but the checkpoint's model has {vocab}: pass the export of "
                          "--load")
    return theirs.float().eval()


def _quietly_load(transformers: ModuleType, hf_dir: str) -> torch.nn.Module:
    """``from_pretrained`` with transformers' own log lines and loading bar off (a failure is
    our one line, not their report and then ours)."""
    logging = transformers.utils.logging
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True)
    except RuntimeError:  # what transformers raises for weights that do not fit the config
        raise ConfigError(f"--hf {hf_dir} cannot be loaded by transformers (its weights do "
                          "not fit its config.json): pass the directory "
                          "tools/checkpoint/export_hf.py wrote") from None
    except (OSError, ValueError, pickle.UnpicklingError, EOFError) as err:  # torch.load's
        raise ConfigError(f"--hf {hf_dir} cannot be loaded by transformers "
                          f"({str(err).strip().splitlines()[0][:120]}): pass the directory "
                          "tools/checkpoint/export_hf.py wrote") from None
    finally:
        logging.set_verbosity(verbosity)


def _budget(model: ModelConfig, prompt: list[int], max_new_tokens: int | None,
            sampling: Sampling) -> int:
    """How many tokens to generate; ConfigError for a request the model cannot serve."""
    _check_request(prompt, max_new_tokens, model.vocab_size, model.seq_length)
    if sampling.top_k is not None and sampling.top_k > model.vocab_size:
        raise ConfigError(f"--top-k {sampling.top_k} exceeds the vocabulary "
                          f"({model.vocab_size} tokens); give at most {model.vocab_size}")
    return model.seq_length - len(prompt) if max_new_tokens is None else max_new_tokens


def _check_request(prompt: list[int], max_new_tokens: int | None, vocab: int,
                   context: int) -> None:
    if not prompt:
        raise ConfigError("the prompt is empty (no tokens): give at least one token")
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise ConfigError(f"prompt token id {bad} is outside the model's vocabulary "
                          f"[0, {vocab}); give ids below {vocab}")
    wanted = len(prompt) + (max_new_tokens or 1)
    if wanted > context:
        room = context - len(prompt)
        fix = (f"give --max-new-tokens {room} or less" if room > 0
               else f"shorten the prompt to at most {context - 1} tokens")
        raise ConfigError(f"the prompt ({len(prompt)} tokens) plus the new tokens "
                          f"({max_new_tokens or 1}) exceed the model's context of {context} "
                          f"tokens (--seq-length at training): {fix}")


def _pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token id from the last position's logits [V]."""
    if sampling.greedy:
        return int(logits.argmax())
    scaled = logits / (sampling.temperature or 1.0)
    if sampling.top_k is not None:
        kept, ids = scaled.topk(sampling.top_k)
        return int(ids[torch.multinomial(kept.softmax(-1), 1, generator=generator)])
    return int(torch.multinomial(scaled.softmax(-1), 1, generator=generator))


def continuation_text(tokenizer: Tokenizer, prompt: Sequence[int], new: Sequence[int]) -> str:
    """The text ``new`` adds after ``prompt``, with the spacing it has in context (tokenizers
    such as SentencePiece drop a leading space when a piece is decoded alone)."""
    before = tokenizer.detokenize(prompt)
    full = tokenizer.detokenize([*prompt, *new])
    return full[len(before):] if full.startswith(before) else tokenizer.detokenize(new)


def resolve_tokenizer(cfg: TrainConfig, overrides: dict[str, str | None]) -> Tokenizer | None:
    """The tokenizer of the run ``cfg`` describes, with ``overrides`` (TokenizerSpec field ->
    value; None = not given) replacing what the checkpoint recorded; None when it has none
    and none is given.

    A ``tokenizer_type`` other than the recorded one starts from that type alone. A recorded
    tokenizer that cannot be loaded (a relative path from elsewhere, a moved file) is a
    one-line ConfigError naming the flags that override it.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    recorded = tokenizer_spec(cfg)
    kind = given.get("tokenizer_type")
    if recorded is not None and kind in (None, recorded.tokenizer_type):
        spec = dataclasses.replace(recorded, **given)
    elif kind is not None:
        spec = TokenizerSpec(**given)
    elif given:
        raise ConfigError(f"the checkpoint records no tokenizer, so {_flag(next(iter(given)))} "
                          "needs --tokenizer-type too")
    else:
        return None
    if spec.tokenizer_type == "NullTokenizer" and spec.vocab_size is None:
        spec = dataclasses.replace(spec, vocab_size=cfg.model.vocab_size - 1)
    unused = spec.unused_flags()
    if unused:
        raise ConfigError(f"--tokenizer-type {spec.tokenizer_type} does not use {unused[0]}; "
                          "drop it")
    try:
        tokenizer = build_tokenizer(spec)
    except ConfigError as err:
        if given:
            raise
        raise ConfigError(f"the checkpoint's tokenizer cannot be loaded ({err}); its paths are "
                          "the ones training was given, maybe relative to where it ran: pass "
                          f"them again with {', '.join(TOKENIZER_FLAGS[1:])}") from None
    _check_vocabulary(tokenizer, cfg.model.vocab_size)
    return tokenizer


def _check_vocabulary(tokenizer: Tokenizer, vocab: int) -> None:
    """A tokenizer of another size is not the run's: its ids would mean other tokens."""
    if tokenizer.vocab_size != vocab:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model was "
                          f"trained with {vocab}: give the tokenizer the run was trained with")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")
