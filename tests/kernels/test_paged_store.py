"""store_kv / compute_kv_scales / allocate_cache against the float64 references.

Stores are compared bit for bit: the kernel rounds with integer arithmetic (round
to nearest even, saturating), so there is no tolerance to state.
"""

from __future__ import annotations

import pytest
import torch

from kvpolicy.kernels.paged_store import allocate_cache, compute_kv_scales, store_kv
from kvpolicy.kernels.reference import quantize_fp8, ref_store_kv

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS = 6, 16, 3


def _poisoned_caches(dtype_name: str, head_dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Caches full of NaN, so an untouched slot stays recognisable and a stray write shows."""
    k, v = allocate_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_dim, dtype_name, device)
    for c in (k, v):
        if c.dtype == torch.float8_e4m3fn:
            c.view(torch.uint8).fill_(0x7F)
        else:
            c.fill_(float("nan"))
    return k, v


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def _slots(num_tokens: int, device: str) -> torch.Tensor:
    """Scattered slots, with every third token skipped (negative slot)."""
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:num_tokens]
    slots[::3] = -1
    return slots.to(device)


def _store_and_compare(key, value, dtype_name, slots, k_scale=None, v_scale=None) -> torch.Tensor:
    head_dim = key.shape[-1]
    kc, vc = _poisoned_caches(dtype_name, head_dim, key.device.type)
    rk, rv = kc.clone(), vc.clone()
    store_kv(key, value, kc, vc, slots, k_scale, v_scale)
    ref_store_kv(key, value, rk, rv, slots, k_scale, v_scale)
    assert torch.equal(_bits(kc), _bits(rk))
    assert torch.equal(_bits(vc), _bits(rv))
    return kc


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_store_bf16_bit_exact(device: str, head_dim: int, src_dtype: torch.dtype) -> None:
    n = 21
    key = torch.randn(n, NUM_KV_HEADS, head_dim, device=device).to(src_dtype)
    value = torch.randn(n, NUM_KV_HEADS, head_dim, device=device).to(src_dtype)
    kc = _store_and_compare(key, value, "bfloat16", _slots(n, device))
    # Skipped tokens left their (NaN) slots alone; stored ones are finite.
    assert kc.isnan().any() and not kc.isnan().all()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("per_head", [False, True])
def test_store_fp8_bit_exact(device: str, head_dim: int, per_head: bool) -> None:
    n = 21
    key = (torch.randn(n, NUM_KV_HEADS, head_dim, device=device) * torch.tensor([0.5, 4.0, 30.0], device=device)[:, None]).bfloat16()
    value = torch.randn(n, NUM_KV_HEADS, head_dim, device=device).bfloat16()
    k_scale, v_scale = compute_kv_scales(key, value, per_head)
    _store_and_compare(key, value, "fp8", _slots(n, device), k_scale, v_scale)


def test_store_fp8_rounding_and_saturation(device: str) -> None:
    """Ties, mantissa carries, subnormals, signed zero, overflow and inf, unscaled."""
    specials = [
        1.0625, 1.1875, 1.9375, 15.5, 240.0, 247.9, 448.0, 460.0, 464.0, 1e4, float("inf"),
        2**-6, 2**-6 * 0.999, 2**-7 * 1.5, 2**-9, 2**-10, 2**-10 * 1.01, 3 * 2**-11, 1e-30, 0.0, -0.0,
    ]
    vals = torch.tensor(specials + [-x for x in specials], dtype=torch.float32)
    vals = torch.cat([vals, torch.randn(NUM_BLOCKS * BLOCK_SIZE - vals.numel()) * 100])  # fills the cache
    key = vals.reshape(-1, 1, 1).expand(-1, NUM_KV_HEADS, 64).contiguous().to(device)
    slots = torch.arange(key.shape[0], device=device)
    kc = _store_and_compare(key, key.clone(), "fp8", slots)
    stored = kc.view(-1, NUM_KV_HEADS, 64)[: key.shape[0]].float()
    assert not stored.isnan().any(), "a finite (or infinite) input produced NaN"
    assert stored.abs().max() == 448.0
    # Spot values, independent of torch's own cast: ties go to even, carries bump the exponent.
    by_input = dict(zip(specials, stored[: len(specials), 0, 0].tolist()))
    assert by_input[1.0625] == 1.0 and by_input[1.1875] == 1.25 and by_input[1.9375] == 2.0
    assert by_input[15.5] == 16.0 and by_input[460.0] == 448.0 and by_input[float("inf")] == 448.0
    assert by_input[2**-10] == 0.0 and by_input[2**-10 * 1.01] == 2**-9 and by_input[3 * 2**-11] == 2**-9


def test_store_fp8_quantisation_error_bound(device: str) -> None:
    """With amax scales every normal-range value is within half an e4m3 ulp (2**-4 relative)."""
    key = torch.randn(64, NUM_KV_HEADS, 128, device=device)
    k_scale, _ = compute_kv_scales(key, key, per_head=True)
    kc, vc = allocate_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 128, "fp8", device)
    store_kv(key, key, kc, vc, torch.arange(64, device=device), k_scale, k_scale)
    deq = kc.flatten(0, 1)[:64].float() * k_scale[:, None]
    normal = key.abs() >= 2**-6 * k_scale[:, None]
    rel = ((deq - key).abs() / key.abs())[normal]
    assert rel.max() <= 2**-4 + 1e-7  # half an ulp of a 3-bit mantissa, plus fp32 slack


def test_compute_kv_scales(device: str) -> None:
    key = torch.randn(10, 4, 32, device=device)
    key[:, 2] = 0.0
    value = torch.randn(10, 4, 32, device=device) * 3
    k_scale, v_scale = compute_kv_scales(key, value, per_head=True)
    assert k_scale.shape == (4,) and k_scale.dtype == torch.float32
    torch.testing.assert_close(k_scale[[0, 1, 3]], key.abs().amax(dim=(0, 2))[[0, 1, 3]] / 448, rtol=0, atol=0)
    assert k_scale[2] == 1.0  # all-zero head: any scale works, 1.0 avoids a division by zero
    k1, v1 = compute_kv_scales(key, value, per_head=False)
    assert k1.shape == (1,) and v1.item() == pytest.approx(value.abs().max().item() / 448)
    key[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        compute_kv_scales(key, value, per_head=True)


def test_allocate_cache(device: str) -> None:
    for name, dtype in (("auto", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn)):
        k, v = allocate_cache(3, 16, 2, 64, name, device)
        assert k.shape == v.shape == (3, 16, 2, 64) and k.dtype == v.dtype == dtype
        assert k.data_ptr() != v.data_ptr()
    with pytest.raises(ValueError, match="fp8_e5m2"):
        allocate_cache(3, 16, 2, 64, "fp8_e5m2", device)
    with pytest.raises(ValueError, match="layout 'NDH'"):
        allocate_cache(3, 16, 2, 64, "fp8", device, layout="NDH")


@pytest.mark.parametrize("dtype_name", ["bfloat16", "fp8"])
def test_store_into_hnd_layout(device: str, dtype_name: str) -> None:
    """A head-major cache has the logical shape of an NHD one; the store writes the same values, head-major in memory."""
    k, v = allocate_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 64, dtype_name, device, layout="HND")
    assert k.shape == (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 64)
    assert k.stride()[1:] == (64, BLOCK_SIZE * 64, 1)
    for c in (k, v):
        _bits(c).fill_(0x7F)
    rk, rv = k.contiguous(), v.contiguous()
    key, value = torch.randn(20, NUM_KV_HEADS, 64, device=device), torch.randn(20, NUM_KV_HEADS, 64, device=device)
    scales = compute_kv_scales(key, value, per_head=True) if dtype_name == "fp8" else (None, None)
    slots = _slots(20, device)
    store_kv(key, value, k, v, slots, *scales)
    ref_store_kv(key, value, rk, rv, slots, *scales)
    assert torch.equal(_bits(k.contiguous()), _bits(rk)) and torch.equal(_bits(v.contiguous()), _bits(rv))
    # head 1 of page 0 is one contiguous run of BLOCK_SIZE x 64 elements in the storage
    flat = _bits(k).permute(0, 2, 1, 3).contiguous().view(-1)
    assert torch.equal(flat[BLOCK_SIZE * 64 : 2 * BLOCK_SIZE * 64], _bits(rk)[0, :, 1].reshape(-1))


def test_store_rejects_bad_inputs(device: str) -> None:
    kc, vc = allocate_cache(2, 16, 2, 64, "fp8", device)
    key = torch.randn(4, 2, 64, device=device)
    slots = torch.arange(4, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, key, kc, vc, slots.int())
    with pytest.raises(ValueError, match="k_scale"):
        store_kv(key, key, kc, vc, slots, torch.ones(3, device=device), torch.ones(1, device=device))
    with pytest.raises(ValueError, match="head_dim"):
        store_kv(torch.randn(4, 2, 32, device=device), torch.randn(4, 2, 32, device=device), kc, vc, slots)
    bc, bv = allocate_cache(2, 16, 2, 64, "bfloat16", device)
    with pytest.raises(ValueError, match="FP8 caches only"):
        store_kv(key, key, bc, bv, slots, torch.ones(1, device=device), torch.ones(1, device=device))


def test_reference_quantize_matches_torch_cast() -> None:
    """The reference's quantiser is torch's e4m3 cast after an fp32 division and a clamp."""
    x = torch.randn(1000, 2, 8) * 50
    scale = torch.tensor([0.3, 1.7])
    expect = (x / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(quantize_fp8(x, scale).view(torch.uint8), expect.view(torch.uint8))
