"""The kernels' entry points refuse out-of-range indices and bad scales, and the TurboQuant store
never turns finite input into NaN. Interpreter on the CPU; the GPU test repeats the store on CUDA."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.kernels.decode_attention import decode_attention
from kvpolicy.kernels.formats import TQ_FORMATS
from kvpolicy.kernels.paged_store import allocate_cache, store_kv
from kvpolicy.kernels.tq_decode import decode_attention_tq
from kvpolicy.kernels.tq_reference import quantize_values_ref, unpack_slots_ref
from kvpolicy.kernels.tq_store import store_kv_tq
from kvpolicy.kernels.turboquant import allocate_tq_cache

BLOCKS, PAGE, HKV, D = 4, 16, 2, 64


def _paged(device: str, dtype: str = "bfloat16"):
    kc, vc = allocate_cache(BLOCKS, PAGE, HKV, D, dtype, device)
    kc.view(torch.uint8).zero_()
    vc.view(torch.uint8).zero_()
    q = torch.randn(1, 4, D, device=device, dtype=torch.bfloat16)
    bt = torch.arange(BLOCKS, dtype=torch.int32, device=device)[None, :]
    return q, kc, vc, bt


@pytest.mark.parametrize("seq_len", [0, -3, BLOCKS * PAGE + 1])
def test_decode_refuses_seq_len_outside_the_block_table(device: str, seq_len: int) -> None:
    q, kc, vc, bt = _paged(device)
    with pytest.raises(ValueError, match=rf"seq_lens must be in 1\.\.{BLOCKS * PAGE}"):
        decode_attention(q, kc, vc, bt, torch.tensor([seq_len], dtype=torch.int32, device=device))


@pytest.mark.parametrize("bad", [-1, BLOCKS, 1 << 20])
def test_decode_refuses_a_block_past_the_cache(device: str, bad: int) -> None:
    q, kc, vc, bt = _paged(device)
    bt[0, 1] = bad
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\]"):
        decode_attention(q, kc, vc, bt, torch.tensor([2 * PAGE], dtype=torch.int32, device=device))
    # an entry past seq_len is never read, so it may hold anything (vLLM pads tables)
    bt[0, 1] = 0
    bt[0, 3] = bad
    out = decode_attention(q, kc, vc, bt, torch.tensor([2 * PAGE], dtype=torch.int32, device=device))
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_fp8_scales_must_be_finite_and_positive(device: str, scale: float) -> None:
    q, kc, vc, bt = _paged(device, "fp8")
    bad = torch.tensor([scale], device=device)
    good = torch.ones(1, device=device)
    lens = torch.tensor([PAGE], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="k_scale must be finite and positive"):
        decode_attention(q, kc, vc, bt, lens, k_scale=bad, v_scale=good)
    kv = torch.randn(2, HKV, D, device=device)
    with pytest.raises(ValueError, match="v_scale must be finite and positive"):
        store_kv(kv, kv, kc, vc, torch.tensor([0, 1], device=device), k_scale=good, v_scale=bad)


def test_stores_refuse_a_slot_past_the_cache(device: str) -> None:
    _, kc, vc, _ = _paged(device)
    kv = torch.randn(2, HKV, D, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"slot {BLOCKS * PAGE}; the cache has {BLOCKS * PAGE} slots"):
        store_kv(kv, kv, kc, vc, torch.tensor([0, BLOCKS * PAGE], device=device))
    cache = allocate_tq_cache(BLOCKS, PAGE, HKV, D, "turboquant_4bit_nc", device)
    with pytest.raises(ValueError, match="slot_mapping holds slot"):
        store_kv_tq(kv.float(), kv.float(), cache, torch.tensor([-1, 10**6], device=device), "turboquant_4bit_nc")


def test_tq_decode_refuses_out_of_range_tables(device: str) -> None:
    fmt = "turboquant_4bit_nc"
    cache = allocate_tq_cache(BLOCKS, PAGE, HKV, D, fmt, device)
    q = torch.randn(1, 4, D, device=device)
    bt = torch.zeros(1, BLOCKS, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="seq_lens must be in"):
        decode_attention_tq(q, cache, bt, torch.tensor([0], dtype=torch.int32, device=device), fmt)
    bt[0, 0] = BLOCKS
    with pytest.raises(ValueError, match="outside the cache"):
        decode_attention_tq(q, cache, bt, torch.tensor([3], dtype=torch.int32, device=device), fmt)
    with pytest.raises(ValueError, match="int32"):
        decode_attention_tq(q, cache, bt.long(), torch.tensor([3], dtype=torch.int32, device=device), fmt)


def _huge_kv(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of +-1e6 (norm far past fp16) and values of +-1e6 with one -70000 below fp16's range."""
    gen = torch.Generator().manual_seed(7)
    sign = torch.randint(0, 2, (4, HKV, D), generator=gen).float() * 2 - 1
    key = sign * 1e6
    value = sign.flip(-1) * 1e6
    value[2, 1, 5] = -70000.0
    value[3] = torch.randn(HKV, D, generator=gen)  # an ordinary token beside them
    value[3, 0, 0] = -70000.0
    return key.to(device), value.to(device)


def _store_and_decode(fmt: str, device: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    key, value = _huge_kv(device)
    cache = allocate_tq_cache(BLOCKS, PAGE, HKV, D, fmt, device)
    store_kv_tq(key, value, cache, torch.arange(4, device=device), fmt)
    fields = unpack_slots_ref(cache.view(-1, HKV, cache.shape[-1])[:4].cpu(), fmt, D)
    q = torch.randn(1, 4, D, device=device)
    out = decode_attention_tq(q, cache, torch.arange(BLOCKS, dtype=torch.int32, device=device)[None, :],
                              torch.tensor([4], dtype=torch.int32, device=device), fmt)
    return fields, out


def _assert_finite(fmt: str, fields: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    for name in ("key_norm", "value_scale", "value_zero"):
        if name in fields:
            assert torch.isfinite(fields[name]).all(), f"{fmt}: {name} holds {fields[name].flatten()[:8]}"
    assert torch.isfinite(out.float()).all(), f"{fmt}: decode output has NaN/inf"


@pytest.mark.parametrize("fmt", TQ_FORMATS)
def test_tq_store_saturates_to_fp16(fmt: str, device: str) -> None:
    fields, out = _store_and_decode(fmt, device)
    _assert_finite(fmt, fields, out)
    # -70000 saturates to fp16's lowest value: the zero point is exactly -65504
    assert fields["value_zero"][2, 1].item() == -65504.0


def test_reference_saturates_like_the_kernel() -> None:
    _, value = _huge_kv("cpu")
    _, scale, zero = quantize_values_ref(value, 4)
    assert torch.isfinite(scale).all() and torch.isfinite(zero).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", TQ_FORMATS)
def test_tq_store_saturates_to_fp16_on_the_gpu(fmt: str) -> None:
    fields, out = _store_and_decode(fmt, "cuda")
    _assert_finite(fmt, fields, out)


@pytest.mark.parametrize("fmt", ["fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"])
def test_per_token_head_entry_points_refuse_out_of_range_indices(device: str, fmt: str) -> None:
    from kvpolicy.kernels.decode_attention import decode_attention_pth
    from kvpolicy.kernels.paged_store import allocate_pth_cache, store_kv_pth

    cache = allocate_pth_cache(BLOCKS, PAGE, HKV, D, fmt, device)
    kv = torch.randn(2, HKV, D, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"slot {BLOCKS * PAGE}; the cache has {BLOCKS * PAGE} slots"):
        store_kv_pth(kv, kv, cache, torch.tensor([0, BLOCKS * PAGE], device=device), fmt)
    q = torch.randn(1, 4, D, device=device, dtype=torch.bfloat16)
    bt = torch.arange(BLOCKS, dtype=torch.int32, device=device)[None, :]
    with pytest.raises(ValueError, match=rf"seq_lens must be in 1\.\.{BLOCKS * PAGE}"):
        decode_attention_pth(q, cache, bt, torch.tensor([0], dtype=torch.int32, device=device), fmt)
    bt[0, 0] = BLOCKS
    with pytest.raises(ValueError, match="outside the cache"):
        decode_attention_pth(q, cache, bt, torch.tensor([3], dtype=torch.int32, device=device), fmt)



def test_unchecked_skips_the_range_checks_only_inside_its_block(device: str) -> None:
    """The runtime, which builds its own tables, turns the checks (a host sync each) off; after its block, even
    one left by an exception, a direct call is checked again."""
    from kvpolicy.kernels.guards import check_paged_ranges, unchecked

    _, _, _, bt = _paged(device)
    bad = torch.tensor([BLOCKS * PAGE + 1], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError), unchecked():
        check_paged_ranges(bt, bad, BLOCKS, PAGE)  # skipped: no error
        raise RuntimeError("leave the block by an exception")
    with pytest.raises(ValueError, match=r"seq_lens must be in"):
        check_paged_ranges(bt, bad, BLOCKS, PAGE)
