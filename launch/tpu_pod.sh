#!/usr/bin/env bash
# Run the main job on every host of a Cloud TPU VM slice (v5p-64 = 32 chips on 8 hosts), from this checkout.
#
# Launch (checks the overrides here, creates or reuses the slice, ships this checkout, installs, starts, streams):
#   launch/tpu_pod.sh --tpu NAME --zone ZONE --workdir gs://BUCKET/RUN [--project P] [--accelerator v5p-64]
#       [--create | --queued] [--spot] [--help] [--runtime VERSION] [--python 3.11] [--env KEY=VALUE ...]
#       [--no-stream] [--skip-check] [--skip-plan | --plan] [--plan-args "PLANNER OPTIONS"] [--dry-run]
#       [--plan-layout | --layout-from PLAN.json]
#       [--config configs/x.py[:arg]] [-- --config.key=value ...] [--watch [--max-relaunches N]] [--slices N]
# --slices N (N > 1): one queued-resource request for N slices of --accelerator joined over DCN (named TPU-0 ..),
# the job started on every host of every slice with --config.mesh.slices=N (launch/slices.sh; docs/multislice.md).
# The plan step (before the slice is made or anything shipped): the TPU compiler compiles the job's update and
# decode programs for the slice's topology here (python -m trace_jax.plan with the config's model preset,
# mesh, rows and engine; needs libtpu locally: pip install "jax[tpu]==<your jax version>") and a config whose
# per-chip peak does not fit the chip's memory stops the launch (exit 3) with the figures. Without libtpu it is
# skipped with a note; --skip-plan skips it; under --dry-run it is printed, and run only with --plan.
# --plan-layout lets the plan choose the layout: the planner searches the train step's mesh, micro-batch rows and
# remat for the slice (the job's model, rows, sequence length), checks the engine on the mesh it picks, and that
# layout joins the job's overrides (--config.mesh.*, ppo.micro_rows, ppo.remat) on every host, relaunches
# included; it runs under --dry-run too (the job line needs it). --layout-from PLAN.json takes the layout a saved
# plan picked (python -m trace_jax.plan --json, or docs/plans/), refused if it planned another model or
# accelerator; the plan step then checks it. With either, an override of one of those keys pins the layout:
# the plan checks that one instead (docs/pod.md).
# --watch (with --create or --queued) stays attached: when the job ends with exit status 143 (a SIGTERM, e.g. a
# preemption notice: it checkpointed first), the slice is preempted / SUSPENDED / FAILED / gone, or the ssh to
# worker 0 drops, it recreates the slice the same way (spot / queued included), ships and starts the same
# command on the same --workdir, which resumes from its last checkpoint; at most N times (default 10). A job
# killed on one worker (the others stop within --config.distributed.heartbeat_timeout_s, naming it) is started
# again on the same slice. A job that fails by itself on a healthy slice (a bug, a config error) is not
# relaunched. Under --dry-run it prints the first
# start and then one relaunch round, as if the slice had been preempted.
# Afterwards (same --tpu/--zone/--project; add --queued if the slice came from a queued resource):
#   --logs [--worker N]   stream worker N's log (default 0; Ctrl-C detaches, the job keeps running)
#   --status              one line per worker     --stop    stop the job on every worker
#   --delete              stop the job and delete the slice (or queued resource): billing stops here
#
# --spot makes a spot slice: it implies --create unless --queued is given (a queued spot request).
# --dry-run prints every command (gcloud and local) instead of running it; the override check still runs.
# --help prints this block.
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/common.sh
. launch/slices.sh
WORKDIR=""  # a pod needs an explicit shared workdir (common.sh defaults to a local one)
TPU=""; ZONE=""; PROJECT=""; ACCELERATOR="v5p-64"; RUNTIME=""; PY_VERSION="3.11"
CREATE=0; QUEUED=0; SPOT=0; SLICES=1; STREAM=1; CHECK=1; ACTION="launch"; WORKER=0; ENVS=()
PLAN="auto"; PLAN_ARGS=""; PLAN_LAYOUT=0; LAYOUT_FROM=""
WATCH=0; MAX_RELAUNCHES=10
PREEMPTED=143  # trace_jax.job.cli.ExitCode.PREEMPTED: stopped by SIGTERM after checkpointing; a rerun resumes
PYTHON="${PYTHON:-python3}"
parse_specific() {
  SHIFT_TWO=1
  case "$1" in
    --tpu) TPU="$2" ;;
    --zone) ZONE="$2" ;;
    --project) PROJECT="$2" ;;
    --accelerator) ACCELERATOR="$2" ;;
    --runtime) RUNTIME="$2" ;;
    --python) PY_VERSION="$2" ;;
    --env) ENVS+=("$2") ;;
    --worker) WORKER="$2" ;;
    --max-relaunches) MAX_RELAUNCHES="$2" ;;
    --slices) SLICES="$2" ;;
    --watch) WATCH=1; SHIFT_TWO=0 ;;
    --create) CREATE=1; SHIFT_TWO=0 ;;
    --queued) QUEUED=1; SHIFT_TWO=0 ;;
    --spot) SPOT=1; SHIFT_TWO=0 ;;
    --help | -h) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    --no-stream) STREAM=0; SHIFT_TWO=0 ;;
    --skip-check) CHECK=0; SHIFT_TWO=0 ;;
    --skip-plan) PLAN=0; SHIFT_TWO=0 ;;
    --plan) PLAN=1; SHIFT_TWO=0 ;;
    --plan-args) PLAN_ARGS="$2" ;;
    --plan-layout) PLAN_LAYOUT=1; SHIFT_TWO=0 ;;
    --layout-from) LAYOUT_FROM="$2" ;;
    --logs | --status | --stop | --delete) ACTION="${1#--}"; SHIFT_TWO=0 ;;
    *) SHIFT_TWO=0; return 1 ;;
  esac
}
parse_common "$@"
fail() { echo "$*" >&2; exit 2; }
[ -n "$TPU" ] && [ -n "$ZONE" ] || fail "--tpu NAME and --zone ZONE are required"
[ "$CREATE" = 1 ] && [ "$QUEUED" = 1 ] && fail "--create and --queued are two ways to make the slice: pick one"
slices_setup
[ "$SPOT" = 1 ] && [ "$QUEUED" = 0 ] && CREATE=1  # a spot slice is one being made: --create unless --queued
for kv in ${ENVS[@]+"${ENVS[@]}"}; do
  [[ "$kv" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || fail "--env $kv: expected KEY=VALUE"
done
[[ "$PY_VERSION" =~ ^3\.[0-9]+$ ]] || fail "--python $PY_VERSION: expected a version like 3.11"
[[ "$MAX_RELAUNCHES" =~ ^[0-9]+$ ]] || fail "--max-relaunches $MAX_RELAUNCHES: expected a number"
[ "$PLAN_LAYOUT" = 1 ] && [ -n "$LAYOUT_FROM" ] && fail "--plan-layout searches a layout, --layout-from reads one: pick one"
[ "$PLAN_LAYOUT" = 1 ] && [ "$PLAN" = 0 ] && fail "--plan-layout runs the plan: drop --skip-plan"
[ "$WATCH" = 1 ] && [ "$CREATE" = 0 ] && [ "$QUEUED" = 0 ] && \
  fail "--watch recreates the slice the way it was made: add --create or --queued"

# The runtime image for each TPU generation (an image ships the TPU driver; jax comes from our install).
default_runtime() {
  case "$1" in
    v4-*) echo "tpu-ubuntu2204-base" ;;
    v5litepod-*) echo "v2-alpha-tpuv5-lite" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    *) return 1 ;;
  esac
}
if [ -z "$RUNTIME" ]; then
  RUNTIME="$(default_runtime "$ACCELERATOR")" || fail "no default runtime for --accelerator $ACCELERATOR; pass --runtime"
fi

SCOPE=(--zone="$ZONE")
[ -n "$PROJECT" ] && SCOPE+=(--project="$PROJECT")
VM=(gcloud compute tpus tpu-vm)
QR=(gcloud compute tpus queued-resources)
WORKER_SCRIPT="trace_jax_run/code/launch/tpu_worker.sh"  # relative to each worker's home directory
# On worker(s) $1 of the slice NODE (each_slice sets it; default: the first slice).
on_workers() { run "${VM[@]}" ssh "${NODE:-$(slice_node 0)}" "${SCOPE[@]}" --worker="$1" --command="$2"; }
note() { if [ "$DRY_RUN" = 1 ]; then echo "# $*"; else echo "==> $*" >&2; fi; }

# ----------------------------------------------------------------------------------------- the slice
ensure_slice() {
  if [ "$QUEUED" = 1 ]; then
    if [ "$DRY_RUN" = 1 ] || ! "${QR[@]}" describe "$TPU" "${SCOPE[@]}" >/dev/null 2>&1; then
      note "queued resource $TPU: create it (skipped when 'describe' finds it), then wait until ACTIVE"
      [ "$DRY_RUN" = 1 ] && run "${QR[@]}" describe "$TPU" "${SCOPE[@]}" --format="value(state.state)"
      local spot=() nodes
      [ "$SPOT" = 1 ] && spot=(--spot)
      read -r -a nodes <<< "$(node_flags)"
      run "${QR[@]}" create "$TPU" "${SCOPE[@]}" "${nodes[@]}" --accelerator-type="$ACCELERATOR" \
        --runtime-version="$RUNTIME" ${spot[@]+"${spot[@]}"}
    fi
    [ "$DRY_RUN" = 1 ] && return 0
    local state
    while :; do
      state="$("${QR[@]}" describe "$TPU" "${SCOPE[@]}" --format="value(state.state)")"
      case "$state" in
        ACTIVE) break ;;
        FAILED | SUSPENDED | SUSPENDING) fail "queued resource $TPU is $state; see: ${QR[*]} describe $TPU ${SCOPE[*]}" ;;
        *) echo "queued resource $TPU: $state (checking again in 30 s; Ctrl-C leaves the request queued)" >&2; sleep 30 ;;
      esac
    done
    return 0
  fi
  local state=""
  if [ "$DRY_RUN" = 1 ]; then
    run "${VM[@]}" describe "$TPU" "${SCOPE[@]}" --format="value(state)"
  else
    state="$("${VM[@]}" describe "$TPU" "${SCOPE[@]}" --format="value(state)" 2>/dev/null || true)"
  fi
  if [ -z "$state" ] && [ "$CREATE" = 1 ]; then
    note "TPU VM $TPU: create it (skipped when 'describe' finds it)"
    local spot=()
    [ "$SPOT" = 1 ] && spot=(--spot)
    run "${VM[@]}" create "$TPU" "${SCOPE[@]}" --accelerator-type="$ACCELERATOR" --version="$RUNTIME" \
      ${spot[@]+"${spot[@]}"}
  elif [ -z "$state" ] && [ "$DRY_RUN" = 0 ]; then
    fail "no TPU VM $TPU in $ZONE${PROJECT:+ ($PROJECT)}: pass --create or --queued to make one"
  elif [ -n "$state" ] && [ "$state" != READY ]; then
    fail "TPU VM $TPU is $state: delete it (--delete) and launch again with --create"
  fi
}

# ------------------------------------------------------------------------------------------- actions
launch() {
  [ -n "$WORKDIR" ] || fail "--workdir gs://BUCKET/RUN is required: every worker writes checkpoints into it"
  [[ "$WORKDIR" == gs://* ]] || fail "--workdir $WORKDIR: a pod's workdir must be a gs:// bucket path all workers share"
  # The workers run from the shipped checkout: the config file must be part of it (relative paths work there).
  local config_path="${CONFIG%%:*}"
  if [[ "$config_path" == /* ]]; then
    [[ "$config_path" == "$PWD"/* ]] || fail "--config $CONFIG: the config file must be inside this checkout (it ships with the code)"
    CONFIG="${CONFIG#"$PWD"/}"
  fi
  local overrides=(--config.distributed.mode=auto ${EXTRA[@]+"${EXTRA[@]}"})
  if [ "$CHECK" = 1 ]; then
    # Runs under --dry-run too: a bad override is cheapest to find here, before a slice is paid for.
    [ "$DRY_RUN" = 1 ] && run "$PYTHON" launch/pod_helper.py check "$CONFIG" "${overrides[@]}"
    "$PYTHON" launch/pod_helper.py check "$CONFIG" "${overrides[@]}" || exit 2
  fi
  read_layout "${overrides[@]}"
  overrides=(--config.distributed.mode=auto ${LAYOUT[@]+"${LAYOUT[@]}"} ${EXTRA[@]+"${EXTRA[@]}"})
  [ "$PLAN_LAYOUT" = 1 ] || plan_step "${overrides[@]}"  # the layout search checked what it picked
  ensure_slice
  JOB=(python -m trace_jax.train "--config=$CONFIG" "--workdir=$WORKDIR" "${overrides[@]}")
  ship_and_start || fail_with "$?" "could not ship and start the job on $TPU (see above)"
  local again="launch/tpu_pod.sh --tpu $TPU --zone $ZONE${PROJECT:+ --project $PROJECT}"
  [ "$QUEUED" = 1 ] && again+=" --queued"
  [ "$SLICES" = 1 ] || again+=" --slices $SLICES"
  echo "job started on every worker of $TPU. Re-attach: $again --logs [--worker N]; stop: $again --stop;" \
    "delete the slice (billing stops only then): $again --delete" >&2
  if [ "$WATCH" = 1 ]; then
    watch
  elif [ "$STREAM" = 1 ]; then
    note "stream worker 0's log (Ctrl-C detaches; the job keeps running)"
    on_workers 0 "bash $WORKER_SCRIPT logs"
  fi
}

# Compile the job for the slice's topology before paying for it; a config that does not fit stops here (exit 3).
plan_step() {
  [ "$PLAN" = 0 ] && return 0
  local extra=()
  [ -n "$PLAN_ARGS" ] && read -r -a extra <<< "$PLAN_ARGS"
  local cmd=("$PYTHON" launch/pod_helper.py plan "$ACCELERATOR" "$CONFIG" "$@" -- ${extra[@]+"${extra[@]}"})
  if [ "$DRY_RUN" = 1 ] && [ "$PLAN" != 1 ]; then
    note "plan: compile the job for $ACCELERATOR with the TPU compiler; stop here if it does not fit (--plan runs it under --dry-run)"
    run "${cmd[@]}"
    return 0
  fi
  if [ "$PLAN" = auto ] && ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('libtpu') is None)"; then
    echo "note: the plan step is skipped: libtpu is not installed here (pip install \"jax[tpu]==<your jax version>\"" \
      "compiles the job for $ACCELERATOR before the slice is paid for; --skip-plan silences this)" >&2
    return 0
  fi
  local code=0
  "${cmd[@]}" >&2 || code=$?
  [ "$code" = 3 ] && fail_with 3 "the job does not fit $ACCELERATOR (figures above): nothing was created or shipped"
  [ "$code" = 0 ] || fail_with "$code" "the plan step failed (exit status $code): nothing was created; --skip-plan to launch anyway"
}
fail_with() { echo "$2" >&2; exit "$1"; }

# The layout's overrides (--plan-layout: searched now; --layout-from: a saved plan's) into LAYOUT; none when
# neither is given or the overrides ($@) pin a layout key (launch/pod_helper.py layout).
read_layout() {
  LAYOUT=()
  local out line cmd code=0
  if [ -n "$LAYOUT_FROM" ]; then
    cmd=("$PYTHON" launch/pod_helper.py layout-from "$LAYOUT_FROM" "$ACCELERATOR" "$CONFIG" "$@")
  elif [ "$PLAN_LAYOUT" = 1 ]; then
    local extra=()
    [ -n "$PLAN_ARGS" ] && read -r -a extra <<< "$PLAN_ARGS"
    if [[ " ${extra[*]-}" != *" --backend"* ]] && \
      ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('libtpu') is None)"; then
      fail "--plan-layout compiles the job's layouts for $ACCELERATOR with the TPU compiler: pip install" \
        "\"jax[tpu]==<your jax version>\" here (or --plan-args \"--backend cpu\": XLA:CPU stand-ins, small models)"
    fi
    cmd=("$PYTHON" launch/pod_helper.py layout "$ACCELERATOR" "$CONFIG" "$@" -- ${extra[@]+"${extra[@]}"})
    note "plan the layout: search $ACCELERATOR's layouts for the job, check the engine on the one picked" \
      "(runs under --dry-run too: the job line needs its choice)"
  else
    return 0
  fi
  [ "$DRY_RUN" = 1 ] && run "${cmd[@]}"
  out="$("${cmd[@]}")" || code=$?
  [ "$code" = 3 ] && fail_with 3 "no layout of the job fits $ACCELERATOR (figures above): nothing was created or shipped"
  [ "$code" = 0 ] || fail_with "$code" "the layout step failed (exit status $code): nothing was created"
  while read -r line; do [ -n "$line" ] && LAYOUT+=("$line"); done <<< "$out"
  return 0
}

# Ships this checkout, installs it and starts the job on every worker; a failing step returns its status (the
# watcher goes round again when a slice disappears under it) instead of ending the launcher.
ship_and_start() {
  local tarball="${TMPDIR:-/tmp}/trace_jax_code_$TPU.tgz"
  note "ship this checkout to every worker of every slice, install it, stop leftovers"
  run "$PYTHON" launch/pod_helper.py pack "$tarball" || return
  each_slice ship "$tarball" || return
  find_coordinator || return
  note "start the same command on every worker (detached; jax.distributed finds the pod by itself)"
  each_slice start_job
}
ship() {
  run "${VM[@]}" scp "$1" "$NODE:trace_jax_code.tgz" "${SCOPE[@]}" --worker=all || return
  on_workers all "set -e; rm -rf trace_jax_run/incoming; mkdir -p trace_jax_run/incoming; \
tar -xzf trace_jax_code.tgz -C trace_jax_run/incoming; bash trace_jax_run/incoming/launch/tpu_worker.sh install $PY_VERSION"
}
start_job() {  # with several slices, each slice's MegaScale variables (launch/slices.sh)
  local remote megascale
  read -r -a megascale <<< "$(megascale_env "$SLICE_ID")"
  remote="$(printf '%q ' bash "$WORKER_SCRIPT" start ${ENVS[@]+"${ENVS[@]}"} ${megascale[@]+"${megascale[@]}"} -- "${JOB[@]}")"
  on_workers all "${remote% }"
}

# The slice's state as gcloud reports it ("" when it is gone).
slice_state() {
  if [ "$QUEUED" = 1 ]; then
    slices_state
  else
    "${VM[@]}" describe "$TPU" "${SCOPE[@]}" --format="value(state)" 2>/dev/null || true
  fi
}

delete_slice() {
  if [ "$QUEUED" = 1 ]; then
    run "${QR[@]}" delete "$TPU" "${SCOPE[@]}" --force --quiet || true
  else
    run "${VM[@]}" delete "$TPU" "${SCOPE[@]}" --quiet || true
  fi
}

# True when some worker's job ended without recording an exit status (killed: its host died, the OOM killer) or
# its host does not answer: the other workers then stopped because they lost it (distributed.heartbeat_timeout_s
# bounds how long they wait), which a relaunch mends; a job that fails by itself everywhere is a bug and is not.
lost_worker() {
  local out code=0
  out="$(on_workers all "bash $WORKER_SCRIPT status" 2>&1)" || code=$?
  echo "$out" >&2
  [ "$code" = 255 ] || grep -q '\] stopped$' <<< "$out"
}

watch() {
  local relaunches=0 code state
  while :; do
    note "watch: follow worker 0's log until the job ends (its exit status decides what happens next)"
    if [ "$DRY_RUN" = 1 ]; then
      on_workers 0 "bash $WORKER_SCRIPT logs"
      note "watch: one relaunch round follows, as if the job had exited $PREEMPTED and the slice were preempted"
      code=$PREEMPTED
      state="SUSPENDED"
      [ "$QUEUED" = 1 ] && run "${QR[@]}" describe "$TPU" "${SCOPE[@]}" --format="value(state.state)"
      [ "$QUEUED" = 0 ] && run "${VM[@]}" describe "$TPU" "${SCOPE[@]}" --format="value(state)"
    else
      code=0
      on_workers 0 "bash $WORKER_SCRIPT logs" || code=$?
      [ "$code" = 0 ] && { echo "watch: the job finished (exit status 0)" >&2; return 0; }
      state="$(slice_state)"
    fi
    local healthy=0
    [ "$state" = ACTIVE ] || [ "$state" = READY ] && healthy=1
    # 255: the ssh itself failed (the host went away); PREEMPTED: the job stopped on a SIGTERM, checkpointed.
    if [ "$healthy" = 1 ] && [ "$code" != "$PREEMPTED" ] && [ "$code" != 255 ] && ! lost_worker; then
      echo "watch: the job failed with exit status $code on a healthy slice ($state): not relaunched;" \
        "see launch/tpu_pod.sh --tpu $TPU --zone $ZONE --logs" >&2
      exit "$code"
    fi
    relaunches=$((relaunches + 1))
    if [ "$relaunches" -gt "$MAX_RELAUNCHES" ]; then
      echo "watch: giving up after $MAX_RELAUNCHES relaunches (last exit status $code, slice ${state:-gone})" >&2
      exit 1
    fi
    note "watch: relaunch $relaunches of $MAX_RELAUNCHES (exit status $code, slice ${state:-gone}): recreate the" \
      "slice unless it is healthy, then ship and start the same command on the same workdir (it resumes)"
    if [ "$healthy" = 0 ]; then
      delete_slice
      ensure_slice
    fi
    ship_and_start || echo "watch: shipping or starting failed (exit status $?): checking the slice again" >&2
    [ "$DRY_RUN" = 1 ] && return 0
  done
}

case "$ACTION" in
  launch) launch ;;
  logs) on_workers "$WORKER" "bash $WORKER_SCRIPT logs" ;;
  status) each_slice on_workers all "bash $WORKER_SCRIPT status" ;;
  stop) each_slice on_workers all "bash $WORKER_SCRIPT stop" ;;
  delete)
    each_slice on_workers all "bash $WORKER_SCRIPT stop" || echo "could not stop the job on every worker; deleting anyway" >&2
    if [ "$QUEUED" = 1 ]; then
      run "${QR[@]}" delete "$TPU" "${SCOPE[@]}" --force --quiet
    else
      run "${VM[@]}" delete "$TPU" "${SCOPE[@]}" --quiet
    fi
    ;;
esac
