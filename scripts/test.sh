#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra arguments go to pytest.
# Beyond scripts/setup.sh it installs Debian's chromium + chromium-driver for the browser tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
# Debian's Chromium and its driver, for the web console's browser tests (tests/test_console_browser.py;
# they skip, saying why, where this cannot run). Nothing downloads a browser at test time.
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing Debian's chromium and chromium-driver (browser tests)"
    (DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 ||
     { apt-get update -q >/dev/null 2>&1 &&
       DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; }) ||
      echo "[setup] could not install chromium; the browser tests will be skipped"
  else
    echo "[setup] chromium not installed and apt-get not usable here; the browser tests will be skipped"
  fi
fi
cd "$ROOT"
exec python -m pytest -q "$@"
