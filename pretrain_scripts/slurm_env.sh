# Sourced by the Slurm templates: the nodes, the rendezvous host, and slurm_run.
#   slurm_run TOOL OVERRIDES_ARRAY_NAME [key=value ...]
# runs TOOL (with $CONFIG and launch.sh's knobs) under srun, one torchrun per node; with
# DRY_RUN=1 it prints the plan and the torchrun command on this machine instead (no scheduler).
export NGPU="${NGPU:-${SLURM_GPUS_ON_NODE:-8}}"
export NNODES="${NNODES:-${SLURM_NNODES:-1}}"
if [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
fi
export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
export MASTER_PORT="${MASTER_PORT:-29500}"

slurm_run() {
  local tool="$1" extra="$2"; shift 2
  if [ "${DRY_RUN:-0}" = 1 ]; then
    # shellcheck disable=SC1091
    source pretrain_scripts/launch.sh
    local -n overrides="$extra"
    run_torchrun "$tool" "$CONFIG" "${overrides[@]}" "$@"
    return 0
  fi
  # every node runs the same launcher; the nodes meet by c10d rendezvous at MASTER_ADDR:MASTER_PORT
  # (node ranks assigned there), so a node that restarts (MAX_RESTARTS) rejoins the same job
  srun --kill-on-bad-exit=1 bash -c 'source pretrain_scripts/launch.sh
    tool="$1" extra="$2"; shift 2; declare -n overrides="$extra"
    run_torchrun "$tool" "$CONFIG" "${overrides[@]}" "$@"' _ "$tool" "$extra" "$@"
}
