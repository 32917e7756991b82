# Sourced by the other scripts; defines the set-up steps and runs none of them.
#   setup_venv [extra,extra]   make .venv if missing and install the project into it
#   setup_rdma_libs            the OS libraries the Mooncake transfer engine needs
# NOTE: functions, not a script reading "$1": `source` without arguments hands a script's
# own arguments to the sourced file.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TORCH_PIN="torch==2.13.0"
VPY="$ROOT/.venv/bin/python"

pip_q() { "$VPY" -m pip install -q --disable-pip-version-check "$@"; }

setup_venv() {
    local extras="${1:-}" need="" e stamp
    if [ ! -x .venv/bin/python ]; then
        echo "[setup] creating .venv" >&2
        "${PYTHON:-python3}" -m venv .venv
    fi
    # NOTE: torch goes in first and pinned, so that no later requirement pulls a CUDA build.
    if ! "$VPY" -c "import torch" 2>/dev/null; then
        echo "[setup] installing $TORCH_PIN (CPU build)" >&2
        pip_q "$TORCH_PIN"
    fi
    # One stamp per extra (and "core"); an install with extras also satisfies "core".
    for e in core ${extras//,/ }; do
        stamp=".venv/.installed-$e"
        if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then need="$need $e"; fi
    done
    if [ -n "$need" ]; then
        echo "[setup] installing mpprefill${extras:+[$extras]}" >&2
        pip_q -e ".${extras:+[$extras]}"
        for e in core ${extras//,/ }; do touch ".venv/.installed-$e"; done
    fi
    export PATH="$ROOT/.venv/bin:$PATH"
}

# Mooncake (even over TCP) loads libibverbs, librdmacm and libnuma. Installed with apt-get
# when running as root and libibverbs is missing; never fails: its tests skip without them.
setup_rdma_libs() {
    if "$VPY" -c "import ctypes; ctypes.CDLL('libibverbs.so.1')" 2>/dev/null; then return 0; fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "[setup] libibverbs missing (needs root and apt-get); mooncake tests will skip" >&2
        return 0
    fi
    echo "[setup] installing libibverbs1 librdmacm1 libnuma1" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq libibverbs1 librdmacm1 libnuma1; } >/dev/null 2>&1 \
        || echo "[setup] could not install the RDMA libraries; mooncake tests will skip" >&2
}
