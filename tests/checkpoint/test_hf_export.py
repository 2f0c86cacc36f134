"""Export to Hugging Face: a checkpoint trained at (TP, PP, DP) = (2, 2, 2) loads with
transformers' AutoModelForCausalLM and gives megatron3d's logits and greedy generations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron3d.checkpoint.hf import ARCHITECTURES
from megatron3d.checkpoint.standalone import load_model
from tests.checkpoint.conftest import FLAVOURS
from tests.checkpoint.test_bad_checkpoints import _tree
from tests.helpers.tools import load_tool

export_hf = load_tool("checkpoint/export_hf.py")

transformers = pytest.importorskip("transformers")

@pytest.fixture
def checkpoints(trained_222) -> Path:
    return trained_222


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_export_matches_transformers_logits_and_greedy_generation(checkpoints, tmp_path,
                                                                   flavour, capsys):
    out = tmp_path / "hf"
    assert export_hf.main(["--load", str(checkpoints / flavour), "--output", str(out)]) == 0
    logged = capsys.readouterr()
    assert "top-1 agreement 100.0%" in logged.err + logged.out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[flavour]]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    ours = load_model(checkpoints / flavour)
    prompt = torch.tensor([[5, 17, 3, 99, 42]])
    with torch.no_grad():
        expected = theirs(prompt).logits
        generated = theirs.generate(prompt, max_new_tokens=8, do_sample=False,
                                    pad_token_id=0)[0, 5:].tolist()
    torch.testing.assert_close(ours.logits(prompt), expected, rtol=1e-4, atol=1e-4)
    tokens = prompt
    for _ in range(8):  # greedy, by hand, through load_model
        tokens = torch.cat([tokens, ours.logits(tokens)[:, -1].argmax(-1, keepdim=True)], 1)
    assert tokens[0, 5:].tolist() == generated


def test_unsupported_model_or_output_is_one_line_and_writes_nothing(checkpoints, tmp_path,
                                                                     capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("keep me\n")
    before = _tree(taken)
    assert export_hf.main(["--load", str(checkpoints / "gpt2"), "--output", str(taken)]) == 2
    assert export_hf.main(["--load", str(tmp_path / "nothing"), "--output",
                           str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err), err
    assert "already exists and is not an empty directory" in err[0]
    assert "no checkpoint in" in err[1]
    assert _tree(taken) == before and not (tmp_path / "new").exists()
