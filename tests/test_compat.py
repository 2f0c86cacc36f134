"""Megatron launch scripts parse: each flag is applied, aliased, noticed or refused as the table
in megatron3d/cli/compat.py says, every problem of a command line is reported in one line, and
the README shows the table as it is."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import pretrain_gpt
from megatron3d.cli import compat, compat_table
from megatron3d.cli.arguments import build_parser, parse_args, parse_command_line
from megatron3d.errors import ConfigError
from megatron3d.validation import validate
from tests.helpers.tiny import train_argv

REPO = Path(__file__).resolve().parents[1]
BLOOM_SCRIPT = REPO / "scripts" / "slurm" / "bloom_176b_48nodes.slurm"


def _bloom_train_args() -> list[str]:
    """TRAIN_ARGS of the BLOOM-176B sbatch script, its shell variables filled in."""
    text = BLOOM_SCRIPT.read_text()
    block = re.search(r"^TRAIN_ARGS=\((.*?)^\)", text, re.MULTILINE | re.DOTALL)[1]
    block = block.replace('"$DATA_PATH"', "/data/roots_text_document")
    return shlex.split(block.replace('"$TOKENIZER_DIR"', "/data/bloom-tokenizer"))


# What BigScience's tr11-176B-ml launch passed on top (Megatron-DeepSpeed), and the verdict.
BLOOM_MEGATRON_DEEPSPEED = {
    "--max-position-embeddings 2048": "applied",
    "--sync-tp-duplicated-parameters": "notice",
    "--abort-on-unmet-fused-kernel-constraints": "notice",
    "--kill-switch-path /tmp/kill-switch-tr11-176B-exp1": "applied",
    "--pad-vocab-size-to 250880": "applied",
    "--optimizer adam": "notice",
    "--exit-duration-in-mins 5990": "applied",
    "--save /ckpt --save-interval 100": "applied",
    "--tensorboard-dir /tb": "applied",
    "--tensorboard-queue-size 5": "notice",
    "--log-timers-to-tensorboard": "notice",
    "--log-batch-size-to-tensorboard": "notice",
    "--log-validation-ppl-to-tensorboard": "notice",
    "--data-impl mmap": "applied",
    "--distributed-backend nccl": "applied",
    "--deepspeed": "notice",
    "--deepspeed_config ds_config.json": "refuse",
    "--deepspeed-activation-checkpointing": "notice",
}

# A Megatron-LM Llama-2-style launch: 40+ flags beyond megatron3d's own names.
MEGATRON_LM = {
    "--use-distributed-optimizer": "alias",
    "--recompute-activations": "alias",
    "--overlap-grad-reduce": "notice",
    "--overlap-param-gather": "applied",
    "--use-flash-attn": "notice",
    "--normalization RMSNorm": "applied",
    "--use-rotary-position-embeddings": "alias",
    "--no-position-embedding": "notice",
    "--rotary-percent 1.0": "notice",
    "--rotary-base 10000": "applied",
    "--swiglu": "applied",
    "--untie-embeddings-and-output-weights": "applied",
    "--disable-bias-linear": "applied",
    "--group-query-attention": "applied",
    "--num-query-groups 8": "applied",
    "--kv-channels 128": "applied",
    "--norm-epsilon 1e-5": "applied",
    "--sequence-parallel": "applied",
    "--distributed-backend nccl": "applied",
    "--DDP-impl local": "notice",
    "--num-workers 2": "notice",
    "--dataloader-type single": "notice",
    "--no-masked-softmax-fusion": "notice",
    "--no-bias-gelu-fusion": "notice",
    "--no-bias-dropout-fusion": "notice",
    "--no-gradient-accumulation-fusion": "notice",
    "--attention-softmax-in-fp32": "notice",
    "--transformer-impl local": "notice",
    "--use-mcore-models": "notice",
    "--exit-signal-handler": "notice",
    "--use-dist-ckpt": "notice",
    "--ckpt-format torch_dist": "notice",
    "--log-memory-to-tensorboard": "notice",
    "--log-world-size-to-tensorboard": "notice",
    "--log-throughput": "notice",
    "--timing-log-level 0": "notice",
    "--context-parallel-size 2": "applied",
    "--cp-comm-type a2a": "applied",
    "--expert-model-parallel-size 1": "notice",
    "--tensorboard-log-interval 10": "applied",
    "--log-params-norm": "applied",
    "--log-num-zeros-in-grad": "applied",
    "--override-opt_param-scheduler": "alias",
    "--exit-on-missing-checkpoint": "applied",
    "--distributed-timeout-minutes 60": "applied",
    "--eval-interval 1000": "applied",
    "--eval-iters 10": "applied",
    "--tensorboard-dir /tb": "applied",
    "--bf16": "applied",
}

MEGATRON_LM_BASE = shlex.split("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 "
                    "--num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096 "
                    "--micro-batch-size 1 --global-batch-size 1024 --lr 3e-4 --min-lr 3e-5 "
                    "--train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine "
                    "--lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 "
                    "--adam-beta1 0.9 --adam-beta2 0.95 --mock-data --vocab-size 32000 "
                    "--load /ckpt --save /ckpt --save-interval 1000")


def _verdicts(flags: dict[str, str]) -> dict[str, str]:
    """What the table does with each entry of ``flags``, one translation per flag."""
    known = build_parser().known_flags()
    verdicts = {}
    for words in flags:
        argv = words.split()
        result = compat.translate(argv, known)
        if result.problems:
            verdicts[words] = "refuse"
        elif result.notices:
            verdicts[words] = "alias" if "read as" in result.notices[0] else "notice"
        else:
            assert result.argv[0] == argv[0]  # megatron3d's own flag, passed to argparse
            verdicts[words] = "applied"
    return verdicts


def test_the_bloom_176b_launch_parses_flag_by_flag():
    assert _verdicts(BLOOM_MEGATRON_DEEPSPEED) == BLOOM_MEGATRON_DEEPSPEED
    argv = _bloom_train_args() + [w for f in BLOOM_MEGATRON_DEEPSPEED for w in f.split()]
    with pytest.raises(ConfigError) as refused:
        parse_args(argv)
    message = str(refused.value)
    assert message.startswith("cannot use a flag on the command line "
                              "(--deepspeed_config=ds_config.json)") and "\n" not in message
    kept = [f for f, verdict in BLOOM_MEGATRON_DEEPSPEED.items() if verdict != "refuse"]
    cfg, notices = parse_command_line(_bloom_train_args() + [w for f in kept for w in f.split()])
    validate(cfg, 48 * 8)
    assert len(notices) == sum(v == "notice" for v in BLOOM_MEGATRON_DEEPSPEED.values())
    assert cfg.checkpoint.kill_switch_path == "/tmp/kill-switch-tr11-176B-exp1"


def test_a_megatron_lm_launch_parses_and_means_what_it_says():
    assert len(MEGATRON_LM) >= 40
    assert _verdicts(MEGATRON_LM) == MEGATRON_LM
    cfg, notices = parse_command_line(MEGATRON_LM_BASE + [w for f in MEGATRON_LM
                                                          for w in f.split()])
    validate(cfg, 16)
    assert cfg.parallel.zero_stage == 1 and cfg.model.recompute == "selective"
    assert cfg.model.normalization == "rmsnorm" and cfg.model.position_embedding_type == "rope"
    assert cfg.lr_schedule.override_opt_param_scheduler
    assert len(notices) == sum(v in ("notice", "alias") for v in MEGATRON_LM.values())
    assert any(n.startswith("--recompute-activations: read as --recompute-granularity "
                            "selective (") for n in notices)


def test_every_problem_of_a_command_line_is_reported_in_one_line():
    argv = train_argv("gpt2", 5, "--foo", "3", "--hiden-size", "8", "--bar")
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    message = str(info.value)
    assert message.startswith("3 flags on the command line cannot be used") and "\n" not in message
    assert "(--foo=3, --bar) not a megatron3d flag" in message and "not supported" in message
    assert "(--hiden-size=8) unknown flag, did you mean --hidden-size?" in message


@pytest.mark.parametrize(("flags", "expected"), [
    (["--use-flash-attn-v3"], "not a megatron3d flag"),  # no fuzzy guess for a stranger
    (["--expert-model-parallel-size", "2"], "use size 1 or drop the flag"),
    (["--optimizer", "sgd"], "AdamW"),
    (["--use-distributed-optimizer", "--zero-stage", "3"], "keep one of the two"),
    (["--recompute-activations", "--recompute-granularity", "full"], "keep one of the two"),
    (["--checkpoint-activations", "--recompute-granularity", "selective"],
     "--checkpoint-activations is full recompute"),
    (["--kv-channels", "16"], "--kv-channels must be hidden size / heads"),
])
def test_refusals_name_the_reason(flags, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        validate(parse_args(train_argv("gpt2", 5, *flags)), 1)


@pytest.mark.parametrize(("flags", "recompute"), [
    ([], None), (["--checkpoint-activations"], "full"),
    (["--recompute-granularity", "full"], "full"),
    (["--recompute-granularity", "selective"], "selective"),
    (["--checkpoint-activations", "--recompute-granularity", "full"], "full"),
])
def test_recompute_granularity_is_a_megatron3d_flag_with_megatron_values(flags, recompute):
    cfg = parse_args(train_argv("gpt2", 5, *flags))
    validate(cfg, 1)
    assert cfg.model.recompute == recompute


def test_notices_are_logged_at_start(capsys):
    assert pretrain_gpt.main(train_argv("gpt2", 3, "--use-flash-attn",
                                        "--use-distributed-optimizer")) == 0
    out = capsys.readouterr().out
    assert "notice: --use-flash-attn: ignored, attention runs through torch's" in out
    assert "notice: --use-distributed-optimizer: read as --zero-stage 1 (" in out


def test_the_readme_shows_the_table():
    assert compat_table.markdown_table() in (REPO / "README.md").read_text()


def test_table_entries_are_not_megatron3d_flags():
    """A flag is either megatron3d's own or in the table, never both."""
    assert not set(compat.BY_NAME) & build_parser().known_flags()
    assert len(compat.BY_NAME) == len(compat.TABLE)
