#!/usr/bin/env bash
# Launch one node of the 3 x 8 GPU deployment (2 actor nodes, 1 rollout node). Run it on every node:
#   NODE_RANK=0 MASTER_ADDR=node0 launch/torchrun_3node.sh [dotted.key=value ...]   # actor node
#   NODE_RANK=1 MASTER_ADDR=node0 launch/torchrun_3node.sh [...]                    # actor node
#   NODE_RANK=2 MASTER_ADDR=node0 launch/torchrun_3node.sh [...]                    # rollout node
# Rendezvous is torchrun's static one (a TCP store at MASTER_ADDR:MASTER_PORT) with fixed node ranks, so global
# ranks are node-major: NODE_RANK * 8 + LOCAL_RANK. train_grpo.py makes the last deploy.rollout_ranks ranks the
# rollout ranks, i.e. all of node 2: the rollout node runs only the FP8 engine, and its KV cache gets the memory.
# (A dynamic c10d rendezvous would number nodes by arrival and could put rollout ranks on an actor node.)
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/env.sh
: "${NODE_RANK:?set NODE_RANK (0, 1: actor nodes; 2: the rollout node)}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
MASTER_PORT=${MASTER_PORT:-29500}
CONFIG=${CONFIG:-configs/dsv4.yaml}
NPROC=${NPROC_PER_NODE:-8}
exec torchrun --nnodes 3 --nproc-per-node "$NPROC" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" ${MAX_RESTARTS:+--max-restarts "$MAX_RESTARTS"} \
  train_grpo.py --config "$CONFIG" --resume auto "$@"
