#!/bin/bash
# Runs bert_jax on one GPU node of a multi-node job on clusters without SLURM. Start it on every
# node with the same flags except --node_rank (0 on the node named in --coordinator):
#
#   launch/gpu_node.sh --coordinator=node0:12345 --num_nodes=2 --node_rank=0 \
#     --config=configs/bert_large.py --workdir=/shared/runs/bert_large \
#     --config.train.batch_size=1024 [-- other bert-jax arguments]
#
# Flags (--flag=value or --flag value):
#   --coordinator HOST:PORT  address of process 0 (not needed with --num_nodes=1)
#   --num_nodes N            number of nodes, one JAX process each (default 1)
#   --node_rank I            this node's process id, 0..N-1 (default 0)
#   --config FILE            config file (required)
#   --workdir DIR            storage every node shares, or gs:// (required)
#   --mode pretrain|finetune default pretrain
#   --dry_run                print the command instead of running it
# --config.key=value flags and everything after `--` go to bert-jax unchanged.
# Environment: BERT_JAX (trainer command, default bert-jax), GPU_XLA_FLAGS (replaces the
# default XLA flags; "" for none), XLA_FLAGS (appended).

set -euo pipefail

die() { echo "gpu_node.sh: error: $*" >&2; exit 2; }

COORDINATOR="" NUM_NODES=1 NODE_RANK=0 CONFIG="" WORKDIR="" MODE=pretrain DRY_RUN=0
EXTRA=()
while (( $# )); do
  case "$1" in
    --dry_run) DRY_RUN=1; shift ;;
    --) shift; EXTRA+=("$@"); break ;;
    --config.*=*) EXTRA+=("$1"); shift ;;
    --coordinator=*|--num_nodes=*|--node_rank=*|--config=*|--workdir=*|--mode=*)
      name="${1%%=*}"; value="${1#*=}"; shift; set -- "$name" "$value" "$@" ;;
    --coordinator|--num_nodes|--node_rank|--config|--workdir|--mode)
      (( $# >= 2 )) && [[ "$2" != --* ]] || die "$1 needs a value"
      case "$1" in
        --coordinator) COORDINATOR="$2" ;;
        --num_nodes) NUM_NODES="$2" ;;
        --node_rank) NODE_RANK="$2" ;;
        --config) CONFIG="$2" ;;
        --workdir) WORKDIR="$2" ;;
        --mode) MODE="$2" ;;
      esac
      shift 2 ;;
    *) die "unknown argument '$1' (config overrides are --config.key=value;" \
           "other bert-jax arguments go after --)" ;;
  esac
done

[[ -n "$CONFIG" ]] || die "--config is required, e.g. --config=configs/bert_large.py"
[[ -n "$WORKDIR" ]] || die "--workdir is required (shared storage or gs://...)"
[[ "$MODE" == pretrain || "$MODE" == finetune ]] \
  || die "--mode must be pretrain or finetune, got '$MODE'"
[[ "$NUM_NODES" =~ ^[1-9][0-9]*$ ]] \
  || die "--num_nodes must be a positive integer, got '$NUM_NODES'"
[[ "$NODE_RANK" =~ ^[0-9]+$ ]] && (( NODE_RANK < NUM_NODES )) \
  || die "--node_rank must be in 0..$((NUM_NODES - 1)), got '$NODE_RANK'"

DIST=()
if (( NUM_NODES > 1 )); then
  [[ "$COORDINATOR" =~ ^[^:[:space:]]+:[0-9]+$ ]] \
    || die "--coordinator must be HOST:PORT with --num_nodes=$NUM_NODES, got '$COORDINATOR'"
  DIST=("--coordinator_address=$COORDINATOR" "--num_processes=$NUM_NODES"
        "--process_id=$NODE_RANK")
fi

# Same defaults as gpu_slurm.sbatch: overlap collectives with compute, cuBLAS GEMMs, fewer and
# bigger gradient all-reduces.
DEFAULT_XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true \
--xla_gpu_enable_triton_gemm=false \
--xla_gpu_all_reduce_combine_threshold_bytes=134217728"
XLA_FLAGS="${GPU_XLA_FLAGS-$DEFAULT_XLA_FLAGS} ${XLA_FLAGS:-}"
export XLA_FLAGS="${XLA_FLAGS% }"
# TensorFlow (tf.data) is kept off the GPUs, so JAX may take most of their memory.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"

read -r -a TRAINER <<< "${BERT_JAX:-bert-jax}"
TRAIN=("${TRAINER[@]}" "$MODE" "--config=$CONFIG" "--workdir=$WORKDIR" ${DIST[@]+"${DIST[@]}"}
       ${EXTRA[@]+"${EXTRA[@]}"})

if (( DRY_RUN )); then
  printf 'export XLA_FLAGS=%q\n' "$XLA_FLAGS"
  printf 'export XLA_PYTHON_CLIENT_MEM_FRACTION=%q\n' "$XLA_PYTHON_CLIENT_MEM_FRACTION"
  printf '%q ' "${TRAIN[@]}"; echo
  exit 0
fi
exec "${TRAIN[@]}"
