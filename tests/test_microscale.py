"""MXFP8 and NVFP4 encoders: the kernels' bits equal the plain-PyTorch reference on every
representable value and every tie, the reference uses PyTorch's own conversions where
PyTorch has them, NaN and infinity as documented, error bounds against the input."""
import math

import pytest
import torch
import triton
import triton.language as tl

from cases import nvfp4_global_scale_oracle
from kernels import microscale as kms
from moe_comm import microscale as ref


@triton.jit
def _elementwise(x, out, N: tl.int32, OP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    if OP == 0:
        tl.store(out + i, kms.e2m1_code(tl.load(x + i, mask=m, other=0.0)), mask=m)
    else:
        tl.store(out + i, kms.e4m3_value(tl.load(x + i, mask=m, other=0)), mask=m)


def _run(x: torch.Tensor, op: int, dtype) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=dtype)
    _elementwise[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), OP=op, BLOCK=256)
    return out


def _e2m1_probe() -> torch.Tensor:
    """Every e2m1 value, every midpoint (tie), one ulp either side of each, beyond the
    range, zeros, infinities, NaN; both signs."""
    vals = torch.tensor(ref.E2M1_VALUES)
    mids = (vals[1:] + vals[:-1]) / 2
    pts = torch.cat([vals, mids, torch.tensor([6.5, 7.0, 1e3, 3e38])])
    near = torch.cat([torch.nextafter(pts, torch.tensor(math.inf)),
                      torch.nextafter(pts, torch.tensor(-math.inf)).clamp(min=0)])
    pos = torch.cat([pts, near, torch.tensor([math.inf, 1e-30, 0.2])])
    return torch.cat([pos, -pos, torch.tensor([math.nan, -math.nan])]).float()


def test_e2m1_codes_every_value_and_tie():
    x = _e2m1_probe()
    got = _run(x, 0, torch.uint8)
    want = ref.e2m1_codes(x)
    assert torch.equal(got, want), [(v, g, w) for v, g, w in zip(x.tolist(), got.tolist(),
                                                                  want.tolist()) if g != w]
    # ties go to the even code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0,
    # 3.5 -> 4.0, 5.0 -> 4.0; beyond 6 saturates; NaN -> signed zero
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 100.0, math.inf, -5.0])
    values = ref.e2m1_values(_run(ties, 0, torch.uint8)).tolist()
    assert values == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -4.0]
    nan_codes = _run(torch.tensor([math.nan]), 0, torch.uint8)
    assert ref.e2m1_values(nan_codes).item() == 0.0
    # every code decodes to the value that encodes back to it
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(_run(ref.e2m1_values(codes), 0, torch.uint8)[codes != 8],
                       codes[codes != 8])   # -0.0 encodes as 8 too: sign kept


def test_e4m3_decode_matches_torch_on_all_codes():
    codes = torch.arange(256, dtype=torch.uint8)
    got = _run(codes, 1, torch.float32)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


def test_e8m0_codes_are_torch_conversions_of_the_scales():
    scales = torch.tensor([2.0 ** e for e in range(-127, 128)] + [math.inf])
    assert torch.equal(ref.e8m0_codes(scales), scales.to(torch.float8_e8m0fnu).view(torch.uint8))
    # the scale is the smallest power of two >= amax / 448 (no element saturates)
    assert ref.ue8m0_ceil(torch.tensor([0.75, 1.0, 1.25, 3.0])).tolist() == [1.0, 1.0, 2.0, 4.0]


def _adversarial(T: int, H: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((T, H), generator=g) * torch.logspace(-6, 6, T)[:, None]
    x[0] = 0.0                                       # an all-zero row
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 6)
    x[1, :min(48, H)] = ties[:H]                     # e2m1 ties (times the block scale)
    x[2, 5] = math.nan                               # a NaN block
    x[3, 7] = math.inf                               # a saturating block
    x[4, 9] = -math.inf
    x[5] = 448.0 * torch.linspace(-1, 1, H)          # the top of e4m3
    return x.to(dtype)


@pytest.mark.parametrize("H", [32, 96, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp8_kernel_equals_reference(H, dtype):
    x = _adversarial(24, H, seed=H, dtype=dtype)
    q, s = kms.quantize_mxfp8(x)
    rq, rs = ref.quantize_mxfp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.view(torch.uint8), rs.view(torch.uint8))
    deq = ref.dequantize_mxfp8(rq, rs)
    xf = x.float()
    blocks = xf.reshape(24, -1, 32)
    nan_block = blocks.isnan().any(-1) | blocks.isinf().any(-1)
    assert deq.reshape(24, -1, 32)[nan_block].isnan().all()      # NaN / inf blocks: NaN
    ok = ~nan_block[..., None].expand_as(blocks).reshape(24, H)
    scale = (rs.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    step = scale.repeat_interleave(32, dim=1)
    # normal e4m3: 2**-4 of the value; subnormal (below 2**-6 scale): 2**-10 scale
    bound = torch.maximum(xf.abs() * 2 ** -4, step * 2 ** -10)
    assert ((deq - xf).abs() <= bound)[ok].all()


@pytest.mark.parametrize("H", [16, 48, 256])
@pytest.mark.parametrize("given", [False, True])
def test_nvfp4_kernel_equals_reference(H, given):
    x = _adversarial(20, H, seed=7 * H)
    # the scale the kernel gets: given, or the documented one computed independently
    gs = torch.tensor([0.01]) if given else nvfp4_global_scale_oracle(x)
    q, s = kms.quantize_nvfp4(x, gs)
    rq, rs, rgs = ref.quantize_nvfp4(x, gs if given else None)
    assert torch.equal(rgs, gs)   # the reference's own scale is the documented one
    assert torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))
    assert q.shape == (20, H // 2) and s.shape == (20, H // 16)
    deq = ref.dequantize_nvfp4(rq, rs, rgs)
    xf = x.float()
    blocks = xf.reshape(20, -1, 16)
    nan_block = blocks.isnan().any(-1)
    assert deq.reshape(20, -1, 16)[nan_block].isnan().all()
    scale = rs.float().repeat_interleave(16, dim=1)
    sq = scale * rgs
    finite = torch.isfinite(xf) & ~nan_block.repeat_interleave(16, dim=1)
    if not given:
        # a block whose scale is a normal e4m3 number (>= 2**-6): within one e2m1 step at
        # its magnitude, i.e. s * global; a block within 2**-6 / 448 of the tensor's amax has
        # a subnormal or zero scale and may saturate: within |x| there
        err = (deq - xf).abs()
        bound = torch.where(scale >= 2 ** -6, sq, torch.maximum(sq, xf.abs()))
        assert (err <= bound * (1 + 1e-6))[finite].all()
        assert (scale >= 2 ** -6).float().mean() > 0.3          # the bound is not vacuous
    # an infinity saturates at +-6 s g (docs/FORMATS.md, "NVFP4"), its block's scale is finite
    inf = torch.isinf(xf) & ~nan_block.repeat_interleave(16, dim=1)
    assert inf.any() and torch.isfinite(scale[inf]).all()
    assert torch.equal(deq[inf], torch.sign(xf[inf]) * 6 * scale[inf] * rgs)
    if not given:   # the global scale ignores NaN and infinity
        assert rgs.item() == pytest.approx(xf[torch.isfinite(xf)].abs().max().item() / 2688)


def _global_scale_inputs():
    """Whole tensors at the edges of the global scale: zeros, tiny (below the 1e-4 floor, fp32
    subnormals), at the floor, only NaN / infinity, NaN and infinity beside finite values,
    huge, no rows."""
    tiny = torch.full((3, 32), 1e-30)
    tiny[1, 5] = -3e-41                                       # an fp32 subnormal
    mixed = torch.linspace(-2, 5, 64).reshape(2, 32)
    mixed[0, 3], mixed[1, 8] = math.nan, -math.inf
    return {"zeros": torch.zeros(4, 16), "tiny": tiny, "floor": torch.full((1, 16), 1e-4),
            "just_above_floor": torch.full((1, 16), 1.5e-4), "nan": torch.full((2, 16), math.nan),
            "inf": torch.full((2, 16), math.inf), "mixed": mixed,
            "huge": torch.full((1, 16), -3e38), "bf16": mixed.to(torch.bfloat16),
            "empty": torch.zeros(0, 48)}


@pytest.mark.parametrize("kind", sorted(_global_scale_inputs()))
def test_nvfp4_global_scale_against_an_independent_oracle(kind):
    x = _global_scale_inputs()[kind]
    want = nvfp4_global_scale_oracle(x)
    got = ref.nvfp4_global_scale(x)
    assert got.dtype == torch.float32 and got.shape == (1,)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (kind, got, want)
    if kind in ("zeros", "tiny", "floor", "nan", "inf", "empty"):   # the floor, exactly
        assert want.item() == torch.tensor(1e-4 / 2688, dtype=torch.float32).item()
    if x.numel():   # the kernel with that scale: every block of zeros and tinies is code 0
        q, s = kms.quantize_nvfp4(x, want)
        rq, rs, _ = ref.quantize_nvfp4(x)
        assert torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))
        if kind in ("zeros", "tiny"):
            assert not q.any() and not s.view(torch.uint8).any()


def test_nvfp4_bytes_per_row_and_global_scale_without_sync():
    x = torch.randn(4, 7168)
    q, s, gs = ref.quantize_nvfp4(x)
    row = q.shape[1] + s.shape[1]
    assert row == 7168 // 2 + 7168 // 16 == 4032 and row < 0.3 * 7168 * 2
    assert gs.shape == (1,) and gs.device == x.device


def test_swizzle_128x4_round_trip_and_layout():
    s = torch.arange(200 * 7, dtype=torch.int32).remainder(251).to(torch.uint8).reshape(200, 7)
    flat = ref.swizzle_128x4(s)
    assert flat.numel() == 2 * 2 * 512
    assert torch.equal(ref.unswizzle_128x4(flat, 200, 7), s)
    r, c = 77, 5            # row tile 0, column tile 1, r % 32 = 13, r // 32 = 2, c % 4 = 1
    assert flat[(0 * 2 + 1) * 512 + 13 * 16 + 2 * 4 + 1] == s[r, c]
    e8 = s.view(torch.float8_e8m0fnu)
    assert ref.swizzle_128x4(e8).dtype == torch.float8_e8m0fnu


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="H % 32"):
        ref.quantize_mxfp8(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="H % 16"):
        ref.quantize_nvfp4(torch.zeros(2, 24))
