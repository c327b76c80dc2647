#!/usr/bin/env bash
# Create (optionally) a Cloud TPU VM pod slice, install trace_jax on every worker and start training on all.
# Usage: launch/tpu_pod.sh --tpu NAME --zone Z [--accelerator v5p-32] [--create] [--repo URL] [--dry-run]
#                          [--config C] [--workdir gs://bucket/run] [-- overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/common.sh
TPU=""; ZONE=""; ACCELERATOR="v5p-32"; CREATE=0; REPO="https://github.com/trace-jax/trace_jax.git"
RUNTIME="v2-alpha-tpuv5"
parse_specific() {
  SHIFT_TWO=1
  case "$1" in
    --tpu) TPU="$2" ;;
    --zone) ZONE="$2" ;;
    --accelerator) ACCELERATOR="$2" ;;
    --repo) REPO="$2" ;;
    --runtime) RUNTIME="$2" ;;
    --create) CREATE=1; SHIFT_TWO=0 ;;
    *) SHIFT_TWO=0; return 1 ;;
  esac
}
parse_common "$@"
[ -n "$TPU" ] && [ -n "$ZONE" ] || { echo "--tpu NAME and --zone ZONE are required" >&2; exit 2; }
if [ "$CREATE" = 1 ]; then
  run gcloud compute tpus tpu-vm create "$TPU" --zone="$ZONE" --accelerator-type="$ACCELERATOR" --version="$RUNTIME"
fi
# Every worker runs the same program; jax.distributed discovers the pod (distributed.mode=auto).
REMOTE="set -e; [ -d trace_jax ] || git clone $REPO trace_jax; cd trace_jax && git pull --ff-only; \
pip install -e '.[tpu]'; $(train_command) --config.distributed.mode=auto"
run gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all --command="$REMOTE"
