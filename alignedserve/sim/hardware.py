"""Hardware profiles as data: accelerators, links, host, and whole nodes.

Every number is a *datasheet* figure (peak bf16 dense FLOP/s, HBM bandwidth, memory size,
link bandwidth per direction) plus an explicit *efficiency* that turns it into what kernels
achieve. Keeping the two apart makes every assumption visible in one place and lets a
calibrated profile (``cpu-local``, written by ``alignedserve calibrate``) state measured
rates with efficiency 1.

Invariants: all rates and sizes are > 0; efficiencies are in (0, 1]. Profiles are frozen;
the registries are read-only mappings.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

GB = 1e9
GiB = float(1 << 30)

# Where `alignedserve calibrate` writes the measured CPU profile by default.
CPU_LOCAL_PATH = Path(__file__).with_name("profiles") / "cpu-local.json"


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """One accelerator (or the CPU acting as one).

    ``parallel_units`` is how many attention work items (thread blocks) run at once;
    ``unit_burst`` is how many times its fair share (``attn_bw / parallel_units``) of memory
    bandwidth one work item can pull when it runs alone; together they set the tail of a
    one-block-per-sequence attention kernel.
    """

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bw: float  # bytes/s
    mem_bytes: float
    parallel_units: int
    gemm_efficiency: float = 0.7  # achieved / peak in the linear layers
    mem_efficiency: float = 0.8  # achieved / peak when streaming weights or KV
    attn_efficiency: float = 0.8  # achieved / peak bandwidth of the decode-attention kernel
    attn_flops_efficiency: float = 0.6  # achieved / peak FLOP/s of attention (FlashAttention-2)
    unit_burst: float = 2.0
    kernel_launch_s: float = 4e-6  # per attention kernel call and layer
    reserved_fraction: float = 0.1  # memory kept for activations / workspace (not KV)

    def __post_init__(self) -> None:
        for f in ("peak_flops", "mem_bw", "mem_bytes", "parallel_units", "unit_burst"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{self.name}: {f} must be > 0")
        for f in ("gemm_efficiency", "mem_efficiency", "attn_efficiency", "attn_flops_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"{self.name}: {f} must be in (0, 1]")

    @property
    def flops(self) -> float:
        return self.peak_flops * self.gemm_efficiency

    @property
    def attn_flops(self) -> float:
        return self.peak_flops * self.attn_flops_efficiency

    @property
    def bandwidth(self) -> float:
        return self.mem_bw * self.mem_efficiency

    @property
    def attn_bandwidth(self) -> float:
        return self.mem_bw * self.attn_efficiency


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """A copy path. ``bandwidth`` is per direction, datasheet; ``efficiency`` what DMA gets."""

    name: str
    bandwidth: float
    latency_s: float = 10e-6
    efficiency: float = 0.8

    @property
    def rate(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True, slots=True)
class HostProfile:
    """The CPU side of a step: the scheduler, batch metadata, launching (not overlapped)."""

    name: str
    ram_bytes: float
    step_overhead_s: float = 300e-6
    per_row_overhead_s: float = 2e-6
    per_batch_overhead_s: float = 10e-6


@dataclass(frozen=True, slots=True)
class NodeProfile:
    """``num_devices`` identical devices, each with its own host link; peers joined by
    ``peer_link`` (None: peer copies go device -> host -> device over the two host links)."""

    name: str
    device: DeviceProfile
    num_devices: int
    host_link: LinkProfile
    peer_link: LinkProfile | None
    host: HostProfile
    single_copy_queue: bool = False  # all copies share one queue (the CPU engine's copy thread)
    # the attention kernel / launch models that describe this node's engine best (CLI defaults)
    attention_kernel: str = "split-kv"
    attention_launch: str = "per-batch"

    def scaled(self, flops: float = 1.0, mem_bw: float = 1.0, link_bw: float = 1.0) -> NodeProfile:
        """A copy with peak FLOP/s, memory and link bandwidths multiplied (for what-ifs)."""
        dev = dataclasses.replace(self.device, peak_flops=self.device.peak_flops * flops,
                                  mem_bw=self.device.mem_bw * mem_bw)
        host = dataclasses.replace(self.host_link, bandwidth=self.host_link.bandwidth * link_bw)
        peer = self.peer_link and dataclasses.replace(
            self.peer_link, bandwidth=self.peer_link.bandwidth * link_bw)
        return dataclasses.replace(self, device=dev, host_link=host, peer_link=peer)


DEVICES: Mapping[str, DeviceProfile] = MappingProxyType({
    # NVIDIA datasheets: A100 SXM4 80GB, H100 SXM5 80GB, H200 SXM 141GB (bf16 dense, no sparsity).
    "a100": DeviceProfile("A100-80GB", 312e12, 2.039e12, 80 * GiB, 108 * 4),
    "h100": DeviceProfile("H100-SXM", 989e12, 3.35e12, 80 * GiB, 132 * 4),
    "h200": DeviceProfile("H200", 989e12, 4.8e12, 141 * GB, 132 * 4),
})

LINKS: Mapping[str, LinkProfile] = MappingProxyType({
    "pcie4": LinkProfile("PCIe Gen4 x16", 32 * GB),
    "pcie5": LinkProfile("PCIe Gen5 x16", 64 * GB),
    "nvlink3": LinkProfile("NVLink 3 (A100)", 300 * GB, latency_s=5e-6),
    "nvlink4": LinkProfile("NVLink 4 (H100/H200)", 450 * GB, latency_s=5e-6),
})

# Which links a GPU of each kind sits on in an SXM (HGX/DGX) node.
_NODE_LINKS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "a100": ("pcie4", "nvlink3"), "h100": ("pcie5", "nvlink4"), "h200": ("pcie5", "nvlink4"),
})
_ALIASES: Mapping[str, str] = MappingProxyType({
    "a100-80gb": "a100", "a100-sxm": "a100", "h100-sxm": "h100", "h100-sxm5": "h100",
})
HOST_RAM_PER_GPU = 256 * GiB  # DGX A100/H100: 1-2 TiB for 8 GPUs


def hardware_names() -> list[str]:
    return sorted(DEVICES) + ["cpu-local"]


def node_profile(hardware: str, num_devices: int = 1, *, host_link: str | None = None,
                 peer_link: str | None = None, host_ram_gb: float | None = None,
                 profile_path: str | Path | None = None) -> NodeProfile:
    """Build a node of ``num_devices`` accelerators of kind ``hardware``.

    ``peer_link='none'`` models a node without NVLink. ``cpu-local`` (or a ``profile_path``)
    loads a calibrated JSON profile.
    """
    if num_devices < 1:
        raise ValueError("--num-devices must be >= 1")
    key = _ALIASES.get(hardware.lower(), hardware.lower())
    if key == "cpu-local" or profile_path is not None:
        return load_profile(profile_path or CPU_LOCAL_PATH, num_devices)
    if key not in DEVICES:
        raise ValueError(f"unknown hardware {hardware!r}; choose one of {hardware_names()}")
    default_host, default_peer = _NODE_LINKS[key]
    host = _link(host_link or default_host)
    peer = None if (peer_link or default_peer) == "none" else _link(peer_link or default_peer)
    ram = (host_ram_gb * GiB) if host_ram_gb is not None else HOST_RAM_PER_GPU * num_devices
    return NodeProfile(f"{num_devices}x {DEVICES[key].name}", DEVICES[key], num_devices,
                       host, peer, HostProfile("server CPU", ram))


def _link(name: str) -> LinkProfile:
    try:
        return LINKS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown link {name!r}; choose one of {sorted(LINKS)} or none") from None


# ---- calibrated profiles (JSON) -------------------------------------------------------------
def profile_to_json(node: NodeProfile, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON form ``load_profile`` reads (device, host link, host; plus free-form extras)."""
    return {"device": dataclasses.asdict(node.device),
            "host_link": dataclasses.asdict(node.host_link),
            "host": dataclasses.asdict(node.host),
            "simulate_with": {"attention_kernel": node.attention_kernel,
                              "attention_launch": node.attention_launch}, **(extra or {})}


def load_profile(path: str | Path, num_devices: int = 1) -> NodeProfile:
    """Read a profile written by ``alignedserve calibrate`` (or by hand, same keys)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"hardware profile {p} not found: run `alignedserve calibrate` first "
                         f"(or pass --hardware-profile PATH)")
    data = json.loads(p.read_text())
    try:
        device = DeviceProfile(**data["device"])
        link = LinkProfile(**data["host_link"])
        host = HostProfile(**data["host"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{p}: not a hardware profile ({exc})") from None
    # On one machine "peer devices" are more RAM: a copy between them is a memcpy.
    hints = data.get("simulate_with", {})
    return NodeProfile(f"{num_devices}x {device.name}", device, num_devices, link, link, host,
                       single_copy_queue=True,
                       attention_kernel=hints.get("attention_kernel", "split-kv"),
                       attention_launch=hints.get("attention_launch", "per-batch"))
