"""Continued pre-training of a Hugging Face import: transformers models (random weights, made
from a config) with their tokenizers, imported and trained through pretrain_gpt at TP=2 x
PP=2 on real ``.bin/.idx`` data that our preprocess tool wrote with that tokenizer, start
from transformers' own loss on the same tokens. Each model family comes with a tokenizer
family: GPT-2 with GPT-2 BPE files, Llama with SentencePiece, BLOOM with a Hugging Face
``tokenizer.json`` (and so do today's families: Llama 3.x with its RoPE scaling, Mistral,
Qwen2 with its QKV bias); the command line names the tokenizer and no model flag or dropout
(the checkpoint's, from the Hugging Face config, are used). One launch runs all six; the
trained checkpoints then export back to transformers with their tokenizers."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from megatron3d.checkpoint.loading import check_model_matches, with_checkpoint_args
from megatron3d.cli.arguments import parse_given
from megatron3d.config import TrainConfig
from megatron3d.convert.standalone import load_model
from megatron3d.data.prep.tokenizer_training import train_sentencepiece
from megatron3d.data.tokenizer import TokenizerSpec, build_tokenizer
from megatron3d.errors import CheckpointError
from megatron3d.validation import validate
from tests.data.test_tokenizer import synthetic_text, tiny_gpt2_files
from tests.helpers.dist import run_distributed
from tests.helpers.hf_models import saved_hf_model
from tests.helpers.runs import build
from tests.helpers.tools import load_tool, tool_logging

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("sentencepiece")
import_hf, preprocess = load_tool("checkpoint/import_hf.py"), load_tool("preprocess_data.py")
export_hf = load_tool("checkpoint/export_hf.py")

SEQ, GBS = 16, 8
INIT_RANGE = 0.5  # far from a flat guess: a misplaced tensor would change the loss
CONFIGS = {  # every dropout 0, as the configs of Llama and BLOOM have by default
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": SEQ,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "bloom": {"model_type": "bloom", "n_layer": 2, "hidden_size": 32, "n_head": 4},
    "llama": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32,
              "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 64,
              "max_position_embeddings": SEQ, "rms_norm_eps": 1e-6},
}
_LLAMA_SHAPE = {k: v for k, v in CONFIGS["llama"].items() if k != "model_type"}
CONFIGS |= {  # Llama 3.x's scaling over an original context of 16 smooths one frequency
    "llama3": {"model_type": "llama", **_LLAMA_SHAPE, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    "mistral": {"model_type": "mistral", **_LLAMA_SHAPE, "sliding_window": SEQ},  # = full
    "qwen2": {"model_type": "qwen2", **_LLAMA_SHAPE, "tie_word_embeddings": True},
}


def _tokenizer(flavour: str, directory: Path) -> tuple[int, list[str]]:
    """Write ``flavour``'s tokenizer into the model directory, as the Hub has it: its
    vocabulary size and the pretrain_gpt.py flags that name it."""
    directory.mkdir(parents=True)
    if flavour == "llama":
        model = train_sentencepiece([synthetic_text(400)], str(directory / "tokenizer"), 300)
        return 300, ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model]
    vocab, merges = tiny_gpt2_files(directory)
    if flavour == "gpt2":
        return len(vocab), ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                            str(directory / "vocab.json"), "--merge-file",
                            str(directory / "merges.txt")]
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    hf.save(str(directory / "tokenizer.json"))
    return len(vocab), ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path",
                        str(directory)]


def _hf_model(flavour: str, directory: Path, vocab: int):
    return saved_hf_model(CONFIGS[flavour], directory, vocab, INIT_RANGE)


def _first_steps(runs: dict[str, list[str]]) -> dict[str, tuple[float, list]]:
    """Rank view of one step from each imported checkpoint: the first loss and the
    micro-batches of the global batch it was computed on (on the last stage)."""
    out = {}
    for flavour, argv in runs.items():
        losses: list[torch.Tensor] = []
        trainer, state = build(argv, on_step=lambda _, result, into=losses:
                               into.append(result.loss))
        trainer.run()
        if state.is_last_stage:
            out[flavour] = (losses[0].item(), trainer.data.train(0, GBS))
    return out


def test_imported_models_continue_from_transformers_loss_on_real_data(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": synthetic_text(6, seed)}) + "\n"
                              for seed in range(60)))
    models, runs = {}, {}
    for flavour in CONFIGS:
        hf_dir = tmp_path / f"hf-{flavour}"
        vocab, tokenizer_flags = _tokenizer(flavour, hf_dir)
        models[flavour] = _hf_model(flavour, hf_dir, vocab)
        prefix = tmp_path / f"data-{flavour}"
        ckpt = str(tmp_path / f"ckpt-{flavour}")
        with tool_logging():
            assert preprocess.main(["--input", str(corpus), "--output-prefix", str(prefix),
                                    "--append-eod", "--no-progress", *tokenizer_flags]) == 0
            assert import_hf.main(["--hf", str(hf_dir), "--save", ckpt, "--seq-length",
                                   str(SEQ), "--tensor-model-parallel-size", "2",
                                   "--pipeline-model-parallel-size", "2"]) == 0
        runs[flavour] = [
            "--load", ckpt, "--use-checkpoint-args", "--data-path",
            f"{prefix}_text_document", "--split", "90,10,0", *tokenizer_flags,
            "--micro-batch-size", "2", "--global-batch-size", str(GBS), "--train-iters", "1",
            "--lr", "1e-3", "--lr-warmup-iters", "0", "--eval-iters", "0",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--data-cache-path", str(tmp_path / "index-cache"),
            "--save", str(tmp_path / f"trained-{flavour}")]
    last_stage = run_distributed(_first_steps, 4, runs, timeout_s=300)[-1]
    for flavour, model in models.items():
        loss, micro_batches = last_stage[flavour]
        tokens = torch.cat([b.tokens for b in micro_batches])
        labels = torch.cat([b.labels for b in micro_batches])
        vocab = model.config.vocab_size
        assert tokens.shape == (GBS, SEQ) and len(set(tokens.flatten().tolist())) > 10, flavour
        assert all(bool(b.loss_mask.all()) for b in micro_batches)
        with torch.no_grad():
            logits = model(tokens).logits
        expected = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1)).item()
        assert expected > math.log(vocab) + 2, (flavour, expected)  # far from a flat guess
        assert loss == pytest.approx(expected, rel=1e-4), flavour
    _export_after_training(tmp_path)


def _export_after_training(tmp_path: Path) -> None:
    """The end of the path: each tokenizer family's trained checkpoint exports to a model
    transformers loads (export_hf checks its logits against ours), with the tokenizer it was
    trained with where transformers has one that reads it as we do (GPT-2 BPE files, a
    tokenizer.json; a SentencePiece model is not: transformers' LlamaTokenizer splits
    leading whitespace otherwise)."""
    for flavour, files in (("gpt2", ["merges.txt", "vocab.json"]), ("bloom", ["tokenizer.json"]),
                           ("llama", [])):
        out = tmp_path / f"exported-{flavour}"
        with tool_logging():
            assert export_hf.main(["--load", str(tmp_path / f"trained-{flavour}"),
                                   "--output", str(out)]) == 0
        assert all((out / f).is_file() for f in files) and (files or not (
            out / "tokenizer.model").exists()), flavour
        if files:
            theirs = transformers.AutoTokenizer.from_pretrained(out)
            ours = build_tokenizer(load_model(str(tmp_path / f"trained-{flavour}")).tokenizer)
            text = synthetic_text(2, 99)
            assert theirs.encode(text, add_special_tokens=False) == ours.tokenize(text)


@pytest.fixture(scope="module")
def llama_import(tmp_path_factory) -> str:
    """An imported Llama (vocabulary 300, attention_dropout 0.0 as transformers' default)."""
    root = tmp_path_factory.mktemp("llama")
    _hf_model("llama", root / "hf", 300)
    with tool_logging():
        assert import_hf.main(["--hf", str(root / "hf"), "--save", str(root / "ckpt")]) == 0
    return str(root / "ckpt")


def _continue(ckpt: str, *flags: str) -> tuple[TrainConfig, list[str]]:
    cfg, _, given = parse_given(["--load", ckpt, "--use-checkpoint-args", "--train-iters", "1",
                                 "--micro-batch-size", "1", "--lr", "1e-3", *flags])
    return with_checkpoint_args(cfg, given)


@pytest.mark.parametrize(("data", "vocab"), [
    (("--mock-data",), 300),
    (("--data-path", "d", "--tokenizer-type", "NullTokenizer"), 299),  # + 1 for its eod
    (("--data-path", "d", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
      "t.model"), None),  # the tokenizer's
], ids=["mock", "NullTokenizer", "SentencePiece"])
def test_checkpoint_args_leave_the_vocabulary_to_the_tokenizer(llama_import, data, vocab):
    cfg, _ = _continue(llama_import, *data)
    assert cfg.model.vocab_size == vocab
    validate(cfg, 1)
    if vocab is not None and not cfg.data.mock_data:
        assert build_tokenizer(TokenizerSpec("NullTokenizer", vocab_size=vocab)).vocab_size == 300


def test_a_tokenizer_of_another_size_is_one_line(llama_import):
    cfg, _ = _continue(llama_import, "--mock-data")
    saved = {"model": {**dataclasses.asdict(cfg.model)}}
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=261))
    with pytest.raises(CheckpointError, match=r"^the tokenizer has 261 tokens but the "
                       r"checkpoint's model 300: give the tokenizer the model was made with"):
        check_model_matches(other, saved)


def test_dropout_is_the_imported_configs_unless_given(llama_import):
    cfg, notices = _continue(llama_import, "--mock-data")
    assert (cfg.model.hidden_dropout, cfg.model.attention_dropout) == (0.0, 0.0)
    assert notices == []
    cfg, notices = _continue(llama_import, "--mock-data", "--hidden-dropout", "0.2")
    assert (cfg.model.hidden_dropout, cfg.model.attention_dropout) == (0.2, 0.0)
    assert notices == ["--hidden-dropout 0.2 differs from the checkpoint's 0.0: the flag is "
                       "used"]


def test_what_the_import_trains_otherwise_is_a_notice(tmp_path, capsys):
    config = {**CONFIGS["gpt2"], "embd_pdrop": 0.2}
    kind = config.pop("model_type")
    transformers.AutoModelForCausalLM.from_config(transformers.CONFIG_MAPPING[kind](
        vocab_size=64, **config)).save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    with tool_logging():
        assert import_hf.main(["--hf", str(tmp_path / "hf"), "--save",
                               str(tmp_path / "ckpt")]) == 0
    assert ("notice: config.json has embd_pdrop=0.2 and resid_pdrop=0.0: megatron3d drops "
            "out the embeddings as the residual stream, with 0.0") in capsys.readouterr().out
