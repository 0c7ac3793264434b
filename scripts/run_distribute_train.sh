#!/usr/bin/env bash
# Data-parallel training: msrun (default) or a rank table, one log per rank, rank 0 on the console.
usage() {
    cat <<USAGE
usage: bash scripts/run_distribute_train.sh [RANK_TABLE_FILE] DATASET_PATH CONFIG_PATH [RESUME_CKPT] [OPTIONS] [--KEY VALUE ...]
       bash scripts/run_distribute_train.sh [RANK_TABLE_FILE] DATASET_PATH CONFIG_PATH RUN_EVAL EVAL_DATASET_PATH [RESUME_CKPT] ...

  RANK_TABLE_FILE   optional .json rank table (older Ascend set-ups); without it msrun launches the ranks
  DATASET_PATH      CIFAR-10 binary folder, a folder of class folders, or their MindRecord shards
  CONFIG_PATH       a yaml file from config/, or one of the model zoo's config files
  RESUME_CKPT       optional: continue from this train.py checkpoint (--resume_ckpt)
  RUN_EVAL EVAL_DATASET_PATH  optional: evaluate during training on this data (the model zoo's form)

Options:
  --workers N        ranks in the whole job (default 8)
  --local_workers N  ranks on this node (default: --workers)
  --device_target T  Ascend (default), GPU or CPU
  --master_addr A    address of node 0 (default 127.0.0.1)
  --master_port P    port on node 0 (default 8118)
  --node_rank R      this node's index for multi-node msrun (default 0); with a rank table, this
                     server's position in its server_list
  --cluster_time_out S  seconds msrun waits for every node to join and for a lost rank (default 600,
                     as msrun's; negative waits forever)
  --check            print what this node has and would start (versions, devices, cores, memory,
                     disk, whether node 0 answers, its ranks) and exit; trains nothing
  --dry_run          print the launch command(s) and exit

Several servers: the same command on every server, --node_rank 0..N-1, --master_addr of node 0
(docs/distributed.md, "Two servers and more").
Other --KEY VALUE pairs are config overrides for train.py.

Logs: <run folder>/logs/<time>/worker_<rank>.log (msrun) or rank_<rank>.log (rank table); the console
follows rank 0. The script waits for every rank and exits non-zero if any failed.

SIGTERM or Ctrl-C: every rank finishes its step, rank 0 saves a resumable checkpoint, and the
script exits with 128 + signal (143, 130); resume with the same command and --resume True.
A second signal kills the ranks at once.
USAGE
}
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
[[ ${1:-} == -h || ${1:-} == --help ]] && { usage; exit 0; }

RANK_TABLE=""
if [[ ${1:-} == *.json ]]; then RANK_TABLE=$1; shift; fi
[[ $# -ge 2 && ${1:0:2} != -- && ${2:0:2} != -- ]] || { usage >&2; die "DATASET_PATH and CONFIG_PATH are required"; }
DATASET_PATH=$1; CONFIG_PATH=$2; shift 2
zoo_trailing_args "$@"; shift "$ZOO_COUNT"
WORKERS=""; LOCAL_WORKERS=""; DEVICE_TARGET=Ascend; MASTER_ADDR=127.0.0.1; MASTER_PORT=8118; NODE_RANK=0; DRY_RUN=0
CLUSTER_TIME_OUT=600; CHECK=0
OVERRIDES=()
needs_value() { [[ $# -ge 2 ]] || die "$1 needs a value; see $(basename "$0") --help"; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --workers) needs_value "$@"; WORKERS=$2; shift 2 ;;
        --local_workers) needs_value "$@"; LOCAL_WORKERS=$2; shift 2 ;;
        --device_target) needs_value "$@"; DEVICE_TARGET=$2; shift 2 ;;
        --master_addr) needs_value "$@"; MASTER_ADDR=$2; shift 2 ;;
        --master_port) needs_value "$@"; MASTER_PORT=$2; shift 2 ;;
        --node_rank) needs_value "$@"; NODE_RANK=$2; shift 2 ;;
        --cluster_time_out) needs_value "$@"; CLUSTER_TIME_OUT=$2; shift 2 ;;
        --check) CHECK=1; shift ;;
        --dry_run) DRY_RUN=1; shift ;;
        *) OVERRIDES+=("$1"); shift ;;
    esac
done
case $DEVICE_TARGET in Ascend|GPU|CPU) ;; *) die "unknown --device_target '$DEVICE_TARGET'; choose Ascend, GPU or CPU" ;; esac
for n in "${WORKERS:-8}" "${LOCAL_WORKERS:-1}" "$MASTER_PORT" "$NODE_RANK"; do
    [[ $n =~ ^[0-9]+$ ]] || die "expected a whole number, got '$n'"
done
[[ $CLUSTER_TIME_OUT =~ ^-?[0-9]+$ ]] || die "--cluster_time_out expects whole seconds, got '$CLUSTER_TIME_OUT'"
# A rank table fixes the job: its size, and this server's ranks and devices (the server at
# position --node_rank). A dry run may name a table of another machine: then ranks are counted.
TABLE_RANKS=()
if [[ -n $RANK_TABLE && -f $RANK_TABLE ]]; then
    TABLE_VIEW=$("$PY" -m src.training.node_check rank_table --file "$RANK_TABLE" --node_rank "$NODE_RANK") || exit 2
    mapfile -t TABLE_RANKS <<< "$TABLE_VIEW"
    TABLE_SIZE=${TABLE_RANKS[0]#RANK_SIZE }; TABLE_RANKS=("${TABLE_RANKS[@]:1}")
    [[ -z $WORKERS || $WORKERS -eq $TABLE_SIZE ]] ||
        die "--workers $WORKERS differs from the $TABLE_SIZE ranks in $RANK_TABLE; leave --workers out with a rank table"
    [[ -z $LOCAL_WORKERS || $LOCAL_WORKERS -eq ${#TABLE_RANKS[@]} ]] ||
        die "--local_workers $LOCAL_WORKERS differs from the ${#TABLE_RANKS[@]} ranks of server $NODE_RANK in $RANK_TABLE; leave --local_workers out with a rank table"
    WORKERS=$TABLE_SIZE; LOCAL_WORKERS=${#TABLE_RANKS[@]}
    # msrun numbers ranks node_rank * local_workers + i: each server must hold exactly those ranks
    for ((i = 0; i < LOCAL_WORKERS; i++)); do
        [[ ${TABLE_RANKS[i]%% *} -eq $((NODE_RANK * LOCAL_WORKERS + i)) ]] ||
            die "server $NODE_RANK of $RANK_TABLE has rank ${TABLE_RANKS[i]%% *} where msrun gives rank $((NODE_RANK * LOCAL_WORKERS + i)); number each server's ranks consecutively (server k: k*$LOCAL_WORKERS..)"
    done
fi
WORKERS=${WORKERS:-8}
LOCAL_WORKERS=${LOCAL_WORKERS:-$WORKERS}
[[ $WORKERS -ge 1 && $LOCAL_WORKERS -ge 1 && $LOCAL_WORKERS -le $WORKERS ]] ||
    die "--local_workers ($LOCAL_WORKERS) must be between 1 and --workers ($WORKERS)"
[[ -n ${TABLE_SIZE:-} || $((WORKERS % LOCAL_WORKERS)) -eq 0 ]] ||
    die "--workers $WORKERS is not a multiple of --local_workers $LOCAL_WORKERS; every node runs the same number of ranks"
NODES=$((WORKERS / LOCAL_WORKERS))
[[ -n ${TABLE_SIZE:-} || $NODE_RANK -lt $NODES ]] ||
    die "--node_rank $NODE_RANK is outside the job: $WORKERS workers / $LOCAL_WORKERS per node make $NODES node(s), numbered 0..$((NODES - 1))"
[[ -f $CONFIG_PATH ]] || die "config file not found: $CONFIG_PATH"
if [[ $DRY_RUN -eq 0 ]]; then   # a dry run only prints, so it may name paths of another machine
    [[ -z $RANK_TABLE || -f $RANK_TABLE ]] || die "rank table not found: $RANK_TABLE"
    [[ -d $DATASET_PATH ]] || die "dataset folder not found: $DATASET_PATH"
fi

count_devices() {
    case $1 in
        Ascend) ls /dev/davinci[0-9]* 2>/dev/null | wc -l ;;
        GPU) (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' ;;
        CPU) env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc ;;   # nproc obeys these; cores are wanted
    esac
}

TRAIN_ARGS=(--config_path "$CONFIG_PATH" --data_path "$DATASET_PATH" --device_target "$DEVICE_TARGET"
            --run_distribute True --device_num "$WORKERS" "${ZOO_ARGS[@]}" "${OVERRIDES[@]}")
if [[ $DRY_RUN -eq 1 ]]; then
    RUN_DIR=$("$PY" -m src.config --run_dir "${TRAIN_ARGS[@]}" 2>/dev/null) || RUN_DIR="<run folder>"
else
    require_env
    AVAILABLE=$(count_devices "$DEVICE_TARGET")
    UNIT="$DEVICE_TARGET devices"; [[ $DEVICE_TARGET == CPU ]] && UNIT="CPU cores (one rank each)"
    [[ $LOCAL_WORKERS -le $AVAILABLE ]] ||
        die "asked for $LOCAL_WORKERS $UNIT on this node but found $AVAILABLE; lower --workers/--local_workers"
    if [[ -z $RANK_TABLE ]]; then
        "$PY" -m src.training.node_check address --master_addr "$MASTER_ADDR" --node_rank "$NODE_RANK" || exit 2
    fi
    RUN_DIR=$(resolve_run_dir "${TRAIN_ARGS[@]}") || exit $?
fi
if [[ $CHECK -eq 1 ]]; then
    exec "$PY" -m src.training.node_check report --device_target "$DEVICE_TARGET" --master_addr "$MASTER_ADDR" \
        --master_port "$MASTER_PORT" --node_rank "$NODE_RANK" --workers "$WORKERS" --local_workers "$LOCAL_WORKERS" \
        --output_folder "$RUN_DIR" ${RANK_TABLE:+--file "$RANK_TABLE"}
fi
LOG_DIR="$RUN_DIR/logs/$(date +%Y%m%d_%H%M%S)"   # a folder per launch: a resumed run keeps the old logs

if [[ -z $RANK_TABLE ]]; then
    COMMAND=(msrun --worker_num="$WORKERS" --local_worker_num="$LOCAL_WORKERS" --master_addr="$MASTER_ADDR"
             --master_port="$MASTER_PORT" --node_rank="$NODE_RANK" --log_dir="$LOG_DIR" --join=True
             --cluster_time_out="$CLUSTER_TIME_OUT" "$ROOT/train.py" "${TRAIN_ARGS[@]}")
    if [[ $DRY_RUN -eq 1 ]]; then show "${COMMAND[@]}"; exit 0; fi
    mkdir -p "$LOG_DIR"
    export PATH="$ROOT/.venv/bin:$PATH"   # msrun starts `python` from PATH
    export LOCAL_WORKER_NUM=$LOCAL_WORKERS   # each rank's share of this node's cores (src/training/distributed.py)
    # msrun's ranks retry their messages to its scheduler every 3-5 s by default (MindSpore's
    # MS_RETRY_INTERVAL_LOWER/UPPER), and forming the cluster and taking it down waited on those
    # retries: 2 CPU ranks that exit at once took 13.8-14.8 s under msrun with them, 8.8-9.5 s with 1.
    export MS_RETRY_INTERVAL_LOWER=${MS_RETRY_INTERVAL_LOWER:-1} MS_RETRY_INTERVAL_UPPER=${MS_RETRY_INTERVAL_UPPER:-1}
    FIRST_LOG="$LOG_DIR/worker_$((NODE_RANK * LOCAL_WORKERS)).log"
    # Its own session: a terminal's Ctrl-C reaches this script only (msrun would SIGKILL the ranks);
    # the trap below passes the signal to the ranks, which stop cleanly.
    setsid "${COMMAND[@]}" > "$LOG_DIR/msrun.log" 2>&1 &
    LAUNCHER=$!
else
    if [[ ${#TABLE_RANKS[@]} -eq 0 ]]; then   # a dry run without the table: ranks in order
        for ((i = 0; i < LOCAL_WORKERS; i++)); do TABLE_RANKS+=("$((NODE_RANK * LOCAL_WORKERS + i)) $i"); done
    fi
    if [[ $DRY_RUN -eq 1 ]]; then
        for pair in "${TABLE_RANKS[@]}"; do
            read -r rank device <<< "$pair"
            printf 'RANK_TABLE_FILE=%q RANK_SIZE=%s RANK_ID=%s DEVICE_ID=%s ' "$RANK_TABLE" "$WORKERS" "$rank" "$device"
            show "$PY" "$ROOT/train.py" "${TRAIN_ARGS[@]}"
        done
        exit 0
    fi
    mkdir -p "$LOG_DIR"
    FIRST_LOG="$LOG_DIR/rank_${TABLE_RANKS[0]%% *}.log"
    PIDS=()
    export LOCAL_WORKER_NUM=$LOCAL_WORKERS
    for pair in "${TABLE_RANKS[@]}"; do
        read -r rank device <<< "$pair"
        RANK_TABLE_FILE=$RANK_TABLE RANK_SIZE=$WORKERS RANK_ID=$rank DEVICE_ID=$device \
            setsid "$PY" "$ROOT/train.py" "${TRAIN_ARGS[@]}" > "$LOG_DIR/rank_$rank.log" 2>&1 &
        PIDS+=($!)
    done
    # Wait for all ranks; the first failure stops the others instead of leaving them hanging.
    wait_ranks() {
        local remaining=${#PIDS[@]} status
        while [[ $remaining -gt 0 ]]; do
            wait -n "${PIDS[@]}"; status=$?
            [[ -n $STOP_SIGNAL ]] && return 0   # stopping: the ranks exit on their own (waited for below)
            if [[ $status -ne 0 ]]; then kill "${PIDS[@]}" 2>/dev/null; return $status; fi
            remaining=$((remaining - 1))
        done
        return 0
    }
fi

echo "logs: $LOG_DIR (console follows $(basename "$FIRST_LOG"))"
touch "$FIRST_LOG"
# -s 0.1: where inotify cannot watch the log, tail reads it every 0.1 s (1 s by default), so the
# 0.2 s given to it after the ranks end (stop_following) covers its last read.
tail -n +1 -F -s 0.1 "$FIRST_LOG" 2>/dev/null &
TAIL=$!
stop_following() { sleep 0.2; kill "$TAIL" 2>/dev/null; wait "$TAIL" 2>/dev/null; }
# The ranks: msrun starts each in a session of its own (its scheduler and log tails share msrun's).
rank_pids() {
    if [[ -n $RANK_TABLE ]]; then echo "${PIDS[@]}"; return; fi
    local pid
    for pid in $(pgrep -P "$LAUNCHER"); do
        [[ $(ps -o sid= -p "$pid" | tr -d ' ') == "$pid" ]] && echo "$pid"
    done
}
# msrun's log names a failed rank by its process id only: keep "pid rank" of this node's ranks.
record_rank_pids() {
    local pid found
    while kill -0 "$LAUNCHER" 2>/dev/null; do
        found=()
        for pid in $(rank_pids); do
            found+=("$pid $(tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | sed -n 's/^RANK_ID=//p')")
        done
        if [[ ${#found[@]} -ge $LOCAL_WORKERS ]]; then printf '%s\n' "${found[@]}" > "$LOG_DIR/rank_pids.txt"; return; fi
        sleep 0.5
    done
}
[[ -z $RANK_TABLE ]] && record_rank_pids &
# First SIGTERM/SIGINT: pass SIGTERM to the ranks, which finish their step, save (rank 0) and
# exit; a second one kills them at once.
STOP_SIGNAL=""
on_signal() {
    if [[ -n $STOP_SIGNAL ]]; then
        kill -KILL $(rank_pids) 2>/dev/null
        echo "error: interrupted again; the ranks were killed" >&2
        return
    fi
    STOP_SIGNAL=$1
    echo "received SIG$1: the ranks finish their step and rank 0 saves a checkpoint (send it again to stop at once)" >&2
    kill -TERM $(rank_pids) 2>/dev/null
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
if [[ -z $RANK_TABLE ]]; then
    wait "$LAUNCHER"; STATUS=$?
    while kill -0 "$LAUNCHER" 2>/dev/null; do wait "$LAUNCHER"; STATUS=$?; done  # a trap ends `wait`
else
    wait_ranks; STATUS=$?
    ranks_alive() { local pid; for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done; return 1; }
    while [[ -n $STOP_SIGNAL ]] && ranks_alive; do wait "${PIDS[@]}"; done
fi
# A stop signal sent to another node's launcher (or to the ranks themselves): this node's ranks
# stopped cleanly after the same step; under msrun they exit 0 (src/training/distributed.py,
# stopped_exit_code), so their logs say it.
stopped_elsewhere() {
    local log found=0
    for log in "$LOG_DIR"/worker_*.log "$LOG_DIR"/rank_*.log; do
        [[ -f $log ]] || continue
        grep -q "stopped by SIGTERM after global step" "$log" || return 1
        found=1
    done
    [[ $found -eq 1 ]]
}
if [[ -z $STOP_SIGNAL ]] && stopped_elsewhere; then
    STOP_SIGNAL=TERM; STOP_WHERE=" (sent to another node's launcher)"
fi
if [[ -n $STOP_SIGNAL ]]; then
    stop_following
    echo "error: stopped by SIG$STOP_SIGNAL${STOP_WHERE:-}; continue with the same command and --resume True (logs in $LOG_DIR)" >&2
    exit $((128 + $(kill -l "$STOP_SIGNAL")))
fi
stop_following
if [[ $STATUS -ne 0 && -z $RANK_TABLE ]]; then
    echo "error: $("$PY" -m src.training.node_check explain --log_dir "$LOG_DIR" --node_rank "$NODE_RANK" \
        --workers "$WORKERS" --local_workers "$LOCAL_WORKERS" --master_addr "$MASTER_ADDR" \
        --master_port "$MASTER_PORT" --cluster_time_out "$CLUSTER_TIME_OUT")" >&2
elif [[ $STATUS -ne 0 ]]; then
    echo "error: distributed training failed (exit $STATUS); see the logs in $LOG_DIR" >&2
fi
exit $STATUS
