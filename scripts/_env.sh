# Sourced by the other scripts: makes .venv if missing and installs the project into it.
# Usage: source scripts/_env.sh [extra,extra]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TORCH_PIN="torch==2.13.0"
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv" >&2
    "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
pip_q() { "$VPY" -m pip install -q --disable-pip-version-check "$@"; }
# NOTE: torch goes in first and pinned, so that no later requirement pulls a CUDA build.
if ! "$VPY" -c "import torch" 2>/dev/null; then
    echo "[setup] installing $TORCH_PIN (CPU build)" >&2
    pip_q "$TORCH_PIN"
fi
# One stamp per extra (and "core"); an install with extras also satisfies "core".
need=""
for e in core ${EXTRAS//,/ }; do
    stamp=".venv/.installed-$e"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then need="$need $e"; fi
done
if [ -n "$need" ]; then
    echo "[setup] installing mpprefill${EXTRAS:+[$EXTRAS]}" >&2
    pip_q -e ".${EXTRAS:+[$EXTRAS]}"
    for e in core ${EXTRAS//,/ }; do touch ".venv/.installed-$e"; done
fi
export PATH="$ROOT/.venv/bin:$PATH"
