"""The kernel layer's path selection (alignedserve.kernels.isa / dispatch) and its builds."""

from __future__ import annotations

import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from alignedserve.kernels import build, isa, kernels_for_path, select_kernels
from alignedserve.kernels.isa import PATHS, cpu_paths
from tests.conftest import kernel_path_params


def test_cpu_paths_are_ordered_and_end_with_the_reference():
    paths = cpu_paths()
    assert paths[-1] == "reference"
    assert list(paths) == [p for p in PATHS if p in paths]  # best first
    # A CPU that runs a path runs every lower one.
    assert paths == PATHS[PATHS.index(paths[0]):]


_AVX2_FLAGS = "avx2 fma f16c bmi1 bmi2 movbe"
_AVX512_FLAGS = _AVX2_FLAGS + " avx512f avx512bw avx512vl avx512dq avx512cd"
_BF16_FLAGS = _AVX512_FLAGS + " avx512_bf16 avx512_vnni"


@pytest.mark.parametrize("flags,best", [
    (_BF16_FLAGS + " amx_tile amx_bf16", "amx"),
    (_BF16_FLAGS, "avx512_bf16"),            # AMD Zen 4/5, Cooper Lake
    (_AVX512_FLAGS + " avx512_vnni", "avx512"),  # Ice Lake, Cascade Lake, masked-bf16 VMs
    (_AVX512_FLAGS, "avx512"),               # Skylake-SP
    (_AVX2_FLAGS + " avx512f", "avx2"),      # no BW/VL: not an AVX-512 path
    ("sse4_2 avx", "reference"),
])
def test_paths_follow_the_cpu_flags(monkeypatch, flags, best):
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(isa, "_cpu_flags", lambda: frozenset(flags.split()))
    cpu_paths.cache_clear()
    try:
        assert cpu_paths() == PATHS[PATHS.index(best):]
    finally:
        cpu_paths.cache_clear()


def per_cpu_choice(monkeypatch, choice, env_var: str, vendor: str, family: str):
    """``choice`` (one of isa's cached per-CPU choices) on a CPU whose /proc/cpuinfo names
    ``vendor`` and ``family``, as a function of its override ``env_var`` (None: unset). The
    cache is cleared around every call, so each reads its inputs afresh and none outlives it."""
    fields = {"vendor_id": vendor, "cpu family": family}
    monkeypatch.setattr(isa, "_cpuinfo_field", lambda name: fields.get(name, ""))

    def read(forced: str | None = None):
        if forced is None:
            monkeypatch.delenv(env_var, raising=False)
        else:
            monkeypatch.setenv(env_var, forced)
        choice.cache_clear()
        try:
            return choice()
        finally:
            choice.cache_clear()

    return read


@pytest.mark.parametrize("vendor,family,units", [
    ("AuthenticAMD", "25", True),    # Zen 4 (family 19h): row units measured faster
    ("AuthenticAMD", "26", False),   # Zen 5 (family 1Ah): per-head items measured faster
    ("GenuineIntel", "6", False),    # not measured: per-head items
    ("", "", False),                 # no /proc/cpuinfo
])
def test_decode_row_units_follow_the_cpu(monkeypatch, vendor, family, units):
    read = per_cpu_choice(monkeypatch, isa.decode_row_units, isa.ROW_UNITS_ENV, vendor, family)
    assert read() is units
    for forced in ("0", "1"):
        assert read(forced) is (forced == "1")
    with pytest.raises(ValueError, match="0 or 1"):
        read("yes")


@pytest.mark.parametrize("vendor,family,distance", [
    ("AuthenticAMD", "26", 8192),    # Zen 5 (family 1Ah): the read-ahead measured faster
    ("AuthenticAMD", "25", 0),       # Zen 4: software requests measured slower
    ("GenuineIntel", "6", 0),        # not measured: the hardware prefetchers alone
    ("", "", 0),                     # no /proc/cpuinfo
])
def test_decode_read_ahead_follows_the_cpu(monkeypatch, vendor, family, distance):
    read = per_cpu_choice(monkeypatch, isa.decode_read_ahead, isa.READ_AHEAD_ENV, vendor, family)
    assert read() == distance
    for forced in ("0", "4096"):
        assert read(forced) == int(forced)
    for bad in ("-64", "8k", "yes", str(1 << 40)):
        with pytest.raises(ValueError, match="bytes"):
            read(bad)


def fake_cpuinfo(monkeypatch, **fields: str) -> None:
    """Make isa read ``fields`` (keys with "_" for " ") as the lines of /proc/cpuinfo."""
    table = {k.replace("_", " "): v for k, v in fields.items()}
    table["vendor_id"] = table.pop("vendor id", "")
    monkeypatch.setattr(isa, "_cpuinfo_field", lambda name: table.get(name, ""))


@pytest.mark.parametrize("vendor,family,model,stepping,core", [
    ("AuthenticAMD", "25", "17", "1", "Zen 4"),        # EPYC Genoa (0x19 / 0x11)
    ("AuthenticAMD", "26", "2", "1", "Zen 5"),         # EPYC Turin (0x1A / 0x02)
    ("AuthenticAMD", "25", "1", "1", "Zen 3"),         # EPYC Milan
    ("GenuineIntel", "6", "143", "8", "Sapphire Rapids"),
    ("GenuineIntel", "6", "207", "2", "Emerald Rapids"),
    ("GenuineIntel", "6", "999", "0", ""),             # not listed: numbers only
])
def test_cpu_info_names_the_core_from_family_and_model(monkeypatch, vendor, family, model,
                                                       stepping, core):
    fake_cpuinfo(monkeypatch, model_name="AMD EPYC", vendor_id=vendor, cpu_family=family,
                 model=model, stepping=stepping, flags=_BF16_FLAGS + " avx512_fp16 sse4_2")
    cpu = isa.cpu_info()
    assert (cpu.vendor, cpu.family, cpu.model, cpu.stepping) == (
        vendor, int(family), int(model), int(stepping))
    assert cpu.core == core
    # The recorded flags in RECORDED_FLAGS' order; sse4_2 decides no path, so is left out.
    assert cpu.recorded_flags == ("avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                  "avx512_vnni", "avx512_bf16", "avx512_fp16")
    summary = cpu.summary()
    assert summary.startswith(f"AMD EPYC ({vendor} family 0x{int(family):02X} model "
                              f"0x{int(model):02X} stepping {stepping}")
    assert (f", {core})" in summary) == bool(core)
    assert summary.endswith("avx512_fp16; without amx_bf16")


def test_cpu_info_without_proc_cpuinfo(monkeypatch):
    fake_cpuinfo(monkeypatch)
    cpu = isa.cpu_info()
    assert (cpu.family, cpu.model, cpu.stepping, cpu.core) == (None, None, None, "")
    assert cpu.summary() == ("unknown CPU (no /proc/cpuinfo); flags: none recorded; without "
                             "avx2, avx512f, avx512_bf16, amx_bf16")


def test_a_kernel_build_is_tagged_with_the_cpu_not_only_its_name(monkeypatch):
    """-mtune=native follows the CPU: Zen 4 and Zen 5 hosts a VM names alike ("AMD EPYC")
    get their own build directories."""
    def tag(family: str, model: str) -> str:
        fake_cpuinfo(monkeypatch, model_name="AMD EPYC", vendor_id="AuthenticAMD",
                     cpu_family=family, model=model, stepping="1")
        return build._build_tag("avx512_bf16")

    zen4, zen5 = tag("25", "17"), tag("26", "2")
    assert zen4 != zen5 and tag("25", "17") == zen4
    assert build._build_tag("avx2") != zen4  # and each path its own


def test_the_env_command_names_the_cpu_and_the_path(monkeypatch, capsys):
    from alignedserve.entrypoints.cli import main

    monkeypatch.delenv(isa.ENV_VAR, raising=False)
    monkeypatch.delenv("ALIGNEDSERVE_NO_KERNELS", raising=False)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"CPU: {isa.cpu_info().summary()}\n" in out
    assert f"kernel path in use: {cpu_paths()[0]} (the best;" in out
    monkeypatch.setenv(isa.ENV_VAR, "reference")
    assert main(["env"]) == 0
    assert "kernel path in use: reference (forced by ALIGNEDSERVE_ISA)" in capsys.readouterr().out
    monkeypatch.setenv(isa.ENV_VAR, "sse9")  # the engine would refuse it: so does env
    assert main(["env"]) == 1
    assert "error: unknown kernel path 'sse9'" in capsys.readouterr().err


def test_default_is_the_best_path(monkeypatch):
    monkeypatch.delenv(isa.ENV_VAR, raising=False)
    monkeypatch.delenv("ALIGNEDSERVE_NO_KERNELS", raising=False)
    assert select_kernels().path == cpu_paths()[0]


@pytest.mark.parametrize("path", kernel_path_params(PATHS))
def test_env_var_forces_a_path(monkeypatch, path):
    monkeypatch.setenv(isa.ENV_VAR, path)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")  # already set: select must not change it
    assert select_kernels().path == path
    import os
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "ALL"


def test_no_kernels_is_the_reference(monkeypatch):
    monkeypatch.delenv(isa.ENV_VAR, raising=False)
    monkeypatch.setenv("ALIGNEDSERVE_NO_KERNELS", "1")
    assert select_kernels().path == "reference"
    assert select_kernels().ext is None


def test_unknown_and_unsupported_paths_are_refused(monkeypatch):
    monkeypatch.setenv(isa.ENV_VAR, "sse9")
    with pytest.raises(ValueError, match="unknown kernel path"):
        select_kernels()
    monkeypatch.setenv(isa.AMX_EMULATE_ENV, "0")  # the hardware's paths only
    lacking = [p for p in PATHS if p not in isa.runnable_paths()]
    if not lacking:
        pytest.skip("this CPU supports every path")
    with pytest.raises(ValueError, match="lacks"):
        select_kernels(lacking[0])


def test_amx_emulation_is_opt_in(monkeypatch):
    """Without ALIGNEDSERVE_AMX_EMULATE=1 a CPU without AMX refuses the amx path, naming the
    switch where the emulation could run; with it the amx path runs but is never the default."""
    if "amx" in cpu_paths():
        pytest.skip("this CPU has AMX: nothing is emulated")
    monkeypatch.delenv(isa.ENV_VAR, raising=False)
    monkeypatch.setenv(isa.AMX_EMULATE_ENV, "0")
    assert not isa.amx_emulated() and "amx" not in isa.runnable_paths()
    hint = isa.AMX_EMULATE_ENV if "avx512_bf16" in cpu_paths() else "lacks"
    with pytest.raises(ValueError, match=hint):
        select_kernels("amx")
    monkeypatch.setenv(isa.AMX_EMULATE_ENV, "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        isa.amx_emulated()
    monkeypatch.setenv(isa.AMX_EMULATE_ENV, "1")
    assert isa.amx_emulated() == ("avx512_bf16" in cpu_paths())
    assert select_kernels().path == cpu_paths()[0]


@pytest.mark.parametrize("path", kernel_path_params(("amx", "avx512_bf16", "avx512", "avx2")))
def test_each_build_is_what_it_says(path):
    kernels = kernels_for_path(path)
    assert kernels.ext.compiled_path() == path
    assert kernels.amx == (path == "amx")
    emulated = path == "amx" and "amx" not in cpu_paths()
    assert kernels.amx_emulated == emulated
    assert kernels.name == (f"{path} (emulated tiles)" if emulated else path)


def test_the_kernel_path_is_logged(caplog, default_model_path):
    """The engine names its path at start-up (the server also puts it in /version and
    /metrics: tests/test_server_e2e.py)."""
    from alignedserve.config import EngineConfig
    from alignedserve.engine import LLMEngine

    with caplog.at_level("INFO", logger="alignedserve.engine"):
        engine = LLMEngine(EngineConfig(kernel_path="reference", dtype="float32"))
    engine.close()
    assert any("kernels: reference path" in r.getMessage() for r in caplog.records)
    assert any(r.getMessage() == f"CPU: {isa.cpu_info().summary()}" for r in caplog.records)


@pytest.mark.parametrize("path", [p for p in PATHS if p not in ("reference",)])
def test_every_path_compiles_even_where_the_cpu_lacks_it(tmp_path: Path, path: str):
    """Compile (not load) every source for ``path``'s target: a machine without AMX still
    proves the AMX build compiles. Paths this CPU runs are built and loaded elsewhere."""
    if path in cpu_paths():
        pytest.skip(f"the {path} build is made and loaded by the other tests on this CPU")
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    includes += [f"-I{sysconfig.get_paths()['include']}", f"-I{build.CSRC}"]
    flags = ["-O1", *build.TARGET_FLAGS[path], "-fopenmp", "-std=c++17", "-fPIC",
             "-DTORCH_EXTENSION_NAME=compile_check", "-D_GLIBCXX_USE_CXX11_ABI="
             f"{int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    for source in build.SOURCES:
        result = subprocess.run(["c++", *flags, *includes, "-c", str(build.CSRC / source),
                                 "-o", str(tmp_path / f"{source}.o")],
                                capture_output=True, text=True)
        assert result.returncode == 0, f"{source} for {path}:\n{result.stderr[-3000:]}"


@pytest.mark.model
def test_batch_invariance_is_asked_for_from_the_cli_and_carried_by_the_kernels():
    """``--batch-invariant`` reaches the engine's `Kernels`; an engine handed a model loaded
    without it refuses rather than silently running non-invariant linears."""
    from alignedserve.config import EngineConfig
    from alignedserve.engine import LLMEngine
    from alignedserve.entrypoints.args import engine_config_from_args
    from alignedserve.entrypoints.cli import build_parser
    from alignedserve.model.loader import load_model

    def config(*argv: str) -> EngineConfig:
        return engine_config_from_args(build_parser().parse_args(argv))

    assert not config("serve").batch_invariant
    assert config("serve", "--batch-invariant").batch_invariant
    assert select_kernels("reference", batch_invariant=True).batch_invariant
    assert not select_kernels("reference").batch_invariant
    loaded = load_model(None, torch.float32, "cpu", kernels_for_path("reference"))
    with pytest.raises(ValueError, match="batch-invariant kernels"):
        LLMEngine(EngineConfig(dtype="float32", batch_invariant=True), loaded)
