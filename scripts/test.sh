#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite. Extra args go to pytest.
source "$(dirname "$0")/_env.sh" test,hf,plot,mooncake
# transformers is the oracle for the Hugging Face loader tests; the tests skip if it is absent.
if ! .venv/bin/python -c "import transformers" 2>/dev/null; then
    echo "[setup] installing transformers (test oracle)" >&2
    .venv/bin/python -m pip install -q --disable-pip-version-check transformers \
        || echo "[setup] transformers unavailable; its tests will skip" >&2
fi
exec .venv/bin/python -m pytest "$@"
