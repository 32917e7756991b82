#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite. Extra args go to pytest.
source "$(dirname "$0")/_env.sh"
setup_venv test,hf,plot,http
setup_rdma_libs
# Test-only oracles and optional backends; their tests skip with a reason when absent.
optional() {  # optional <import name> <pip requirement>
    .venv/bin/python -c "import $1" 2>/dev/null && return 0
    echo "[setup] installing $2" >&2
    .venv/bin/python -m pip install -q --disable-pip-version-check "$2" \
        || echo "[setup] $2 unavailable; its tests will skip" >&2
}
optional transformers transformers
optional mooncake.engine mooncake-transfer-engine-non-cuda
optional sglang_router sglang-router
optional openai openai
# Two pytest workers by default: many tests wait on processes starting, stopping or timing
# out, so two overlap well even on two cores; a file stays on one worker, so its module
# fixtures start once. `-n 0` (or MPPREFILL_TEST_WORKERS=0) runs one.
exec .venv/bin/python -m pytest -n "${MPPREFILL_TEST_WORKERS:-2}" --dist loadfile "$@"
