"""Store kernel: quantize + pack into the paged TurboQuant cache, against the float64 reference.

Runs on the GPU when there is one, else under the Triton interpreter (small shapes).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvpolicy.kernels.tq_reference import (
    fp8_e4m3_ref,
    pack_slots_ref,
    unpack_slots_ref,
)
from kvpolicy.kernels.tq_store import store_kv_tq
from kvpolicy.kernels.formats import TQ_FORMATS, tq_layout
from kvpolicy.kernels.turboquant import (
    allocate_tq_cache,
    hadamard_rotation,
    lloyd_max_codebook,
)

POISON = 0xAB


def _case(fmt: str, head_dim: int, num_tokens: int, device: str, num_kv_heads: int = 2, block_size: int = 16,
          num_blocks: int = 8, fp8_exact: bool = True):
    """Random K/V, a poisoned cache, and a scattered slot mapping with one skipped token."""
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device) * 3
    value = torch.randn(num_tokens, num_kv_heads, head_dim, device=device) * 2 + 0.5
    if fmt == "turboquant_k8v4" and fp8_exact and device == "cpu":
        # the interpreter's fp32 -> e4m3 cast rounds wrongly (kernels.md): give it representable keys
        key = fp8_e4m3_ref(key).float()
    cache = allocate_tq_cache(num_blocks, block_size, num_kv_heads, head_dim, fmt, device)
    cache.fill_(POISON)
    slot_mapping = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slot_mapping[1] = -1
    return key, value, cache, slot_mapping


def _slots(cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    nb, bs, h, sb = cache.shape
    return cache.view(nb * bs, h, sb)[slot_mapping[slot_mapping >= 0]]


CASES = [(fmt, 128) for fmt in TQ_FORMATS] + [("turboquant_4bit_nc", 64), ("turboquant_3bit_nc", 64)]


@pytest.mark.parametrize("fmt,head_dim", CASES)
def test_store_matches_reference(fmt: str, head_dim: int, device: str) -> None:
    key, value, cache, slot_mapping = _case(fmt, head_dim, 40, device)
    store_kv_tq(key, value, cache, slot_mapping, fmt)
    keep = slot_mapping >= 0
    got = unpack_slots_ref(_slots(cache, slot_mapping).cpu(), fmt, head_dim)
    want = unpack_slots_ref(pack_slots_ref(key[keep].cpu(), value[keep].cpu(), fmt), fmt, head_dim)
    lay = tq_layout(fmt, head_dim)
    if lay.key_fp8:
        # e4m3 keys: exactly torch's saturating round-to-nearest-even cast
        assert torch.equal(got["key_fp8"], want["key_fp8"])
    else:
        # fp32 kernel vs float64 reference: codes may differ only for coordinates within
        # ~1e-7 of a threshold, by one level; norms by one fp16 ulp (2^-10 relative)
        diff = (got["key_codes"] - want["key_codes"]).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() <= 1e-3
        assert torch.allclose(got["key_norm"], want["key_norm"], rtol=2**-10, atol=0)
    # value scale/zero: fp32 vs float64 before the fp16 rounding, one ulp apart at most
    assert torch.allclose(got["value_scale"], want["value_scale"], rtol=2**-10, atol=0)
    assert torch.allclose(got["value_zero"], want["value_zero"], rtol=2**-10, atol=1e-6)
    same = (got["value_scale"] == want["value_scale"]) & (got["value_zero"] == want["value_zero"])
    assert same.float().mean() >= 0.9
    vdiff = (got["value_codes"] - want["value_codes"]).abs()[same]
    # where scale and zero agree, codes differ only at exact .5 ties of (v - zero) / scale
    assert vdiff.max() <= 1 and (vdiff > 0).float().mean() <= 1e-3


@pytest.mark.parametrize("fmt", TQ_FORMATS)
def test_store_writes_only_mapped_slots(fmt: str, device: str) -> None:
    key, value, cache, slot_mapping = _case(fmt, 64, 20, device, num_blocks=4)
    store_kv_tq(key, value, cache, slot_mapping, fmt)
    nb, bs, h, sb = cache.shape
    flat = cache.view(nb * bs, h, sb)
    written = torch.zeros(nb * bs, dtype=torch.bool, device=device)
    written[slot_mapping[slot_mapping >= 0]] = True
    assert torch.all(flat[~written] == POISON), "a skipped or unmapped slot was written"
    lay = tq_layout(fmt, 64)
    used = lay.vzero_off + 2
    assert not torch.all(flat[written][:, :, :used] == POISON, dim=-1).any(), "a mapped slot was not written"
    if used < sb:
        assert torch.all(flat[written][:, :, used:] == POISON), "padding bytes must be left alone"


@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
def test_stored_key_codes_are_nearest_centroids(fmt: str, device: str) -> None:
    """Property independent of the reference packer: each code is the nearest centroid of its rotated coordinate."""
    d = 128
    key, value, cache, slot_mapping = _case(fmt, d, 32, device)
    # keys with outlier channels: a distribution where a wrong rotation would show
    key[:, :, [5, 77]] *= 10
    store_kv_tq(key, value, cache, slot_mapping, fmt)
    lay = tq_layout(fmt, d)
    got = unpack_slots_ref(_slots(cache, slot_mapping).cpu(), fmt, d)
    k = key[slot_mapping >= 0].cpu().double()
    u = (k @ hadamard_rotation(d).T) / k.norm(dim=-1, keepdim=True)
    cb = lloyd_max_codebook(lay.key_bits, d)
    dist = (u[..., None] - cb).abs()
    chosen = dist.gather(-1, got["key_codes"][..., None]).squeeze(-1)
    # fp32 rotation error ~1e-7 on coordinates ~0.09: a tie within 1e-6 may go either way
    assert torch.all(chosen <= dist.min(dim=-1).values + 1e-6)
    # norm correction: stored norm = ||k|| / ||c[codes]||, fp16
    want = k.norm(dim=-1) / cb[got["key_codes"]].norm(dim=-1)
    assert torch.allclose(got["key_norm"], want, rtol=2**-10, atol=0)


@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
def test_stored_values_within_half_a_step(fmt: str, device: str) -> None:
    """Uniform coding error per element is at most scale/2 (plus the fp16 rounding of scale and zero)."""
    d = 128
    key, value, cache, slot_mapping = _case(fmt, d, 32, device)
    store_kv_tq(key, value, cache, slot_mapping, fmt)
    got = unpack_slots_ref(_slots(cache, slot_mapping).cpu(), fmt, d)
    v = value[slot_mapping >= 0].cpu().double()
    rec = got["value_codes"] * got["value_scale"][..., None] + got["value_zero"][..., None]
    levels = 2 ** tq_layout(fmt, d).value_bits - 1
    exact_scale = (v.amax(-1) - v.amin(-1)) / levels
    slack = (got["value_zero"] - v.amin(-1)).abs() + levels * (got["value_scale"] - exact_scale).abs()
    assert torch.all((rec - v).abs() <= got["value_scale"][..., None] / 2 + slack[..., None] + 1e-6)
    assert got["value_codes"].max() == levels and got["value_codes"].min() == 0


def test_store_constant_vector_and_zero_key(device: str) -> None:
    """Degenerate inputs: a constant value vector (scale 0) and an all-zero key stay finite."""
    fmt, d = "turboquant_4bit_nc", 64
    key, value, cache, slot_mapping = _case(fmt, d, 16, device)
    key[0] = 0.0
    value[0] = 1.25
    store_kv_tq(key, value, cache, slot_mapping, fmt)
    got = unpack_slots_ref(_slots(cache, slot_mapping[:1]).cpu(), fmt, d)
    assert torch.all(got["value_scale"] == 0) and torch.all(got["value_zero"] == 1.25)
    assert torch.all(got["value_codes"] == 0)
    assert torch.all(got["key_norm"] == 0)


def test_store_rejects_bad_inputs(device: str) -> None:
    fmt = "turboquant_4bit_nc"
    key, value, cache, slot_mapping = _case(fmt, 64, 8, device)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_tq(key, value, cache, slot_mapping[:4], fmt)
    with pytest.raises(ValueError, match="cache"):
        store_kv_tq(key, value, cache[..., :-2], slot_mapping, fmt)
    with pytest.raises(ValueError, match="head_dim"):
        store_kv_tq(key[..., :48], value[..., :48], cache, slot_mapping, fmt)
    with pytest.raises(ValueError, match="unknown"):
        store_kv_tq(key, value, cache, slot_mapping, "turboquant_2bit")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", TQ_FORMATS)
def test_store_gpu_random_keys_and_bf16_input(fmt: str) -> None:
    """On the GPU: random (non-representable) FP8 keys, bf16 inputs, a large scattered batch."""
    key, value, cache, slot_mapping = _case(fmt, 128, 3000, "cuda", num_kv_heads=8, num_blocks=256, fp8_exact=False)
    key, value = key.bfloat16(), value.bfloat16()
    store_kv_tq(key, value, cache, slot_mapping, fmt)
    keep = slot_mapping >= 0
    got = unpack_slots_ref(_slots(cache, slot_mapping).cpu(), fmt, 128)
    want = unpack_slots_ref(pack_slots_ref(key[keep].cpu(), value[keep].cpu(), fmt), fmt, 128)
    if tq_layout(fmt, 128).key_fp8:
        assert torch.equal(got["key_fp8"], want["key_fp8"])
    else:
        diff = (got["key_codes"] - want["key_codes"]).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() <= 1e-3
    assert torch.allclose(got["value_scale"], want["value_scale"], rtol=2**-10, atol=0)
    assert not math.isnan(got["value_zero"].sum().item())


@pytest.mark.parametrize("fmt", TQ_FORMATS)
@pytest.mark.parametrize("d", [64, 128])
def test_store_writes_planar_pages(fmt: str, d: int, device: str) -> None:
    """The store kernel writes a planar cache byte for byte as the slot layout, permuted by the planar map
    (rows in order, or the per-warp kernel's order: `turboquant.warp_plane_order`); bytes of slots it does not
    touch stay as they were."""
    from kvpolicy.kernels.turboquant import allocate_tq_planar_cache, planar_from_slots

    h = 2
    key, value = torch.randn(21, h, d), torch.randn(21, h, d)
    slots = torch.randperm(3 * 16)[:21]
    slots[4] = -1  # skipped
    nhd = allocate_tq_cache(3, 16, h, d, fmt, device).fill_(7)
    planar = allocate_tq_planar_cache(3, 16, h, d, fmt, device).fill_(7)
    store_kv_tq(key.to(device), value.to(device), nhd, slots.to(device), fmt)
    store_kv_tq(key.to(device), value.to(device), planar, slots.to(device), fmt)
    assert torch.equal(planar.cpu(), planar_from_slots(nhd.cpu(), fmt, d))
