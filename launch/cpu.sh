#!/usr/bin/env bash
# Train on this machine's CPU (the laptop path). Usage: launch/cpu.sh [--dry-run] [--config C] [--workdir W] [-- --config.x=y ...]
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/common.sh
parse_specific() { SHIFT_TWO=0; return 1; }
parse_common "$@"
run env JAX_PLATFORMS=cpu bash -c "$(train_command)"
