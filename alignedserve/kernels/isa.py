"""Which instruction-set path the kernels run: detected once, overridable for testing.

A *path* names one build of the compiled kernels and the rules for what runs where:

* ``amx`` — Intel AMX-BF16 tiles (Sapphire Rapids and later): tile-based small-batch linears,
  prefill attention, and decode attention over tiled bf16 caches;
* ``avx512_bf16`` — AVX-512 with ``vdpbf16ps`` (AMD Zen 4/5, Intel Cooper Lake and the AMX
  parts): ``vdpbf16ps`` linears, prefill attention and decode attention over tiled bf16
  caches, AVX-512 fused elementwise ops;
* ``avx512`` — AVX-512 F/BW/VL/DQ/CD without AVX512-BF16 (Intel Skylake-SP, Cascade Lake,
  Ice Lake, and VMs that hide the bf16 flags): the ``avx512_bf16`` path's kernels with
  ``vdpbf16ps`` built from AVX-512F FMAs (``csrc/bf16_pairs.h``: the same results but for
  denormals), FMA decode attention over tiled bf16 caches;
* ``avx2`` — AVX2 + FMA (any x86-64 server of the last decade): AVX2 FMA linears and prefill
  attention, the portable kernels compiled for AVX2;
* ``reference`` — PyTorch only, no compiled code (any CPU, and every non-CPU device).

``PATHS`` lists them best first; a CPU supports a path and every path after it. The path in
use is the best one the CPU supports, or the one ``ALIGNEDSERVE_ISA`` names (a lower one, to
test or benchmark it on a machine that has a higher one; naming one the CPU lacks is an
error, since its code would fault). ``ALIGNEDSERVE_NO_KERNELS=1`` is kept as a synonym of
``ALIGNEDSERVE_ISA=reference``.

``ALIGNEDSERVE_AMX_EMULATE=1`` lets a CPU without AMX that has the ``avx512_bf16`` path run the
``amx`` path on tiles emulated in software (``csrc/amx_emulated.h``), so the AMX kernels' logic
is tested on such machines too. It is slow and never the default: only forcing ``amx`` (or a
test naming it) runs it.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

PATHS = ("amx", "avx512_bf16", "avx512", "avx2", "reference")
ENV_VAR = "ALIGNEDSERVE_ISA"

# /proc/cpuinfo flags each compiled path's code may execute: the features of its -march
# target (build.py), which the kernels or the compiler's code generation may use.
_AVX2 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")
_AVX512 = _AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")
_AVX512_BF16 = _AVX512 + ("avx512_bf16", "avx512_vnni")
_REQUIRED_FLAGS = {"amx": _AVX512_BF16 + ("amx_tile", "amx_bf16"),
                   "avx512_bf16": _AVX512_BF16, "avx512": _AVX512, "avx2": _AVX2}

# oneDNN (torch's bf16 GEMMs) takes its own ceiling from ONEDNN_MAX_CPU_ISA; forcing one of
# our paths sets the matching ceiling so both libraries run the same instruction set.
ONEDNN_CEILING = {"avx512_bf16": "AVX512_CORE_BF16", "avx512": "AVX512_CORE", "avx2": "AVX2"}


ROW_UNITS_ENV = "ALIGNEDSERVE_DECODE_ROW_UNITS"
# CPUs on which the avx512_bf16 decode attention reads a call of many rows faster as row
# units, as (vendor_id, cpu family) from /proc/cpuinfo: AMD family 19h (Zen 4; its Zen 3
# parts have no AVX-512)
# (docs/results/2026-12-05-zen4-decode-row-units.md). On family 1Ah (Zen 5) per-head items
# read faster (docs/results/2026-12-05-zen5-first-measurements.md).
_ROW_UNIT_CPUS = frozenset({("AuthenticAMD", 0x19)})

READ_AHEAD_ENV = "ALIGNEDSERVE_DECODE_READ_AHEAD"
# Bytes the avx512_bf16 decode attention's per-head items keep requested ahead of their reads,
# per CPU as (vendor_id, cpu family): on family 1Ah (Zen 5) that read faster than the hardware
# prefetchers alone (docs/results/2026-12-05-zen5-decode-read-ahead.md). On Zen 4 every
# software request pattern tried read slower, this one included (read against row units:
# docs/results/2026-12-07-zen4-after-the-epilogues.md); other CPUs are not measured: 0 (none).
_READ_AHEAD_BYTES = {("AuthenticAMD", 0x1A): 8192}
_MAX_READ_AHEAD = 1 << 30  # past any span's reads: no requests at all


def _cpuinfo_field(name: str) -> str:
    """The first value of ``name`` in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return frozenset(_cpuinfo_field("flags").split())


@functools.lru_cache(maxsize=1)
def cpu_paths() -> tuple[str, ...]:
    """The paths this CPU can execute, best first (always ends with ``reference``)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("reference",)
    flags = _cpu_flags()
    return tuple(p for p in PATHS if all(f in flags for f in _REQUIRED_FLAGS.get(p, ())))


def missing_flags(path: str) -> tuple[str, ...]:
    """CPU flags ``path`` needs that this CPU lacks (for skip reasons and errors)."""
    if platform.machine().lower() not in ("x86_64", "amd64") and path != "reference":
        return (f"an x86-64 CPU (this is {platform.machine()})",)
    flags = _cpu_flags()
    return tuple(f for f in _REQUIRED_FLAGS.get(path, ()) if f not in flags)


def requested_path() -> str | None:
    """The path the environment asks for, validated, or None (use the best)."""
    name = os.environ.get(ENV_VAR, "").strip().lower()
    if not name and os.environ.get("ALIGNEDSERVE_NO_KERNELS", "") == "1":
        return "reference"
    if not name or name == "auto":
        return None
    check_path(name)
    return name


AMX_EMULATE_ENV = "ALIGNEDSERVE_AMX_EMULATE"


def amx_emulated() -> bool:
    """Whether the ``amx`` path runs on emulated tiles here: ``ALIGNEDSERVE_AMX_EMULATE=1`` on
    a CPU without AMX that runs the ``avx512_bf16`` path (the rest of the amx build's code).
    Read on every call, so a test can switch it; the build is made once per process."""
    value = os.environ.get(AMX_EMULATE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{AMX_EMULATE_ENV} must be 0 or 1, not {value!r}")
    paths = cpu_paths()
    return value == "1" and "amx" not in paths and "avx512_bf16" in paths


def runnable_paths() -> tuple[str, ...]:
    """The paths that can run here, best first: `cpu_paths`, with ``amx`` ahead of them where
    its tiles are emulated (`amx_emulated`). The best path in use stays ``cpu_paths()[0]``."""
    return ("amx", *cpu_paths()) if amx_emulated() else cpu_paths()


def check_path(name: str) -> None:
    """Raise ValueError unless ``name`` is a known path that can run here (`runnable_paths`)."""
    if name not in PATHS:
        raise ValueError(f"unknown kernel path {name!r}; choose one of {', '.join(PATHS)}")
    if name not in runnable_paths():
        hint = (f" ({AMX_EMULATE_ENV}=1 runs it on emulated tiles, for tests)"
                if name == "amx" and "avx512_bf16" in cpu_paths() else "")
        raise ValueError(f"kernel path {name!r} needs CPU features this machine lacks: "
                         f"{', '.join(missing_flags(name))}{hint}")


@functools.lru_cache(maxsize=1)
def decode_row_units() -> bool:
    """Whether the avx512_bf16 decode attention takes calls of many rows as row units (every
    kv head of a row in one work item, read side by side) rather than per-head items.

    Both give the same bits; which reads KV faster depends on the CPU's prefetchers, so it is
    chosen per CPU as measured (``_ROW_UNIT_CPUS``); CPUs not measured keep per-head items,
    the kernel's plain form. ``ALIGNEDSERVE_DECODE_ROW_UNITS=1`` or ``0`` forces either, to
    test or compare them on any machine."""
    forced = os.environ.get(ROW_UNITS_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"{ROW_UNITS_ENV} must be 0 or 1, not {forced!r}")
    return _cpu_kind() in _ROW_UNIT_CPUS


@functools.lru_cache(maxsize=1)
def decode_read_ahead() -> int:
    """Bytes the avx512_bf16 decode attention's per-head items keep requested ahead of their
    reads (0: none, the hardware prefetchers alone).

    The bits are the same either way; whether requests beat the hardware prefetchers depends
    on the CPU, so it is chosen per CPU as measured (``_READ_AHEAD_BYTES``).
    ``ALIGNEDSERVE_DECODE_READ_AHEAD=<bytes>`` forces a distance (0 turns it off)."""
    forced = os.environ.get(READ_AHEAD_ENV, "").strip()
    if forced:
        if not (forced.isdigit() and int(forced) <= _MAX_READ_AHEAD):
            raise ValueError(f"{READ_AHEAD_ENV} must be a number of bytes from 0 to "
                             f"{_MAX_READ_AHEAD}, not {forced!r}")
        return int(forced)
    return _READ_AHEAD_BYTES.get(_cpu_kind(), 0)


# Flags a machine record names: those that decide the paths, and the bf16 / int8 extensions
# beside them.
RECORDED_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                  "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
# The flags that separate the compiled paths, lowest first: a record says which are missing.
_PATH_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")

# The core of the server CPUs this project meets, from (vendor_id, cpu family, models): a VM
# often shows only "AMD EPYC" as the model name, and Zen 4 and Zen 5 differ in what each
# kernel path does best (isa's per-CPU choices above). Models from AMD's and Intel's family /
# model tables; a CPU not listed is named by its numbers alone.
_CORES = (
    ("AuthenticAMD", 0x17, range(0x00, 0x30), "Zen / Zen+"),
    ("AuthenticAMD", 0x17, range(0x30, 0x100), "Zen 2"),
    ("AuthenticAMD", 0x19, range(0x00, 0x10), "Zen 3"),
    ("AuthenticAMD", 0x19, range(0x10, 0x20), "Zen 4"),
    ("AuthenticAMD", 0x19, range(0x20, 0x60), "Zen 3"),
    ("AuthenticAMD", 0x19, range(0x60, 0x80), "Zen 4"),
    ("AuthenticAMD", 0x19, range(0xA0, 0xB0), "Zen 4"),
    ("AuthenticAMD", 0x1A, range(0x00, 0x80), "Zen 5"),
    ("GenuineIntel", 6, range(0x3F, 0x40), "Haswell-EP"),
    ("GenuineIntel", 6, range(0x4F, 0x50), "Broadwell-EP"),
    ("GenuineIntel", 6, range(0x55, 0x56), "Skylake-SP / Cascade Lake / Cooper Lake"),
    ("GenuineIntel", 6, range(0x6A, 0x6B), "Ice Lake-SP"),
    ("GenuineIntel", 6, range(0x6C, 0x6D), "Ice Lake-D"),
    ("GenuineIntel", 6, range(0x8F, 0x90), "Sapphire Rapids"),
    ("GenuineIntel", 6, range(0xCF, 0xD0), "Emerald Rapids"),
    ("GenuineIntel", 6, range(0xAD, 0xAF), "Granite Rapids"),
    ("GenuineIntel", 6, range(0xAF, 0xB0), "Sierra Forest"),
)


@dataclass(frozen=True, slots=True)
class CpuInfo:
    """What /proc/cpuinfo says about this CPU, as a benchmark record and a bug report name it
    (numbers None and strings empty where it does not say)."""

    model_name: str
    vendor: str
    family: int | None
    model: int | None
    stepping: int | None
    flags: frozenset[str]

    @property
    def core(self) -> str:
        """The core's name ("Zen 5", "Sapphire Rapids", ...), or "" where not listed."""
        return next((name for vendor, family, models, name in _CORES
                     if (vendor, family) == (self.vendor, self.family)
                     and self.model in models), "")

    @property
    def recorded_flags(self) -> tuple[str, ...]:
        """The flags of ``RECORDED_FLAGS`` this CPU has, in that order."""
        return tuple(f for f in RECORDED_FLAGS if f in self.flags)

    def summary(self) -> str:
        """One line: name, vendor / family / model / stepping and core, the recorded flags
        and the path-deciding flags it lacks."""
        numbers = " ".join(f"{label} 0x{value:02X}" for label, value in (
            ("family", self.family), ("model", self.model)) if value is not None)
        if self.stepping is not None:
            numbers += f" stepping {self.stepping}"
        ident = ", ".join(part for part in (f"{self.vendor} {numbers}".strip(), self.core)
                          if part)
        missing = [f for f in _PATH_FLAGS if f not in self.flags]
        flags = " ".join(self.recorded_flags) or "none recorded"
        return (f"{self.model_name or 'unknown CPU'} ({ident or 'no /proc/cpuinfo'}); flags: "
                f"{flags}" + (f"; without {', '.join(missing)}" if missing else ""))


def cpu_info() -> CpuInfo:
    """This CPU as /proc/cpuinfo describes it (its first processor)."""
    return CpuInfo(_cpuinfo_field("model name"), _cpuinfo_field("vendor_id"),
                   _cpuinfo_int("cpu family"), _cpuinfo_int("model"),
                   _cpuinfo_int("stepping"), _cpu_flags())


def _cpuinfo_int(name: str) -> int | None:
    """A decimal field of /proc/cpuinfo, or None where it is missing or not a number."""
    value = _cpuinfo_field(name)
    return int(value) if value.isdigit() else None


def _cpu_kind() -> tuple[str, int] | None:
    """(vendor_id, cpu family) from /proc/cpuinfo, or None where it does not say."""
    family = _cpuinfo_int("cpu family")
    return None if family is None else (_cpuinfo_field("vendor_id"), family)
