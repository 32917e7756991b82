#!/usr/bin/env bash
# Start a PD deployment on this host and print a request that works against it:
#   a prefill server (`mpprefill serve`: its scheduler and forward processes),
#   --num-decodes N decode servers (`mpprefill decode`, default 1) and, when sglang-router
#   is installed (python package sglang_router), SGLang's router in PD mode in front.
# It waits until every server answers GET /health with 200 (and the router a one-token
# request), prints a curl line (and a python openai line) for the deployment, and runs
# until Ctrl-C (or SIGTERM), which stops them all. When any one exits, it stops the rest
# and exits 1 naming it.
#
# Usage: scripts/launch.sh [--num-decodes N] [--port P] [--host H] [--no-router]
#                          [--api-key KEY] [--ready-timeout S] [flags of mpprefill serve ...]
# Every other flag goes to `mpprefill serve`. These go to the decodes as well, whose
# model and pool must match the prefill's: --model-path --tokenizer-path
# --skip-tokenizer-init --page-size --dtype --kv-cache-dtype --random-seed
# --sliding-window --swa-layers --log-level --disaggregation-transfer-backend (default
# shm). `--disaggregation-transfer-backend fake` starts the prefill alone, on P.
#
# Ports, from P = --port (default 30000). Each server's auxiliary ports derive from its
# own --port (mpprefill/ports.py; README "Ports: several servers on one host"), so a
# deployment takes P - 1000 .. P + 201 + N, and the prefill's bootstrap port:
#   router         P          its Prometheus metrics on P - 1000 (SGLang's 29000 at 30000)
#   prefill        P + 1      ZeroMQ P + 101; bootstrap P + 1 - 21002 (8999 at P = 30000)
#                             unless --disaggregation-bootstrap-port is given
#   decode i       P + 1 + i  ZeroMQ P + 101 + i, receiver P + 201 + i   (i = 1..N, N < 99)
#
# Without sglang-router (or with --no-router) the same prefill and decodes start and the
# printed line does the router's part by hand: one body with a bootstrap room, sent to
# the first decode (whose reply is the generation) and to the prefill at once.
#
# The printed request sends `text`: the model's tokenizer, or without --model-path the
# built-in model's byte-level one.
#
# --api-key KEY (or MPPREFILL_API_KEY in the environment): every HTTP route but /health of
# every server, and of the router, needs `Authorization: Bearer KEY`. The servers get the
# key in their environment (MPPREFILL_API_KEY), not on their command lines, which ps shows;
# the router has only its flag (--api-key), which it also sends to the servers. The printed
# lines read the key from $MPPREFILL_API_KEY.
# MPPREFILL_PYTHON=/path/to/python runs that interpreter's mpprefill, with no set-up.
source "$(dirname "$0")/_env.sh"
if [ -n "${MPPREFILL_PYTHON:-}" ]; then
    PY="$MPPREFILL_PYTHON"
else
    setup_venv
    PY="$VPY"
fi
set +e

NUM_DECODES=1
PORT=30000
HOST=127.0.0.1
ROUTER=auto
READY_TIMEOUT=900
BACKEND=shm
BOOT=""
MODEL=""
LOG_LEVEL=info
SERVE=()  # flags for the prefill only
SHARED=() # flags for the prefill and the decodes

say() { echo "[launch] $*" >&2; }
die() {
    say "$*"
    exit 2
}
is_int() { [[ "$1" =~ ^[0-9]+$ ]]; }

while [ $# -gt 0 ]; do
    flag="$1"
    shift
    inline=0
    case "$flag" in --*=*)
        val="${flag#*=}"
        flag="${flag%%=*}"
        inline=1
        ;;
    esac
    case "$flag" in
    --num-decodes | --port | --host | --ready-timeout | --disaggregation-transfer-backend | \
        --disaggregation-bootstrap-port | --log-level | --model-path | --tokenizer-path | \
        --page-size | --dtype | --kv-cache-dtype | --random-seed | --sliding-window | --swa-layers | \
        --api-key)
        if [ "$inline" = 0 ]; then
            [ $# -gt 0 ] || die "$flag needs a value"
            val="$1"
            shift
        fi
        ;;
    esac
    case "$flag" in
    --num-decodes) NUM_DECODES="$val" ;;
    --port) PORT="$val" ;;
    --host) HOST="$val" ;;
    --no-router) ROUTER=no ;;
    --api-key)
        [ -n "$val" ] || die "--api-key must not be empty"
        export MPPREFILL_API_KEY="$val"
        ;;
    --ready-timeout) READY_TIMEOUT="$val" ;;
    --disaggregation-transfer-backend) BACKEND="$val" ;;
    --disaggregation-bootstrap-port) BOOT="$val" ;;
    --log-level)
        LOG_LEVEL="$val"
        SHARED+=("$flag" "$val")
        ;;
    --model-path)
        MODEL="$val"
        SHARED+=("$flag" "$val")
        ;;
    --tokenizer-path | --page-size | --dtype | --kv-cache-dtype | --random-seed | \
        --sliding-window | --swa-layers) SHARED+=("$flag" "$val") ;;
    --skip-tokenizer-init) SHARED+=("$flag") ;;
    -h | --help)
        sed -n '2,/^source/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *) if [ "$inline" = 1 ]; then SERVE+=("$flag=$val"); else SERVE+=("$flag"); fi ;;
    esac
done

is_int "$NUM_DECODES" && [ "$NUM_DECODES" -ge 1 ] && [ "$NUM_DECODES" -le 98 ] ||
    die "--num-decodes must be 1..98, got $NUM_DECODES"
is_int "$PORT" && [ "$PORT" -ge 1001 ] && [ "$((PORT + 201 + NUM_DECODES))" -le 65535 ] ||
    die "--port $PORT leaves no room for the deployment's ports (P - 1000 .. P + 201 + N)"
is_int "$READY_TIMEOUT" || die "--ready-timeout must be whole seconds, got $READY_TIMEOUT"
PREFILL_PORT=$((PORT + 1))
case "$HOST" in 0.0.0.0 | "::" | "[::]" | "") CLIENT_HOST=127.0.0.1 ;; *) CLIENT_HOST="$HOST" ;; esac
KEY_HEADER=""
ROUTER_KEY=()
if [ -n "${MPPREFILL_API_KEY:-}" ]; then
    KEY_HEADER="-H \"Authorization: Bearer \$MPPREFILL_API_KEY\""
    ROUTER_KEY=(--api-key "$MPPREFILL_API_KEY")
fi
case "$LOG_LEVEL" in warning) ROUTER_LOG=warn ;; critical) ROUTER_LOG=error ;; *) ROUTER_LOG="$LOG_LEVEL" ;; esac

if [ "$BACKEND" = fake ]; then
    ROUTER=no
    NUM_DECODES=0
    PREFILL_PORT=$PORT
elif [ -z "$BOOT" ]; then
    BOOT=$((PREFILL_PORT - 21002))
    [ "$BOOT" -ge 1 ] || die "--port $PORT derives no bootstrap port: give --disaggregation-bootstrap-port"
fi
if [ "$ROUTER" = auto ]; then
    if "$PY" -c "import sglang_router" 2>/dev/null; then
        ROUTER=yes
    else
        ROUTER=no
        say "sglang-router is not installed: '$PY -m pip install sglang-router' adds SGLang's"
        say "router; without it the servers start and the request line does the router's part"
    fi
fi

PIDS=()
NAMES=()
PORTS=()
# Each server in its own session (setsid execs in place, so $! is the server): Ctrl-C
# reaches this script alone, which stops the servers, and a group left behind is killed.
start() { # NAME PORT COMMAND...
    NAMES+=("$1")
    PORTS+=("$2")
    shift 2
    setsid "$@" </dev/null &
    PIDS+=($!)
}

alive() { kill -0 "$1" 2>/dev/null; }
any_alive() {
    local pid
    for pid in "${PIDS[@]}"; do alive "$pid" && return 0; done
    return 1
}
any_group() { # a process of some server's session is left
    local pid
    for pid in "${PIDS[@]}"; do kill -0 -- "-$pid" 2>/dev/null && return 0; done
    return 1
}

stop_all() {
    local pid i=0
    trap '' INT TERM
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    # 30 s for the servers to clean up, then 5 for what they started to be gone
    while any_alive && [ "$i" -lt 300 ]; do
        sleep 0.1
        i=$((i + 1))
    done
    while any_group && [ "$i" -lt 350 ]; do
        sleep 0.1
        i=$((i + 1))
    done
    for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
    wait 2>/dev/null
}

on_signal() {
    say "stopping"
    stop_all
    exit 0
}
trap on_signal INT TERM

# The first server that has exited: its name and status; none: return 1.
check_dead() {
    local i
    for i in "${!PIDS[@]}"; do
        if ! alive "${PIDS[$i]}"; then
            wait "${PIDS[$i]}"
            say "${NAMES[$i]} (--port ${PORTS[$i]}) exited (status $?); stopping the rest"
            stop_all
            exit 1
        fi
    done
}

http_ok() { # URL [JSON body]: 200 within 60 s
    "$PY" - "$@" <<'EOF' 2>/dev/null
import os, sys, urllib.request
url, body = sys.argv[1], (sys.argv[2].encode() if len(sys.argv) > 2 else None)
headers = {"Content-Type": "application/json"}
if os.environ.get("MPPREFILL_API_KEY"):
    headers["Authorization"] = "Bearer " + os.environ["MPPREFILL_API_KEY"]
req = urllib.request.Request(url, body, headers)
sys.exit(0 if urllib.request.urlopen(req, timeout=60).status == 200 else 1)
EOF
}

wait_ready() { # NAME URL [body]
    local name="$1" deadline=$((SECONDS + READY_TIMEOUT))
    shift
    until http_ok "$@"; do
        check_dead
        [ "$SECONDS" -lt "$deadline" ] || {
            say "$name not ready after ${READY_TIMEOUT}s; stopping everything"
            stop_all
            exit 1
        }
        sleep 0.5
    done
}

MPP=("$PY" -m mpprefill)
for ((i = 1; i <= NUM_DECODES; i++)); do
    start "decode $i" $((PREFILL_PORT + i)) "${MPP[@]}" decode "${SHARED[@]}" \
        --host "$HOST" --port $((PREFILL_PORT + i)) --disaggregation-transfer-backend "$BACKEND"
done
BOOT_FLAG=()
[ "$BACKEND" = fake ] || BOOT_FLAG=(--disaggregation-bootstrap-port "$BOOT")
start prefill "$PREFILL_PORT" "${MPP[@]}" serve "${SHARED[@]}" --host "$HOST" \
    --port "$PREFILL_PORT" --disaggregation-transfer-backend "$BACKEND" "${BOOT_FLAG[@]}" \
    "${SERVE[@]}"
for i in "${!PIDS[@]}"; do
    wait_ready "${NAMES[$i]}" "http://$CLIENT_HOST:${PORTS[$i]}/health"
done

PROMPT='"text": "The capital of France is"'
OPENAI_PROMPT='"The capital of France is"'
PARAMS='"sampling_params": {"temperature": 0, "max_new_tokens": 16}'
JSON="-H 'Content-Type: application/json'${KEY_HEADER:+ $KEY_HEADER}"
OPENAI_KEY='"none"'
if [ -n "$KEY_HEADER" ]; then
    OPENAI_KEY='__import__("os").environ["MPPREFILL_API_KEY"]'
    say "the lines below send \$MPPREFILL_API_KEY as the key: export it in your shell first"
fi
if [ "$ROUTER" = yes ]; then
    DECODES=()
    for ((i = 1; i <= NUM_DECODES; i++)); do
        DECODES+=(--decode "http://$CLIENT_HOST:$((PREFILL_PORT + i))")
    done
    start router "$PORT" "$PY" -m sglang_router.launch_router --pd-disaggregation \
        --prefill "http://$CLIENT_HOST:$PREFILL_PORT" "$BOOT" "${DECODES[@]}" \
        --host "$HOST" --port "$PORT" --prometheus-port $((PORT - 1000)) \
        --policy round_robin --log-level "$ROUTER_LOG" \
        --disable-retries --disable-circuit-breaker --health-check-interval-secs 1 \
        --health-failure-threshold 2 --health-success-threshold 1 "${ROUTER_KEY[@]}"
    one='{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}'
    wait_ready "router" "http://$CLIENT_HOST:$PORT/generate" "$one"
    URL="http://$CLIENT_HOST:$PORT"
    # NOTE: the client check first, so that nothing comes between the two lines
    "$PY" -c "import openai" 2>/dev/null || say "the openai line needs the client: $PY -m pip install openai"
    say "ready: router $URL, prefill :$PREFILL_PORT, $NUM_DECODES decode(s) from :$((PREFILL_PORT + 1))"
    CURL_LINE="curl -s $URL/generate $JSON -d '{$PROMPT, $PARAMS}'"
    OPENAI_LINE="$PY -c 'from openai import OpenAI; c = OpenAI(base_url=\"$URL/v1\", api_key=$OPENAI_KEY);"
    OPENAI_LINE+=" print(c.completions.create(model=\"default\", prompt=$OPENAI_PROMPT, max_tokens=16,"
    OPENAI_LINE+=" temperature=0).choices[0].text)'"
    printf '%s\n%s\n' "$CURL_LINE" "$OPENAI_LINE"  # one write: both lines or none
elif [ "$BACKEND" = fake ]; then
    URL="http://$CLIENT_HOST:$PREFILL_PORT"
    say "ready: the prefill alone on $URL (fake transfer: each reply is the first token)"
    echo "curl -s $URL/generate $JSON -d '{$PROMPT, $PARAMS}'"
else
    ROOM="\"bootstrap_host\": \"$CLIENT_HOST\", \"bootstrap_port\": $BOOT, \"bootstrap_room\": '\$RANDOM'"
    DEC="http://$CLIENT_HOST:$((PREFILL_PORT + 1))"
    say "ready (no router): prefill :$PREFILL_PORT, $NUM_DECODES decode(s) from :$((PREFILL_PORT + 1));"
    say "the line sends one body to the first decode and to the prefill, as the router would"
    echo "B='{$PROMPT, $PARAMS, $ROOM}'; curl -s -o /dev/null http://$CLIENT_HOST:$PREFILL_PORT/generate" \
        "$JSON -d \"\$B\" & curl -s $DEC/generate $JSON -d \"\$B\"; wait"
fi

while true; do
    check_dead
    sleep 0.5
done
