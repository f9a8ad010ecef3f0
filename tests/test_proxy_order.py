"""The proxy's ordering promise, which CPU ranks over a fast loopback transport never put to
the test: a notification posted without data (a fence: the low-latency mode's per-expert
signal after the per-pair rows it counts) goes out only once every transfer posted to that
peer before it is complete, fences to one peer in their posting order, whatever the order and
delay in which the transport completes transfers. Driven here by a transport that completes
them late and out of order (a stand-in for the NIXL agent, no thread, no process group)."""
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_comm.transport.nixl import _NOTIF, NixlProxy


class LateAgent:
    """Transfers stay in flight until :meth:`complete_one` ends a random one."""

    def __init__(self, rng: random.Random):
        self.rng, self.events, self.state, self.count = rng, [], {}, 0

    def get_xfer_descs(self, descs, kind):
        return descs

    def initialize_xfer(self, op, local, remote, name, notif):
        self.count += 1
        self.state[self.count] = "PROC"
        self.events.append(("post", self.count, name))
        return self.count

    def transfer(self, handle):
        return "PROC"

    def check_xfer_state(self, handle):
        return self.state[handle]

    def release_xfer_handle(self, handle):
        pass

    def send_notif(self, name, notif):
        self.events.append(("fence", _NOTIF.unpack(notif)[1], name))

    def complete_one(self) -> bool:
        running = [h for h, s in self.state.items() if s == "PROC"]
        if not running:
            return False
        h = self.rng.choice(running)
        self.state[h] = "DONE"
        self.events.append(("done", h, None))
        return True


def _proxy(agent) -> NixlProxy:
    proxy = NixlProxy.__new__(NixlProxy)  # the thread's state only: no agent, no group
    proxy.__dict__.update(
        rank=0, lost={}, tolerant=False, failure=None, timeout_s=600.0, transfer_seconds=0.0,
        _agent=agent, _peer_name={1: "one", 2: "two"}, _peer_base={1: 0, 2: 0},
        _peer_device={1: -1, 2: -1}, _memory=SimpleNamespace(device_id=-1, kind="DRAM"),
        _segment=torch.zeros(1 << 12, dtype=torch.uint8), _labels={},
        _bytes={"other": np.zeros(3, dtype=np.int64)}, messages_to=np.zeros(3, np.int64),
        _inflight=[], _posted=0, _fenced=[])
    return proxy


@pytest.mark.parametrize("seed", range(6))
def test_a_fence_waits_for_every_earlier_transfer_to_its_peer(seed):
    rng = random.Random(seed)
    agent = LateAgent(rng)
    proxy = _proxy(agent)
    posted = {"one": [], "two": []}  # per peer, in posting order: ("rows", handle) / ("fence", v)
    for value in range(1, 120):
        peer = rng.choice((1, 2))
        name = proxy._peer_name[peer]
        if rng.random() < 0.3:
            proxy._post(peer, 8, value, [])  # a signal alone, fenced
            posted[name].append(("fence", value))
        else:
            proxy._post(peer, 8, value, [(0, 64, 64, 64, rng.randint(1, 3))])
            posted[name].append(("rows", agent.count))
        for _ in range(rng.randint(0, 2)):  # the transport completes late, in any order
            agent.complete_one()
            proxy._complete()
            proxy._send_fenced()
    while agent.complete_one():
        proxy._complete()
        proxy._send_fenced()
    proxy._complete()
    proxy._send_fenced()
    assert proxy.failure is None and not proxy._fenced and not proxy._inflight
    when = {(e[0], e[1]): i for i, e in enumerate(agent.events)}
    for name, items in posted.items():
        fences = [v for kind, v in items if kind == "fence"]
        sent = [e[1] for e in agent.events if e[0] == "fence" and e[2] == name]
        assert sent == fences, name  # every fence sent once, in posting order
        for i, (kind, v) in enumerate(items):
            if kind != "fence":
                continue
            for earlier_kind, h in items[:i]:
                if earlier_kind == "rows":
                    assert when[("done", h)] < when[("fence", v)], (name, v, h)
