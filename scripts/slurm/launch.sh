#!/usr/bin/env bash
# The launch logic shared by every sbatch script in this folder. A script sets the variables
# below and then `source`s this file as its last line; it runs in the batch shell (on the first
# node of the allocation) and starts one task per node with srun, each running torchrun.
#
#   GPUS_PER_NODE      worker processes per node (the GPUs of a node; on CPU any number)
#   TRAIN_ARGS         array of pretrain_gpt.py flags: model, layout, batch, data, logging
#   SAVE_INTERVAL      --save-interval
# Optional (each script's header lists the ones it reads from the environment):
#   OUTPUT_ROOT        where outputs go (default ${SCRATCH:-$HOME/scratch}/megatron3d): on a
#                      file system every node sees, and outside the repository
#   RUN_DIR            this job's outputs (default OUTPUT_ROOT/JOB_NAME)
#   CHECKPOINT_DIR     --save and --load (default RUN_DIR/checkpoints): a requeued job reruns
#                      the same command and resumes from CHECKPOINT_DIR/latest (an empty dir
#                      starts from scratch); hang dumps go to CHECKPOINT_DIR/hang (or to
#                      --hang-dump-dir in TRAIN_ARGS), with torch's NCCL traces
#   TENSORBOARD_DIR    --tensorboard-dir (default RUN_DIR/tensorboard; empty: no TensorBoard)
#   DATA_CACHE_DIR     --data-cache-path, with --data-path (default OUTPUT_ROOT/index-cache)
#   SETUP_HOOK         a bash file sourced before the launch, also in a dry run: `module load`,
#                      `conda activate`, exports, or SRUN_ARGS for a container
#   SRUN_ARGS          array of extra srun options, e.g. pyxis's --container-image=IMAGE
#                      --container-mounts=... (python3 is then looked up in the container)
#   MEGATRON3D_DIR     the repository (default: the directory sbatch was run from)
#   VENV               virtualenv to activate (default: MEGATRON3D_DIR/.venv when it exists;
#                      VENV=none: none, e.g. with a container or a SETUP_HOOK)
#   MASTER_PORT        rendezvous port (default: 20000 + job id % 10000, so that two jobs
#                      sharing a first node do not collide)
#   REQUEUE_ON_SIGNAL  1 (default): after a SIGUSR1-triggered save, requeue the job; 0: stop
#   MAX_RESTARTS       torchrun's --max-restarts (default 3): a worker that fails (a crash, a
#                      hang's exit 3, a lost peer) restarts every worker of the job, on every
#                      node, within seconds, and they resume from the newest checkpoint; after
#                      MAX_RESTARTS restarts the step fails. torchrun checks its workers every
#                      --monitor-interval 0.5 s.
#   REQUEUE_ON_FAILURE after a failed step, requeue the job while fewer failed runs than this
#                      (default 2) came in a row without a newer checkpoint; 0: never
#   FAILED_NODES_FILE  the failed-node list (default RUN_DIR/failed_nodes.txt): the node that
#                      failed first is added after each failed step; a node listed twice is
#                      excluded when the job requeues itself (see failed_nodes.sh)
#   LAUNCH_DRY_RUN     1: make pretrain_gpt.py's start-up checks for this world size (python
#                      --print-topology: flags, data and checkpoint paths; exit 2 with its
#                      one line), then print the layout, the outputs and the srun command
#                      line, run nothing. Needs no Slurm: fake the allocation with
#                      SLURM_JOB_ID, SLURM_JOB_NAME, SLURM_JOB_NODELIST (e.g. gpu[001-004])
#                      and SLURM_NNODES.
#
# How the time-limit warning becomes a checkpoint (the scripts set `--signal=B:USR1@SECONDS`):
#   1. Slurm sends SIGUSR1 to this batch shell only (the "B:"); the trap below catches it.
#   2. The trap forwards it with `scancel --signal=USR1 $SLURM_JOB_ID`. Without --batch/--full,
#      scancel signals every process of every job step on every node, but not the batch shell.
#      It repeats that every 20 s until the step ends, for workers that were still starting.
#   3. torchrun would die on SIGUSR1 (its default action) and orphan its workers, which then
#      never save. So each node starts torchrun with SIGUSR1 ignored (`trap "" USR1` before
#      exec); the workers inherit the ignored disposition, and pretrain_gpt.py installs its own
#      handler once training starts (megatron3d/training/exit_watch.py).
#      Not `pkill -USR1 -f pretrain_gpt.py`: the pattern also matches torchrun's own command
#      line, and other jobs on a shared node. Not torchrun's `--signals-to-handle ...,SIGUSR1`:
#      it forwards the signal but then exits 1 and kills workers still saving after 30 s.
#   4. Every worker finishes its step and the next (the ranks agree on the signal a step
#      later, without stalling the GPUs), they save a checkpoint and exit 0; torchrun then
#      exits 0 and the step ends.
#   5. This shell requeues the job (`scontrol requeue`): Slurm ends this run and queues the same
#      job again, which resumes from CHECKPOINT_DIR/latest. Keep `#SBATCH --open-mode=append`
#      so both runs stay in one log.
# By hand: `scancel --signal=USR1 --batch JOBID` saves, stops and requeues (the path above);
# `scancel --signal=USR1 JOBID` (steps only) saves and stops, and the job ends COMPLETED.
# Preemption and `scancel JOBID` send SIGTERM to every process: torchrun forwards it to the
# workers, which save after their next step, and kills them after 30 s (its shutdown
# timeout); Slurm kills everything after KillWait. Neither is a failure: no in-job restart,
# no node recorded. Workers that torchrun restarts after a failure inherit the ignored
# SIGUSR1 as the first ones did, so a warning during a restart is repeated until they take it. A preempted job with --requeue is requeued
# by Slurm itself. (Where the site sets SlurmctldParameters=preempt_send_user_signal and a
# GraceTime, preemption sends the --signal first, and the path above saves.)
set -euo pipefail

die() { echo "launch.sh: error: $*" >&2; exit 2; }

# The value of the last FLAG in TRAIN_ARGS (`FLAG VALUE` or `FLAG=VALUE`), else DEFAULT.
flag_value() {
  local flag=$1 value=$2 i
  for ((i = 0; i < ${#TRAIN_ARGS[@]}; i++)); do
    case ${TRAIN_ARGS[i]} in
      "$flag") value=${TRAIN_ARGS[i + 1]:-} ;;
      "$flag"=*) value=${TRAIN_ARGS[i]#*=} ;;
    esac
  done
  printf '%s' "$value"
}

# Slurm's host list syntax without Slurm, for a dry run where scontrol is missing or has no
# configuration: comma-separated names, each with any number of [1-4,07] groups (numbers keep
# the width of their lower bound), expanded in scontrol's order. Appends to NODES.
expand_host() {
  local host=$1 head rest tail range low high n name
  local -a ranges
  if [[ $host != *"["* ]]; then
    [[ -n $host && $host != *"]"* ]] || return 1
    NODES+=("$host")
    return 0
  fi
  head=${host%%"["*}
  rest=${host#*"["}
  [[ $rest == *"]"* ]] || return 1
  tail=${rest#*"]"}
  IFS=, read -r -a ranges <<< "${rest%%"]"*}"
  ((${#ranges[@]})) || return 1
  for range in "${ranges[@]}"; do
    [[ $range =~ ^([0-9]+)(-([0-9]+))?$ ]] || return 1
    low=${BASH_REMATCH[1]}
    high=${BASH_REMATCH[3]:-$low}
    for ((n = 10#$low; n <= 10#$high; n++)); do
      printf -v name '%s%0*d%s' "$head" "${#low}" "$n" "$tail"
      expand_host "$name" || return 1
    done
  done
}

expand_hostlist() {
  local list=$1 item='' depth=0 i ch
  for ((i = 0; i < ${#list}; i++)); do
    ch=${list:i:1}
    case $ch in
      "[") depth=$((depth + 1)) ;;
      "]") depth=$((depth - 1)) ;;
    esac
    if [[ $ch == , && $depth == 0 ]]; then
      expand_host "$item" || return 1
      item=''
    else
      item+=$ch
    fi
  done
  expand_host "$item"
}

[ -n "${GPUS_PER_NODE:-}" ] || die "set GPUS_PER_NODE (worker processes per node) first"
[ -n "${SAVE_INTERVAL:-}" ] || die "set SAVE_INTERVAL (--save-interval) first"
declare -p TRAIN_ARGS >/dev/null 2>&1 || die "set the TRAIN_ARGS array first"
[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a Slurm job: submit with sbatch (or set" \
  "LAUNCH_DRY_RUN=1 and fake an allocation: SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURM_NNODES)"
for var in SLURM_JOB_NODELIST SLURM_NNODES; do
  [ -n "${!var:-}" ] || die "$var is not set (sbatch sets it; a dry run fakes it)"
done
MEGATRON3D_DIR="${MEGATRON3D_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}"
[ -f "$MEGATRON3D_DIR/pretrain_gpt.py" ] \
  || die "no pretrain_gpt.py in $MEGATRON3D_DIR: submit from the repository or set MEGATRON3D_DIR"

# --- Signals first: a warning that arrives while the job starts up must not be lost. ---------
STOP_REQUESTED=0
INTERRUPTED=0
TERMINATED=0
RESENDER_PID=
# shellcheck disable=SC2317  # the handlers run from `trap`, which shellcheck cannot see
on_usr1() {
  INTERRUPTED=1
  [ "$STOP_REQUESTED" = 0 ] || return 0
  STOP_REQUESTED=1
  echo "launch.sh: SIGUSR1 (time limit warning or by hand): asking the workers to save and stop"
  scancel --signal=USR1 "$SLURM_JOB_ID" || echo "launch.sh: scancel failed" >&2
  # Workers still starting up (building the model, loading a checkpoint) have no handler yet
  # and ignore SIGUSR1, so repeat it until the step ends; a second one changes nothing.
  (while sleep 20; do scancel --signal=USR1 "$SLURM_JOB_ID" 2>/dev/null || true; done) &
  RESENDER_PID=$!
}
# shellcheck disable=SC2317
on_term() {
  INTERRUPTED=1
  TERMINATED=1
  echo "launch.sh: SIGTERM: the workers save after their next step if time allows"
}
trap on_usr1 USR1
trap on_term TERM

declare -p SRUN_ARGS >/dev/null 2>&1 || SRUN_ARGS=()
if [ -n "${SETUP_HOOK:-}" ]; then
  [ -f "$SETUP_HOOK" ] || die "SETUP_HOOK=$SETUP_HOOK is not a file: give the bash file to source"
  # `module` and `conda activate` read unset variables: no `set -u` while the hook runs.
  set +u
  # shellcheck source=/dev/null
  source "$SETUP_HOOK"
  set -u
fi

# --- Layout: world = nodes x GPUS_PER_NODE = TP x PP x DP. -----------------------------------
TP_SIZE=$(flag_value --tensor-model-parallel-size 1)
PP_SIZE=$(flag_value --pipeline-model-parallel-size 1)
for pair in "GPUS_PER_NODE=$GPUS_PER_NODE" "SLURM_NNODES=$SLURM_NNODES" \
    "--tensor-model-parallel-size=$TP_SIZE" "--pipeline-model-parallel-size=$PP_SIZE"; do
  [[ ${pair#*=} =~ ^[1-9][0-9]*$ ]] || die "${pair%%=*} is '${pair#*=}': give a positive integer"
done
WORLD_SIZE=$((SLURM_NNODES * GPUS_PER_NODE))
((WORLD_SIZE % (TP_SIZE * PP_SIZE) == 0)) \
  || die "world size $WORLD_SIZE ($SLURM_NNODES node(s) x $GPUS_PER_NODE) is not divisible" \
         "by TP $TP_SIZE x PP $PP_SIZE: change --nodes, GPUS_PER_NODE or the layout flags"
DP_SIZE=$((WORLD_SIZE / (TP_SIZE * PP_SIZE)))

MAX_RESTARTS="${MAX_RESTARTS:-3}"
[[ $MAX_RESTARTS =~ ^[0-9]+$ ]] \
  || die "MAX_RESTARTS is '$MAX_RESTARTS': give torchrun's restart count (0: no in-job restart)"

# --- Outputs: outside the repository, on a file system every node sees. ---------------------
OUTPUT_ROOT="${OUTPUT_ROOT:-${SCRATCH:-$HOME/scratch}/megatron3d}"
RUN_DIR="${RUN_DIR:-$OUTPUT_ROOT/${SLURM_JOB_NAME:-job$SLURM_JOB_ID}}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-$RUN_DIR/checkpoints}"
TENSORBOARD_DIR="${TENSORBOARD_DIR-$RUN_DIR/tensorboard}"
DATA_CACHE_DIR="${DATA_CACHE_DIR:-$OUTPUT_ROOT/index-cache}"
OUTPUT_ARGS=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL")
HANG_DIR=$(flag_value --hang-dump-dir "$CHECKPOINT_DIR/hang")
OUTPUTS="checkpoints $CHECKPOINT_DIR (hang dumps in hang/)"
if [ "$HANG_DIR" != "$CHECKPOINT_DIR/hang" ]; then
  OUTPUTS="checkpoints $CHECKPOINT_DIR, hang dumps $HANG_DIR"
fi
if [ -n "$TENSORBOARD_DIR" ]; then
  OUTPUT_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
  OUTPUTS+=", tensorboard $TENSORBOARD_DIR"
fi
if [ -n "$(flag_value --data-path "")$(flag_value --data-path-file "")" ]; then
  OUTPUT_ARGS+=(--data-cache-path "$DATA_CACHE_DIR")
  OUTPUTS+=", index caches $DATA_CACHE_DIR"
fi

# shellcheck source=scripts/slurm/failed_nodes.sh
source "$MEGATRON3D_DIR/scripts/slurm/failed_nodes.sh"

# --- Environment of every worker (srun passes the batch shell's environment to each node). --
# Workers use one OpenMP thread each (torchrun's default too): GPUs do the math, and more
# threads per process would oversubscribe the node's cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# One hardware queue per GPU, so kernels start in the order they are issued: a tensor-parallel
# collective issued before a GEMM starts before it (Megatron's communication overlap needs it).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# A failed or timed-out NCCL collective aborts the process instead of hanging; torchrun exits
# non-zero and srun --kill-on-bad-exit ends the job rather than burning it to the time limit.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# PyTorch's NCCL flight recorder: each rank keeps its last collectives (with their state:
# scheduled, started, completed on the GPU) and writes them beside megatron3d's own hang dumps
# (HANG_DIR: --hang-dump-dir, default CHECKPOINT_DIR/hang; read by tools/hang_report.py) when
# megatron3d's watchdog fires, or when a collective times out (--distributed-timeout-minutes).
# torch's `torchfrtrace -p nccl_trace_rank_ HANG_DIR` analyses those. Only ProcessGroupNCCL
# reads these, so CPU runs ignore them.
export TORCH_NCCL_TRACE_BUFFER_SIZE="${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}"
export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$HANG_DIR/nccl_trace_rank_}"
# NCCL prints warnings only; set INFO to see the chosen network, rings and trees.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# Log lines reach the job's log as they are printed, and fatal signals print a Python stack.
export PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1
# Where each node's launcher notes that its workers failed (failed_nodes.sh reads it).
export MEGATRON3D_NODE_EXIT_DIR="$NODE_EXIT_DIR"
# Slurm 22.05+ no longer passes the job's --cpus-per-task to srun: the task on each node runs
# every worker of the node, so give it all the CPUs the job has there.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
  export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
fi

# --- Rendezvous: the first node of the allocation hosts torchrun's c10d store. ---------------
# scontrol knows the site's host list syntax; without a Slurm configuration (a dry run on a
# laptop or login node) it fails, and expand_hostlist does it.
NODES=()
if command -v scontrol >/dev/null && HOSTNAMES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" \
    2>/dev/null); then
  mapfile -t NODES <<< "$HOSTNAMES"
else
  expand_hostlist "$SLURM_JOB_NODELIST" \
    || die "SLURM_JOB_NODELIST is '$SLURM_JOB_NODELIST': not a host list like gpu[001-004,007]"
fi
[ "${#NODES[@]}" -eq "$SLURM_NNODES" ] \
  || die "SLURM_JOB_NODELIST expands to ${#NODES[@]} hosts, SLURM_NNODES is $SLURM_NNODES"
MASTER_ADDR="${NODES[0]}"
MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}"

# The same command runs on every node: c10d rendezvous numbers the nodes, so nothing here
# depends on SLURM_NODEID, and the 8 ranks of a node are consecutive (TP stays inside a node).
# tools/launch.py is torchrun (same options) whose exit code is the first failing rank's
# (2 bad input, 3 a hang, 1 a run gone wrong; torchrun alone exits 1) and which prints that
# rank's error line once; the job script exits with it (`exit "$STEP_RC"` below).
# --max-restarts: a failed worker makes its node's torchrun stop its workers and rendezvous
# again; the other nodes' torchruns see a node waiting and restart theirs (each node counts
# the restarts its own workers' failures caused). The c10d store lives in the first node's
# torchrun, so the rendezvous survives a restart as long as that torchrun does.
TORCHRUN=(
  python3 "$MEGATRON3D_DIR/tools/launch.py"
  --nnodes "$SLURM_NNODES"
  --nproc-per-node "$GPUS_PER_NODE"
  --rdzv-backend c10d
  --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
  --rdzv-id "$SLURM_JOB_ID"
  --max-restarts "$MAX_RESTARTS"
  --monitor-interval 0.5
  "$MEGATRON3D_DIR/pretrain_gpt.py"
  "${TRAIN_ARGS[@]}"
  "${OUTPUT_ARGS[@]}"
)
# One task per node; if one node's launcher fails, srun kills the others instead of leaving
# them waiting in a collective. The bash wrapper makes torchrun ignore SIGUSR1 (step 3 above).
# (srun options take `=`: --kill-on-bad-exit's value is optional, so a separate 1 would be
# read as the command.)
SRUN=(
  srun
  --nodes="$SLURM_NNODES"
  --ntasks-per-node=1
  --kill-on-bad-exit=1
  "${SRUN_ARGS[@]}"
  bash -c 'trap "" USR1; exec "$@"' megatron3d-node
  "${TORCHRUN[@]}"
)

# What runs where, before the command: PREFIX starts each line.
describe() {
  local prefix=$1
  echo "${prefix}job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $SLURM_NNODES node(s)" \
    "x $GPUS_PER_NODE workers = world $WORLD_SIZE = TP $TP_SIZE x PP $PP_SIZE x DP $DP_SIZE"
  echo "${prefix}nodes ${NODES[*]}; rendezvous $MASTER_ADDR:$MASTER_PORT"
  echo "${prefix}outputs: $OUTPUTS"
  echo "${prefix}on failure: up to $MAX_RESTARTS in-job restart(s), then requeue up to" \
    "$REQUEUE_ON_FAILURE time(s) without a newer checkpoint; failed nodes in $FAILED_NODES_FILE"
}

VENV="${VENV:-$MEGATRON3D_DIR/.venv}"
if [ -f "$VENV/bin/activate" ]; then
  # shellcheck source=/dev/null
  source "$VENV/bin/activate"
fi
IN_CONTAINER=0
[[ " ${SRUN_ARGS[*]} " != *" --container-image"* ]] || IN_CONTAINER=1

if [ "${LAUNCH_DRY_RUN:-0}" = 1 ]; then
  # Every check a worker makes at start before the processes meet (flags, data and checkpoint
  # paths), for this world size: its one-line error and exit 2 now, not after the queue wait.
  PYTHON=$(command -v python || command -v python3 || true)
  if [ -n "$PYTHON" ]; then
    WORLD_SIZE=$WORLD_SIZE RANK=0 LOCAL_RANK=0 "$PYTHON" "$MEGATRON3D_DIR/pretrain_gpt.py" \
      "${TRAIN_ARGS[@]}" "${OUTPUT_ARGS[@]}" --print-topology >/dev/null || exit $?
  elif [ "$IN_CONTAINER" = 1 ]; then
    echo "# start-up checks not made: no python outside the container (it makes them at launch)"
  else
    die "no python to check the flags with: activate an environment with torch (VENV or SETUP_HOOK)"
  fi
  describe "# "
  printf '%q ' "${SRUN[@]}"
  printf '\n'
  exit 0
fi

# In a pyxis container (srun --container-image) python3 is the image's, not this shell's.
if [ "$IN_CONTAINER" = 0 ]; then
  python3 -c "import torch.distributed.run" 2>/dev/null \
    || die "python3 cannot import torch: activate an environment with torch (VENV, SETUP_HOOK)"
fi
mkdir -p "$HANG_DIR" "$NODE_EXIT_DIR"

describe "launch.sh: "
printf 'launch.sh: '
printf '%q ' "${SRUN[@]}"
printf '\n'

# srun runs in the background so that the traps run as soon as a signal arrives (bash defers
# a trap while a foreground command runs, but interrupts `wait`).
"${SRUN[@]}" &
STEP_PID=$!
while true; do
  INTERRUPTED=0
  STEP_RC=0
  wait "$STEP_PID" || STEP_RC=$?
  [ "$INTERRUPTED" = 1 ] || break  # a trap ran: the step is still going (or just ended)
done
trap - USR1 TERM
if [ -n "$RESENDER_PID" ]; then
  kill "$RESENDER_PID" 2>/dev/null || true
fi
echo "launch.sh: training step exited with code $STEP_RC"

collect_node_exits
if [ "$STEP_RC" = 0 ]; then
  if [ "$STOP_REQUESTED" = 1 ] && [ "${REQUEUE_ON_SIGNAL:-1}" = 1 ]; then
    requeue_job "checkpoint saved"
  fi
elif [ "$TERMINATED" = 0 ]; then
  after_failure  # SIGTERM (scancel, preemption) is no failure: Slurm ends or requeues the job
fi
exit "$STEP_RC"
