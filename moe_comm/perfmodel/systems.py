"""Hardware descriptions the performance model reads: one `System` per machine type.

Every number is per GPU unless its name says otherwise. Units are in the names: `_GBps` is
1e9 bytes per second, `_Gbps` is 1e9 bits per second (network line rates are quoted that way),
`_us` is microseconds, `_Mpps` is 1e6 messages per second. Each preset number carries a
comment naming the datasheet or paper it comes from; numbers that no datasheet gives are
marked "estimate" and explained in docs/PERFMODEL.md.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

GB = 1e9  # one definition of GB for the whole model

TOPOLOGIES = ("rail-optimized", "fat-tree")


@dataclass(frozen=True)
class System:
    """One machine type: a GPU, its NVLink domain, its NIC and the fabric between nodes.

    Use a preset (`SYSTEMS["h800"]`) or build one; `dataclasses.replace(SYSTEMS["h100"],
    nic_Gbps=800)` derives a variant. All bandwidths are per GPU and per direction.
    """

    name: str
    # --- scale-up: NVLink through NVSwitch ---
    nvlink_peak_GBps: float        # datasheet NVLink bandwidth per GPU, one direction
    nvlink_domain_size: int        # GPUs that reach each other over NVLink
    nvlink_latency_us: float       # store on one GPU -> flag seen by the peer (estimate)
    # fraction of nvlink_peak_GBps a peer-to-peer copy reaches (link protocol overhead); the
    # default 0.8 is H800's measured 160 GB/s over its 200 GB/s datasheet peak
    nvlink_efficiency: float = 0.8
    # --- scale-out: NIC, PCIe path to it, fabric ---
    nic_Gbps: float = 400.0        # NIC line rate per GPU (all ports the GPU owns)
    nic_message_rate_Mpps: float = 330.0   # RDMA writes the NIC issues (or absorbs) per second
    rdma_latency_us: float = 3.0   # GPU-initiated put to remote GPU memory, one switch (estimate)
    rdma_mtu_bytes: int = 4096     # InfiniBand MTU
    rdma_header_bytes_per_packet: int = 26  # LRH 8 + BTH 12 + ICRC 4 + VCRC 2 (IBTA spec)
    rdma_header_bytes_per_message: int = 16  # RETH, first packet of an RDMA write (IBTA spec)
    rdma_wqe_bytes: int = 64       # work-queue entry the NIC fetches over PCIe per message
    pcie_GBps: float = 63.0        # GPU<->NIC PCIe, per direction, after line encoding
    pcie_max_payload_bytes: int = 256  # PCIe max payload size of one TLP
    pcie_tlp_overhead_bytes: int = 24  # framing 4 + header 16 + LCRC 4 (PCIe base spec)
    topology: str = "rail-optimized"  # "rail-optimized" or "fat-tree"
    switch_radix: int = 64         # ports per switch
    tiers: int = 2                 # switch tiers the fabric is built with
    planes: int = 1                # disjoint fabrics; GPU i of a node sits on plane i % planes
    oversubscription: float = 1.0  # leaf downlink : uplink bandwidth (1.0 = non-blocking)
    switch_latency_us: float = 0.3  # per switch hop, cut-through, with cables (estimate)
    # --- the GPU itself ---
    hbm_GBps: float = 3350.0       # device memory bandwidth (reads + writes)
    num_sms: int = 132
    sm_clock_GHz: float = 1.98
    sm_copy_bytes_per_clk: float = 32.0   # bytes one SM moves per clock in a copy (estimate)
    sm_messages_per_us: float = 16.0      # RDMA puts one SM can post per microsecond (estimate)

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"System {self.name!r}: topology must be one of {TOPOLOGIES}, "
                             f"got {self.topology!r}")
        positive = ("nvlink_peak_GBps", "nvlink_domain_size", "nic_Gbps", "nic_message_rate_Mpps",
                    "rdma_mtu_bytes", "pcie_GBps", "pcie_max_payload_bytes", "switch_radix",
                    "tiers", "planes", "hbm_GBps", "num_sms", "sm_clock_GHz",
                    "sm_copy_bytes_per_clk", "sm_messages_per_us")
        for field in positive:
            if not getattr(self, field) > 0:
                raise ValueError(f"System {self.name!r}: {field} must be > 0, "
                                 f"got {getattr(self, field)!r}")
        if not 0 < self.nvlink_efficiency <= 1:
            raise ValueError(f"System {self.name!r}: nvlink_efficiency must be in (0, 1]")
        if self.oversubscription < 1:
            raise ValueError(f"System {self.name!r}: oversubscription must be >= 1")
        if self.switch_radix < 2:
            raise ValueError(f"System {self.name!r}: switch_radix must be >= 2")

    # Derived rates, all per GPU and per direction.
    @property
    def nvlink_GBps(self) -> float:
        """NVLink bandwidth a peer-to-peer copy reaches: peak x link efficiency."""
        return self.nvlink_peak_GBps * self.nvlink_efficiency

    @property
    def nic_GBps(self) -> float:
        """NIC line rate in bytes: nic_Gbps / 8."""
        return self.nic_Gbps / 8.0

    @property
    def sm_copy_GBps(self) -> float:
        """Bytes per second one SM moves in a copy loop."""
        return self.sm_copy_bytes_per_clk * self.sm_clock_GHz

    def replace(self, **changes) -> System:
        """A copy with some fields changed (a thin wrapper over dataclasses.replace)."""
        return dataclasses.replace(self, **changes)


# Sources, abbreviated in the comments below:
#   [H100-DS]   NVIDIA H100 Tensor Core GPU datasheet (SXM5: 132 SMs, 3.35 TB/s HBM3,
#               NVLink 900 GB/s bidirectional; H800 SXM5 is the same GH100 part with
#               NVLink cut to 400 GB/s bidirectional, NVIDIA H800 product brief).
#   [H200-DS]   NVIDIA H200 Tensor Core GPU datasheet (4.8 TB/s HBM3e, NVLink 900 GB/s).
#   [DGXB200]   NVIDIA DGX B200 datasheet / BasePOD reference architecture (8x B200, NVLink 5
#               1.8 TB/s bidirectional per GPU, 8x single-port ConnectX-7 400 Gb/s).
#   [GB200]     NVIDIA GB200 NVL72 spec and DGX GB200 user guide (72 GPUs in one NVLink
#               domain, 1.8 TB/s bidirectional NVLink per GPU, 8 TB/s HBM3e per GPU,
#               one 400 Gb/s ConnectX-7 per GPU for the compute fabric).
#   [B200-SM]   Blackwell B200: 2 dies x 74 enabled SMs = 148 SMs (public microbenchmark
#               write-ups of B200; NVIDIA does not list the count in the datasheet).
#   [CX7]       NVIDIA ConnectX-7 user manual / product brief: NDR 400 Gb/s per port, PCIe Gen5
#               x16 host interface, message rate "up to 330-370 million messages/s"
#               (the lower figure is used).
#   [PCIe5]     PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b encoding -> 63.0 GB/s per direction.
#   [QM9700]    NVIDIA Quantum-2 QM9700: 64 ports of NDR 400 Gb/s per switch.
#   [DeepEP]    DeepEP README: H800 NVLink "~160 GB/s" measured per direction, one CX7
#               400 Gb/s NIC per GPU.
#   [GB300]     NVIDIA GB300 NVL72 / HGX B300 specifications: 72 (or 8) Blackwell Ultra GPUs per
#               NVLink domain, NVLink 5 at 1.8 TB/s bidirectional per GPU, 8 TB/s HBM3e, one
#               ConnectX-8 SuperNIC at 800 Gb/s per GPU.
#   [CX8]       NVIDIA ConnectX-8 SuperNIC product brief: 800 Gb/s per GPU, PCIe Gen6 x16 host
#               interface (64 GT/s x 16, ~121 GB/s per direction after FLIT overhead),
#               multi-plane operation (the 800 Gb/s split into planes on separate switches).
#   [ROADMAP]   NVIDIA's public roadmap for Rubin Ultra "NVL576": 576 GPUs in one NVLink domain,
#               NVLink 7, ConnectX-9 at 1.6 Tb/s. No datasheet yet: every number of that
#               preset is an assumption and says so.
_HOPPER_GPU: dict[str, Any] = {"num_sms": 132,            # [H100-DS] 132 SMs
               "sm_clock_GHz": 1.98}      # [H100-DS] 1.98 GHz boost
_BLACKWELL_GPU: dict[str, Any] = {"num_sms": 148,         # [B200-SM] 148 SMs
                  "sm_clock_GHz": 1.965}  # boost clock (estimate)
_BLACKWELL_ULTRA_GPU: dict[str, Any] = {"num_sms": 160,   # assumption: 2 dies x 80 SMs
                         "sm_clock_GHz": 1.965}            # estimate, as Blackwell
_XDR800_FABRIC: dict[str, Any] = {"nic_Gbps": 800.0,       # [CX8] 800 Gb/s per GPU
                  "nic_message_rate_Mpps": 660.0,  # assumption: twice CX7's rate
                  "pcie_GBps": 121.0,              # [CX8] PCIe Gen6 x16
                  "topology": "rail-optimized",
                  "switch_radix": 144, "tiers": 2}  # assumption: 144-port 800G switches
_NDR_FABRIC: dict[str, Any] = {"nic_Gbps": 400.0,                 # [CX7] one NDR port per GPU
               "nic_message_rate_Mpps": 330.0,    # [CX7] 330-370 M msg/s
               "pcie_GBps": 63.0,                 # [PCIe5] Gen5 x16 NIC slot
               "topology": "rail-optimized",      # SuperPOD-style rails
               "switch_radix": 64, "tiers": 2}    # [QM9700] 64-port leaves and spines

SYSTEMS: dict[str, System] = {
    "h800": System(
        name="h800",
        nvlink_peak_GBps=200.0,     # [H100-DS] H800 SXM5: 400 GB/s bidirectional NVLink
        nvlink_efficiency=0.8,      # [DeepEP] measured ~160 GB/s of the 200 GB/s peak
        nvlink_domain_size=8,       # HGX H800 8-GPU baseboard
        nvlink_latency_us=1.0,      # estimate: NVSwitch store + flag round of polling
        hbm_GBps=3350.0,            # [H100-DS] H800 SXM5 shares H100 SXM5 HBM3, 3.35 TB/s
        **_HOPPER_GPU, **_NDR_FABRIC),
    "h100": System(
        name="h100",
        nvlink_peak_GBps=450.0,     # [H100-DS] 900 GB/s bidirectional
        nvlink_domain_size=8,       # HGX H100 8-GPU baseboard
        nvlink_latency_us=1.0,
        hbm_GBps=3350.0,            # [H100-DS]
        **_HOPPER_GPU, **_NDR_FABRIC),
    "h200": System(
        name="h200",
        nvlink_peak_GBps=450.0,     # [H200-DS] 900 GB/s bidirectional
        nvlink_domain_size=8,       # HGX H200 8-GPU baseboard
        nvlink_latency_us=1.0,
        hbm_GBps=4800.0,            # [H200-DS] 4.8 TB/s HBM3e
        **_HOPPER_GPU, **_NDR_FABRIC),
    "b200": System(
        name="b200",
        nvlink_peak_GBps=900.0,     # [DGXB200] NVLink 5, 1.8 TB/s bidirectional
        nvlink_domain_size=8,       # [DGXB200] 8 GPUs per NVLink domain
        nvlink_latency_us=1.0,
        hbm_GBps=8000.0,            # [DGXB200] 8 TB/s HBM3e per GPU
        **_BLACKWELL_GPU, **_NDR_FABRIC),   # [DGXB200] ConnectX-7 400 Gb/s per GPU
    "gb200-nvl72": System(
        name="gb200-nvl72",
        nvlink_peak_GBps=900.0,     # [GB200] 1.8 TB/s bidirectional = 900 GB/s per direction
        nvlink_domain_size=72,      # [GB200] 72 GPUs in one NVLink domain
        nvlink_latency_us=1.5,      # estimate: two NVSwitch-tray hops of cable in the rack
        hbm_GBps=8000.0,            # [GB200] 8 TB/s per GPU
        **_BLACKWELL_GPU, **_NDR_FABRIC),   # [GB200] ConnectX-7 400 Gb/s per GPU
    "b300": System(
        name="b300",
        nvlink_peak_GBps=900.0,     # [GB300] NVLink 5
        nvlink_domain_size=8,       # HGX B300 baseboard
        nvlink_latency_us=1.0,
        hbm_GBps=8000.0,            # [GB300]
        **_BLACKWELL_ULTRA_GPU, **_XDR800_FABRIC),
    "gb300-nvl72": System(
        name="gb300-nvl72",
        nvlink_peak_GBps=900.0,     # [GB300] 1.8 TB/s bidirectional
        nvlink_domain_size=72,      # [GB300]
        nvlink_latency_us=1.5,      # estimate, as GB200 NVL72
        hbm_GBps=8000.0,            # [GB300]
        **_BLACKWELL_ULTRA_GPU, **_XDR800_FABRIC),
    "gb300-nvl72-2plane": System(
        name="gb300-nvl72-2plane",
        nvlink_peak_GBps=900.0, nvlink_domain_size=72, nvlink_latency_us=1.5, hbm_GBps=8000.0,
        planes=2,                   # assumption: GPUs alternate between two disjoint planes
        #                             (plane = local index mod 2), each built of 64-port
        #                             switches: fewer tiers, an NVLink relay across planes
        **_BLACKWELL_ULTRA_GPU, **{**_XDR800_FABRIC, "switch_radix": 64}),
    "nvl576": System(
        name="nvl576",
        nvlink_peak_GBps=1800.0,    # [ROADMAP] assumption: NVLink 7, 3.6 TB/s bidirectional
        nvlink_domain_size=576,     # [ROADMAP]
        nvlink_latency_us=2.0,      # assumption: one more switch level than NVL72
        hbm_GBps=16000.0,           # assumption: HBM4e
        num_sms=224, sm_clock_GHz=2.0,  # assumption
        nic_Gbps=1600.0,            # [ROADMAP] ConnectX-9 1.6 Tb/s
        nic_message_rate_Mpps=1320.0,   # assumption: four times CX7
        pcie_GBps=242.0,            # assumption: PCIe Gen7-class x16 or an on-package link
        topology="rail-optimized", switch_radix=144, tiers=2),   # assumption
}


def with_nic(system: str | System, nic_Gbps: float, planes: int | None = None) -> System:
    """`system` with another NIC line rate per GPU (400, 800, 1600 Gb/s ...): the message rate
    and the PCIe link scale with it (a faster NIC comes with a matching host link), and
    optionally split into `planes` disjoint fabrics."""
    s = get_system(system)
    scale = nic_Gbps / s.nic_Gbps
    return s.replace(name=f"{s.name}@{nic_Gbps:g}G" + (f"x{planes}p" if planes else ""),
                     nic_Gbps=nic_Gbps, nic_message_rate_Mpps=s.nic_message_rate_Mpps * scale,
                     pcie_GBps=max(s.pcie_GBps, s.pcie_GBps * scale),
                     planes=planes or s.planes)


def get_system(system: str | System) -> System:
    """The `System` for a preset name (case-insensitive) or the instance itself."""
    if isinstance(system, System):
        return system
    if isinstance(system, str):
        key = system.strip().lower()
        if key in SYSTEMS:
            return SYSTEMS[key]
        raise ValueError(f"unknown system {system!r}; presets are {sorted(SYSTEMS)} "
                         "(or pass a moe_comm.perfmodel.System instance)")
    raise TypeError(f"system must be a preset name or a System, got {type(system).__name__}")
