#!/usr/bin/env bash
# Start a local Ray head bound to 127.0.0.1 with token auth (idempotent).
#   RAY_PORT (default 6379)  DASHBOARD_PORT (default 8265)  NUM_CPUS (default: all)
#   PYTHON (default .venv/bin/python)
# Prints the GCS address (for RAY_ADDRESS / ray.init) and the dashboard URL.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
args=(cluster up --port "${RAY_PORT:-6379}" --dashboard-port "${DASHBOARD_PORT:-8265}" --json)
if [[ -n "${NUM_CPUS:-}" ]]; then args+=(--num-cpus "$NUM_CPUS"); fi
info="$("$PYTHON" -m privcode.cli "${args[@]}")"
"$PYTHON" - "$info" <<'PY'
import json, sys
info = json.loads(sys.argv[1])
state = "started" if info["started"] else "already running"
print(f"Ray head {state} (auth: {info['auth_mode']})")
print(f"  address:   {info['address']}    (export RAY_ADDRESS={info['address']})")
print(f"  dashboard: {info['dashboard_url']}")
PY
