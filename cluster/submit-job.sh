#!/usr/bin/env bash
# Submit jobs/pipeline.py and follow it.
#   TARGET: local (default) - the local head on 127.0.0.1, started if none runs
#           ray             - any Ray cluster at RAY_ADDRESS (http://HOST:8265 dashboard, or
#                             HOST:6379 GCS), e.g. a port-forwarded KubeRay head
#           k8s             - a KubeRay RayJob in the current kube context, rendered from
#                             charts/privcode (VALUES=file.yaml for image/storage/workers,
#                             NAMESPACE, RELEASE); where the privcode operator is
#                             installed, a PrivCodeRun it admits first (DATA_CLAIM and
#                             DATA_PATH: the claim and file of the training records)
#   CONFIG (default jobs/configs/demo.yaml)
#   DEMO_STORE: with TARGET=local, the privacy store the job charges (make passes the demo's)
#   NO_WAIT=1: return right after submitting
# Extra arguments are passed to `privcode submit` (e.g. --set data.size=200).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
TARGET="${TARGET:-local}"
args=(submit --target "$TARGET" --config "${CONFIG:-jobs/configs/demo.yaml}")
case "$TARGET" in
    local) if [[ -n "${DEMO_STORE:-}" ]]; then args+=(--set "privacy.store=$DEMO_STORE"); fi ;;
    ray) [[ -n "${RAY_ADDRESS:-}${RAY_API_SERVER_ADDRESS:-}" ]] || {
             echo "submit-job: TARGET=ray needs RAY_ADDRESS (e.g. http://127.0.0.1:8265)" >&2; exit 2; } ;;
    k8s) if [[ -n "${NAMESPACE:-}" ]]; then args+=(--namespace "$NAMESPACE"); fi
         if [[ -n "${RELEASE:-}" ]]; then args+=(--release "$RELEASE"); fi
         if [[ -n "${VALUES:-}" ]]; then args+=(--values "$VALUES"); fi
         if [[ -n "${DATA_CLAIM:-}" ]]; then args+=(--data-claim "$DATA_CLAIM"); fi
         if [[ -n "${DATA_PATH:-}" ]]; then args+=(--data-path "$DATA_PATH"); fi ;;
    *) echo "submit-job: TARGET must be local, ray or k8s (got '$TARGET')" >&2; exit 2 ;;
esac
if [[ -n "${NO_WAIT:-}" ]]; then args+=(--no-wait); fi
exec "$PYTHON" -m privcode.cli "${args[@]}" "$@"
