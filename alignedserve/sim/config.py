"""What one simulation runs on: model, node, kernel, scheduler limits, topology, KV budgets.

Two topologies of an N-device node:

* ``staging`` (the engine's own semantics): one engine; ``dev0`` holds the weights and
  computes, ``dev1..`` are KV tiers that stage batches for it (GPU-Prefetch-For-GPU);
* ``dp``: N data-parallel replicas, each a separate engine (own scheduler, one device,
  1/N of the host budget), on ``nodes`` identical nodes; requests dispatched round-robin, to
  the fewest in flight, or by the served replica router (``kv``, ``kv+length``).

KV budgets default to what a serving engine would get: device memory less the reserved
fraction, less the weights on the compute device; half the host RAM for the host tier.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from alignedserve.config import SchedulerConfig
from alignedserve.sim.costmodel import AttentionKernel, AttentionLaunch, CostModel
from alignedserve.sim.hardware import GiB, NodeProfile
from alignedserve.sim.models import ModelProfile

TOPOLOGIES = ("staging", "dp")
# kv / kv+length: the served router's decision (cluster/routing.py) on exact replica state
DISPATCH = ("round-robin", "least-loaded", "kv", "kv+length")
HOST_KV_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything but the policy and the workload.

    ``device_kv_gb`` / ``host_kv_gb``: explicit budgets (per device / whole host) instead of
    the derived ones. ``prefetch_link_tokens``: None derives it (see ``link_tokens_per_step``),
    0 means unlimited, as in ``SchedulerConfig``. ``plugin_admission``: the vLLM plug-in's
    admission lever, for the ``vllm-plugin`` policy (``sim/plugin_policy.py``).
    """

    model: ModelProfile
    node: NodeProfile
    kernel: AttentionKernel = AttentionKernel.SPLIT_KV
    launch: AttentionLaunch = AttentionLaunch.PER_BATCH
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    topology: str = "staging"
    dispatch: str = "round-robin"
    device_kv_gb: float | None = None
    host_kv_gb: float | None = None
    prefetch_link_tokens: int | None = None
    plugin_admission: bool = False
    record_itl: bool = False
    step_samples: int = 3000
    nodes: int = 1  # dp: identical nodes, one replica per device on each

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel", AttentionKernel(self.kernel))  # accept names
        object.__setattr__(self, "launch", AttentionLaunch(self.launch))
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if self.dispatch not in DISPATCH:
            raise ValueError(f"dispatch must be one of {DISPATCH}, got {self.dispatch!r}")
        if self.nodes < 1 or (self.nodes > 1 and self.topology != "dp"):
            raise ValueError("nodes must be >= 1, and more than one only with topology dp")

    @property
    def replicas(self) -> int:
        return self.nodes * self.node.num_devices if self.topology == "dp" else 1

    @property
    def devices_per_replica(self) -> int:
        return 1 if self.topology == "dp" else self.node.num_devices

    def cost_model(self) -> CostModel:
        return CostModel(self.model, self.node.device, self.node.host, self.kernel, self.launch)

    def device_kv_bytes(self) -> list[int]:
        """KV budget of each device tier of one replica (``dev0`` first)."""
        dev = self.node.device
        usable = dev.mem_bytes * (1 - dev.reserved_fraction)
        if self.device_kv_gb is not None:
            compute = staging = self.device_kv_gb * GiB
        else:
            compute, staging = usable - self.model.weight_bytes, usable
        if compute <= 0:
            raise ValueError(f"{self.model.name} ({self.model.weight_bytes / GiB:.1f} GiB of "
                             f"weights) does not fit on {dev.name}")
        return [int(compute)] + [int(staging)] * (self.devices_per_replica - 1)

    def host_kv_bytes(self) -> int:
        """Host-tier KV budget of one replica."""
        if self.host_kv_gb is not None:
            total = self.host_kv_gb * GiB
        else:
            total = self.node.host.ram_bytes * HOST_KV_FRACTION
        return int(total * self.nodes / self.replicas)  # each node's host RAM, shared

    def scheduler_config(self) -> SchedulerConfig:
        tokens = self.prefetch_link_tokens
        if tokens is None:  # a real link has a finite budget: it also caps the host pool
            tokens = self.link_tokens_per_step()
        return dataclasses.replace(self.scheduler, prefetch_link_tokens=tokens)

    def link_tokens_per_step(self) -> int:
        """KV tokens one host link carries during a typical full decode step.

        The step is estimated as one pass over the compute device's whole KV budget plus the
        linear layers at ``max_num_seqs`` rows: the step length the prefetch must hide under.
        """
        cost = self.cost_model()
        kv = self.device_kv_bytes()[0]
        step_s = kv / self.node.device.attn_bandwidth + cost.linear_s(self.scheduler.max_num_seqs)
        return max(1, int(self.node.host_link.rate * step_s / self.model.kv_bytes_per_token))
