#!/usr/bin/env bash
# Start a decode receiver and a prefill server (scheduler + forward worker) on this host.
# Flags go to `mpprefill serve` (its HTTP front on --port, default 30000; its ZeroMQ socket
# on --zmq-port, default --port + 100); DECODE_PORT (default 30200) picks the decode port.
# Ctrl-C stops both.
source "$(dirname "$0")/_env.sh"
setup_venv
DECODE_PORT="${DECODE_PORT:-30200}"
BACKEND=shm
prev=""
for a in "$@"; do
    [ "$prev" = "--disaggregation-transfer-backend" ] && BACKEND="$a"
    case "$a" in --disaggregation-transfer-backend=*) BACKEND="${a#*=}" ;; esac
    prev="$a"
done
pids=()
cleanup() {
    trap - INT TERM EXIT
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
    wait
}
trap cleanup INT TERM EXIT
if [ "$BACKEND" != "fake" ]; then
    .venv/bin/mpprefill decode --receiver-port "$DECODE_PORT" --disaggregation-transfer-backend "$BACKEND" &
    pids+=($!)
fi
.venv/bin/mpprefill serve --disaggregation-transfer-backend "$BACKEND" \
    --decode-address "127.0.0.1:$DECODE_PORT" "$@" &
pids+=($!)
wait -n "${pids[@]}"
