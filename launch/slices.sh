# Several TPU slices as one job (sourced by launch/tpu_pod.sh; --slices N). With N = 1 nothing here changes the
# one-slice launch: each_slice runs its command once, on the slice named --tpu.
#
# N > 1: one multislice queued-resource request, `gcloud compute tpus queued-resources create TPU --node-count N
# --node-prefix TPU ...`; Cloud TPU names its slices TPU-0 .. TPU-(N-1). The same code is shipped to every host of
# every slice and the same command started everywhere with the MegaScale runtime's variables (the TPU runtime joins
# the slices over DCN with them; jax then numbers the processes slice by slice):
#   MEGASCALE_COORDINATOR_ADDRESS  slice 0's worker 0 (its internal IP and MEGASCALE_PORT)
#   MEGASCALE_NUM_SLICES           N
#   MEGASCALE_SLICE_ID             this host's slice, 0 .. N-1
#   MEGASCALE_PORT                 the coordinator's port
# The job gets --config.mesh.slices=N (the outermost mesh axis; trace_jax/parallel/mesh.py). Any slice preempted
# counts as the job's preemption: --watch deletes the request and re-creates all the slices (slices_state).
# Uses tpu_pod.sh's TPU, SCOPE, VM, QR, ACCELERATOR, RUNTIME, SPOT, QUEUED, CREATE, EXTRA, ENVS, run, note, fail.

MEGASCALE_PORT=8080

# Checks --slices and sets up the multislice request: implies --queued, adds the job's mesh.slices override.
slices_setup() {
  [[ "$SLICES" =~ ^[1-9][0-9]*$ ]] || fail "--slices $SLICES: expected a number of slices >= 1"
  [ "$SLICES" = 1 ] && return 0
  [ "$CREATE" = 1 ] && fail "--slices $SLICES: several slices come from one queued-resource request; drop --create"
  QUEUED=1
  EXTRA=("--config.mesh.slices=$SLICES" ${EXTRA[@]+"${EXTRA[@]}"})
}

# The TPU VM name of slice $1 (0-based): TPU itself with one slice, else TPU-$1 (the request's node prefix).
slice_node() {
  if [ "$SLICES" = 1 ]; then echo "$TPU"; else echo "$TPU-$1"; fi
}

# The queued-resource flags that name the nodes: one node, or N under the prefix TPU.
node_flags() {
  if [ "$SLICES" = 1 ]; then
    echo "--node-id=$TPU"
  else
    echo "--node-count=$SLICES --node-prefix=$TPU"
  fi
}

# `each_slice CMD ARGS...`: CMD once per slice with NODE set to that slice's TPU VM (on_workers uses it) and
# SLICE_ID to its index.
each_slice() {
  local NODE SLICE_ID
  for ((SLICE_ID = 0; SLICE_ID < SLICES; SLICE_ID++)); do
    NODE="$(slice_node "$SLICE_ID")"
    "$@" || return
  done
}

# The MegaScale variables of slice $1 (KEY=VALUE words for tpu_worker.sh start); none with one slice.
megascale_env() {
  [ "$SLICES" = 1 ] && return 0
  echo "MEGASCALE_COORDINATOR_ADDRESS=$COORDINATOR:$MEGASCALE_PORT MEGASCALE_NUM_SLICES=$SLICES" \
    "MEGASCALE_SLICE_ID=$1 MEGASCALE_PORT=$MEGASCALE_PORT"
}

# Slice 0's worker 0 internal IP (the MegaScale coordinator) into COORDINATOR; a placeholder under --dry-run.
find_coordinator() {
  COORDINATOR=""
  [ "$SLICES" = 1 ] && return 0
  local node cmd
  node="$(slice_node 0)"
  cmd=("${VM[@]}" describe "$node" "${SCOPE[@]}" --format="value(networkEndpoints[0].ipAddress)")
  if [ "$DRY_RUN" = 1 ]; then
    run "${cmd[@]}"
    COORDINATOR="IP_OF_${node}_WORKER_0"
  else
    COORDINATOR="$("${cmd[@]}")"
    [ -n "$COORDINATOR" ] || fail "no internal IP for $node worker 0 (the MegaScale coordinator): ${cmd[*]}"
  fi
}

# The request's health: its own state unless ACTIVE, else the first slice that is not READY ("PREEMPTED (TPU-1)"),
# else ACTIVE. Any slice down is the whole job's preemption.
slices_state() {
  local state node node_state i
  state="$("${QR[@]}" describe "$TPU" "${SCOPE[@]}" --format="value(state.state)" 2>/dev/null || true)"
  if [ "$state" != ACTIVE ] || [ "$SLICES" = 1 ]; then
    echo "$state"
    return 0
  fi
  for ((i = 0; i < SLICES; i++)); do
    node="$(slice_node "$i")"
    node_state="$("${VM[@]}" describe "$node" "${SCOPE[@]}" --format="value(state)" 2>/dev/null || true)"
    if [ "$node_state" != READY ]; then
      echo "${node_state:-GONE} ($node)"
      return 0
    fi
  done
  echo ACTIVE
}
