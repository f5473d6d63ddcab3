#!/usr/bin/env bash
# Set up (if needed) and run the main job on the default model.
# Extra arguments go to `alignedserve generate`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec alignedserve generate --chat "$@"
