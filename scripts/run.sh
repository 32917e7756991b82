#!/usr/bin/env bash
# Set up .venv (if needed) and run the main job: the forward-mode benchmark on the built-in
# model. Extra flags go to `mpprefill bench` (see `mpprefill bench --help`).
source "$(dirname "$0")/_env.sh"
setup_venv
exec .venv/bin/mpprefill bench "$@"
