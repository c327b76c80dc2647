# Shared by the launch scripts: option parsing and a runner that prints instead of executing under --dry-run.
# Usage inside a script: parse_common "$@"; then `run cmd args...` (prints with --dry-run, executes otherwise).

DRY_RUN=0
CONFIG="configs/default.py"
WORKDIR="./runs/default"
EXTRA=()

parse_common() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --dry-run) DRY_RUN=1 ;;
      --config) CONFIG="$2"; shift ;;
      --config=*) CONFIG="${1#*=}" ;;
      --workdir) WORKDIR="$2"; shift ;;
      --workdir=*) WORKDIR="${1#*=}" ;;
      --) shift; EXTRA+=("$@"); break ;;
      *) if ! parse_specific "$1" "${2-}"; then echo "unknown option: $1" >&2; exit 2; fi
         [ "$SHIFT_TWO" = 1 ] && shift ;;
    esac
    shift
  done
}

run() {
  if [ "$DRY_RUN" = 1 ]; then
    printf '%q ' "$@"; echo
  else
    "$@"
  fi
}

train_command() {
  # The one training command every launcher ends with; extra flags are config overrides.
  # (${X[@]+"${X[@]}"}: an empty array under `set -u` in the bash 3.2 that macOS ships.)
  printf '%s' "python -m trace_jax.train --config=$CONFIG --workdir=$WORKDIR"
  for flag in ${EXTRA[@]+"${EXTRA[@]}"}; do printf ' %q' "$flag"; done
}
