"""What ``Buffer.warmup`` compiles against what later calls launch (run in a subprocess:
compiled kernels are recorded, not interpreted).

    python tests/warmup_jobs.py

Prints, as JSON, per setup (GPU flavours on the meta device, as the gate builds them): the
kernels of the calls a user makes later (fewer tokens than the Buffer's maximum, another
expert alignment, two calls for both parities, top-1) that ``warmup`` did not compile, for a
warm-up with the Buffer's top-k and one with top-1; and the kernels ``compile_ahead`` compiled
for sm_90 at the small size.
"""
from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402

from moe_comm import warmup  # noqa: E402
from moe_comm.kernels.recording import recording  # noqa: E402
from moe_comm.testing import gate, lockstep  # noqa: E402

SMALL = gate.CONFIGS[0]
ROUNDS = gate.GateConfig("small-rounds", 2, 8, 512, 2, 64, nvshmem=False, ring_slots=16)


def later_calls(bufs, cfg, K: int, fp8: bool) -> set:
    """(kernel, key) of two calls with 37 tokens and alignment 16, and their backward; or of
    the low-latency pair."""
    T, H, dt = 37, cfg.hidden, torch.bfloat16

    def meta(*shape, dtype):
        return [torch.empty(shape, dtype=dtype, device="meta") for _ in bufs]

    xs, idxs, ws = meta(T, H, dtype=dt), meta(T, K, dtype=torch.int64), meta(T, K,
                                                                               dtype=torch.float32)
    with recording(90) as rec:
        for _ in range(2):
            if bufs[0].layout.low_latency:
                recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=fp8)
                ys = [torch.empty(r.x.shape, dtype=dt, device="meta") for r in recvs]
                lockstep.low_latency_combine(bufs, ys, idxs, ws, [r.handle for r in recvs])
                continue
            res = lockstep.dispatch(bufs, xs, idxs, ws, 16, fp8=fp8, max_recv_rows=500)
            handles, ys = [r.handle for r in res], meta(500, H, dtype=dt)
            lockstep.combine(bufs, ys, handles, [r.weights for r in res])
            lockstep.dispatch_cached(bufs, xs, handles)
            lockstep.combine_with_pairs(bufs, ys, handles, meta(500, dtype=torch.float32))
    return {(launch.name, launch.key) for launch in rec}


def recorded_after_a_real_compile(bufs) -> dict:
    """What ``warmup.launches`` does in a process whose GPU already ran the same kernels: each
    kernel's cache for device 0 (Triton's, per device) is given a compiled kernel for every
    key, as after real calls, and must not be launched: ``{"recorded": n, "launched": [...]}``.
    """
    from triton.runtime import driver

    from moe_comm.kernels.recording import _StandInDriver

    launched = []

    class Compiled:  # what a real call left in the cache; any use of it is a launch
        def __getattr__(self, name):
            launched.append(name)
            raise RuntimeError(f"a compiled kernel was launched ({name})")

    class EveryKey(dict):
        def get(self, key, default=None):
            return Compiled()

    kernels = {id(launch.kernel): launch.kernel
               for launch in warmup.launches(bufs[0], SMALL.topk, False, True, 90)}
    previous = getattr(driver, "_active", None)
    driver.set_active(_StandInDriver(90))
    try:
        saved = {k: dict(fn.device_caches) for k, fn in kernels.items()}
        for fn in kernels.values():
            fn.device_caches[0] = (EveryKey(),) + tuple(fn.create_binder())[1:]
    finally:
        driver.set_active(previous)
    try:
        n = len(warmup.launches(bufs[0], SMALL.topk, False, True, 90))
    except RuntimeError as err:
        n = str(err)
    finally:
        for k, fn in kernels.items():
            fn.device_caches.clear()
            fn.device_caches.update(saved[k])
    return {"recorded": n, "launched": launched}


def main() -> None:
    out = {}
    setups = {"normal": (SMALL, False, 0, False), "normal-fp8": (SMALL, False, 0, True),
              "low-latency": (SMALL, True, 0, True), "proxy-flat": (SMALL, False, 2, False),
              "rounds": (ROUNDS, False, 0, False)}
    for name, (cfg, low_latency, transport, fp8) in setups.items():
        bufs = gate._buffers(cfg, torch.bfloat16, low_latency, transport, 90)
        row = {}
        for warm_k in (cfg.topk, 1):
            keys = {launch.key for launch in warmup.launches(bufs[0], warm_k, fp8, True, 90)}
            row[f"missing_after_warmup_k{warm_k}"] = {
                f"calls_k{k}": sorted(n for n, key in later_calls(bufs, cfg, k, fp8)
                                      if key not in keys) for k in (cfg.topk, 1)}
        out[name] = row
    bufs = gate._buffers(SMALL, torch.bfloat16, False, 0, 90)
    out["compiled"] = warmup.compile_ahead(bufs[0], arch=90)["variants"]
    out["after_a_real_compile"] = recorded_after_a_real_compile(bufs)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
