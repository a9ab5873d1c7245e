"""Paged decode attention (flash-decoding) over BF16 and FP8 (e4m3) KV caches.

One program handles one (KV head, split, sequence): the query heads of that KV
head (its GQA group) are packed into the rows of one tile, so each K/V tile is
read from HBM once per group. Splits cut the sequence into contiguous ranges
so that small batches still fill the GPU; each split writes a partial output
and its log-sum-exp, and `_decode_merge_kernel` combines them.

Two orientations of the same math (`DecodeConfig.swap_ab`):
- standard: S = Q.K^T with the padded group as M (16 rows). M = 16 is below
  Hopper's wgmma minimum of 64, so Triton uses mma.sync; for FP8 operands it
  upcasts them to fp16 there, which also means exact fp32 accumulation.
- swapped: S^T = K.Q^T and O^T = V^T.P^T, so M is the KV tile (BLOCK_N) or the
  head dim, both multiples of 64: wgmma, and for FP8 the fp8 wgmma whose
  in-MMA accumulation keeps only about 14 mantissa bits. That is the form where
  the two-level toggle matters. On the H200 it was slower than the standard form,
  which is the default (bench/NOTES.md).

FP8 caches: K is upcast to fp16 for Q.K^T, or the query is quantised to e4m3
per program (`fp8_query`) and the product runs in fp8. P is always rounded to
e4m3 (scaled by `P_SCALE` first), as FA3 does; in the standard form the P.V
MMA then runs in fp16 on those exact values against V converted in registers.
Scales fold into the math: k_scale (and the query's scale) into the logit
scale, v_scale into the output.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from kvpolicy.kernels.paged_store import check_scale, fp8_e4m3_bits
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LOG2E = tl.constexpr(1.4426950408889634)
P_SCALE = tl.constexpr(256.0)
"""Softmax probabilities (<= 1) are multiplied by this before the e4m3 cast, so
small ones land in e4m3's normal range (>= 2**-6) rather than its coarse subnormals."""


@dataclass(frozen=True)
class DecodeConfig:
    """Launch configuration of the decode kernel; `default_config` picks one."""

    block_n: int
    """KV positions per tile (a multiple of 64 when `swap_ab`, so wgmma applies)."""
    num_warps: int
    """Warps per program."""
    num_stages: int
    """Software-pipelining depth of the KV loop."""
    swap_ab: bool
    """Compute S^T = K.Q^T and O^T = V^T.P^T (wgmma on Hopper) instead of Q.K^T and P.V."""
    programs_per_sm: float
    """Programs of this config resident per SM at once (registers and shared memory allow this many):
    `choose_num_splits` fills whole waves of them."""
    min_tokens_per_split: int = 0
    """Never split a sequence into pieces shorter than this (0: one tile)."""
    num_sub: int = 1
    """K/V tiles of `block_n` loaded together per loop iteration (1 or 2): more bytes in flight per program."""
    maxnreg: int | None = None
    """Register cap per thread (more resident programs per SM, at the price of spills); None: the compiler's choice."""
    defer_sum: bool = False
    """Standard form: keep the softmax denominator as per-position partial sums and reduce it once after
    the loop, instead of a cross-warp sum per tile (more registers)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Registers per thread and shared memory per program of the default configs, compiled for sm_90
# (bench/sass_mix.py): FP8 at both head_dims 123 / 55,296 B; BF16 head_dim 128 130 / 73,984 B;
# BF16 head_dim 64 140 / 71,680 B. The tiles hold 16K elements at every head_dim, so shared
# memory barely moves with it; other GPUs differ mostly in shared memory per SM.
_FP8_PROGRAM = (123, 55296)
_BF16_PROGRAM = (130, 73984)
_BF16_HD64_PROGRAM = (140, 71680)


def resident_programs(regs_per_thread: int, smem_bytes: int, num_warps: int, device: torch.device) -> int:
    """Programs of this size one SM of `device` holds at once: 64K registers per SM (allocated per
    warp in units of 8 per thread), its shared memory (+1 KB reserved per block), its threads.
    On an H200: 4 for the FP8 default, 3 for BF16 (what the split-count sweeps found best)."""
    props = torch.cuda.get_device_properties(device)
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 0) or 233472
    threads_per_sm = getattr(props, "max_threads_per_multi_processor", 0) or 2048
    by_regs = 65536 // (-(-regs_per_thread // 8) * 8 * 32 * num_warps)
    by_smem = smem_per_sm // (smem_bytes + 1024)
    by_threads = threads_per_sm // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, 32))


def default_config(head_dim: int, kv_fp8: bool, device: torch.device) -> DecodeConfig:
    """Configuration for a head_dim and cache format: tuned on an H200 (bench/NOTES.md), large tiles under the interpreter."""
    if device.type != "cuda" or _interpreting():
        # The interpreter runs programs one after another in numpy: few, large tiles.
        return DecodeConfig(block_n=128, num_warps=4, num_stages=1, swap_ab=False, programs_per_sm=1.0, min_tokens_per_split=128)
    # Triton gives each K/V load one buffer here, so a program has one tile in
    # flight: keep block_n x head_dim at 16K elements (64 KB of BF16 K+V) for
    # every head_dim, the size that reached the memory floor at head_dim 128.
    block_n = max(32, min(256, 16384 // head_dim))
    if kv_fp8:
        # FP8 is latency-bound at ~1 IPC (NOTES.md v4-v6): half the tile (4 programs
        # of 4 warps resident per SM on an H200), three stages (two tiles in flight
        # per program now that the page look-up runs one tile ahead), and the
        # denominator summed once after the loop measured fastest.
        return DecodeConfig(block_n=max(32, block_n // 2), num_warps=4, num_stages=3, swap_ab=False,
                            programs_per_sm=float(resident_programs(*_FP8_PROGRAM, 4, device)), defer_sum=True)
    if head_dim <= 64:
        # gpt-oss's head_dim 64 (GQA 8): half tiles, three stages, deferred sum (NOTES.md v6).
        return DecodeConfig(block_n=block_n // 2, num_warps=4, num_stages=3, swap_ab=False,
                            programs_per_sm=float(resident_programs(*_BF16_HD64_PROGRAM, 4, device)), defer_sum=True)
    return DecodeConfig(block_n=block_n, num_warps=4, num_stages=2, swap_ab=False,
                        programs_per_sm=float(resident_programs(*_BF16_PROGRAM, 4, device)))


def use_pdl(device: torch.device) -> bool:
    """Launch both kernels with programmatic dependent launch (PDL): off unless `KVPOLICY_PDL=1`.

    A PDL kernel is scheduled while the kernel before it on the stream drains and waits
    (`griddepcontrol.wait`) for that kernel's writes before it reads anything; the decode
    kernel lets its merge be scheduled once its programs leave the KV loop. Measured on an
    H200 in back-to-back calls (bench/NOTES.md v7): 0.6-1.3 us faster up to 4k tokens, 4-5%
    slower for BF16 at batch 8 from 16k, so it is opt-in. Hopper and newer; never under
    the interpreter."""
    if device.type != "cuda" or _interpreting() or os.environ.get("KVPOLICY_PDL", "0") != "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device (cached; the current one for a bare "cuda"), 1 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, config: DecodeConfig, device: torch.device) -> int:
    """Splits per sequence for `config`: `split_count` with its tile, residency and split floor."""
    return split_count(batch, num_kv_heads, max_context, config.block_n * config.num_sub, config.programs_per_sm, device,
                       config.min_tokens_per_split)


def split_count(batch: int, num_kv_heads: int, max_context: int, tile: int, programs_per_sm: float, device: torch.device,
                min_tokens_per_split: int = 0, waves: tuple[int, ...] = (4, 2), wave_tiles: int = 64,
                pow2_fill: float = 0.0) -> int:
    """Splits per sequence for programs of `tile` tokens of which `programs_per_sm` are resident per SM at once,
    from the block table's capacity (no host sync, graph-safe).

    Measured on an H200 over 1, 2, 4, ..., 128 splits at 1k-128k tokens, batch 1 and 8, both
    layers, BF16, FP8 and TurboQuant (bench/NOTES.md v7, `bench/results_splits_*_h200.json`):
    - one full wave: batch x KV heads x splits programs up to what the SMs hold at once,
      rounded down to a power of two; a partial second wave or an empty trailing split cost
      up to 20%;
    - long contexts: 2 or 4 waves while each split keeps >= 64 tiles, if the power-of-two count
      fills the last wave to >= 85% (FP8, batch 8, 128k: 16 splits 9% faster than 8 on the
      gpt-oss layer); a count that does not (8 BF16 splits at batch 8 = 1.3 waves of 396
      programs) measured 10-12% slower at 64k;
    - each split >= 4 tiles, or 2, or 1 when longer splits would leave SMs without a program
      (a one-tile program spends as long on its prologue, epilogue and merge as on the tile);
    - never shorter than `min_tokens_per_split`, never more than 128; no splits at all when the
      batch's (sequence, KV head) pairs alone fill a wave.
    Against the previous rule (16 programs per SM for FP8, 2 for BF16, >= 128 tokens per split)
    this was 7% faster on average over those cases and up to 33% (FP8, batch 8, 4k).
    `waves`: the whole-wave multiples tried at long contexts, largest first. The Gluon kernel passes
    none: one wave measured fastest for it (bench/probe_gluon.py, NOTES.md v8; gpt-oss layer, batch 8,
    128k: 4 splits 259.5-261.3 us, 8 splits 305.5 us). `wave_tiles`: the tiles each split keeps when
    it takes more waves (the TurboQuant per-warp kernel measured 128 at 64-token tiles; its defaults now
    take one wave). `pow2_fill`: the one wave's count stays a power of two only if that fills at least
    this share of the wave; otherwise it is the largest count that fits (nor is the tile cap rounded).
    The TurboQuant kernels pass 0.85 (`tq_gluon.default_splits`): at 5 programs per SM (k8v4, head_dim
    64) 8 splits at batch 8 fill 512 of 660 slots, 10 fill 640: 235.3 against 248.1 us on the gpt-oss
    layer at 128k.
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
        # whole waves only: the last one at least 85% full, and every split >= wave_tiles tiles
        if more > splits and tiles >= wave_tiles * more and (programs % resident == 0 or programs % resident >= 0.85 * resident):
            splits = more
            break
    per_split = next((t for t in (4, 2) if (tiles // t) * pairs >= num_sms), 1)
    cap = max(1, tiles // per_split)
    if min_tokens_per_split:
        cap = min(cap, max(1, max_context // min_tokens_per_split))
    return max(1, min(splits, round_down(cap), 128))


@triton.jit
def _load_pages(bt_row, offs_n, seq_len, PAGE_SIZE: tl.constexpr):
    """Physical page of each position `offs_n` (0 past the sequence)."""
    # (unsigned: a shift, not a signed division)
    return tl.load(bt_row + offs_n.to(tl.uint32) // PAGE_SIZE, mask=offs_n < seq_len, other=0).to(tl.int64)


@triton.jit
def _load_tile(k_base, v_base, page, offs_n, seq_len, start, offs_d,
               stride_kb, stride_kt, stride_vb, stride_vt, PAGE_SIZE: tl.constexpr):
    """K and V rows [BLOCK_N, HEAD_DIM] of positions `offs_n` in pages `page`; masked rows read nothing."""
    valid = (offs_n < seq_len) & (offs_n >= start)
    in_page = offs_n.to(tl.uint32) % PAGE_SIZE
    k = tl.load(k_base + (page * stride_kb + in_page * stride_kt)[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
    v = tl.load(v_base + (page * stride_vb + in_page * stride_vt)[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
    return k, v, valid


@triton.jit
def _e4m3_to_f16(x):
    """e4m3 bytes (uint8) to fp16, in registers: opaque to Triton, so the tile reaches the MMA as fp16."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        # Not pure: Triton would otherwise move the layout conversion above it
        # and gather e4m3 bytes again.
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _attend_tile(k, v, valid, q_op, qk_scale, m_i, l_i, acc,
                 KV_FP8: tl.constexpr, FP8_QUERY: tl.constexpr, SWAP_AB: tl.constexpr,
                 TWO_LEVEL: tl.constexpr, INTERPRET: tl.constexpr, DEFER_SUM: tl.constexpr):
    """One online-softmax step over a K/V tile: returns the updated (running max, denominator, accumulator)."""
    # FP8 operands and how they reach the MMA (bench/NOTES.md v4). V is the
    # transposed operand of P.V: left to itself, Triton keeps the e4m3 tile in
    # shared memory and gathers it byte by byte (LDS.U8) into the MMA layout.
    # Converted to fp16 in registers by opaque inline asm instead, it is staged
    # in shared memory as fp16 and read with ldmatrix.trans. K is K-major, and
    # Triton reads its e4m3 bytes with ldmatrix already (converting K the same
    # way measured slower: more shared-memory traffic).
    if KV_FP8:
        if INTERPRET:
            k = k.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            v = v.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif SWAP_AB:
            k = k.to(tl.float8e4nv, bitcast=True)
            v = v.to(tl.float8e4nv, bitcast=True)
            if not FP8_QUERY:
                k = k.to(tl.float16)
        else:
            k = k.to(tl.float8e4nv, bitcast=True)
            if not FP8_QUERY:
                k = k.to(tl.float16)
            v = _e4m3_to_f16(v)
    elif INTERPRET:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    if SWAP_AB:
        s = tl.dot(k, q_op)  # [BLOCK_N, BLOCK_H]
        s = tl.where(valid[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
    else:
        s = tl.dot(q_op, tl.trans(k))  # [BLOCK_H, BLOCK_N]
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
    # A sub-tile can be wholly masked (window start, sequence end) before any
    # position was seen: keep exp2 away from (-inf) - (-inf).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    if SWAP_AB:
        p = tl.exp2(s - m_ref[None, :])
        acc = acc * alpha[None, :]
    else:
        p = tl.exp2(s - m_ref[:, None])
        acc = acc * alpha[:, None]

    if KV_FP8:
        if INTERPRET:
            # The interpreter's fp32 -> fp8 cast truncates; round exactly as the GPU does.
            p_op = fp8_e4m3_bits(p * P_SCALE).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            p_op = (p * P_SCALE).to(tl.float8e4nv)
            if not SWAP_AB:
                # The fp16-converted V takes an fp16 P; its values are still
                # e4m3's, so both forms compute the same products.
                p_op = p_op.to(tl.float16)
        # The denominator sums the rounded weights the MMA multiplies (in
        # P_SCALE units), so e4m3's rounding, and its flush of the tiny weights
        # of a long tail, cancels between numerator and denominator instead of
        # shrinking the output.
        p_w = p_op.to(tl.float32)
    else:
        if INTERPRET:
            p_op = p  # fp32 dot: keeps the CPU check tight; the GPU rounds P to bf16
        else:
            p_op = p.to(v.dtype)
        p_w = p
    if SWAP_AB:
        l_i = l_i * alpha + tl.sum(p_w, 0)
        if TWO_LEVEL:
            acc += tl.dot(tl.trans(v), p_op)
        else:
            acc = tl.dot(tl.trans(v), p_op, acc)
    else:
        if DEFER_SUM:
            # l_i is [BLOCK_H, BLOCK_N] here: per-position partial sums, reduced once
            # after the loop, so no tile waits on a cross-warp sum (NOTES.md v6).
            l_i = l_i * alpha[:, None] + p_w
        else:
            l_i = l_i * alpha + tl.sum(p_w, 1)
        if TWO_LEVEL:
            acc += tl.dot(p_op, v)
        else:
            acc = tl.dot(p_op, v, acc)
    return m_new, l_i, acc


@triton.jit
def _decode_attention_kernel(
    # tensors
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    k_scale_ptr, v_scale_ptr, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    # scalars
    sm_scale, window, num_splits,
    # strides (last dimension contiguous everywhere); the cache's are compiled
    # in, so every row address is a page base plus a constant (NOTES.md v5)
    stride_qb, stride_qh,
    stride_kb: tl.constexpr, stride_kt: tl.constexpr, stride_kh: tl.constexpr,
    stride_vb: tl.constexpr, stride_vt: tl.constexpr, stride_vh: tl.constexpr,
    stride_bt,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    # shapes
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SUB: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    # features
    KV_FP8: tl.constexpr,
    FP8_QUERY: tl.constexpr,
    HAS_K_SCALE: tl.constexpr,
    HAS_V_SCALE: tl.constexpr,
    K_SCALE_STRIDE: tl.constexpr,
    V_SCALE_STRIDE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    # how
    TWO_LEVEL: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DEFER_SUM: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    if PDL:
        gdc_wait()  # the previous kernel's writes (query, cache, tables) are visible after this

    seq_len = tl.load(seq_lens_ptr + seq)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    TILE = BLOCK_N * NUM_SUB
    first_tile = start // TILE
    end_tile = (seq_len + TILE - 1) // TILE
    # (tl.cdiv is not callable under the interpreter in Triton 3.9)
    tiles_per_split = (end_tile - first_tile + num_splits - 1) // num_splits
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, end_tile)

    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    q_head = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, HEAD_DIM)

    q = tl.load(q_ptr + seq * stride_qb + q_head[:, None] * stride_qh + offs_d[None, :], mask=h_mask[:, None], other=0.0)
    q = q.to(tl.float32)
    qk_scale = sm_scale * LOG2E
    if HAS_K_SCALE:
        qk_scale *= tl.load(k_scale_ptr + kv_head * K_SCALE_STRIDE)
    if FP8_QUERY:
        # One dynamic scale per program (its GQA group), computed here so the
        # query needs no separate quantisation pass.
        q_scale = tl.maximum(tl.max(tl.max(tl.abs(q), 1), 0) / 448.0, 1e-30)
        q_op = fp8_e4m3_bits(tl.math.div_rn(q, q_scale)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        qk_scale *= q_scale
    elif KV_FP8:
        # e4m3 K converts to fp16 in one instruction (to bf16 in two), and fp16
        # holds every e4m3 value; the query saturates at fp16's range.
        q_op = tl.minimum(tl.maximum(q, -65504.0), 65504.0).to(tl.float16)
    else:
        q_op = q.to(tl.bfloat16)
    if INTERPRET:
        # The interpreter's bf16 tl.dot is wrong; fp8/bf16 values are exact in fp32.
        q_op = q_op.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    if SWAP_AB:
        l_i = tl.zeros([BLOCK_H], tl.float32)
        q_op = tl.trans(q_op)
        acc = tl.zeros([HEAD_DIM, BLOCK_H], tl.float32)
    elif DEFER_SUM:
        l_i = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    else:
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)

    bt_row = block_tables_ptr + seq * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    # The block-table entries of the next tile are loaded one iteration ahead:
    # K/V addresses then never wait on a load issued in the same iteration, so
    # the page look-up's round trip leaves the loop's critical path.
    offs_n = tile_lo * TILE + tl.arange(0, BLOCK_N)
    pages0 = _load_pages(bt_row, offs_n, seq_len, PAGE_SIZE)
    if NUM_SUB == 2:
        pages1 = _load_pages(bt_row, offs_n + BLOCK_N, seq_len, PAGE_SIZE)
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE + tl.arange(0, BLOCK_N)
        k0, v0, valid0 = _load_tile(k_base, v_base, pages0, offs_n, seq_len, start, offs_d,
                                    stride_kb, stride_kt, stride_vb, stride_vt, PAGE_SIZE)
        if NUM_SUB == 2:
            k1, v1, valid1 = _load_tile(k_base, v_base, pages1, offs_n + BLOCK_N, seq_len, start, offs_d,
                                        stride_kb, stride_kt, stride_vb, stride_vt, PAGE_SIZE)
            pages1 = _load_pages(bt_row, offs_n + TILE + BLOCK_N, seq_len, PAGE_SIZE)
        pages0 = _load_pages(bt_row, offs_n + TILE, seq_len, PAGE_SIZE)
        m_i, l_i, acc = _attend_tile(k0, v0, valid0, q_op, qk_scale, m_i, l_i, acc,
                                     KV_FP8, FP8_QUERY, SWAP_AB, TWO_LEVEL, INTERPRET, DEFER_SUM)
        if NUM_SUB == 2:
            m_i, l_i, acc = _attend_tile(k1, v1, valid1, q_op, qk_scale, m_i, l_i, acc,
                                         KV_FP8, FP8_QUERY, SWAP_AB, TWO_LEVEL, INTERPRET, DEFER_SUM)

    if PDL:
        gdc_launch_dependents()  # the merge may be scheduled now; it waits for this grid's writes
    if DEFER_SUM:
        l_i = tl.sum(l_i, 1)
    out_scale = 1.0
    if KV_FP8:
        out_scale = 1.0 / P_SCALE
        l_i = l_i * (1.0 / P_SCALE)
    if HAS_V_SCALE:
        out_scale = out_scale * tl.load(v_scale_ptr + kv_head * V_SCALE_STRIDE)

    if IS_SPLIT:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = m_i + tl.log2(l_i)  # -inf for an empty split; the merge gives it weight 0
        tl.store(part_lse_ptr + seq * stride_pb + q_head * stride_ph + split * stride_ps, lse, mask=h_mask)
        part = part_out_ptr + seq * stride_pb * HEAD_DIM + split * stride_ps * HEAD_DIM
        if SWAP_AB:
            o = acc * (out_scale / l_safe)[None, :]
            tl.store(part + q_head[None, :] * stride_ph * HEAD_DIM + offs_d[:, None], o, mask=h_mask[None, :])
        else:
            o = acc * (out_scale / l_safe)[:, None]
            tl.store(part + q_head[:, None] * stride_ph * HEAD_DIM + offs_d[None, :], o, mask=h_mask[:, None])
    else:
        if HAS_SINKS:
            # The sink logit joins the denominator only.
            sink = tl.load(sinks_ptr + q_head, mask=h_mask, other=0.0) * LOG2E
            m_fin = tl.maximum(m_i, sink)
            corr = tl.exp2(m_i - m_fin)
            l_i = l_i * corr + tl.exp2(sink - m_fin)
            if SWAP_AB:
                acc = acc * corr[None, :]
            else:
                acc = acc * corr[:, None]
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        dst = out_ptr + seq * stride_ob
        if SWAP_AB:
            o = acc * (out_scale / l_safe)[None, :]
            tl.store(dst + q_head[None, :] * stride_oh + offs_d[:, None], o.to(out_ptr.dtype.element_ty), mask=h_mask[None, :])
        else:
            o = acc * (out_scale / l_safe)[:, None]
            tl.store(dst + q_head[:, None] * stride_oh + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr,
    num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    if PDL:
        gdc_wait()  # the split partials of the decode grid
        gdc_launch_dependents()
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


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    if query.dim() != 3 or query.stride(-1) != 1:
        raise ValueError(f"query: expected [batch, num_q_heads, head_dim] with a contiguous last dim, got {tuple(query.shape)}")
    if query.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"query: dtype {query.dtype}; expected bfloat16, float16 or float32")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dim() != 4 or c.stride(-1) != 1:
            raise ValueError(f"{name}: expected [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(c.shape)}")
        if c.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError(f"{name}: dtype {c.dtype} is not supported; expected bfloat16 or float8_e4m3fn")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError("key_cache and value_cache must have the same shape and dtype")
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {key_cache.shape[3]} != query head_dim {head_dim}")
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables: expected int32 [{batch}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables: the last dim must be contiguous")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens: expected int32 [{batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != query.device:
            raise ValueError(f"{name}: on {t.device}, query is on {query.device}")


@functools.cache
def _gluon_device(device_type: str, index: int | None) -> str:
    if device_type != "cuda" or _interpreting():
        return "it needs a CUDA GPU (Gluon does not run under the interpreter)"
    if torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device()) != (9, 0):
        return "it is written for sm_90 (Hopper)"
    try:
        from kvpolicy.kernels import decode_gluon  # noqa: F401
    except ImportError as exc:  # Gluon's API moves between Triton releases
        return f"this Triton has no usable Gluon ({exc})"
    return ""


def gluon_runs_on(device: torch.device) -> tuple[bool, str]:
    """Whether the Gluon kernel (`decode_gluon`) runs on `device`, and if not, why: an sm_90 GPU, no
    interpreter, and a Triton with the Gluon API it is written against."""
    why = _gluon_device(device.type, device.index)
    return not why, why


def _gluon_applies(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, fp8_query: bool,
                   config: DecodeConfig | None) -> tuple[bool, str]:
    """Whether the Gluon kernel can take this call, and if not, why."""
    if config is not None:
        return False, "an explicit DecodeConfig is for the Triton kernel"
    ok, why = gluon_runs_on(query.device)
    if not ok:
        return ok, why
    if not fp8_query or key_cache.dtype != torch.float8_e4m3fn:
        return False, "it handles FP8 caches with fp8_query=True only"
    from kvpolicy.kernels import decode_gluon

    return decode_gluon.supported(query, key_cache, value_cache)


def split_partials(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs [batch, heads, splits, head_dim] and log-sum-exps [batch, heads, splits] of a
    split call (`out` itself, unused, when there is one split)."""
    if splits == 1:
        return out, out
    batch, heads, head_dim = out.shape
    return (torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=out.device),
            torch.empty(batch, heads, splits, dtype=torch.float32, device=out.device))


def launch_merge(part_out: torch.Tensor, part_lse: torch.Tensor, sinks: torch.Tensor | None, out: torch.Tensor,
                 splits: int, pdl: bool) -> None:
    """Combine `split_partials` (written by either decode kernel) into `out`, sinks in the denominator."""
    batch, heads, head_dim = out.shape
    _decode_merge_kernel[(heads, batch)](
        part_out, part_lse, sinks if sinks is not None else part_lse, out,
        splits,
        heads * splits, splits, 1,
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_S=max(2, triton.next_power_of_2(splits)),
        HAS_SINKS=sinks is not None,
        PDL=pdl,
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )


def _span(block_tables: torch.Tensor, page_size: int, sliding_window: int | None, tile: int) -> int:
    """Longest context a call may attend, from the block table's capacity (no host sync): a window's
    worth plus a tile for windowed layers."""
    span = block_tables.shape[1] * page_size
    return span if sliding_window is None else min(span, sliding_window + tile)


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    two_level: bool = True,
    fp8_query: bool = False,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    kernel: str = "triton",
) -> torch.Tensor:
    """Attention of one new token per sequence over a paged KV cache; returns [batch, num_q_heads, head_dim].

    `query` [batch, num_q_heads, head_dim]; query head h reads KV head
    h // (num_q_heads // num_kv_heads). Sequence b attends to its first
    `seq_lens[b]` positions, found through `block_tables[b]` (only the last
    `sliding_window` of them when given). `sinks` (fp32 [num_q_heads]) are logits
    that join the softmax denominator only. K/V dequantise as stored * scale.
    `two_level` adds each tile's P.V into an fp32 accumulator (True) or carries
    the accumulation inside the MMA (False); on Hopper only the swapped form's
    fp8 MMA loses precision when it carries (the default form promotes fp8 to
    fp16 and accumulates in fp32 either way). `fp8_query` quantises the query to
    e4m3 (FP8 caches only). `num_splits` overrides the split-KV heuristic, which
    uses the block table's capacity, not `seq_lens`, so the call needs no host
    sync and can be captured in a CUDA graph. `out` (query dtype or float32) is
    written in place and returned; otherwise a tensor of the query dtype is.
    `kernel`: "triton" (this module, every case), "gluon" (`decode_gluon`, the Hopper
    TMA/wgmma kernel: FP8 cache with `fp8_query`, 16-token pages, head_dim 64/128; an error
    where it does not apply) or "auto" (gluon where it applies, else triton).
    """
    _check_inputs(query, key_cache, value_cache, block_tables, seq_lens)
    batch, num_q_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = key_cache.shape
    device = query.device
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    if fp8_query and not kv_fp8:
        raise ValueError("fp8_query needs an FP8 cache; the bfloat16 path multiplies in bf16")
    k_stride = check_scale(k_scale, "k_scale", num_kv_heads, device)
    v_stride = check_scale(v_scale, "v_scale", num_kv_heads, device)
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (num_q_heads,) or sinks.device != device):
        raise ValueError(f"sinks: expected float32 [{num_q_heads}] on {device}, got {sinks.dtype} {tuple(sinks.shape)}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be a positive number of positions, got {sliding_window}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype not in (query.dtype, torch.float32) or out.stride(-1) != 1 or out.device != device:
        raise ValueError(f"out: expected {tuple(query.shape)} of {query.dtype} or float32 on {device}, got {out.dtype} {tuple(out.shape)}")
    if batch == 0:
        return out
    if kernel not in ("triton", "gluon", "auto"):
        raise ValueError(f"kernel must be 'triton', 'gluon' or 'auto', got {kernel!r}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if kernel != "triton":
        gluon_ok, why = _gluon_applies(query, key_cache, value_cache, fp8_query, config)
        if gluon_ok:
            from kvpolicy.kernels import decode_gluon

            gcfg = decode_gluon.default_gluon_config(head_dim)
            splits = num_splits or split_count(
                batch, num_kv_heads, _span(block_tables, page_size, sliding_window, gcfg.block_n), gcfg.block_n,
                decode_gluon.programs_per_sm(head_dim, device, gcfg), device, waves=())
            return decode_gluon.decode_gluon(
                query, key_cache, value_cache, block_tables, seq_lens, k_scale=k_scale, v_scale=v_scale,
                k_stride=k_stride, v_stride=v_stride, sm_scale=float(head_dim**-0.5 if sm_scale is None else sm_scale),
                sliding_window=sliding_window, sinks=sinks, two_level=two_level, splits=splits, out=out, config=gcfg)
        if kernel == "gluon":
            raise ValueError(f"kernel='gluon' does not apply here: {why}")

    cfg = config or default_config(head_dim, kv_fp8, device)
    if cfg.swap_ab and cfg.block_n % 64:
        raise ValueError(f"swap_ab needs block_n a multiple of 64, got {cfg.block_n}")
    if cfg.swap_ab and cfg.num_stages < 2 and device.type == "cuda":
        # Seen on an H200 with Triton 3.6: the swapped (wgmma) form with one
        # stage gave wrong results (relative error ~0.5); two or more matched.
        raise ValueError("swap_ab needs num_stages >= 2")
    if cfg.num_sub not in (1, 2):
        raise ValueError(f"num_sub must be 1 or 2, got {cfg.num_sub}")
    splits = num_splits or choose_num_splits(
        batch, num_kv_heads, _span(block_tables, page_size, sliding_window, cfg.block_n * cfg.num_sub), cfg, device)
    group = num_q_heads // num_kv_heads
    is_split = splits > 1
    part_out, part_lse = split_partials(out, splits)
    kc = key_cache.view(torch.uint8) if kv_fp8 else key_cache
    vc = value_cache.view(torch.uint8) if kv_fp8 else value_cache
    dummy = seq_lens
    pdl = use_pdl(device)
    _decode_attention_kernel[(num_kv_heads, splits, batch)](
        query, kc, vc, block_tables, seq_lens,
        k_scale if k_scale is not None else dummy, v_scale if v_scale is not None else dummy,
        sinks if sinks is not None else dummy, out, part_out, part_lse,
        float(head_dim**-0.5 if sm_scale is None else sm_scale), int(sliding_window or 0), splits,
        query.stride(0), query.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_q_heads * splits, splits, 1,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=cfg.block_n,
        NUM_SUB=cfg.num_sub,
        PAGE_SIZE=page_size,
        KV_FP8=kv_fp8,
        FP8_QUERY=fp8_query,
        HAS_K_SCALE=k_scale is not None,
        HAS_V_SCALE=v_scale is not None,
        K_SCALE_STRIDE=k_stride,
        V_SCALE_STRIDE=v_stride,
        HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None and not is_split,
        IS_SPLIT=is_split,
        TWO_LEVEL=two_level,
        SWAP_AB=cfg.swap_ab,
        DEFER_SUM=cfg.defer_sum and not cfg.swap_ab,
        INTERPRET=_interpreting(),
        PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
        **({"launch_pdl": True} if pdl else {}),
    )
    if is_split:
        launch_merge(part_out, part_lse, sinks, out, splits, pdl)
    return out
