#!/usr/bin/env bash
# The worker side of launch/tpu_pod.sh: it runs on every TPU VM host (over `gcloud ... ssh --worker=all`).
#
#   tpu_worker.sh install PYTHON_VERSION   stop leftovers, take the shipped code (incoming/ -> code/), make a venv
#                                          with that Python (uv brings one if the image's is older) and install
#   tpu_worker.sh start [K=V ...] -- CMD   start CMD detached in its own session (a dropped ssh does not reach it)
#   tpu_worker.sh logs                     stream this host's log until the job ends; exit with the job's status
#   tpu_worker.sh stop                     SIGTERM the job's process group, SIGKILL after a grace; free the TPU
#   tpu_worker.sh status                   one line: running / finished with status N / stopped / never started
#
# TRACE_JAX_VENV=DIR (tests only: the pod in a box of tests/pod/, whose hosts share this machine's environment)
# makes install link venv/ to that existing environment instead of creating one and installing into it.
# Everything lives under $TRACE_JAX_RUN_DIR (default ~/trace_jax_run) on the host's own disk: code/, venv/,
# logs/<UTC start time>.log (one per start, so every worker keeps its own history), job.log (-> the latest),
# job.pid (the job's process group id) and job.exit (its exit status, written when it ends by itself).
set -euo pipefail
RUN_DIR="${TRACE_JAX_RUN_DIR:-$HOME/trace_jax_run}"
GRACE_S="${TRACE_JAX_STOP_GRACE_S:-30}"
PID_FILE="$RUN_DIR/job.pid"
EXIT_FILE="$RUN_DIR/job.exit"
LOG_LINK="$RUN_DIR/job.log"
HOST="$(hostname)"

usage() { sed -n '3,8p' "$0" >&2; exit 2; }
say() { echo "[$HOST] $*"; }
alive() { [ -f "$PID_FILE" ] && kill -0 -- "-$(cat "$PID_FILE")" 2>/dev/null; }

as_root() {  # sudo for a TPU VM's default user; directly as root or where there is no sudo
  if [ "$(id -u)" -eq 0 ] || ! command -v sudo >/dev/null; then "$@"; else sudo "$@"; fi
}

free_accelerator() {
  # Anything else holding the TPU (a run started by hand, a notebook) makes the new job fail at start-up.
  local holders="" dev
  shopt -s nullglob
  for dev in /dev/accel* /dev/vfio/[0-9]*; do
    holders+=" $(as_root fuser "$dev" 2>/dev/null || true)"
  done
  shopt -u nullglob
  holders="$(echo "$holders" | xargs)"
  if [ -n "$holders" ]; then
    say "processes $holders hold the TPU: stopping them"
    # shellcheck disable=SC2086
    as_root kill -TERM $holders 2>/dev/null || true
    sleep 5
    # shellcheck disable=SC2086
    as_root kill -KILL $holders 2>/dev/null || true
  fi
  [ -e /tmp/libtpu_lockfile ] && as_root rm -f /tmp/libtpu_lockfile
  return 0
}

stop() {
  if alive; then
    local pgid
    pgid="$(cat "$PID_FILE")"
    say "stopping the job (process group $pgid)"
    kill -TERM -- "-$pgid" 2>/dev/null || true
    for _ in $(seq "$GRACE_S"); do alive || break; sleep 1; done
    if alive; then
      say "still running after ${GRACE_S}s: SIGKILL"
      kill -KILL -- "-$pgid" 2>/dev/null || true
      for _ in $(seq 50); do alive || break; sleep 0.2; done  # until init has reaped them
    fi
  fi
  rm -f "$PID_FILE"
  free_accelerator
}

install() {
  local version="${1:?python version}" uv
  stop
  [ -d "$RUN_DIR/incoming" ] || { echo "[$HOST] no shipped code in $RUN_DIR/incoming" >&2; exit 2; }
  rm -rf "$RUN_DIR/code"
  mv "$RUN_DIR/incoming" "$RUN_DIR/code"
  if [ -n "${TRACE_JAX_VENV:-}" ]; then
    say "using the existing environment $TRACE_JAX_VENV (TRACE_JAX_VENV): nothing installed"
    rm -rf "$RUN_DIR/venv"
    ln -s "$TRACE_JAX_VENV" "$RUN_DIR/venv"
    return 0
  fi
  uv="$(command -v uv || echo "$HOME/.local/bin/uv")"
  if [ ! -x "$uv" ]; then
    say "installing uv"
    python3 -m pip install --user --quiet --upgrade uv || curl -LsSf https://astral.sh/uv/install.sh | sh
  fi
  if ! "$RUN_DIR/venv/bin/python" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$version')" \
    2>/dev/null; then
    say "creating a Python $version environment"
    rm -rf "$RUN_DIR/venv"
    "$uv" venv --quiet --python "$version" "$RUN_DIR/venv"
  fi
  say "installing trace_jax[tpu] from the shipped code"
  "$uv" pip install --quiet --python "$RUN_DIR/venv/bin/python" -e "$RUN_DIR/code[tpu]"
  say "ready: $("$RUN_DIR/venv/bin/python" -c 'import jax; print("python", __import__("sys").version.split()[0], "jax", jax.__version__)')"
}

start() {
  local envs=() log
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  [ "${1-}" = "--" ] || usage
  shift
  [ $# -gt 0 ] || usage
  if alive; then
    echo "[$HOST] a job is already running (process group $(cat "$PID_FILE")); run stop first" >&2
    exit 1
  fi
  mkdir -p "$RUN_DIR/logs"
  log="$RUN_DIR/logs/$(date -u +%Y%m%dT%H%M%SZ).log"
  rm -f "$PID_FILE" "$EXIT_FILE"
  ln -sfn "$log" "$LOG_LINK"
  [ -d "$RUN_DIR/code" ] && cd "$RUN_DIR/code"
  # setsid: a session and process group of its own, so a dropped ssh sends it no SIGHUP and stop can signal
  # the whole group. The wrapper records its pid (= the group id) and, when the command ends, its status. A
  # SIGTERM to the group (a preemption notice, stop) reaches the command, which checkpoints and exits 143: the
  # wrapper outlives it (trap) so that `logs` follows the job to its end and reads that status.
  setsid env PATH="$RUN_DIR/venv/bin:$PATH" PYTHONUNBUFFERED=1 ${envs[@]+"${envs[@]}"} \
    bash -c 'echo $$ > "$0"; trap : TERM; "${@:2}" & job=$!
      while :; do wait "$job"; code=$?; kill -0 "$job" 2>/dev/null || break; done
      echo "$code" > "$1"' "$PID_FILE" "$EXIT_FILE" "$@" >"$log" 2>&1 </dev/null &
  for _ in $(seq 100); do [ -s "$PID_FILE" ] && break; sleep 0.1; done
  [ -s "$PID_FILE" ] || { echo "[$HOST] the job did not start; see $log" >&2; exit 1; }
  say "started process group $(cat "$PID_FILE"), log $log"
}

logs() {
  for _ in $(seq 60); do [ -e "$LOG_LINK" ] && break; sleep 1; done
  [ -e "$LOG_LINK" ] || { echo "[$HOST] no job log in $RUN_DIR: nothing was started here" >&2; exit 1; }
  if alive; then
    tail -n +1 -F --pid="$(cat "$PID_FILE")" "$LOG_LINK" 2>/dev/null
  else
    cat "$LOG_LINK"
  fi
  if [ -s "$EXIT_FILE" ]; then
    local code
    code="$(cat "$EXIT_FILE")"
    say "job finished with exit status $code"
    exit "$code"
  fi
  say "job stopped before it finished"
  exit 1
}

status() {
  if alive; then say "running (process group $(cat "$PID_FILE"))"
  elif [ -s "$EXIT_FILE" ]; then say "finished with exit status $(cat "$EXIT_FILE")"
  elif [ -e "$LOG_LINK" ]; then say "stopped"
  else say "never started"
  fi
}

[ $# -ge 1 ] || usage
action="$1"
shift
case "$action" in
  install) install "$@" ;;
  start) start "$@" ;;
  logs) logs ;;
  stop) stop ;;
  status) status ;;
  *) usage ;;
esac
