#!/usr/bin/env bash
# Train on the GPUs of one host, or one host of several (--num-hosts/--host-id/--coordinator host:port).
# Usage: launch/gpu.sh [--dry-run] [--config C] [--workdir W] [--num-hosts N --host-id I --coordinator A] [-- overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/common.sh
NUM_HOSTS=1; HOST_ID=0; COORDINATOR=""
parse_specific() {
  SHIFT_TWO=1
  case "$1" in
    --num-hosts) NUM_HOSTS="$2" ;;
    --host-id) HOST_ID="$2" ;;
    --coordinator) COORDINATOR="$2" ;;
    *) SHIFT_TWO=0; return 1 ;;
  esac
}
parse_common "$@"
if [ "$NUM_HOSTS" -gt 1 ]; then
  [ -n "$COORDINATOR" ] || { echo "--num-hosts > 1 needs --coordinator host:port" >&2; exit 2; }
  EXTRA=(--config.distributed.mode=explicit "--config.distributed.coordinator_address=$COORDINATOR"
         "--config.distributed.num_processes=$NUM_HOSTS" "--config.distributed.process_id=$HOST_ID" ${EXTRA[@]+"${EXTRA[@]}"})
fi
run pip install -e ".[cuda]"
run bash -c "$(train_command)"
