#!/usr/bin/env bash
# Stop the local Ray head on RAY_PORT (default 6379); other Ray clusters are left alone.
# Idempotent: nothing to stop is not an error.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
"$PYTHON" -m privcode.cli cluster down --port "${RAY_PORT:-6379}"
