"""Megatron-LM and Megatron-DeepSpeed flags that megatron3d takes under another name, ignores
with a notice, or refuses with the replacement: one table, so that a launch script written for
Megatron runs after at most one round of edits, and every answer is a deliberate one.

``translate`` rewrites a command line before argparse sees it: an alias becomes the flags it
stands for, a harmless flag is dropped with a notice saying what happens instead, and a refused
or unknown flag becomes a problem. All problems of a command line are reported together. The
README's "Megatron flags" table is ``compat_table.markdown_table()`` (a test keeps them
equal).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from megatron3d.cli.line_rewrites import deepspeed_stage_0, tokenizer_spelling
from megatron3d.cli.weighted_splits import data_path_words
from megatron3d.errors import ConfigError

Action = Literal["alias", "notice", "refuse"]


@dataclass(frozen=True)
class CompatFlag:
    """One foreign flag. ``text`` says what megatron3d does instead (alias, notice) or why it
    is refused and what to use. ``nargs``: values it takes. ``becomes``: an alias's flags,
    ``{}`` standing for its value. ``only``: a notice's harmless values; any other value is
    refused with ``text``. ``convert``: turns the value (a file) into the alias's values,
    raising ConfigError when it cannot. ``values``: a verdict of its own for each value (a
    mode flag); any other value is refused with ``text``."""

    name: str
    action: Action
    text: str
    nargs: int = 0
    becomes: tuple[str, ...] = ()
    only: tuple[str, ...] = ()
    convert: Callable[[str], list[str]] | None = None
    values: Mapping[str, CompatFlag] = field(default_factory=dict)


def _alias(name: str, becomes: str, text: str = "", nargs: int = 0) -> CompatFlag:
    return CompatFlag(name, "alias", text, nargs, tuple(becomes.split()))


def _from_file(name: str, ours: str) -> CompatFlag:
    return CompatFlag(name, "alias", "", 1, (ours,), convert=data_path_words)


def _notice(names: str, text: str, nargs: int = 0, only: str = "") -> list[CompatFlag]:
    return [CompatFlag(n, "notice", text, nargs, only=tuple(only.split())) for n in names.split()]


def _refuse(names: str, text: str, nargs: int = 0) -> list[CompatFlag]:
    return [CompatFlag(n, "refuse", text, nargs) for n in names.split()]


def _by_value(name: str, values: Mapping[str, CompatFlag], other: str) -> CompatFlag:
    """A flag taking a mode: each value in ``values`` has its verdict, any other is refused."""
    return CompatFlag(name, "refuse", other, 1, values=values)


_NO_FUSION = ("megatron3d has no hand-fused kernels to switch (torch kernels, apex when found); "
              "--compile fuses a layer's elementwise work")
_ALWAYS_TB = "always written to TensorBoard when --tensorboard-dir is given"
_LAYOUT_FREE = "checkpoints are already layout-independent: any layout loads any other"
_NO_MOE = ("mixture-of-experts models are not supported: drop the MoE flags (a dense model "
           "of the same --ffn-hidden-size trains)")
_DEEPSPEED = ("megatron3d runs its own ZeRO, not DeepSpeed: --zero-stage 0/1/3 carries the "
              "stage, --micro-batch-size and --global-batch-size the batch sizes, --bf16/--fp16 "
              "the precision and --clip-grad the clipping; drop the DeepSpeed flags")

TABLE: tuple[CompatFlag, ...] = (
    _alias("--use-distributed-optimizer", "--zero-stage 1",
           "Megatron's distributed optimizer shards the optimizer state over data-parallel "
           "ranks: ZeRO-1"),
    _alias("--recompute-activations", "--recompute-granularity selective",
           "Megatron's meaning: only the attention core is recomputed in backward"),
    _alias("--override-opt_param-scheduler", "--override-opt-param-scheduler"),
    _alias("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"),
    _alias("--override-lr-scheduler", "--override-opt-param-scheduler"),
    _alias("--use-checkpoint-lr-scheduler", "--use-checkpoint-opt-param-scheduler"),
    _alias("--use-rotary-position-embeddings", "--position-embedding-type rope"),
    _alias("--encoder-seq-length", "--seq-length {}", nargs=1),
    _alias("--zero-reduce-bucket-size", "--reduce-bucket-size {}", nargs=1),
    *_notice("--recompute-method --recompute-num-layers --checkpoint-num-layers",
             "full recompute re-runs each transformer layer on its own (Megatron's uniform "
             "method with one layer)", nargs=1),
    *_notice("--overlap-grad-reduce", "always on: gradient buckets are reduced while backward "
             "runs"),
    *_notice("--overlap-p2p-communication", "always on: each pipeline transfer is waited "
             "for only by the computation that needs it (on NCCL each is posted alone, each "
             "direction of a link on its own communicator)"),
    *_notice("--DDP-impl", "data parallelism is megatron3d's own: bucketed gradient reduction "
             "overlapped with backward", nargs=1),
    *_notice("--use-flash-attn", "attention runs through torch's scaled_dot_product_attention, "
             "which picks flash kernels where the GPU has them"),
    *_notice("--no-masked-softmax-fusion --masked-softmax-fusion --no-bias-gelu-fusion "
             "--bias-gelu-fusion --no-bias-dropout-fusion --bias-dropout-fusion "
             "--no-gradient-accumulation-fusion --no-persist-layer-norm --no-rope-fusion "
             "--no-async-tensor-model-parallel-allreduce "
             "--async-tensor-model-parallel-allreduce --abort-on-unmet-fused-kernel-constraints",
             _NO_FUSION),
    *_notice("--num-workers", "batches are read in the training process from memory-mapped "
             ".bin files", nargs=1),
    *_notice("--dataloader-type", "samples are read in the order of a shuffled index, as "
             "Megatron's single loader does", nargs=1, only="single"),
    *_notice("--log-timers-to-tensorboard --log-batch-size-to-tensorboard "
             "--log-validation-ppl-to-tensorboard --log-memory-to-tensorboard "
             "--log-world-size-to-tensorboard --log-learning-rate-to-tensorboard "
             "--log-loss-scale-to-tensorboard --log-throughput", _ALWAYS_TB),
    *_notice("--tensorboard-queue-size", "TensorBoard's own queue is used; events are flushed "
             "at every evaluation and at exit", nargs=1),
    *_notice("--timing-log-level", "the log line reports the time per iteration; there are no "
             "per-phase timers", nargs=1),
    *_notice("--exit-signal-handler", "SIGTERM and SIGUSR1 always save and stop a run that has "
             "--save"),
    *_notice("--use-mcore-models --use-legacy-models", "there is one model implementation"),
    *_notice("--transformer-impl", "megatron3d's own transformer layers (no Transformer "
             "Engine)", nargs=1),
    *_notice("--use-cpu-initialization", "each rank draws its slices of the weights on its "
             "own device, the same values whatever the layout"),
    *_notice("--attention-softmax-in-fp32", "the softmax precision is SDPA's (fp32 accumulation "
             "in its fused GPU kernels)"),
    *_notice("--apply-query-key-layer-scaling --no-query-key-layer-scaling",
             "a rescaling that only guards fp16 softmax overflow; attention scales by "
             "1/sqrt(head dim) inside SDPA"),
    *_notice("--sync-tp-duplicated-parameters", "tensor-parallel replicas are checked "
             "identical every --check-replicas-interval steps"),
    *_notice("--use-dist-ckpt --auto-detect-ckpt-format", _LAYOUT_FREE),
    *_notice("--ckpt-format", _LAYOUT_FREE, nargs=1),
    *_notice("--local_rank --local-rank", "the rank comes from the launcher's LOCAL_RANK",
             nargs=1),
    *_notice("--deepspeed-activation-checkpointing", "activation checkpointing is megatron3d's "
             "own (--checkpoint-activations)"),
    *_notice("--contigious-checkpointing --synchronize-each-layer --profile-backward",
             "a DeepSpeed activation-checkpointing option; megatron3d's has no such setting"),
    *_notice("--mmap-warmup --no-mmap-bin-files", "the .bin files are memory-mapped and read "
             "as batches need them"),
    *_notice("--fp16-lm-cross-entropy", "the cross entropy always runs in fp32"),
    *_notice("--no-position-embedding", "positions follow --position-embedding-type (rope and "
             "alibi use no learned position table)"),
    *_notice("--optimizer", "AdamW, which Megatron's 'adam' is", nargs=1, only="adam"),
    *_notice("--expert-model-parallel-size",
             "expert parallelism is not supported: use size 1 or drop the flag",
             nargs=1, only="1"),
    *_notice("--rotary-percent", "rotary embeddings cover the whole head; only 1.0 is "
             "supported", nargs=1, only="1 1.0"),
    *_notice("--lr-warmup-init", "warmup starts from 0; only 0 is supported", nargs=1,
             only="0 0.0"),
    *_notice("--weight-decay-incr-style", "the weight decay is constant; only 'constant' is "
             "supported", nargs=1, only="constant"),
    *_notice("--attention-backend", "attention runs through torch's SDPA, which picks the "
             "flash or fused kernel the GPU has", nargs=1, only="auto flash fused unfused local"),
    *_notice("--cross-entropy-loss-fusion", _NO_FUSION),
    *_notice("--manual-gc --manual-gc-interval --empty-unused-memory-level", "Python's "
             "garbage collector and torch's caching allocator run as they are; results do not "
             "depend on them", nargs=1),
    *_notice("--tp-comm-overlap --defer-embedding-wgrad-compute", "a Transformer Engine "
             "overlap; megatron3d's tensor-parallel collectives are plain torch.distributed "
             "calls (the same results)"),
    *_notice("--ckpt-fully-parallel-save --ckpt-fully-parallel-load "
             "--ckpt-assume-constant-structure --use-persistent-ckpt-worker", "every rank "
             "already writes and reads only its own chunks, in parallel (--async-save writes in "
             "the background)"),
    *_notice("--wandb-project --wandb-exp-name --wandb-save-dir --wandb-entity", "megatron3d "
             "has no Weights & Biases writer: the metrics go to the log and to TensorBoard "
             "(--tensorboard-dir)", nargs=1),
    _alias("--ddp-bucket-size", "--reduce-bucket-size {}",
           "elements per data-parallel gradient bucket, as in Megatron", nargs=1),
    *_notice("--ddp-num-buckets", "the bucket size is --reduce-bucket-size", nargs=1),
    *_notice("--ddp-average-in-collective --overlap-param-gather-with-optimizer-step "
             "--use-contiguous-parameters-in-local-ddp", "data parallelism is megatron3d's "
             "own: contiguous buckets reduced while backward runs"),
    *_notice("--profile --use-pytorch-profiler", "no built-in profiler: run torch.profiler or "
             "Nsight Systems around pretrain_gpt.py"),
    *_notice("--profile-step-start --profile-step-end --profile-ranks", "no built-in profiler: "
             "run torch.profiler or Nsight Systems around pretrain_gpt.py", nargs=1),
    *_notice("--no-create-attention-mask-in-dataloader", "no mask is ever built: SDPA applies "
             "the causal mask itself"),
    *_notice("--tiktoken-pattern", "read only by Megatron's TikTokenizer (megatron3d's "
             "tokenizers: --tokenizer-type)", nargs=1),
    *_notice("--log-memory-interval --logging-level --timing-log-option --straggler-minmax-count",
             "the log line is megatron3d's; --memory-report prints the memory after the first "
             "step", nargs=1),
    _alias("--log-straggler", "--straggler-interval 100", "the ranks' compute times are "
           "compared every 100 steps and a persistently slow rank is named; on by default"),
    *_notice("--log-progress --log-energy --disable-straggler-on-startup",
             "the log line is megatron3d's; --memory-report prints the memory after the first "
             "step"),
    *_notice("--disable-gloo-process-groups", "megatron3d makes gloo groups only where the "
             "backend is gloo"),
    *_notice("--enable-cuda-graph --external-cuda-graph --te-rng-tracker", "no CUDA graphs or "
             "Transformer Engine: each step runs eagerly"),
    *_notice("--cuda-graph-impl --high-priority-stream-groups", "no CUDA graphs or "
             "Transformer Engine: each step runs eagerly", nargs=1),
    _by_value("--rerun-mode", {
        "validate_results": _alias("--rerun-mode", "--rerun-on-bad-step", "a bad step is "
                                   "re-run once on the same ranks to tell bad data from a "
                                   "faulty rank"),
        "disabled": _notice("--rerun-mode", "no step is re-run unless --rerun-on-bad-step "
                            "is given")[0]},
        "megatron3d does not re-run every step to measure its determinism: use "
        "validate_results (--rerun-on-bad-step) or drop the flag"),
    *_notice("--valid-num-workers", "batches are read in the training process from "
             "memory-mapped .bin files", nargs=1),
    *_notice("--deepspeed", "megatron3d runs its own data parallelism and ZeRO: give the stage "
             "with --zero-stage"),
    _alias("--data-args-path", "--data-path-file {}", "the file holds the --data-path words",
           nargs=1),
    _from_file("--train-weighted-split-paths-path", "--train-data-path"),
    _from_file("--valid-weighted-split-paths-path", "--valid-data-path"),
    _from_file("--test-weighted-split-paths-path", "--test-data-path"),
    *_refuse("--per-split-data-args-path", "give each split's datasets with --train-data-path, "
             "--valid-data-path and --test-data-path ('W1 P1 W2 P2 ...' each)", nargs=1),
    *_refuse("--deepspeed_mpi --zero-contigious-gradients --zero-reduce-scatter "
             "--cpu-optimizer --cpu_torch_adam --use-pin-memory", _DEEPSPEED),
    *_refuse("--deepspeed_config --deepspeed-config --zero-allgather-bucket-size "
             "--remote-device", _DEEPSPEED, nargs=1),
    *_refuse("--decoupled-lr --decoupled-min-lr", "every parameter follows --lr and --min-lr "
             "(no separate embedding learning rate): drop the flag", nargs=1),
    *_refuse("--calculate-per-token-loss", "the loss is the mean over each micro-batch's "
             "tokens, averaged over micro-batches (Megatron's default): drop the flag"),
    *_refuse("--fp8-format --fp8-amax-history-len --fp8-amax-compute-algo --fp8-margin "
             "--fp8-interval --fp8-recipe", "fp8 training is not supported: drop the fp8 "
             "flags and use --bf16", nargs=1),
    *_refuse("--fp8-param-gather", "fp8 training is not supported: drop the fp8 flags and use "
             "--bf16"),
    *_refuse("--use-torch-fsdp2", "use --zero-stage 3: megatron3d's ZeRO-3 shards parameters, "
             "gradients and optimizer states as FSDP does"),
    *_refuse("--save-retain-interval", "use --keep-last-n N to keep the newest N checkpoints",
             nargs=1),
    *_refuse("--lr-wsd-decay-style --lr-wsd-decay-samples --lr-wsd-decay-iters", "the WSD "
             "schedule is not supported: use --lr-decay-style constant, linear or cosine",
             nargs=1),
    *_refuse("--num-experts --moe-router-topk --moe-router-load-balancing-type "
             "--moe-aux-loss-coeff --moe-token-dispatcher-type --moe-router-dtype "
             "--moe-ffn-hidden-size --expert-tensor-parallel-size", _NO_MOE, nargs=1),
    *_refuse("--moe-grouped-gemm --moe-router-enable-expert-bias", _NO_MOE),
    *_refuse("--no-save-optim --no-save-rng", "checkpoints always hold the optimizer and RNG "
             "states so that a resume is exact; tools/checkpoint/consolidate.py writes the "
             "weights alone"),
    *_refuse("--fp32-residual-connection --apply-layernorm-1p --init-method-xavier-uniform "
             "--data-parallel-random-init --checkpoint-in-cpu --partition-activations",
             "not supported by megatron3d: drop the flag (for activation memory, "
             "--sequence-parallel keeps activations sharded over the tensor-parallel ranks)"),
    *_refuse("--world-size --rank", "the launcher's WORLD_SIZE and RANK set them", nargs=1),
)
BY_NAME: Mapping[str, CompatFlag] = {flag.name: flag for flag in TABLE}

VALUE_SPELLINGS: Mapping[str, Mapping[str, str]] = {
    "--normalization": {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"},
    "--non-persistent-ckpt-type": {"in_memory": "memory"},
}
"""Megatron's spelling of values of flags megatron3d shares, taken silently."""

REFUSED_VALUES: Mapping[str, Mapping[str, str]] = {
    "--non-persistent-ckpt-type": {
        "global": "the global checkpoints are --save's: use --save-interval N instead"},
}
"""Values of flags megatron3d shares that it refuses, with the replacement."""


@dataclass
class Translation:
    """What ``translate`` made of a command line."""

    argv: list[str] = field(default_factory=list)  # for argparse: megatron3d flags only
    notices: list[str] = field(default_factory=list)  # one line per alias or ignored flag
    problems: list[tuple[str, str]] = field(default_factory=list)  # (flag as given, why)


def translate(argv: Sequence[str], known: Collection[str]) -> Translation:
    """Rewrite ``argv`` through the table; ``known`` are megatron3d's own flags."""
    out = Translation()
    args, i = tokenizer_spelling(list(argv), out.notices), 0
    aliased: dict[str, str] = {}  # a flag an alias produced -> the alias
    while i < len(args):
        word = args[i]
        name, eq, inline = word.partition("=")
        i += 1
        if not word.startswith("--") or name in known:
            refused = _refused_value(out.argv, word)
            if refused is not None:
                out.problems.append(refused)
            out.argv.append(_respell(out.argv, word))
            continue
        flag = BY_NAME.get(name)
        nargs = flag.nargs if flag else _unknown_nargs(args, i, eq)
        values = [inline] if eq else args[i:i + nargs]
        i += 0 if eq else len(values)
        if flag is not None and flag.values and values:
            flag = flag.values.get(values[0], flag)
        shown = f"{name}={values[0]}" if len(values) == 1 else " ".join([name, *values])
        if flag is None:
            out.problems.append((shown, _unknown(name, known)))
        elif flag.action == "refuse" or (flag.only and values and values[0] not in flag.only):
            out.problems.append((shown, flag.text))
        elif flag.action == "notice":
            out.notices.append(f"{shown}: ignored, {flag.text}")
        elif flag.convert is not None:
            try:
                becomes = [*flag.becomes, *flag.convert(values[0])]
            except ConfigError as err:
                out.problems.append((shown, str(err)))
                continue
            out.argv += becomes
            aliased[becomes[0]] = shown
            out.notices.append(f"{shown}: read as {' '.join(becomes)}")
        else:
            becomes = [w.replace("{}", values[0]) if values else w for w in flag.becomes]
            out.argv += becomes
            aliased[becomes[0]] = shown
            why = f" ({flag.text})" if flag.text else ""
            out.notices.append(f"{shown}: read as {' '.join(becomes)}{why}")
    out.problems += _conflicts(out.argv, aliased)
    out.notices += deepspeed_stage_0(argv)
    return out


def _conflicts(argv: list[str], aliased: Mapping[str, str]) -> list[tuple[str, str]]:
    """An alias and the flag it stands for, both given: which one was meant is unclear."""
    given = [w.partition("=")[0] for w in argv]
    return [(alias, f"it means {ours}, which is given as well: keep one of the two")
            for ours, alias in aliased.items() if given.count(ours) > 1]


def _respell(previous: list[str], word: str) -> str:
    """A value in Megatron's spelling (``--normalization RMSNorm``) -> megatron3d's."""
    flag_name, _, inline = word.partition("=")
    if inline and flag_name in VALUE_SPELLINGS:
        return f"{flag_name}={VALUE_SPELLINGS[flag_name].get(inline, inline)}"
    spellings = VALUE_SPELLINGS.get(previous[-1], {}) if previous else {}
    return spellings.get(word, word)


def _refused_value(previous: list[str], word: str) -> tuple[str, str] | None:
    """(the flag and value as given, why) when ``word`` gives a refused value."""
    flag_name, eq, inline = word.partition("=")
    name, value = (flag_name, inline) if eq else (previous[-1] if previous else "", word)
    why = REFUSED_VALUES.get(name, {}).get(value)
    return None if why is None else (f"{name} {value}", why)


def _unknown_nargs(args: list[str], start: int, inline: str) -> int:
    """An unknown flag's values: the words up to the next flag (none after ``--x=v``)."""
    if inline:
        return 0
    end = start
    while end < len(args) and not args[end].startswith("--"):
        end += 1
    return end - start


def _unknown(name: str, known: Collection[str]) -> str:
    """No fuzzy guess unless the flag is a near-certain typo of one of ours."""
    close = difflib.get_close_matches(name, [k for k in known if k.startswith("--")], n=1,
                                      cutoff=0.85)
    if close:
        return f"unknown flag, did you mean {close[0]}?"
    return ("not a megatron3d flag, nor a Megatron flag it knows (README: Megatron flags): "
            "not supported")
