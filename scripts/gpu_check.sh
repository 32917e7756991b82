#!/usr/bin/env bash
# GPU check, under 11 minutes on one GPU (each phase has its own time limit): the GPU-marked
# tests, then a short six-mode bench and a pinned vs cuda-ipc staging comparison on a random
# model big enough that a forward takes milliseconds. Usage: scripts/gpu_check.sh OUTDIR
#
# Assumes python3 with a CUDA build of torch (never installs torch). Missing pure-Python
# dependencies are pip-installed; on a machine without network set PIP_ARGS, e.g.
# PIP_ARGS="--no-index --find-links /path/to/wheels". PYTHON picks the interpreter.
# OUTDIR gets: gpu_check.log, gpu_tests.xml, bench.json, staging.json, summary.txt and the
# bench's server and decode logs (bench_logs/), calibration.json (the emulated device's
# roofline against measured device times).
set -uo pipefail
OUT="${1:?usage: scripts/gpu_check.sh OUTDIR}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
cd "$ROOT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
MODEL="${MPP_GPU_MODEL:-${TMPDIR:-/tmp}/mpp-gpu-model-2048x16}"
T0=$SECONDS
declare -A RC

phase() { echo; echo "=== [$((SECONDS - T0))s] $*"; }

phase "setup"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible to $PY:"
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    exit 2
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv 2>/dev/null || true
missing=""
for pair in zmq:pyzmq posix_ipc:posix-ipc numpy:numpy safetensors:safetensors \
            pytest:pytest pytest_timeout:pytest-timeout; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing="$missing ${pair##*:}"
done
if [ -n "$missing" ]; then
    echo "installing:$missing"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --disable-pip-version-check ${PIP_ARGS:-} $missing || {
        echo "could not install$missing"; exit 2; }
fi
SHM_AVAIL=$(df --output=avail -B1 /dev/shm 2>/dev/null | tail -1 || echo 0)
BACKEND=shm  # the transfer thread reads GPU KV pages through CUDA IPC
if [ "${SHM_AVAIL:-0}" -lt $((6 << 30)) ]; then BACKEND=fake; fi  # decode pool: 4 GiB
echo "/dev/shm available: $SHM_AVAIL bytes; bench transfer backend: $BACKEND"

phase "GPU-marked tests"
timeout 190 "$PY" -m pytest -m gpu tests/gpu -q -p no:cacheprovider -o addopts="" -rfEsP \
    --junitxml "$OUT/gpu_tests.xml"
RC[tests]=$?

phase "random model (hidden 2048, 16 layers; the loader runs it in float32) at $MODEL"
timeout 45 "$PY" - "$MODEL" <<'EOF'
import os, sys
from mpprefill.model import ModelConfig
from mpprefill.model.export import save_random_model
path = sys.argv[1]
if not os.path.exists(os.path.join(path, "model.safetensors")):
    cfg = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                      num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                      max_position_embeddings=8192, dtype="bfloat16")
    save_random_model(cfg, path + ".part")
    os.replace(path + ".part", path)
print("model ready:", path)
EOF
RC[model]=$?

phase "six-mode bench"
timeout 165 "$PY" -m mpprefill bench --device cuda --model-path "$MODEL" \
    --modes normal,overlap,thread,thread-ahead,proc,proc-ahead \
    --num-requests 48 --prompt-len 1024 --hit-rate 0.5 \
    --max-total-tokens 32768 --chunked-prefill-size 2048 --max-prefill-tokens 4096 \
    --max-running-requests 16 --worker-threads 4 \
    --disaggregation-transfer-backend "$BACKEND" --json "$OUT/bench.json"
RC[bench]=$?
LOGS=$(grep -o 'logs in [^ ]*' "$OUT/gpu_check.log" | tail -1 | cut -d' ' -f3)
[ -n "$LOGS" ] && [ -d "$LOGS" ] && cp -r "$LOGS" "$OUT/bench_logs"

phase "staging: pinned vs cuda-ipc (proc, proc-ahead)"
timeout 70 "$PY" -m tests.gpu.staging_bench --model "$MODEL" --json "$OUT/staging.json"
RC[staging]=$?

phase "emulation calibration: real shapes in bfloat16 against the roofline"
timeout 180 "$PY" scripts/calibrate_emulation.py --models Qwen2.5-0.5B,Llama-3.1-8B \
    --tokens 512,2048,8192,16384 --forwards 5 --json "$OUT/calibration.json"
RC[calibration]=$?

phase "done"
status=0
for k in tests model bench staging calibration; do
    echo "$k: rc=${RC[$k]}" | tee -a "$OUT/summary.txt"
    [ "${RC[$k]}" -eq 0 ] || status=1
done
echo "total: $((SECONDS - T0))s" | tee -a "$OUT/summary.txt"
exit $status
