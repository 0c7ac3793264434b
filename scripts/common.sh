# Shared by the launchers: repository root, the project's Python, quiet framework logs.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY="$ROOT/.venv/bin/python"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export GLOG_v=${GLOG_v:-3}   # MindSpore C++ logs: errors only unless the user asks for more

die() { echo "error: $*" >&2; exit 2; }

require_env() {
    [[ -x $PY ]] || die "no environment at $ROOT/.venv; run: bash $ROOT/scripts/setup_env.sh"
}

# Resolve the run folder from the config and overrides (validates them before anything is written).
resolve_run_dir() {
    "$PY" -m src.config --run_dir "$@"
}

# Run a command; its stdout and stderr go to the console (each to its own stream, so a JSON last
# line stays last on stdout) and both into LOG. Returns its exit code, or 128 + the signal that
# stopped this script. The command runs in a session of its own, so a terminal's Ctrl-C reaches
# only this script, which passes SIGTERM on once (train.py then finishes its step and saves a
# checkpoint); a second signal kills the command at once.
run_logged() {
    local log=$1 status out err out_pid err_pid
    shift
    exec {out}> >(tee -a "$log"); out_pid=$!
    exec {err}> >(tee -a "$log" >&2); err_pid=$!
    setsid "$@" >&"$out" 2>&"$err" &
    RUN_LOGGED_PID=$! RUN_LOGGED_STOP=""
    trap 'stop_logged 130' INT
    trap 'stop_logged 143' TERM
    wait "$RUN_LOGGED_PID"; status=$?
    while kill -0 "$RUN_LOGGED_PID" 2>/dev/null; do wait "$RUN_LOGGED_PID"; status=$?; done  # a trap ends `wait`
    trap - INT TERM
    exec {out}>&- {err}>&-
    wait "$out_pid" "$err_pid"   # a bare wait covers only the last tee; the log must be complete on return
    return "${RUN_LOGGED_STOP:-$status}"
}

stop_logged() {
    if [[ -n $RUN_LOGGED_STOP ]]; then kill -KILL "$RUN_LOGGED_PID" 2>/dev/null; return; fi
    RUN_LOGGED_STOP=$1
    kill -TERM "$RUN_LOGGED_PID" 2>/dev/null
}

# Print a command as a shell would re-read it (for --dry_run).
show() { printf '%q ' "$@" | sed 's/ $//'; echo; }

# The model zoo's optional arguments after CONFIG_PATH, as its README gives them:
# [RESUME_CKPT] | [RUN_EVAL EVAL_DATASET_PATH] | [RUN_EVAL EVAL_DATASET_PATH RESUME_CKPT].
# Reads the leading non-option arguments; sets ZOO_ARGS (config overrides) and ZOO_COUNT (how many to shift).
zoo_trailing_args() {
    local -a given=()
    while [[ $# -gt 0 && ${1:0:2} != -- ]]; do given+=("$1"); shift; done
    ZOO_COUNT=${#given[@]}
    case $ZOO_COUNT in
        0) ZOO_ARGS=() ;;
        1) ZOO_ARGS=(--resume_ckpt "${given[0]}") ;;
        2) ZOO_ARGS=(--run_eval "${given[0]}" --eval_dataset_path "${given[1]}") ;;
        3) ZOO_ARGS=(--run_eval "${given[0]}" --eval_dataset_path "${given[1]}" --resume_ckpt "${given[2]}") ;;
        *) die "too many arguments after CONFIG_PATH (${given[*]}); expected [RESUME_CKPT] or [RUN_EVAL EVAL_DATASET_PATH [RESUME_CKPT]]" ;;
    esac
}
