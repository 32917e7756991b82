#!/usr/bin/env bash
# Set up .venv (if needed) and run the main job.
source "$(dirname "$0")/_env.sh"
exec .venv/bin/python scripts/bench_ipc.py "$@"
