"""What surrounds training: data, logging, checkpoints and resilience."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron3d.config.ranges import AT_LEAST_ONE, ITERATIONS, NON_NEGATIVE, POSITIVE, Range, option

TokenizerType = Literal["SentencePieceTokenizer", "PretrainedFromHF", "GPT2BPETokenizer",
                        "NullTokenizer"]


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where training samples come from: Megatron .bin/.idx datasets, or mock data."""

    mock_data: bool = option(False, "Synthetic Markov-chain tokens; needs --vocab-size.")
    data_path: tuple[str, ...] | None = option(
        None, "Dataset prefix without .bin/.idx (e.g. data/corpus_text_document), or "
        "'W1 P1 W2 P2 ...' weight-prefix pairs blended by sampling proportion.")
    data_path_file: str | None = option(
        None, "File holding the --data-path words (for long blends); '#' starts a comment.")
    train_data_path: tuple[str, ...] | None = option(
        None, "Training datasets of their own, read whole ('W1 P1 W2 P2 ...' blends them); "
        "instead of --data-path and --split.")
    valid_data_path: tuple[str, ...] | None = option(
        None, "Validation datasets of their own, read whole; needs --train-data-path.")
    test_data_path: tuple[str, ...] | None = option(
        None, "Test datasets of their own, read whole; needs --train-data-path.")
    data_impl: Literal["mmap"] = option(
        "mmap", "Dataset format; the memory-mapped .bin/.idx format is the one supported.")
    split: str = option("969, 30, 1", "Train, valid, test shares of each dataset's documents.")
    tokenizer_type: TokenizerType | None = option(
        None, "Tokenizer the data was made with; its vocabulary sizes the model.")
    tokenizer_model: str | None = option(None, "SentencePiece model file (SentencePieceTokenizer).")
    vocab_file: str | None = option(None, "GPT-2 vocab.json (GPT2BPETokenizer).")
    merge_file: str | None = option(None, "GPT-2 merges.txt (GPT2BPETokenizer).")
    tokenizer_name_or_path: str | None = option(
        None, "Local Hugging Face tokenizer directory or tokenizer.json (PretrainedFromHF); "
        "never downloaded.")
    data_cache_path: str | None = option(
        None, "Directory for dataset index caches; default index-cache beside the first dataset.")
    dry_run_data: bool = option(
        False, "Print each source's weight, samples drawn and implied epochs, then exit.")
    eod_mask_loss: bool = option(
        False, "No loss on positions whose input token is end-of-document.")
    reset_position_ids: bool = option(
        False, "Packed documents: positions restart at 0 after each end-of-document token.")
    reset_attention_mask: bool = option(
        False, "Packed documents: a token attends only to earlier tokens of its own document "
        "(the end-of-document token belongs to the one it ends).")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """The log line and TensorBoard."""

    log_interval: int = option(
        100, "Print the iteration line every this many iterations.", range=AT_LEAST_ONE)
    tensorboard_dir: str | None = option(None, "Write TensorBoard event files here.")
    tensorboard_log_interval: int = option(
        1, "Write TensorBoard scalars every this many iterations.", range=AT_LEAST_ONE)
    log_num_zeros_in_grad: bool = option(
        False, "Count the zero gradient elements (padding rows of the vocabulary excluded) "
        "and log them as 'num zeros'.")
    log_params_norm: bool = option(
        False, "Log the global norm of the parameters (each logical parameter once).")
    peak_tflops: float | None = option(
        None, "Device peak TFLOP/s for MFU; default known for A100/H100.", range=POSITIVE)
    memory_report: bool = option(
        False, "After the first step, print each rank's measured parameter, gradient and "
        "optimizer-state bytes (and the device's allocated bytes).")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Saving, resuming and stopping early (preemption, time limits)."""

    save: str | None = option(None, "Directory to save checkpoints in (shared by all nodes).")
    save_interval: int | None = option(
        None, "Save every this many iterations (and at the end).", range=ITERATIONS)
    keep_last_n: int | None = option(
        None, "Keep only the newest N checkpoints of this run's series (never another's).",
        range=AT_LEAST_ONE)
    async_save: bool = option(
        False, "Copy the state to host memory at the save's step and write it in a background "
        "thread while training goes on; 'latest' moves only once every rank's file is "
        "written, a save first waits for the one before, and the run waits for its last save "
        "before it exits.")
    new_series: bool = option(
        False, "Let --save hold another run's checkpoints: this run starts a new series there "
        "and 'latest' follows it; the other checkpoints stay, except one at an iteration this "
        "run saves, which it replaces.")
    compile_cache_dir: str | None = option(
        None, "Where --compile keeps its compiled kernels and graphs, reused by the next run "
        "(a warm start); default TORCHINDUCTOR_CACHE_DIR when set, else SAVE/compile-cache "
        "with --save, else torch's own temporary directory.")
    load: str | None = option(
        None, "Resume from the newest checkpoint here; an empty or missing directory starts "
        "from scratch, so a requeued job can rerun the same command.")
    finetune: bool = option(False, "Load only the weights: iteration, optimizer and data start "
                          "from zero.")
    use_checkpoint_args: bool = option(
        False, "Take the model flags from the checkpoint in --load.")
    no_load_optim: bool = option(
        False, "Resume without the optimizer state (Adam moments start from zero; the fp32 "
        "master weights come from the loaded model).")
    no_load_rng: bool = option(
        False, "Resume without the saved random states (dropout and data noise are seeded "
        "afresh).")
    exit_interval: int | None = option(
        None, "Save and stop at the first iteration divisible by N.", range=ITERATIONS)
    exit_duration_in_mins: float | None = option(
        None, "Save and stop once training has run this many minutes.", range=POSITIVE)
    kill_switch_path: str | None = option(
        None, "Save and stop once this file exists (checked by every rank after each step, "
        "the ranks agreeing a step later; BigScience's way to stop a job that would be "
        "requeued).")
    exit_on_missing_checkpoint: bool = option(
        False, "Fail when --load holds no checkpoint, instead of starting from scratch.")
    non_persistent_save_interval: int | None = option(
        None, "Keep each rank's state every N iterations in host memory or a node-local "
        "directory (--non-persistent-ckpt-type), replicated to a peer rank on another node; "
        "a restarted job resumes from the newest complete one when it is newer than --load's.",
        range=ITERATIONS)
    non_persistent_ckpt_type: Literal["local", "memory"] | None = option(
        None, "Where --non-persistent-save-interval keeps the states: 'memory' in /dev/shm "
        "(host memory that survives a worker restart, not the node), 'local' in "
        "--non-persistent-local-ckpt-dir (Megatron's 'in_memory' is read as 'memory').")
    non_persistent_local_ckpt_dir: str | None = option(
        None, "Root of the node-local store of --non-persistent-ckpt-type (required for "
        "'local'; default /dev/shm for 'memory'); removed at the normal end of a run.")


@dataclass(frozen=True, kw_only=True)
class ResilienceConfig:
    """What happens when a run hangs or diverges: watchdog, hang dumps, non-finite steps."""

    hang_timeout: float = option(
        300.0, "Seconds without a finished step after which every rank writes a hang dump "
        "(stacks, recent collectives, coordinates) and exits non-zero; 0 disables the watchdog.",
        range=NON_NEGATIVE)
    hang_startup_timeout: float | None = option(
        None, "The watchdog's allowance for each phase longer than a step whose own flag is "
        "not given: dataset index building, checkpoint load, the first step, checkpoint "
        "saves, evaluation. Default: 90% of --distributed-timeout-minutes.", range=POSITIVE)
    hang_index_timeout: float | None = option(
        None, "Allowance for building (or reading) the datasets' index caches at start-up; "
        "default --hang-startup-timeout.", range=POSITIVE)
    hang_load_timeout: float | None = option(
        None, "Allowance for loading the checkpoint in --load; default "
        "--hang-startup-timeout.", range=POSITIVE)
    hang_first_step_timeout: float | None = option(
        None, "Allowance for the rest of start-up (process groups, model, optimizer) and the "
        "first step, each stretch between index building and load counted afresh; default "
        "--hang-startup-timeout.", range=POSITIVE)
    hang_save_timeout: float | None = option(
        None, "Allowance for each checkpoint save (with --async-save: waiting for the one "
        "before); default --hang-startup-timeout.", range=POSITIVE)
    hang_eval_timeout: float | None = option(
        None, "Allowance for each evaluation; default --hang-startup-timeout.", range=POSITIVE)
    hang_dump_dir: str | None = option(
        None, "Directory for hang dumps (rank-XXXXX.txt); default SAVE/hang, or ./hang "
        "without --save. SIGUSR2 writes a dump there without stopping the run.")
    flight_recorder_size: int = option(
        2048, "Collective and point-to-point operations each rank remembers for hang dumps.",
        range=Range(0, 2**24))
    distributed_timeout_minutes: int = option(
        10, "Timeout of every collective in the process group; every --hang-*-timeout must "
        "be below it, so the watchdog reports a hang before the backend aborts.",
        range=Range(1, 7 * 24 * 60))  # a week
    rendezvous_timeout: float = option(
        300.0, "Seconds a rank waits to join the job (all WORLD_SIZE ranks meeting at "
        "MASTER_ADDR:MASTER_PORT) before it stops with one line naming what did not come: a "
        "stray WORLD_SIZE or a wrong address would otherwise wait for the process-group "
        "timeout.", range=Range(0, 7 * 24 * 3600, low_open=True))  # a week
    max_skipped_iters_in_a_row: int = option(
        200, "Stop with an error (exit 1, nothing saved) once this many steps in a row were "
        "skipped (non-finite gradients: a diverged run, or an fp16 loss scale that always "
        "overflows); checked at each log line and save; 0 never stops. The default is above "
        "the fp16 dynamic scaler's start (2**32 down to its working scale, --hysteresis "
        "overflows per halving).", range=Range(0, 2**32))
    check_for_nan_in_loss_and_grad: bool = option(
        False, "Stop with an error when the global gradient norm is NaN or Inf (bf16, fp32; "
        "in fp16 that is an overflow for the loss scaler); by default such a step is skipped "
        "on every rank and counted in 'number of nan iterations'.")
    straggler_interval: int = option(
        100, "Compare the ranks' compute time per step every this many iterations (at the "
        "first log line from then on); a rank slower than --straggler-threshold in 3 "
        "comparisons in a row is named in a warning and TensorBoard; 0 turns it off.",
        range=Range(0, 2**32))
    straggler_threshold: float = option(
        0.2, "How much slower than the median of its peers (the ranks of its pipeline stage) "
        "a rank must compute, as a fraction, to count as a straggler.", range=POSITIVE)
    rerun_on_bad_step: bool = option(
        False, "Re-run a bad step (non-finite loss or grad norm, or a loss spike) once with the "
        "same data and RNG before the optimizer applies it: the same result skips the batch "
        "as bad data (its sample ids logged and kept in the checkpoint); a different one names "
        "the ranks at fault and goes on with the re-run. Costs one all-reduce and one host "
        "sync per step.")
    rerun_spike_factor: float = option(
        3.0, "With --rerun-on-bad-step: a loss above this many times the mean of the last "
        "--rerun-spike-window finite losses is a spike.", range=Range(1, low_open=True))
    rerun_spike_window: int = option(
        20, "With --rerun-on-bad-step: the losses a spike is measured against; no spike is "
        "judged before that many steps; 0 checks no spikes.", range=Range(0, 2**20))
    rerun_max_faults_per_rank: int = option(
        2, "With --rerun-on-bad-step: stop the run (exit 1, after saving under --save) when "
        "one rank caused this many transient faults, naming its node to exclude.",
        range=Range(1, 2**32))

    def budget(self, phase: str) -> float:
        """Seconds the watchdog allows ``phase`` (index, load, first_step, save, eval or
        startup): its own ``--hang-PHASE-timeout``, else --hang-startup-timeout, else 90%
        of the process-group timeout."""
        for given in (getattr(self, f"hang_{phase}_timeout"), self.hang_startup_timeout):
            if given is not None:
                return given
        return float(self.distributed_timeout_minutes * 54)  # 90% of its seconds
