#!/usr/bin/env bash
# What launch.sh does after its job step failed (sourced by launch.sh, whose variables it
# reads): name the node that failed, keep the list of failed nodes, requeue the job within
# REQUEUE_ON_FAILURE, and exclude a node that failed twice.
#
# Which node failed: each node's tools/launch.py whose workers failed (after torchrun's
# in-job restarts ran out) writes `TIME_US NODE CODE RANK` into NODE_EXIT_DIR
# (megatron3d/resilience/node_exit.py); a launcher stopped by a signal (srun tearing down the
# other nodes) writes nothing. The node that failed first is the one recorded. An exit code 2
# first (bad input, or a peer's bad input) names no node and is not requeued: it would fail
# again. Where no launcher wrote a line (a node lost, a launcher killed), every node of the
# step is recorded.
#
# FAILED_NODES_FILE (default RUN_DIR/failed_nodes.txt): one line per failure of a node,
#   NODE job=JOBID.RESTART code=CODE rank=RANK latest=ITERATION time=DATE
# A node on two lines is excluded from the job's next run; add a node twice by hand to
# exclude it, delete its lines to let it back. Slurm changes a job's ExcNodeList only while
# the job is pending, and a requeue stops this shell before it is, so a job that must exclude
# a new node is submitted again (same script, name, nodes, time, partition, account, QOS and
# log, `--exclude`, starting after this job ends) instead of requeued.
#
# REQUEUE_ON_FAILURE (default 2): how many failed runs in a row may requeue the job without
# the global checkpoint (CHECKPOINT_DIR/latest) advancing. Hardware faults come between
# checkpoints and each one is requeued; a broken configuration or code fails again at the
# same checkpoint and stops after REQUEUE_ON_FAILURE requeues. 0: never requeue a failure.

FAILED_NODES_FILE="${FAILED_NODES_FILE:-$RUN_DIR/failed_nodes.txt}"
REQUEUE_ON_FAILURE="${REQUEUE_ON_FAILURE:-2}"
[[ $REQUEUE_ON_FAILURE =~ ^[0-9]+$ ]] \
  || die "REQUEUE_ON_FAILURE is '$REQUEUE_ON_FAILURE': give a count (0: never requeue a failure)"
NODE_EXIT_DIR="$CHECKPOINT_DIR/node_exits/$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"

# The iteration in CHECKPOINT_DIR/latest, or "none" before the first save.
latest_iteration() {
  local iteration=''
  if [ -f "$CHECKPOINT_DIR/latest" ]; then
    read -r iteration < "$CHECKPOINT_DIR/latest" || true
  fi
  printf '%s' "${iteration:-none}"
}

# How many failed runs FAILED_NODES_FILE holds at checkpoint iteration $1.
failed_runs_at() {
  [ -f "$FAILED_NODES_FILE" ] || { echo 0; return; }
  awk -v at="latest=$1" '
    /^#/ { next }
    { hit = 0; run = "" }
    { for (i = 2; i <= NF; i++) { if ($i == at) hit = 1; if ($i ~ /^job=/) run = $i } }
    hit && run != "" && !(run in seen) { seen[run] = 1; n++ }
    END { print n + 0 }' "$FAILED_NODES_FILE"
}

# The nodes FAILED_NODES_FILE lists at least twice, one a line.
twice_failed_nodes() {
  [ -f "$FAILED_NODES_FILE" ] || return 0
  awk '!/^#/ && NF { n[$1]++ } END { for (node in n) if (n[node] >= 2) print node }' \
    "$FAILED_NODES_FILE" | sort
}

# The value of FIELD in `scontrol show job -o`'s line JOB_LINE, empty when unset.
job_field() {
  local job_line=" $1 " name=$2
  [[ $job_line =~ \ $name=([^ ]*)\  ]] || return 0
  [[ ${BASH_REMATCH[1]} == "(null)" ]] || printf '%s' "${BASH_REMATCH[1]}"
}

# Submit this job's script again, excluding EXCLUDE (a host list), to start after this job.
resubmit_excluding() {
  local exclude=$1 job_line script value pair var
  local -a options clean_env=(env)
  job_line=$(scontrol show job -o "$SLURM_JOB_ID") || return 1
  script=$(job_field "$job_line" Command)
  [ -f "$script" ] || { echo "launch.sh: cannot resubmit: job script '$script' is gone" >&2; return 1; }
  options=(--parsable "--job-name=${SLURM_JOB_NAME:-$(job_field "$job_line" JobName)}"
           "--nodes=$SLURM_NNODES" "--dependency=afterany:$SLURM_JOB_ID" "--exclude=$exclude")
  for pair in chdir:WorkDir output:StdOut error:StdErr time:TimeLimit partition:Partition \
      account:Account qos:QOS; do
    value=$(job_field "$job_line" "${pair#*:}")
    [ -z "$value" ] || options+=("--${pair%%:*}=$value")
  done
  # The new job gets its own SLURM_* variables; stale ones (SLURM_RESTART_COUNT) must not leak.
  for var in $(compgen -e); do
    [[ $var != SLURM_* || $var == SLURM_CONF ]] || clean_env+=(-u "$var")
  done
  "${clean_env[@]}" sbatch "${options[@]}" "$script"
}

# Requeue this job to resume from the newest checkpoint, saying so after WHY; submit it again
# instead when a node that failed twice is not yet excluded from it.
requeue_job() {
  local why=$1 job_line excluded node new_id joined
  local -a twice fresh=()
  mapfile -t twice < <(twice_failed_nodes)
  if ((${#twice[@]})); then
    job_line=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null) || job_line=''
    excluded=$(job_field "$job_line" ExcNodeList)
    if [ -n "$excluded" ]; then
      excluded=" $(scontrol show hostnames "$excluded" 2>/dev/null | tr '\n' ' ')"
    fi
    for node in "${twice[@]}"; do
      [[ "$excluded " == *" $node "* ]] || fresh+=("$node")
    done
  fi
  if ((${#fresh[@]})); then
    joined=$(IFS=,; echo "${twice[*]}")
    if new_id=$(resubmit_excluding "$joined"); then
      echo "launch.sh: $why; excluding node(s) ${fresh[*]} (failed twice, listed in" \
        "$FAILED_NODES_FILE): resubmitted as job ${new_id%%;*}, which resumes from" \
        "$CHECKPOINT_DIR/latest once this one ends"
      return 0
    fi
    echo "launch.sh: node(s) ${fresh[*]} failed twice, but submitting the job again with" \
      "--exclude failed: requeueing it as it is" >&2
  fi
  echo "launch.sh: $why; requeueing job $SLURM_JOB_ID to resume from $CHECKPOINT_DIR/latest"
  scontrol requeue "$SLURM_JOB_ID"
}

# The step's node records, earliest first, into NODE_EXITS; their directory is removed.
collect_node_exits() {
  mapfile -t NODE_EXITS < <(cat "$NODE_EXIT_DIR"/* 2>/dev/null | sort -n)
  rm -rf "$NODE_EXIT_DIR"
  rmdir "$CHECKPOINT_DIR/node_exits" 2>/dev/null || true
}

# After a failed step that nobody stopped: record the node that failed first, then requeue
# within REQUEUE_ON_FAILURE.
after_failure() {
  local -a blamed
  local first_node first_code first_rank latest runs stamp node
  if ((${#NODE_EXITS[@]})); then
    read -r _ first_node first_code first_rank <<< "${NODE_EXITS[0]}"
    if [ "$first_code" = 2 ]; then
      echo "launch.sh: bad input (exit 2, rank $first_rank): no node recorded, not" \
        "requeueing; fix what its error line says and resubmit"
      return 0
    fi
    blamed=("$first_node")
    echo "launch.sh: node $first_node failed first (exit $first_code, rank $first_rank):" \
      "recorded in $FAILED_NODES_FILE"
  else
    blamed=("${NODES[@]}")
    first_code=$STEP_RC
    first_rank=unknown
    echo "launch.sh: no node said why the step failed (exit $STEP_RC): recorded every node" \
      "of the step in $FAILED_NODES_FILE"
  fi
  latest=$(latest_iteration)
  stamp=$(date +%Y-%m-%dT%H:%M:%S)
  mkdir -p "$(dirname "$FAILED_NODES_FILE")"
  for node in "${blamed[@]}"; do
    printf '%s job=%s.%s code=%s rank=%s latest=%s time=%s\n' "$node" "$SLURM_JOB_ID" \
      "${SLURM_RESTART_COUNT:-0}" "$first_code" "$first_rank" "$latest" "$stamp" \
      >> "$FAILED_NODES_FILE"
  done
  runs=$(failed_runs_at "$latest")
  if ((runs > REQUEUE_ON_FAILURE)); then
    echo "launch.sh: $runs failed run(s) at checkpoint iteration $latest" \
      "(REQUEUE_ON_FAILURE=$REQUEUE_ON_FAILURE): not requeueing; fix the cause and resubmit"
    return 0
  fi
  requeue_job "failed run $runs of at most $REQUEUE_ON_FAILURE at checkpoint iteration $latest"
}
