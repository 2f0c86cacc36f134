"""tools/generate.py on a checkpoint trained at (TP, PP, DP) = (2, 2, 2): greedy ids equal
transformers' ``generate`` on the export (also through the tool's --hf) and a hand-written
argmax loop over ``load_model``; sampling is reproducible per seed; bad input is one line
and exit code 2."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megatron3d.convert.standalone import load_model
from megatron3d.errors import ConfigError
from megatron3d.inference.generation import Sampling, generate, resolve_tokenizer
from tests.helpers.device import rank_device
from tests.helpers.tools import load_tool, tool_logging

generate_tool = load_tool("generate.py")
PROMPT = [5, 17, 3, 99, 42]
VARIED = [200, 3]
IDS = ["--prompt-ids", " ".join(map(str, PROMPT))]


@pytest.fixture
def checkpoint(trained_222) -> Path:
    return trained_222 / "gpt2"


def _generated(capsys, checkpoint: Path, *argv: str) -> str:
    assert generate_tool.main(["--load", str(checkpoint), *argv]) == 0
    return capsys.readouterr().out


def _ids(capsys, checkpoint: Path, *argv: str) -> list[int]:
    """The ids the tool prints; the prompt is ``PROMPT`` unless ``argv`` gives another."""
    prompt = [] if "--prompt-ids" in argv else IDS
    return [int(w) for w in _generated(capsys, checkpoint, *prompt, *argv).split()]


def test_greedy_equals_transformers_and_a_load_model_argmax_loop(checkpoint, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    export_hf = load_tool("checkpoint/export_hf.py")
    with tool_logging():
        assert export_hf.main(["--load", str(checkpoint), "--output", str(tmp_path / "hf"),
                               "--no-verify"]) == 0
    capsys.readouterr()  # its log lines
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    loaded, results = load_model(checkpoint), []
    for prompt in (PROMPT, VARIED):
        ours = _ids(capsys, checkpoint, "--prompt-ids", " ".join(map(str, prompt)),
                    "--max-new-tokens", "8")
        tokens = torch.tensor([prompt])
        with torch.no_grad():
            expected = theirs.generate(tokens, max_new_tokens=8, do_sample=False,
                                       pad_token_id=0)[0, len(prompt):].tolist()
        for _ in range(8):
            tokens = torch.cat([tokens, loaded.logits(tokens)[:, -1].argmax(-1, keepdim=True)],
                               1)
        through_hf = _ids(capsys, checkpoint, "--prompt-ids", " ".join(map(str, prompt)),
                          "--max-new-tokens", "8", "--hf", str(tmp_path / "hf"))
        assert ours == expected == tokens[0, len(prompt):].tolist() == through_hf
        results.append(ours)
    assert results[0][0] != results[1][0] and len(set(results[1])) > 1
    hot = ("--max-new-tokens", "8", "--temperature", "50", "--hf", str(tmp_path / "hf"))
    sampled = _ids(capsys, checkpoint, *hot, "--seed", "7")
    assert sampled == _ids(capsys, checkpoint, *hot, "--seed", "7") != results[0]


def test_sampling_is_reproducible_per_seed_and_not_greedy(checkpoint, capsys):
    hot = ("--max-new-tokens", "8", "--temperature", "50")
    first = _ids(capsys, checkpoint, *hot, "--seed", "7")
    assert first == _ids(capsys, checkpoint, *hot, "--seed", "7")
    loaded = load_model(checkpoint)
    greedy = generate(loaded, PROMPT, 8)
    assert first != greedy
    assert first == generate(loaded, PROMPT, 8, sampling=Sampling(temperature=50, seed=7))
    assert first != generate(loaded, PROMPT, 8, sampling=Sampling(temperature=50, seed=8))
    assert generate(loaded, PROMPT, 8, sampling=Sampling(top_k=1)) == greedy
    hot = Sampling(top_k=20, temperature=2.0, seed=3)
    assert generate(loaded, PROMPT, 8, sampling=hot) == generate(loaded, PROMPT, 8, sampling=hot)


@pytest.mark.cuda
def test_generation_on_the_test_device_equals_the_cpu(checkpoint):
    """The checkpoint (trained on the test device, its 8 ranks sharing it) loaded there
    generates the CPU's greedy tokens, and samples reproducibly per seed."""
    device = rank_device()
    here, cpu = load_model(checkpoint, device=device), load_model(checkpoint)
    assert next(here.model.parameters()).device == device
    for prompt in (PROMPT, VARIED):
        assert generate(here, prompt, 8) == generate(cpu, prompt, 8)
    hot = Sampling(top_k=20, temperature=2.0, seed=3)
    assert generate(here, PROMPT, 8, sampling=hot) == generate(here, PROMPT, 8, sampling=hot)


def test_stops_at_eod_and_fills_the_context_by_default(checkpoint):
    loaded = load_model(checkpoint)
    full = generate(loaded, VARIED)
    assert len(full) == loaded.config.model.seq_length - len(VARIED)
    eod = full[2]
    assert generate(loaded, VARIED, 8, eod=eod) == full[:full.index(eod)] != []


def test_text_prompt_through_a_tokenizer_override(checkpoint, capsys):
    """Mock data records no tokenizer; NullTokenizer (ids as words, eod = vocabulary - 1)
    stands in for one: the text continues the prompt and stops at its eod."""
    greedy = _ids(capsys, checkpoint, "--max-new-tokens", "8")
    text = _generated(capsys, checkpoint, "--prompt", " ".join(map(str, PROMPT)),
                      "--max-new-tokens", "8", "--tokenizer-type", "NullTokenizer")
    eod = load_model(checkpoint).config.model.vocab_size - 1
    kept = greedy[:greedy.index(eod)] if eod in greedy else greedy
    assert text == "".join(f" {t}" for t in kept) + "\n"


def test_a_recorded_tokenizer_that_is_gone_names_the_override_flags(checkpoint):
    cfg = load_model(checkpoint).config
    moved = dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, tokenizer_type="SentencePieceTokenizer", tokenizer_model="elsewhere/sp.model"))
    with pytest.raises(ConfigError, match="cannot be loaded .*pass them again with "
                       "--tokenizer-model, --vocab-file"):
        resolve_tokenizer(moved, {})


BAD = [
    ([], "required: --load"),
    (["--load", "MISSING", *IDS], "no checkpoint in"),
    (["--load", "CKPT"], "one of the arguments --prompt --prompt-ids is required"),
    (["--load", "CKPT", "--prompt", "x", *IDS], "not allowed with argument"),
    (["--load", "CKPT", "--prompt", "5 17"], "has no tokenizer (it trained on --mock-data)"),
    (["--load", "CKPT", "--prompt-ids", "1 x"], "expected whitespace-separated whole numbers"),
    (["--load", "CKPT", "--prompt-ids", "1 203"], "prompt token id 203 is outside"),
    (["--load", "CKPT", "--prompt-ids", "-1"], "prompt token id -1 is outside"),
    (["--load", "CKPT", "--prompt-ids", ""], "the prompt is empty"),
    (["--load", "CKPT", *IDS, "--max-new-tokens", "12"], "give --max-new-tokens 11 or less"),
    (["--load", "CKPT", *IDS, "--max-new-tokens", "0"], "--max-new-tokens='0'"),
    (["--load", "CKPT", *IDS, "--top-k", "0"], "--top-k='0'"),
    (["--load", "CKPT", *IDS, "--top-k", "500"], "--top-k 500 exceeds the vocabulary"),
    (["--load", "CKPT", *IDS, "--temperature", "0"], "--temperature='0'): expected a finite "
     "number >= 0.001"),
    (["--load", "CKPT", *IDS, "--temperature", "nan"], "--temperature='nan'"),
    (["--load", "CKPT", *IDS, "--seed", "3"], "--seed applies only to sampling"),
    (["--load", "CKPT", *IDS, "--top-k", "2", "--seed", "-3"], "--seed='-3'"),
    (["--load", "CKPT", *IDS, "--tokenizer-model", "sp.model"], "records no tokenizer, so "
     "--tokenizer-model needs --tokenizer-type too"),
    (["--load", "CKPT", *IDS, "--tokenizer-type", "SentencePieceTokenizer",
      "--tokenizer-model", "none.model"], "'none.model': file not found"),
    (["--load", "CKPT", *IDS, "--tokenizer-type", "NullTokenizer", "--vocab-file", "v.json"],
     "NullTokenizer does not use --vocab-file"),
    (["--load", "CKPT", *IDS, "--top-p", "0.9"], "unknown flag on the command line (--top-p"),
    (["--load", "CKPT", *IDS, "--hf", "MISSING"], "MISSING holds no config.json: pass the "
     "directory tools/checkpoint/export_hf.py wrote"),
    (["--load", "CKPT", *IDS, "--hf", "CKPT"], "holds no config.json"),
    (["--load", "CKPT", *IDS, "--hf", "MISSING", "--max-new-tokens", "12"],
     "give --max-new-tokens 11 or less"),
]


@pytest.mark.parametrize(("argv", "expected"), BAD, ids=[b[1][:30] for b in BAD])
def test_bad_input_exits_2_with_one_line(checkpoint, tmp_path, capsys, argv, expected):
    argv = [str(checkpoint) if a == "CKPT" else str(tmp_path / a) if a == "MISSING" else a
            for a in argv]
    assert generate_tool.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert captured.out == ""


def test_a_directory_that_is_not_this_checkpoints_export_is_one_line(checkpoint, tmp_path,
                                                                     capsys):
    """Not a transformers model, weights unlike their config, another model's vocabulary."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=300)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "other")
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text('{"model_type": "no-such-model"}')
    (tmp_path / "unlike").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "unlike" / name).write_bytes((tmp_path / "other" / name).read_bytes())
    (tmp_path / "unlike" / "config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "other" / "config.json").read_text()), "vocab_size": 203}))
    capsys.readouterr()
    for name, expected in (("unknown", "cannot be loaded by transformers ("),
                           ("unlike", "cannot be loaded by transformers (its weights do "
                            "not fit its config.json)"),
                           ("other", "has a vocabulary of 300 tokens but the checkpoint's "
                            "model has 203: pass the export of --load")):
        assert generate_tool.main(["--load", str(checkpoint), *IDS, "--hf",
                                   str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --hf {tmp_path / name} ") and expected in err, err
        assert err.count("\n") == 1, err


def test_help_prints_and_exits_0(capsys):
    with pytest.raises(SystemExit) as info:
        generate_tool.main(["--help"])
    assert info.value.code == 0
    assert "--tokenizer-model PATH" in capsys.readouterr().out
