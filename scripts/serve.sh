#!/usr/bin/env bash
# Set up (if needed) and run the main job on the default model.
# Extra arguments go to `alignedserve serve` (default: 127.0.0.1:8000, policy aligned).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec alignedserve serve "$@"
