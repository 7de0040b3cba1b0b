#!/usr/bin/env bash
# Submit jobs/pipeline.py as a Ray Job and follow its logs.
#   CONFIG (default jobs/configs/demo.yaml)
#   RAY_ADDRESS: http://HOST:8265 (dashboard) or HOST:6379 (GCS); unset = local head,
#                started on 127.0.0.1 if none runs
#   NO_WAIT=1: return right after submitting
# Extra arguments are passed to `privcode submit` (e.g. --set data.size=200).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
args=(submit --config "${CONFIG:-jobs/configs/demo.yaml}")
if [[ -n "${NO_WAIT:-}" ]]; then args+=(--no-wait); fi
exec "$PYTHON" -m privcode.cli "${args[@]}" "$@"
