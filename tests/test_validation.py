"""Cross-field checks: each bad config raises one line naming the flag; good ones pass."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron3d.config import SECTIONS, TrainConfig
from megatron3d.errors import ConfigError
from megatron3d.optim.batch_schedule import BatchSchedule
from megatron3d.validation import validate

# A tiny valid run: every bad case below changes one thing (or two that clash).
BASE = {
    "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
    "micro_batch_size": 2, "lr": 1e-3, "train_iters": 10, "mock_data": True, "vocab_size": 100,
}
_SECTION_OF = {f.name: s for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def make(**overrides) -> TrainConfig:
    """BASE with overrides, built straight from the dataclasses (no argument parsing)."""
    parts: dict[str, dict] = {section: {} for section in SECTIONS}
    for name, value in {**BASE, **overrides}.items():
        parts[_SECTION_OF[name]][name] = value
    return TrainConfig(**{s: cls(**parts[s]) for s, cls in SECTIONS.items()})


SAMPLES = {"train_iters": None, "train_samples": 1000}  # switch BASE to sample-based

# (overrides, world size, texts the message must contain: the flag=value at least)
BAD = {
    # required values
    "missing num layers": ({"num_layers": None}, 1, ["--num-layers=None", "pass --num-layers"]),
    "missing hidden": ({"hidden_size": None}, 1, ["--hidden-size=None"]),
    "missing heads": ({"num_attention_heads": None}, 1, ["--num-attention-heads=None"]),
    "missing seq": ({"seq_length": None}, 1, ["--seq-length=None"]),
    "compile cache without compile": ({"compile_cache_dir": "/tmp/c"}, 1, [
        "--compile-cache-dir=/tmp/c", "add --compile"]),
    "missing micro batch": ({"micro_batch_size": None}, 1, ["--micro-batch-size=None"]),
    "missing lr": ({"lr": None}, 1, ["--lr=None"]),
    "no run length": ({"train_iters": None}, 1, ["--train-iters=None", "--train-samples=None"]),
    "two run lengths": ({"train_samples": 100}, 1, ["--train-iters=10", "--train-samples=100"]),
    "no data source": ({"mock_data": False}, 1, ["--mock-data=False", "--data-path"]),
    "two data sources": ({"data_path": ("d",)}, 1, ["--mock-data=True", "--data-path=('d',)"]),
    "real data without tokenizer": ({"mock_data": False, "vocab_size": None,
                                     "data_path": ("d",)}, 1, ["--tokenizer-type=None"]),
    "sentencepiece without model": ({"mock_data": False, "vocab_size": None,
                                     "data_path": ("d",),
                                     "tokenizer_type": "SentencePieceTokenizer"}, 1,
                                    ["--tokenizer-model=None"]),
    "vocab size with a real tokenizer": ({"mock_data": False, "data_path": ("d",),
                                          "tokenizer_type": "SentencePieceTokenizer",
                                          "tokenizer_model": "m"}, 1, ["--vocab-size=100"]),
    "tokenizer flag it does not read": ({"mock_data": False, "vocab_size": None,
                                         "data_path": ("d",),
                                         "tokenizer_type": "SentencePieceTokenizer",
                                         "tokenizer_model": "m", "vocab_file": "v.json"}, 1,
                                        ["SentencePieceTokenizer does not use --vocab-file",
                                         "--vocab-file=v.json"]),
    "gpt2 bpe without merges": ({"mock_data": False, "vocab_size": None, "data_path": ("d",),
                                 "tokenizer_type": "GPT2BPETokenizer", "vocab_file": "v.json"},
                                1, ["GPT2BPETokenizer needs --merge-file", "--merge-file=None"]),
    "null tokenizer without vocab": ({"mock_data": False, "vocab_size": None,
                                      "data_path": ("d",), "tokenizer_type": "NullTokenizer"}, 1,
                                     ["NullTokenizer needs --vocab-size"]),
    "eod mask with mock data": ({"eod_mask_loss": True}, 1, ["--eod-mask-loss=True"]),
    "reset positions with mock data": ({"reset_position_ids": True}, 1,
                                       ["--reset-position-ids=True", "end-of-document"]),
    "reset mask with mock data": ({"reset_attention_mask": True}, 1,
                                  ["--reset-attention-mask=True", "end-of-document"]),
    "mock without vocab": ({"vocab_size": None}, 1, ["--vocab-size=None"]),
    # sizes and ranges
    "zero layers": ({"num_layers": 0}, 1, ["--num-layers=0", "in [1, 65536]"]),
    "huge layers": ({"num_layers": 10**6}, 1, ["--num-layers=1000000", "in [1, 65536]"]),
    "huge run": ({"train_iters": 2**33}, 1, ["--train-iters=8589934592", "[1, 4294967296]"]),
    "huge vocabulary": ({"vocab_size": 2**40}, 1, ["--vocab-size=1099511627776"]),
    "huge batch": ({"global_batch_size": 2**30}, 1, ["--global-batch-size=1073741824"]),
    "zero keep-last-n": ({"keep_last_n": 0, "save": "x"}, 1, ["--keep-last-n=0", "at least 1"]),
    "async save without save": ({"async_save": True}, 1, ["--async-save needs --save"]),
    "negative seq": ({"seq_length": -4}, 1, ["--seq-length=-4"]),
    "zero global batch": ({"global_batch_size": 0}, 1, ["--global-batch-size=0"]),
    "zero vocab": ({"vocab_size": 0}, 1, ["--vocab-size=0"]),
    "zero ffn": ({"ffn_hidden_size": 0}, 1, ["--ffn-hidden-size=0"]),
    "zero train iters": ({"train_iters": 0}, 1, ["--train-iters=0"]),
    "log interval 0": ({"log_interval": 0}, 1, ["--log-interval=0", "at least 1"]),
    "eval interval 0": ({"eval_interval": 0}, 1, ["--eval-interval=0"]),
    "negative eval iters": ({"eval_iters": -1}, 1, ["--eval-iters=-1"]),
    "hidden dropout 1": ({"hidden_dropout": 1.0}, 1, ["--hidden-dropout=1.0", "[0, 1)"]),
    "negative attn dropout": ({"attention_dropout": -0.1}, 1, ["--attention-dropout=-0.1"]),
    "lr zero": ({"lr": 0.0}, 1, ["--lr=0.0", "in (0, 1]"]),
    "lr 1e30": ({"lr": 1e30}, 1, ["--lr=1e+30", "in (0, 1]"]),
    "lr nan": ({"lr": math.nan}, 1, ["--lr=nan"]),
    "negative min lr": ({"min_lr": -1e-5}, 1, ["--min-lr=-1e-05"]),
    "min lr above lr": ({"min_lr": 1e-2}, 1, ["--min-lr 0.01", "--lr 0.001"]),
    "negative weight decay": ({"weight_decay": -0.1}, 1, ["--weight-decay=-0.1"]),
    "negative clip grad": ({"clip_grad": -1.0}, 1, ["--clip-grad=-1.0"]),
    "beta1 negative": ({"adam_beta1": -0.1}, 1, ["--adam-beta1=-0.1"]),
    "beta2 one": ({"adam_beta2": 1.0}, 1, ["--adam-beta2=1.0"]),
    "eps zero": ({"adam_eps": 0.0}, 1, ["--adam-eps=0.0"]),
    "layernorm eps zero": ({"layernorm_epsilon": 0.0}, 1, ["--layernorm-epsilon=0.0"]),
    "negative seed": ({"seed": -1}, 1, ["--seed=-1"]),
    "seed past 32 bits": ({"seed": 2**70}, 1, [f"--seed={2**70}", "[0, 4294967296)"]),
    "seed 2**32": ({"seed": 2**32}, 1, [f"--seed={2**32}"]),
    "seq length absurd": ({"seq_length": 50_000_000}, 1,
                          ["--seq-length=50000000", "in [1, 1048576]"]),
    "hidden size absurd": ({"hidden_size": 2**21}, 1, [f"--hidden-size={2**21}", "1048576"]),
    "micro batch absurd": ({"micro_batch_size": 2**21}, 1, [f"--micro-batch-size={2**21}"]),
    "lr inf": ({"lr": math.inf}, 1, ["--lr=inf", "finite"]),
    "min lr inf": ({"min_lr": math.inf}, 1, ["--min-lr=inf", "finite"]),
    "clip grad inf": ({"clip_grad": math.inf}, 1, ["--clip-grad=inf", "finite"]),
    # model shape
    "hidden % heads": ({"num_attention_heads": 6}, 1, ["--hidden-size=64",
                                                       "--num-attention-heads=6"]),
    "odd head dim with rope": ({"hidden_size": 36, "position_embedding_type": "rope"}, 1,
                               ["even head dimension", "--hidden-size=36"]),
    "position table too short": ({"max_position_embeddings": 16}, 1,
                                 ["--max-position-embeddings=16", "--seq-length=32"]),
    "rope scaling without rope": ({"use_rope_scaling": True}, 1,
                                  ["--use-rope-scaling=True",
                                   "--position-embedding-type=learned_absolute"]),
    "rope scaling high <= low": ({"position_embedding_type": "rope", "use_rope_scaling": True,
                                  "rope_scaling_high_freq_factor": 1.0}, 1,
                                 ["--rope-scaling-high-freq-factor=1.0",
                                  "--rope-scaling-low-freq-factor=1.0"]),
    "rope scaling factor below 1": ({"position_embedding_type": "rope",
                                     "use_rope_scaling": True, "rope_scaling_factor": 0.5}, 1,
                                    ["--rope-scaling-factor=0.5"]),
    # precision
    "bf16 and fp16": ({"bf16": True, "fp16": True}, 1, ["--bf16=True", "--fp16=True"]),
    "loss scale zero": ({"fp16": True, "loss_scale": 0.0}, 1, ["--loss-scale=0.0"]),
    "loss scale without fp16": ({"bf16": True, "loss_scale": 1024.0}, 1,
                                ["--loss-scale=1024.0", "--fp16=False"]),
    "min loss scale above initial": ({"fp16": True, "min_loss_scale": 1e10}, 1,
                                     ["--min-loss-scale=10000000000.0", "--initial-loss-scale"]),
    "loss scale window 0": ({"loss_scale_window": 0}, 1, ["--loss-scale-window=0"]),
    # learning-rate schedule
    "two warmups": ({"lr_warmup_iters": 2, "lr_warmup_fraction": 0.1}, 1,
                    ["--lr-warmup-fraction and --lr-warmup-iters", "exclusive"]),
    "warmup fraction above 1": ({"lr_warmup_fraction": 1.5}, 1, ["--lr-warmup-fraction=1.5"]),
    "warmup fraction negative": ({"lr_warmup_fraction": -0.1}, 1, ["--lr-warmup-fraction=-0.1"]),
    "decay iters with samples": ({**SAMPLES, "lr_decay_iters": 5}, 1,
                                 ["--lr-decay-iters cannot", "with --train-samples"]),
    "warmup iters with samples": ({**SAMPLES, "lr_warmup_iters": 5}, 1,
                                  ["--lr-warmup-iters cannot", "with --train-samples"]),
    "decay samples with iters": ({"lr_decay_samples": 50}, 1,
                                 ["--lr-decay-samples cannot", "with --train-iters"]),
    "warmup samples with iters": ({"lr_warmup_samples": 50}, 1,
                                  ["--lr-warmup-samples cannot", "with --train-iters"]),
    "warmup longer than run": ({"lr_warmup_iters": 20}, 1,
                               ["warmup (40 samples)", "decay (20 samples)"]),
    "warmup as long as the run": ({"lr_warmup_iters": 10}, 1,
                                  ["warmup (20 samples)", "decay (20 samples)"]),
    "warmup longer than decay": ({"lr_warmup_iters": 8, "lr_decay_iters": 5}, 1,
                                 ["warmup (16 samples)", "decay (10 samples)"]),
    "warmup samples longer than decay": ({**SAMPLES, "lr_warmup_samples": 600,
                                          "lr_decay_samples": 500}, 1,
                                         ["warmup (600 samples)", "decay (500 samples)"]),
    # parallel layout and batch
    "world not multiple of tp x pp": ({"tensor_model_parallel_size": 2}, 3,
                                      ["world size 3", "tp*pp = 2 (tp=2, pp=1)"]),
    "world size zero": ({}, 0, ["world size must be an integer >= 1, got 0"]),
    "zero tp": ({"tensor_model_parallel_size": 0}, 1, ["--tensor-model-parallel-size=0"]),
    "heads % tp": ({"hidden_size": 48, "tensor_model_parallel_size": 3}, 3,
                   ["--num-attention-heads=4", "--tensor-model-parallel-size=3"]),
    "ffn % tp": ({"ffn_hidden_size": 99, "tensor_model_parallel_size": 2}, 2,
                 ["--ffn-hidden-size=99", "--tensor-model-parallel-size=2"]),
    "global batch % micro x dp": ({"global_batch_size": 6}, 2,
                                  ["--global-batch-size", "6 not divisible",
                                   "--micro-batch-size 2", "nearest 4 or 8"]),
    "zero stage 2": ({"zero_stage": 2}, 1, ["--zero-stage=2", "0, 1 or 3"]),
    "unknown partition method": ({"pp_partition_method": "balanced"}, 1,
                                 ["--pp-partition-method=balanced", "type:REGEX"]),
    "bad partition regex": ({"pp_partition_method": "type:(transformer"}, 1,
                            ["--pp-partition-method=type:(transformer", "invalid regex"]),
    "empty partition regex": ({"pp_partition_method": "type:"}, 1, ["--pp-partition-method="]),
    # the partitioner on the real layer list (embedding, 2 blocks, final norm, head)
    "more stages than layers": ({"pipeline_model_parallel_size": 8}, 8,
                                ["8 pipeline stages but only 5 of 5 layers have parameters",
                                 "--pipeline-model-parallel-size=8"]),
    "more virtual stages than layers": ({"pipeline_model_parallel_size": 2,
                                         "virtual_pipeline_model_parallel_size": 4,
                                         "global_batch_size": 4}, 2,
                                        ["2 x 4 virtual pipeline stages but only 5 of 5"]),
    "partition regex matching no layer": ({"pp_partition_method": "type:nothing"}, 1,
                                          ["only 0 of 5 layers match type:nothing"]),
    "rampup not divisible": ({**SAMPLES, "rampup_batch_size": (2, 2, 100),
                              "global_batch_size": 8}, 2, ["--rampup-batch-size", "2"]),
    "rampup bad increment": ({**SAMPLES, "rampup_batch_size": (2, 4, 100),
                              "global_batch_size": 8}, 1, ["--rampup-batch-size", "INCR"]),
    # valid settings that are not implemented yet
    "sequence parallel seq not divisible": (
        {"sequence_parallel": True, "tensor_model_parallel_size": 4, "seq_length": 18,
         "max_position_embeddings": 18}, 4, ["--seq-length=18", "--tensor-model-parallel-size=4"]),
    "overlap gather off ZeRO-1": ({"overlap_param_gather": True, "zero_stage": 3}, 1,
                                  ["--zero-stage=3", "--overlap-param-gather"]),
    "bf16 and fp32 reduction": ({"grad_reduce_in_bf16": True,
                                 "accumulate_allreduce_grads_in_fp32": True}, 1,
                                ["--grad-reduce-in-bf16=True", "drop one"]),
    "negative prefetch": ({"zero3_prefetch_depth": -1, "zero_stage": 3}, 1,
                          ["--zero3-prefetch-depth=-1"]),
    "pool smaller than prefetch": ({"zero3_prefetch_depth": 2, "zero3_max_live_units": 2,
                                    "zero_stage": 3}, 1,
                                   ["--zero3-max-live-units=2", ">= 3"]),
    # every watchdog budget below the process group's timeout (10 minutes by default)
    "step budget at the timeout": ({"hang_timeout": 600.0}, 1,
                                   ["--hang-timeout=600.0, --distributed-timeout-minutes=10",
                                    "below 600 seconds"]),
    "start-up budget over the timeout": ({"hang_startup_timeout": 1800.0}, 1,
                                         ["--hang-startup-timeout=1800.0, "
                                          "--distributed-timeout-minutes=10"]),
    "index budget over the timeout": ({"hang_index_timeout": 3600.0,
                                       "distributed_timeout_minutes": 30}, 1,
                                      ["--hang-index-timeout=3600.0, "
                                       "--distributed-timeout-minutes=30", "below 1800 seconds"]),
    "load budget over the timeout": ({"hang_load_timeout": 900.0}, 1,
                                     ["--hang-load-timeout=900.0"]),
    "first step budget over the timeout": ({"hang_first_step_timeout": 700.0}, 1,
                                           ["--hang-first-step-timeout=700.0"]),
    "save budget over the timeout": ({"hang_save_timeout": 601.0}, 1,
                                     ["--hang-save-timeout=601.0"]),
    "evaluation budget over the timeout": ({"hang_eval_timeout": 1e4}, 1,
                                           ["--hang-eval-timeout=10000.0"]),
    "zero save budget": ({"hang_save_timeout": 0.0}, 1, ["--hang-save-timeout=0.0",
                                                          "greater than 0"]),
}


@pytest.mark.parametrize(("overrides", "world_size", "expected"), BAD.values(), ids=BAD.keys())
def test_bad_config_raises_one_line_naming_the_flag(overrides, world_size, expected):
    with pytest.raises(ConfigError) as info:
        validate(make(**overrides), world_size)
    message = str(info.value)
    assert "\n" not in message
    for text in expected:
        assert text in message, message


FLOAT_FIELDS = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)
                if f.type in ("float", "float | None")]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_every_float_flag_must_be_finite(name, value):
    """inf would train nothing (--adam-eps inf) or never stop; the range alone let it pass."""
    with pytest.raises(ConfigError) as info:
        validate(make(**{name: value}), 1)
    assert str(info.value).startswith(f"--{name.replace('_', '-')} must be a finite number (")


def test_message_format_is_what_value_fix():
    with pytest.raises(ConfigError, match=r"^.+ \(--num-layers=0\): .+$"):
        validate(make(num_layers=0), 1)


GOOD = {
    "base": ({}, 1),
    "gbs defaults to micro x dp": ({}, 8),
    "explicit gbs with dp 4": ({"global_batch_size": 16}, 4),
    "sample based with ramp": ({**SAMPLES, "global_batch_size": 16,
                                "rampup_batch_size": (4, 4, 400), "lr_warmup_samples": 100,
                                "lr_decay_samples": 800}, 2),
    "ramp start equals final": ({**SAMPLES, "global_batch_size": 8,
                                 "rampup_batch_size": (8, 8, 100)}, 1),
    "iteration based warmup and decay": ({"lr_warmup_iters": 4, "lr_decay_iters": 5}, 1),
    "warmup fraction": ({"lr_warmup_fraction": 0.1, "lr_decay_style": "cosine"}, 1),
    "llama style": ({"position_embedding_type": "rope", "normalization": "rmsnorm",
                     "swiglu": True, "disable_bias_linear": True, "bf16": True,
                     "untie_embeddings_and_output_weights": True, "hidden_dropout": 0.0,
                     "attention_dropout": 0.0}, 1),
    "llama 3.x and qwen2": ({"position_embedding_type": "rope", "normalization": "rmsnorm",
                             "swiglu": True, "disable_bias_linear": True, "add_qkv_bias": True,
                             "use_rope_scaling": True, "rope_scaling_factor": 32.0}, 1),
    "bloom style": ({"position_embedding_type": "alibi", "embed_layernorm": True,
                     "max_position_embeddings": 8, "pp_partition_method": "type:transformer",
                     "bf16": True}, 1),
    "gpt2 fp16 static scale": ({"fp16": True, "loss_scale": 4096.0,
                                "max_position_embeddings": 64, "checkpoint_activations": True,
                                "clip_grad": 0.0, "weight_decay": 0.0}, 1),
    "uniform partition": ({"pp_partition_method": "uniform"}, 1),
    "largest seed and sizes": ({"seed": 2**32 - 1, "seq_length": 2**20, "hidden_size": 2**20,
                                "micro_batch_size": 2**20, "ffn_hidden_size": 2**20,
                                "max_position_embeddings": 2**20}, 1),
    "regex partition": ({"pp_partition_method": "type:transformer|embedding"}, 1),
    "long start-up under a long timeout": ({"hang_startup_timeout": 1800.0,
                                            "hang_load_timeout": 3500.0,
                                            "distributed_timeout_minutes": 60}, 1),
    "budgets unused without the watchdog": ({"hang_timeout": 0.0,
                                             "hang_load_timeout": 5000.0}, 1),
}


def test_unset_budgets_fall_back_to_start_up_then_below_the_timeout():
    """--hang-startup-timeout is every phase's default; unset, 90% of the group's timeout."""
    r = make(hang_startup_timeout=120.0, hang_load_timeout=400.0).resilience
    assert [r.budget(p) for p in ("index", "load", "first_step", "save", "eval")] == [
        120.0, 400.0, 120.0, 120.0, 120.0]
    assert make(distributed_timeout_minutes=30).resilience.budget("save") == 1620.0


@pytest.mark.parametrize(("overrides", "world_size"), GOOD.values(), ids=GOOD.keys())
def test_valid_configs_pass(overrides, world_size):
    validate(make(**overrides), world_size)


def test_global_batch_size_defaults_to_micro_times_dp():
    assert BatchSchedule.from_config(make().training, dp_size=8).global_batch_size == 2 * 8
    assert BatchSchedule.from_config(make(global_batch_size=32).training,
                                     dp_size=8).global_batch_size == 32


def test_not_yet_checks_come_after_the_real_ones():
    """A TP layout that is wrong anyway reports the real problem, not "not supported yet"."""
    with pytest.raises(ConfigError, match="--num-attention-heads=4"):
        validate(make(hidden_size=48, tensor_model_parallel_size=3), 3)


@pytest.mark.parametrize(("overrides", "world_size", "expected"), [
    ({"num_query_groups": 2}, 1, "--num-query-groups needs --group-query-attention"),
    ({"group_query_attention": True}, 1, "--num-query-groups=None"),
    ({"group_query_attention": True, "num_query_groups": 3}, 1, "dividing --num-attention-heads"),
    ({"group_query_attention": True, "num_query_groups": 1, "tensor_model_parallel_size": 2},
     2, "--num-query-groups 1 is not divisible by the tensor-parallel size"),
], ids=["groups without gqa", "gqa without groups", "groups not dividing", "one group at tp2"])
def test_grouped_query_attention_is_checked(overrides, world_size, expected):
    with pytest.raises(ConfigError, match=expected):
        validate(make(**overrides), world_size)


def test_another_layout_reports_every_conflict_in_the_flags_the_user_typed():
    """A resume on 64 ranks at TP 8 of a run made at TP 1: the heads and the sequence clash
    with TP, and 3 micro-batches per step with PP 2 under interleaving, all in one line,
    naming --num-layers-per-virtual-pipeline-stage as typed (not the derived chunk count) and
    not --num-query-groups, which follows the heads unless grouped-query attention is on."""
    cfg = make(num_layers=8, hidden_size=160, num_attention_heads=20, seq_length=1020,
               sequence_parallel=True, tensor_model_parallel_size=8,
               pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1,
               global_batch_size=24)
    with pytest.raises(ConfigError) as info:
        validate(cfg, 64)
    message = str(info.value)
    assert "\n" not in message and message.startswith("3 settings conflict with"), message
    for text in ("--num-attention-heads=20", "--seq-length=1020",
                 "--num-layers-per-virtual-pipeline-stage=1", "got 3"):
        assert text in message, message
    assert "--virtual-pipeline-model-parallel-size" not in message
    assert "--num-query-groups" not in message
