"""What every split-KV decode kernel here shares: SM count and residency, the split count, each split's tile
range, the partial outputs and their merge.

A decode call runs one program per (KV head, split, sequence); each split of a sequence's context writes a
partial output normalised by its own softmax sum and that sum's base-2 log-sum-exp, and `merge_splits`
combines them (sinks in the denominator). Split counts come from the block table's capacity, never from
`seq_lens`, so a call needs no host sync and can be captured in a CUDA graph. The rules and the sweeps
behind them: bench/KERNELS.md.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device (cached; the current one for a bare "cuda"), 1 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def resident_programs(regs_per_thread: int, smem_bytes: int, num_warps: int, device: torch.device) -> int:
    """Programs of this size one SM of `device` holds at once: 64K registers per SM (allocated per warp in units
    of 8 per thread), its shared memory (+1 KB reserved per block), its threads. Cached per device: every
    decode call asks."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _resident(regs_per_thread, smem_bytes, num_warps, index)


@functools.cache
def _resident(regs_per_thread: int, smem_bytes: int, num_warps: int, index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 0) or 233472
    threads_per_sm = getattr(props, "max_threads_per_multi_processor", 0) or 2048
    by_regs = 65536 // (-(-regs_per_thread // 8) * 8 * 32 * num_warps)
    by_smem = smem_per_sm // (smem_bytes + 1024)
    by_threads = threads_per_sm // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, 32))


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def split_count(batch: int, num_kv_heads: int, max_context: int, tile: int, programs_per_sm: float,
                device: torch.device, waves: tuple[int, ...] = (4, 2), pow2_fill: float = 0.0) -> int:
    """Splits per sequence for programs of `tile` tokens of which `programs_per_sm` are resident per SM at once.

    One full wave: batch x KV heads x splits programs up to what the SMs hold, rounded down to a power of two;
    with `waves`, 2 or 4 whole waves instead while each split keeps >= 64 tiles and the last wave is >= 85%
    full; each split >= 4 tiles, or 2, or 1 when longer splits would leave SMs idle; at most 128; none when
    the batch's (sequence, KV head) pairs alone fill a wave. `pow2_fill`: the one wave's count stays a power
    of two only if that fills at least this share of the wave, else it is the largest count that fits.
    """
    num_sms = sm_count(device)
    pairs = batch * num_kv_heads
    resident = int(programs_per_sm * num_sms)
    if pairs >= resident:
        return 1  # the sequences alone fill a wave
    tiles = max(1, -(-max_context // tile))
    # a power of two that would leave more than 1 - pow2_fill of the wave empty gives way to the exact count
    exact = _pow2_floor(resident // pairs) * pairs < pow2_fill * resident
    round_down = (lambda x: x) if exact else _pow2_floor
    splits = round_down(resident // pairs)
    for w in waves:
        more = _pow2_floor(w * resident // pairs)
        programs = more * pairs
        # whole waves only: the last one at least 85% full, and every split >= 64 tiles
        if more > splits and tiles >= 64 * more and (programs % resident == 0 or programs % resident >= 0.85 * resident):
            splits = more
            break
    per_split = next((t for t in (4, 2) if (tiles // t) * pairs >= num_sms), 1)
    cap = max(1, tiles // per_split)
    return max(1, min(splits, round_down(cap), 128))


def span(block_tables: torch.Tensor, page_size: int, sliding_window: int | None, tile: int) -> int:
    """Longest context a call may attend, from the block table's capacity (no host sync): a window's worth plus
    a tile for windowed layers."""
    full = block_tables.shape[1] * page_size
    return full if sliding_window is None else min(full, sliding_window + tile)


@triton.jit
def split_tiles(seq_lens_ptr, seq, window, split, num_splits, BN: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(seq_len, first attended position, first tile, end tile) of this program's split: the attended range
    [start, seq_len) in whole BN-token tiles, cut into `num_splits` runs of equal tile counts (Triton and
    Gluon kernels alike)."""
    seq_len = tl.load(seq_lens_ptr + seq)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    first_tile = start // BN
    end_tile = (seq_len + BN - 1) // BN
    # (tl.cdiv is not callable under the interpreter in Triton 3.9)
    tiles_per_split = (end_tile - first_tile + num_splits - 1) // num_splits
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, end_tile)
    return seq_len, start, tile_lo, tile_hi


@triton.jit
def store_result(o, m, l, q_head, h_mask, offs_d, seq, split, num_splits, sinks_ptr, out_ptr, part_out_ptr,
                 part_lse_ptr, stride_ob, stride_oh, NUM_KV: tl.constexpr, GROUP: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HAS_SINKS: tl.constexpr, IS_SPLIT: tl.constexpr):
    """Write a program's result from the Gluon TurboQuant kernels: o [D, heads] unnormalised (row i is dim
    offs_d[i]), m and l each head's max (log2 units) and softmax sum. Split: the partial output and its
    log-sum-exp (`split_partials`' layout); else the normalised output, the sink's logit in the denominator."""
    if IS_SPLIT:
        l_safe = tl.where(l == 0.0, 1.0, l)
        lse = m + tl.log2(l)  # -inf for an empty split: the merge gives it weight 0
        row = seq * (NUM_KV * GROUP) + q_head
        tl.store(part_lse_ptr + row * num_splits + split, lse, mask=h_mask)
        tl.store(part_out_ptr + ((row * num_splits + split) * HEAD_DIM)[None, :] + offs_d[:, None],
                 o / l_safe[None, :], mask=h_mask[None, :])
    else:
        if HAS_SINKS:
            # The sink logit joins the denominator only.
            sink = tl.load(sinks_ptr + q_head, mask=h_mask, other=0.0) * LOG2E
            m_fin = tl.maximum(m, sink)
            corr = tl.exp2(m - m_fin)
            l = l * corr + tl.exp2(sink - m_fin)
            o = o * corr[None, :]
        l_safe = tl.where(l == 0.0, 1.0, l)
        tl.store(out_ptr + seq * stride_ob + (q_head * stride_oh)[None, :] + offs_d[:, None],
                 (o / l_safe[None, :]).to(out_ptr.dtype.element_ty), mask=h_mask[None, :])


def split_partials(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs [batch, heads, splits, head_dim] and log-sum-exps [batch, heads, splits] of a split
    call (`out` itself, unused, when there is one split)."""
    if splits == 1:
        return out, out
    batch, heads, head_dim = out.shape
    return (torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=out.device),
            torch.empty(batch, heads, splits, dtype=torch.float32, device=out.device))


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr,
    num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + seq * stride_pb + head * stride_ph + offs_s * stride_ps, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * LOG2E
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    parts = tl.load(
        part_out_ptr + (seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps) * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None],
        other=0.0,
    )
    o = tl.sum(parts * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, sinks: torch.Tensor | None, out: torch.Tensor,
                 splits: int) -> None:
    """Combine `split_partials` (written by any decode kernel here) into `out`, sinks in the denominator."""
    batch, heads, head_dim = out.shape
    _merge_kernel[(heads, batch)](
        part_out, part_lse, sinks if sinks is not None else part_lse, out,
        splits,
        heads * splits, splits, 1,
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_S=max(2, triton.next_power_of_2(splits)),
        HAS_SINKS=sinks is not None,
        num_warps=4,
    )


GLUON_MODULES = ("decode_gluon", "pth_gluon", "tq_gluon", "tq_warp")
"""The Hopper kernels, written in Gluon."""


@functools.cache
def _gluon_refusal(device_type: str, index: int | None) -> str:
    if device_type != "cuda" or interpreting():
        return "it needs a CUDA GPU (Gluon does not run under the interpreter)"
    if torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device()) != (9, 0):
        return "it is written for sm_90 (Hopper)"
    try:
        for name in GLUON_MODULES:
            importlib.import_module(f"kvpolicy.kernels.{name}")
    except ImportError as exc:  # Gluon's API moves between Triton releases
        return f"this Triton has no usable Gluon ({exc})"
    return ""


def gluon_runs_on(device: torch.device) -> tuple[bool, str]:
    """Whether the Gluon kernels run on `device`, and if not, why: an sm_90 GPU, no interpreter, and a Triton
    with the Gluon API they are written against."""
    why = _gluon_refusal(device.type, device.index)
    return not why, why
