"""Today's Megatron-LM example scripts and BigScience's BLOOM launch line: every flag gets its
own verdict (applied, a notice, read as megatron3d's flag, or refused with the replacement),
never the generic "not a megatron3d flag"; the README's table says what the code does."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from megatron3d.cli import compat
from megatron3d.cli.arguments import build_parser, parse_args, parse_command_line
from megatron3d.errors import ConfigError
from megatron3d.validation import validate
from tests.helpers.tiny import train_argv

REPO = Path(__file__).resolve().parents[1]

# examples/gpt3/train_gpt3_175b_distributed.sh, examples/llama/train_llama3_8b_h100_fp8.sh,
# examples/mixtral/*.sh and the newer large-run scripts (flags not megatron3d's own).
CURRENT_MEGATRON_LM = {
    "--attention-backend auto": "notice",
    "--attention-backend flash": "notice",
    "--cross-entropy-loss-fusion": "notice",
    "--manual-gc": "notice",
    "--manual-gc-interval 10": "notice",
    "--empty-unused-memory-level 1": "notice",
    "--tp-comm-overlap": "notice",
    "--ckpt-fully-parallel-save": "notice",
    "--ckpt-fully-parallel-load": "notice",
    "--ckpt-assume-constant-structure": "notice",
    "--use-persistent-ckpt-worker": "notice",
    "--wandb-project megatron-lm-training": "notice",
    "--wandb-exp-name llama3x-8b": "notice",
    "--wandb-save-dir /ckpt/wandb": "notice",
    "--ddp-bucket-size 40000000": "alias",
    "--ddp-num-buckets 8": "notice",
    "--profile": "notice",
    "--profile-step-start 4": "notice",
    "--profile-step-end 6": "notice",
    "--no-create-attention-mask-in-dataloader": "notice",
    "--tiktoken-pattern v2": "notice",
    "--log-memory-interval 1000": "notice",
    "--log-progress": "notice",
    "--log-straggler": "alias",
    "--log-energy": "notice",
    "--logging-level 20": "notice",
    "--timing-log-option minmax": "notice",
    "--disable-gloo-process-groups": "notice",
    "--disable-straggler-on-startup": "notice",
    "--straggler-minmax-count 16": "notice",
    "--rerun-mode disabled": "notice",
    "--rerun-mode validate_results": "alias",
    "--rerun-mode report_stats": "refuse",
    "--data-args-path /data/blend.txt": "alias",
    "--decoupled-lr 5e-4": "refuse",
    "--calculate-per-token-loss": "refuse",
    "--fp8-format hybrid": "refuse",
    "--fp8-param-gather": "refuse",
    "--moe-router-topk 2": "refuse",
    "--moe-grouped-gemm": "refuse",
    "--use-torch-fsdp2": "refuse",
    "--per-split-data-args-path /data/blend.json": "refuse",
    "--save-retain-interval 2000": "refuse",
    "--lr-wsd-decay-style exponential": "refuse",
    "--expert-model-parallel-size 8": "refuse",
}

# BigScience's tr11-176B-ml launch (Megatron-DeepSpeed), beyond what test_compat.py covers.
BLOOM_MORE = {
    "--pad-vocab-size-to 250880": "applied",
    "--valid-num-workers 0": "notice",
    "--deepspeed": "notice",
    "--deepspeed_config ds_config.json": "refuse",
    "--data-impl mmap": "applied",
}


def _verdict(words: str) -> tuple[str, compat.Translation]:
    argv = shlex.split(words)
    result = compat.translate(argv, build_parser().known_flags())
    if result.problems:
        return "refuse", result
    if result.notices:
        return ("alias" if ": read as " in result.notices[0] else "notice"), result
    assert result.argv[0] == argv[0]
    return "applied", result


@pytest.mark.parametrize(("words", "expected"), [*CURRENT_MEGATRON_LM.items(),
                                                 *BLOOM_MORE.items()])
def test_each_flag_of_todays_launch_lines_has_its_own_verdict(words, expected):
    verdict, result = _verdict(words)
    assert verdict == expected
    for _, why in result.problems:  # a refusal names what to do instead
        assert "not a megatron3d flag" not in why and re.search(r"\b(use|drop|give)\b", why)


def test_hugging_face_tokenizer_maps_to_pretrained_from_hf(tmp_path):
    cfg, notices = parse_command_line([
        *train_argv("gpt2", 3), "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", "/models/llama3"])
    assert cfg.data.tokenizer_type == "PretrainedFromHF"
    assert cfg.data.tokenizer_name_or_path == "/models/llama3" and cfg.data.tokenizer_model is None
    assert any(n.startswith("--tokenizer-type HuggingFaceTokenizer --tokenizer-model "
                            "/models/llama3: read as --tokenizer-type PretrainedFromHF "
                            "--tokenizer-name-or-path /models/llama3") for n in notices)
    cfg, _ = parse_command_line(train_argv("gpt2", 3, "--tokenizer-type", "Llama2Tokenizer",
                                           "--tokenizer-model", "/m/tokenizer.model"))
    assert (cfg.data.tokenizer_type, cfg.data.tokenizer_model) == ("SentencePieceTokenizer",
                                                                   "/m/tokenizer.model")


def test_mock_data_takes_megatrons_null_tokenizer():
    validate(parse_args(train_argv("gpt2", 3, "--tokenizer-type", "NullTokenizer")), 1)


def test_pad_vocab_size_to_pads_to_exactly_n():
    cfg = parse_args(train_argv("gpt2", 3, "--pad-vocab-size-to", "256"))
    validate(cfg, 1)
    assert cfg.model.padded_vocab_size(1) == 256 == cfg.model.padded_vocab_size(4)


@pytest.mark.parametrize(("flags", "world", "expected"), [
    (["--pad-vocab-size-to", "200"], 1, "--pad-vocab-size-to 200 is below the vocabulary of "
     "203 tokens"),
    (["--pad-vocab-size-to", "250", "--tensor-model-parallel-size", "4"], 4,
     "--pad-vocab-size-to 250 is not divisible by the tensor-parallel size"),
])
def test_pad_vocab_size_to_refuses_what_cannot_hold_the_vocabulary(flags, world, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        validate(parse_args(train_argv("gpt2", 3, *flags)), world)


def _weights_file(tmp_path: Path, name: str, line: str) -> str:
    path = tmp_path / name
    path.write_text(line + "\n")
    return str(path)


def test_bigscience_weighted_split_files_become_per_split_data_paths(tmp_path):
    train = _weights_file(tmp_path, "train.txt", '"train: 0.7 0:1 /d/en, 0.3 0:1 /d/fr"')
    valid = _weights_file(tmp_path, "valid.txt", '"valid: 1 0:1 /d/en_valid"')
    cfg, notices = parse_command_line(train_argv("gpt2", 3) + [
        "--train-weighted-split-paths-path", train, "--valid-weighted-split-paths-path", valid])
    assert cfg.data.train_data_path == ("0.7", "/d/en", "0.3", "/d/fr")
    assert cfg.data.valid_data_path == ("1", "/d/en_valid")
    assert any(f"--train-weighted-split-paths-path={train}: read as --train-data-path 0.7 "
               "/d/en 0.3 /d/fr" in n for n in notices)


@pytest.mark.parametrize(("line", "expected"), [
    ('"train: 0.7 0:0.95 /d/en"', "only whole datasets (0:1)"),
    ('"a: 1 0:1 /d/a" "b: 1 0:1 /d/b"', "one dataset group"),
    ("train: 1 0:1 /d/a", "one line holding one double-quoted group"),
    ('"train: 1 /d/a"', "WEIGHT START:END PREFIX"),
])
def test_bigscience_weighted_split_files_refuse_what_has_no_equivalent(tmp_path, line,
                                                                       expected):
    path = _weights_file(tmp_path, "w.txt", line)
    with pytest.raises(ConfigError) as info:
        parse_args(train_argv("gpt2", 3, "--valid-weighted-split-paths-path", path))
    message = str(info.value)
    assert expected in message and "--valid-weighted-split-paths-path" in message
    assert "\n" not in message


def test_bloom_zero_stage_0_with_deepspeed_says_stage_1_is_the_equivalent():
    bf16_stage0 = ["--bf16", "--zero-stage", "0"]
    _, notices = parse_command_line(train_argv("gpt2", 3, *bf16_stage0, "--deepspeed",
                                               "--deepspeed-activation-checkpointing"))
    assert any(n.startswith("--zero-stage 0 with --bf16 and DeepSpeed flags: DeepSpeed's bf16 "
                            "optimizer sharded the optimizer states") and "--zero-stage 1" in n
               for n in notices)
    for argv in (train_argv("gpt2", 3, *bf16_stage0),
                 train_argv("gpt2", 3, "--bf16", "--zero-stage", "1", "--deepspeed"),
                 train_argv("gpt2", 3, "--fp16", "--zero-stage", "0", "--deepspeed")):
        assert not any("--zero-stage 1 is" in n for n in parse_command_line(argv)[1])


def _readme_rows() -> list[tuple[str, str, str]]:
    """(flag, sample value or '', verdict class) for each row of the README's flag table."""
    rows = []
    verbs = {"same as": "alias", "accepted, ignored": "notice", "refused": "refuse",
             "read from the file as": "alias"}
    pattern = re.compile(r"^\| `(--[\w-]+)( VALUE| FILE)?`(?: \(only ([^)]*)\))? \| ([^|:;]+)")
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| Megatron flag | megatron3d |"):].split("\n\n")[0]
    for line in table.splitlines():
        match = pattern.match(line)
        if match and "`--tokenizer-type`" not in line:
            flag, value, only, verb = match.groups()
            kind = next(v for k, v in verbs.items() if verb.startswith(k))
            sample = (only.split(", ")[0] if only else "1") if value else ""
            rows.append((flag, sample, kind))
    return rows


def test_the_readme_table_and_the_code_agree():
    rows = _readme_rows()
    assert len(rows) == len(compat.TABLE)
    for flag, sample, kind in rows:
        if compat.BY_NAME[flag].convert is not None:  # reads a file: covered above
            continue
        verdict, _ = _verdict(f"{flag} {sample}".strip())
        assert verdict == kind, flag
    listed = {flag for flag, _, _ in rows}
    own = build_parser().known_flags()
    for words in [*CURRENT_MEGATRON_LM, *BLOOM_MORE]:
        assert words.split()[0] in listed | own, words


def test_preprocess_data_takes_dataset_impl_mmap_only():
    from megatron3d.tools.preprocess_data import parse_args as preprocess_args

    base = ["--input", "c.jsonl", "--output-prefix", "o", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "10"]
    assert preprocess_args([*base, "--dataset-impl", "mmap"]).output_prefix == "o"
    with pytest.raises(ConfigError, match=r"--dataset-impl.*'lazy'.*mmap is the only format"):
        preprocess_args([*base, "--dataset-impl", "lazy"])
