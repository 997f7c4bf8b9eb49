#!/usr/bin/env bash
# Start or stop the local server stack on 127.0.0.1: a Prefect server, an MLflow server,
# a process work pool with one worker, and the rlhf/full-pipeline deployment.
#   infra/stack.sh up | down | status
#   infra/stack.sh worker NAME       another process worker in the pool, with its own PREFECT_HOME
#   infra/stack.sh stop NAME         stop one worker (`worker` is the one `up` starts)
# Settings (environment): STACK_DIR (.stack), PREFECT_PORT (4200), MLFLOW_PORT (5000),
# RLHF_ARTIFACT_ROOT (STACK_DIR/artifacts), RLHF_WORK_DIR (STACK_DIR/work), VENV (.venv),
# WORKER_HOME (the PREFECT_HOME of a worker started by `worker`; STACK_DIR/NAME-home).
# Logs and PIDs live in STACK_DIR; `down` stops only the processes this script started.
set -euo pipefail
cd "$(dirname "$0")/.."
export RLHF_REPO_DIR="$PWD"
STACK_DIR="$(mkdir -p "${STACK_DIR:-.stack}" && cd "${STACK_DIR:-.stack}" && pwd)"
PREFECT_PORT="${PREFECT_PORT:-4200}"
MLFLOW_PORT="${MLFLOW_PORT:-5000}"
BIN="${VENV:-.venv}/bin"
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false HF_HUB_DISABLE_TELEMETRY=1
# The hub's offline mode (HF_HUB_OFFLINE and the like) is passed on as given: the Makefile sets it
# for an offline preset whose rows are on disk; a preset that reads the hub reaches it.
export PREFECT_HOME="$STACK_DIR/prefect"
export PREFECT_API_URL="http://127.0.0.1:$PREFECT_PORT/api"
export MLFLOW_TRACKING_URI="http://127.0.0.1:$MLFLOW_PORT"
export RLHF_ARTIFACT_ROOT="${RLHF_ARTIFACT_ROOT:-$STACK_DIR/artifacts}"
export RLHF_WORK_DIR="${RLHF_WORK_DIR:-$STACK_DIR/work}"

start() {  # name, command...: run in its own session, remember its PID
  local name=$1; shift
  setsid "$@" >> "$STACK_DIR/$name.log" 2>&1 < /dev/null &  # appended: a restart keeps the old log
  echo $! > "$STACK_DIR/$name.pid"
}

wait_http() {  # name, url, seconds
  for _ in $(seq 1 "$3"); do
    if curl -fsS "$2" > /dev/null 2>&1; then return 0; fi
    if ! kill -0 "$(cat "$STACK_DIR/$1.pid")" 2> /dev/null; then
      echo "$1 exited; its log:" >&2; tail -30 "$STACK_DIR/$1.log" >&2; return 1
    fi
    sleep 1
  done
  echo "$1 did not answer on $2" >&2; tail -30 "$STACK_DIR/$1.log" >&2; return 1
}

start_worker() {  # name, PREFECT_HOME: a process worker polling the pool
  local home=$2
  mkdir -p "$home"
  PREFECT_HOME="$home" start "$1" "$BIN/prefect" worker start --pool rlhf-process --type process --name "$1"
}

descendants() {  # pid: every process below it (a worker's flow runs have their own sessions)
  local child
  for child in $(pgrep -P "$1" 2> /dev/null); do echo "$child"; descendants "$child"; done
}

stop_one() {
  local pidfile="$STACK_DIR/$1.pid"
  [ -f "$pidfile" ] || return 0
  local pid tree; pid=$(cat "$pidfile")
  if kill -0 "$pid" 2> /dev/null; then
    tree=$(descendants "$pid")
    kill -TERM -- "-$pid" 2> /dev/null || kill -TERM "$pid" 2> /dev/null || true
    # shellcheck disable=SC2086
    [ -z "$tree" ] || kill -TERM $tree 2> /dev/null || true
    for _ in $(seq 1 20); do kill -0 "$pid" 2> /dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2> /dev/null || true
    # shellcheck disable=SC2086
    [ -z "$tree" ] || kill -KILL $tree 2> /dev/null || true
  fi
  rm -f "$pidfile"
}

case "${1:-}" in
  up)
    start prefect-server "$BIN/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT"
    wait_http prefect-server "http://127.0.0.1:$PREFECT_PORT/api/health" 120
    start mlflow-server "$BIN/mlflow" server --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 \
      --backend-store-uri "sqlite:///$STACK_DIR/mlflow.db" --artifacts-destination "$STACK_DIR/mlartifacts"
    wait_http mlflow-server "http://127.0.0.1:$MLFLOW_PORT/health" 180
    "$BIN/prefect" work-pool inspect rlhf-process > /dev/null 2>&1 \
      || "$BIN/prefect" work-pool create rlhf-process --type process > /dev/null
    start_worker worker "$PREFECT_HOME"
    "$BIN/prefect" --no-prompt deploy --prefect-file infra/prefect.yaml --all > "$STACK_DIR/deploy.log" 2>&1 \
      || { tail -30 "$STACK_DIR/deploy.log" >&2; exit 1; }
    cat <<MSG
stack up (logs and PIDs in $STACK_DIR)
  Prefect UI   http://127.0.0.1:$PREFECT_PORT
  MLflow UI    http://127.0.0.1:$MLFLOW_PORT
  artifacts    $RLHF_ARTIFACT_ROOT
run the pipeline:
  PREFECT_API_URL=$PREFECT_API_URL $BIN/prefect deployment run rlhf/full-pipeline --param preset=cpu-demo --watch
MSG
    ;;
  worker)
    name="${2:?usage: $0 worker NAME}"
    [ ! -f "$STACK_DIR/$name.pid" ] || { echo "$name is running (pid $(cat "$STACK_DIR/$name.pid"))" >&2; exit 1; }
    start_worker "$name" "${WORKER_HOME:-$STACK_DIR/$name-home}"
    echo "worker $name started (pid $(cat "$STACK_DIR/$name.pid"), log $STACK_DIR/$name.log)"
    ;;
  stop)
    stop_one "${2:?usage: $0 stop NAME}"
    echo "${2} stopped"
    ;;
  down)
    for pidfile in "$STACK_DIR"/*.pid; do  # every worker, then the servers
      name=$(basename "$pidfile" .pid)
      case "$name" in mlflow-server | prefect-server | '*') ;; *) stop_one "$name" ;; esac
    done
    for name in mlflow-server prefect-server; do stop_one "$name"; done
    echo "stack down"
    ;;
  status)
    workers=$(for f in "$STACK_DIR"/*.pid; do [ -f "$f" ] && basename "$f" .pid; done | grep -vx 'prefect-server\|mlflow-server\|worker' || true)
    for name in prefect-server mlflow-server worker $workers; do
      if [ -f "$STACK_DIR/$name.pid" ] && kill -0 "$(cat "$STACK_DIR/$name.pid")" 2> /dev/null; then
        echo "$name: running (pid $(cat "$STACK_DIR/$name.pid"))"
      else
        echo "$name: stopped"
      fi
    done
    ;;
  *)
    echo "usage: $0 up|down|status|worker NAME|stop NAME" >&2; exit 2 ;;
esac
