"""A Buffer's plan: what it decides once, from its arguments and where its ranks run, before
any memory exists; every later step reads it and nothing decides it again.

* topology: the nodes, the transport between them, hierarchical or flat (forwarders), the
  NVSHMEM outboxes (``rdma``);
* staging: the ring slots per source and the rounds of a call (``moe_comm.rings``: on GPUs a
  ring of several rounds is cut to what one launch runs a round of), and every region of the
  workspace (``layout``, a ``workspace.WorkspaceLayout``);
* programs: ``num_sms``, the normal mode's persistent grids on GPUs;
* formats: per format, whether a call's rounds run in one launch per op
  (:meth:`BufferPlan.with_one_launch`, once the Buffer's flavour is known).

Equivalent to what ``Buffer(...)`` decides::

    plan = resolve(R, H, E, T, dtype, K, ranks_per_node=N, transport="nixl")
    plan.layout.nbytes                    # Buffer.required_workspace_bytes
    plan.layout.hierarchical, plan.layout.ring_slots, plan.layout.rounds, plan.num_sms
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

import torch

from .call_descriptor import MAX_TOPK
from .kernels.comm import SLOT_BITS, Flavour
from .rings import (
    COMBINE_FORMATS,
    DEFAULT_GPU_SMS,
    checked_num_sms,
    dispatch_formats,
    one_launch_fits,
    one_launch_sms,
    staging_ring_slots,
)
from .validation import FLOAT_DTYPES
from .workspace import WorkspaceLayout


@dataclasses.dataclass(frozen=True)
class BufferPlan:
    """``layout``: the workspace, its rings and nodes; ``num_experts``; ``transport`` between
    nodes (``"nixl"``: the proxy, ``"nvshmem"``: puts, None: one node); ``num_sms``: programs
    of the normal mode's persistent launches on GPUs (None on CPU ranks: one program);
    ``dispatch_in_one_launch[fp8, ue8m0, elem]`` and ``combine_in_one_launch[fp8, pair]``:
    whether a call of several rounds in that format runs them in one launch per op (empty
    until :meth:`with_one_launch`)."""

    layout: WorkspaceLayout
    num_experts: int
    transport: str | None = None
    num_sms: int | None = None
    dispatch_in_one_launch: Mapping = dataclasses.field(default_factory=dict)
    combine_in_one_launch: Mapping = dataclasses.field(default_factory=dict)

    def with_one_launch(self, flavour: Flavour, own_process: bool, proxy: bool,
                        ep_invariant: bool) -> BufferPlan:
        """This plan with its one-launch tables for ``flavour`` (``rings.one_launch_fits``):
        a combine's rounds in one launch (``kernels.combine_rounds``; EP-invariant:
        ``kernels.invariant_rounds``) and a dispatch's rounds after its first send
        (``kernels.dispatch_rounds``), for a format whose round fits the launch's programs,
        where the ranks run in processes of their own, a call has several rounds, its waits
        run in the kernels, and every peer is reached by stores (fault tolerance too: one
        program decides each round's sources, ``kernels.comm.wait_or_exclude_once``), by
        NVSHMEM puts across hosts (no fault tolerance, no EP-invariant combine there), or
        through the proxy, flat (fault tolerance too) or hierarchical (each round's node
        messages and forwarder pass in the launch; the EP-invariant combine has none).
        Elsewhere no format does: every round launches its own kernels."""
        layout = self.layout
        elem = torch.empty((), dtype=layout.dtype).element_size()
        rounds_in_kernels = own_process and layout.rounds > 1 and flavour.device_wait
        by_puts = flavour.transport in (0, 1) and not proxy
        if rounds_in_kernels and (by_puts or proxy):
            dispatch, combine = one_launch_fits(
                layout.ring_slots, layout.world_size, layout.hidden, layout.max_topk, elem,
                self.num_sms, flavour, ep_invariant)
        else:
            dispatch = dict.fromkeys(dispatch_formats(elem), False)
            combine = dict.fromkeys(COMBINE_FORMATS, False)
        return dataclasses.replace(self, dispatch_in_one_launch=types.MappingProxyType(dispatch),
                                   combine_in_one_launch=types.MappingProxyType(combine))


def resolve(world_size: int, hidden: int, num_experts: int, max_tokens: int,
            dtype: torch.dtype, max_topk: int, *, low_latency: bool = False,
            ranks_per_node: int | None = None, transport: str | None = None,
            hierarchical: bool | None = None, fault_tolerant: bool = False,
            ep_invariant: bool = False, kernel_impl: str = "auto",
            staging_bytes: int | None = None, device_type: str = "cpu",
            num_sms: int | None = None, own_process: bool = True) -> BufferPlan:
    """The plan of a Buffer with these arguments (checked: ValueError) on ``world_size //
    ranks_per_node`` nodes (None: one) joined by ``transport`` (``transport.choose_transport``'s
    choice; None on one node), on ``device_type``. ``hierarchical`` None: across nodes unless
    fault-tolerant or EP-invariant. ``own_process``: each rank drives its Buffer from a
    process of its own (virtual ranks of one process never cut their ring)."""
    num_sms = checked_num_sms(num_sms)
    N = world_size if ranks_per_node is None else ranks_per_node
    nodes = world_size // N
    transport = transport if nodes > 1 else None
    if hierarchical is None:  # fault tolerance, ep_invariant across nodes: flat
        hierarchical = nodes > 1 and not fault_tolerant and not ep_invariant
    hierarchical = bool(hierarchical)
    if fault_tolerant and nodes > 1 and (transport != "nixl" or hierarchical):
        raise ValueError("fault_tolerant=True across nodes runs through the proxy "
                         "(transport='nixl') in flat mode (hierarchical=False: a dead "
                         "forwarder would cut off its whole node) so far")
    check_ep_invariant(ep_invariant, nodes, kernel_impl, low_latency, transport, hierarchical)
    # the normal mode's invariant regions: one node, or through the proxy
    invariant = ep_invariant and (nodes == 1 or transport == "nixl")
    # NVSHMEM puts to the ranks of other nodes (through the proxy, its outboxes instead; on
    # CPU ranks the interpreter's copies into mappings no kernel has a pointer to)
    rdma = nodes > 1 and transport == "nvshmem"
    proxy = transport == "nixl"
    forwarders = proxy and hierarchical and nodes > 1
    cut = one_launch_sms(device_type, proxy, num_sms) if own_process else None
    ring_slots = staging_ring_slots(
        staging_bytes, world_size, max_tokens, hidden, max_topk, dtype, outboxes=proxy,
        ranks_per_node=N if forwarders else None, rdma=rdma, invariant=invariant,
        one_launch_sms=cut)
    layout = WorkspaceLayout(world_size, max_tokens, hidden, num_experts // world_size,
                             max_topk, dtype, low_latency, rdma=rdma, ranks_per_node=N,
                             proxy=proxy, hierarchical=hierarchical, ring_slots=ring_slots,
                             invariant=invariant)
    if num_sms is None and device_type == "cuda":
        num_sms = DEFAULT_GPU_SMS
    return BufferPlan(layout, num_experts, transport, num_sms)


def check_config(world_size: int, hidden, num_experts, max_tokens_per_rank, dtype, max_topk,
                 dispatch_dtype=None) -> None:
    """A Buffer's sizes and dtypes, each a clear error (ValueError, TypeError)."""
    for name, v in (("world_size", world_size), ("hidden", hidden), ("num_experts", num_experts),
                    ("max_tokens_per_rank", max_tokens_per_rank), ("max_topk", max_topk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by the world size "
                         f"{world_size}; expert e lives on rank e // (num_experts // world_size)")
    if max_topk > num_experts:
        raise ValueError(f"max_topk={max_topk} exceeds num_experts={num_experts}")
    if max_tokens_per_rank >= 1 << SLOT_BITS.value or max_topk > MAX_TOPK:  # (call_descriptor)
        raise ValueError(f"max_tokens_per_rank must be < {1 << SLOT_BITS.value} and max_topk <= "
                         f"{MAX_TOPK} (a dispatch's counts word holds the slots and its call "
                         f"descriptor), got {max_tokens_per_rank} and {max_topk}")
    if dispatch_dtype not in (None, dtype, torch.float8_e4m3fn):
        raise TypeError(f"dispatch_dtype must be None, {dtype} or torch.float8_e4m3fn, "
                        f"got {dispatch_dtype}")
    if dispatch_dtype == torch.float8_e4m3fn and (hidden % 128 or dtype == torch.float64):
        raise ValueError("FP8 dispatch needs hidden % 128 == 0 and a 16- or 32-bit dtype, got "
                         f"hidden={hidden}, dtype={dtype}")


def check_ep_invariant(ep_invariant, num_nodes: int, kernel_impl: str,
                       low_latency: bool = False, via: str | None = "nixl",
                       hierarchical: bool = False) -> None:
    """``ep_invariant=True`` runs on the Triton kernels; across nodes the normal mode's
    invariant combine runs through the proxy (each (token, choice) row goes to its home by a
    descriptor of its own, flat or hierarchical: the dispatch keeps its forwarders, the combine
    none), and the low-latency mode's over every transport."""
    if not isinstance(ep_invariant, bool):
        raise ValueError(f"ep_invariant must be a bool, got {ep_invariant!r}")
    if ep_invariant and num_nodes > 1 and not low_latency:
        if via != "nixl":
            raise ValueError("ep_invariant=True across nodes runs the normal mode through the "
                             "proxy (transport='nixl') so far, or the low-latency mode "
                             "(low_latency=True) over any transport: no NVSHMEM put moves the "
                             f"invariant combine's rows yet ({num_nodes} nodes asked for)")
    if ep_invariant and kernel_impl == "cuda":
        raise ValueError("ep_invariant=True runs the Triton kernels: kernel_impl='cuda' "
                         "(csrc/) sums with fused multiply-adds")
