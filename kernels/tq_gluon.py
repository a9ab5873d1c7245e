"""Hopper TurboQuant decode in Gluon: keys unpacked into the score wgmma's register operand, tokens as M.

An experiment against the Triton kernel (`tq_decode.py`), which is issue-bound (bench/NOTES_TQ.md):
per (token, KV head) it spends 45-53 warp-instructions, a quarter on byte shuffles that bring codes
into `tl.dot`'s operand layout and a quarter on the softmax of 16 padded MMA rows. Here, with explicit
layouts:
- key bytes load from global memory straight into the register layout of the wgmma A operand (the
  tile's tokens as M), are unpacked there by the Triton kernel's PTX programs (sign-magnitude 4-bit
  look-ups, or e4m3 -> fp16 for k8v4) and multiplied by the rotated query in shared memory: the
  dequantized keys never leave registers;
- value codes load as int16 pairs, become exact fp16 integers (`v4_pairs_program`) in shared memory;
  the per-token scale folds into P and the zero point into a per-column sum; O^T = codes^T.(P*scale)^T
  is an fp16 wgmma, summed per tile in fp32 registers;
- the softmax runs on [tile, 8] (the GQA group padded to 8, not 16) over 128 threads;
- the bytes of tile i+1 load while tile i is computed, the page ids of tile i+2 a step earlier.
No TMA: a TMA copy must start on a 16-byte boundary (bench/probe_tma_alignment.py), and a head's slot in
vLLM's NHD page starts at h x slot bytes (134 or 196 at head_dim 128), a multiple of 2 only.

Measured on an H200 (bench/probe_tq_gluon.py, NOTES_TQ.md sixth session): 0.86-1.2x the Triton kernel's
time, not the step the issue needs; the sm_90 loop still issues ~35 warp-instructions per slot.

Scope: `turboquant_k8v4` and `turboquant_4bit_nc`, head_dim 64 or 128, GQA groups up to 8, 16-token
pages of a contiguous NHD cache, sm_90. Gluon does not run under the interpreter: this kernel is
tested on the GPU only (tests/kernels/test_tq_gluon.py), against the same float64 reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from kvpolicy.kernels.turboquant import k4_program, render_ptx, tq_layout, v4_pairs_program

PAGE = 16
"""Page size (vLLM's default block size)."""
HEAD_DIMS = (64, 128)
"""Head dims it takes."""
MAX_GROUP = 8
"""Largest GQA group: the N of the score MMA is 8."""
FORMATS = ("turboquant_k8v4", "turboquant_4bit_nc")
"""Formats it decodes (4-bit values; FP8 or 4-bit sign-magnitude keys)."""

_K4_ASM = gl.constexpr(render_ptx(k4_program()))
_V4_ASM = gl.constexpr(render_ptx(v4_pairs_program()))

# Layouts (one warpgroup, 4 warps). S^T [BN, 8] and O^T [D, 8] are wgmma accumulators with the tile's
# tokens (or the head dim) as M; keys are the A operand of the score wgmma, straight from registers.
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16]))
A_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=S_LAYOUT.value, k_width=2))
ROW_S = gl.constexpr(gl.SliceLayout(1, S_LAYOUT.value))


@gluon.jit
def _slot_base(bt_row, tile, seq_len, kvh, L: gl.constexpr, BN: gl.constexpr, SLOT: gl.constexpr,
               NUM_KV: gl.constexpr):
    """Byte offset of each token's slot of tile `tile` (rows of layout L); page 0 past the sequence (masked
    later; the table may hold anything there)."""
    t = tile * BN + gl.arange(0, BN, layout=L)
    page = gl.load(bt_row + t // 16, mask=t < seq_len, other=0)
    return page.to(gl.int64) * (16 * NUM_KV * SLOT) + ((t % 16) * NUM_KV + kvh) * SLOT


@gluon.jit
def _load_tile(cache_ptr, cache16_ptr, base_k, base_v, base_f, KW: gl.constexpr, HALF: gl.constexpr,
               V_OFF: gl.constexpr, KNORM_OFF: gl.constexpr, VSCALE_OFF: gl.constexpr, VZERO_OFF: gl.constexpr,
               KEY_FP8: gl.constexpr, V_LAYOUT: gl.constexpr):
    """The packed bytes of one tile, each in the register layout its consumer wants: key bytes in the wgmma
    A layout, value codes as int16 pairs, the fp16 fields in the score rows' layout."""
    kc = gl.load(cache_ptr + base_k[:, None] + gl.arange(0, KW, layout=gl.SliceLayout(0, A_LAYOUT))[None, :])
    cols_v = gl.arange(0, HALF // 2, layout=gl.SliceLayout(0, V_LAYOUT))
    vc = gl.load(cache16_ptr + (base_v // 2)[:, None] + (V_OFF // 2 + cols_v)[None, :])
    f = cache16_ptr + base_f // 2
    knorm = gl.full(base_f.shape, 1.0, gl.float32, layout=ROW_S)
    if not KEY_FP8:
        knorm = gl.load(f + KNORM_OFF // 2).to(gl.float16, bitcast=True).to(gl.float32)
    vscale = gl.load(f + VSCALE_OFF // 2).to(gl.float16, bitcast=True).to(gl.float32)
    vzero = gl.load(f + VZERO_OFF // 2).to(gl.float16, bitcast=True).to(gl.float32)
    return kc, vc, knorm, vscale, vzero


@gluon.jit
def _attend(kc, vc, knorm, vscale, vzero, q_smem, qh_smem, v16_smem, p_smem, m_i, l_part, z_part, acc,
            tile_start, seq_len, start, HEAD_DIM: gl.constexpr, BN: gl.constexpr, KEY_FP8: gl.constexpr,
            EDGE: gl.constexpr):
    """One tile: keys unpacked in registers into the score wgmma, value codes to fp16 in shared memory,
    online softmax with the value scale folded into P, P.V. Returns the updated state. EDGE: the tile
    reaches outside [start, seq_len) (a second compiled copy keeps the masks off the common path)."""
    HALF: gl.constexpr = HEAD_DIM // 2
    s0 = gl.zeros([BN, 8], gl.float32, layout=S_LAYOUT)
    if KEY_FP8:
        k16 = kc.to(gl.float8e4nv, bitcast=True).to(gl.float16)
        s = warpgroup_mma(k16, q_smem.permute((1, 0)), s0, use_acc=False, is_async=True)
    else:
        # byte j holds coordinate j (low nibble) and j + D/2 (high nibble)
        k_lo, k_hi = gl.inline_asm_elementwise(_K4_ASM, "=r,=r,=r,=r,r", [kc], dtype=(gl.float16, gl.float16),
                                               is_pure=True, pack=4)
        s = warpgroup_mma(k_lo, q_smem.permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma(k_hi, qh_smem.permute((1, 0)), s, is_async=True)

    # While it runs: value codes to exact fp16 integers. Every warp is past the previous tile's P.V
    # (its wait), so V16 may be rewritten.
    gl.thread_barrier()
    b0_lo, b1_lo, b0_hi, b1_hi = gl.inline_asm_elementwise(
        _V4_ASM, "=r,=r,=r,=r,r", [vc], dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=2)
    v16_smem.slice(0, HALF, dim=1).store(gl.reshape(gl.join(b0_lo, b1_lo), [BN, HALF]))
    v16_smem.slice(HALF, HALF, dim=1).store(gl.reshape(gl.join(b0_hi, b1_hi), [BN, HALF]))  # 16 x code

    if KEY_FP8:
        s, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s, k16, q_smem))
    else:
        s, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s, k_lo, k_hi, q_smem, qh_smem))
        s = s * knorm[:, None]
    if EDGE:
        # Stale slots may hold NaN norms and scales: masked scores, zero scale and zero point.
        pos = tile_start + gl.arange(0, BN, layout=ROW_S)
        ok = (pos < seq_len) & (pos >= start)
        s = gl.where(ok[:, None], s, float("-inf"))
        vscale = gl.where(ok, vscale, 0.0)
        vzero = gl.where(ok, vzero, 0.0)

    # ---- online softmax over the tile's tokens (rows); denominators and zero-point sums per position ----
    m_new = gl.maximum(m_i, gl.max(s, 0))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[None, :])
    l_part = l_part * alpha[None, :] + p
    z_part = z_part * alpha[None, :] + p * vzero[:, None]
    p_smem.store(gl.permute((p * vscale[:, None]).to(gl.float16), (1, 0)))
    fence_async_shared()
    gl.thread_barrier()

    # ---- O^T += codes^T . (P * scale)^T, summed per tile in fp32 registers (two-level) ----
    pv = warpgroup_mma(v16_smem.permute((1, 0)), p_smem.permute((1, 0)),
                       gl.zeros([HEAD_DIM, 8], gl.float32, layout=S_LAYOUT), use_acc=False, is_async=True)
    pv, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(pv, v16_smem, p_smem))
    acc = acc * alpha[None, :] + pv
    return m_new, l_part, z_part, acc


@gluon.jit
def _tq_gluon_kernel(
    q_ptr, cache_ptr, cache16_ptr, block_tables_ptr, seq_lens_ptr, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    q_scale, window, num_splits,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
    GROUP: gl.constexpr, NUM_KV: gl.constexpr, HEAD_DIM: gl.constexpr, SLOT: gl.constexpr, BN: gl.constexpr,
    KEY_FP8: gl.constexpr, V_OFF: gl.constexpr, KNORM_OFF: gl.constexpr, VSCALE_OFF: gl.constexpr,
    VZERO_OFF: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr, IS_SPLIT: gl.constexpr,
):
    kvh = gl.program_id(0)
    split = gl.program_id(1)
    seq = gl.program_id(2)
    HALF: gl.constexpr = HEAD_DIM // 2
    KW: gl.constexpr = HEAD_DIM if KEY_FP8 else HALF  # key bytes per slot, and the K of the score MMA
    V_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HALF // 16), HALF // 16], [4, 1], [1, 0])
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (KW // 8), KW // 8], [4, 1], [1, 0])

    v16_smem = gl.allocate_shared_memory(gl.float16, [BN, HEAD_DIM],
                                         gl.NVMMASharedLayout.get_default_for([BN, HEAD_DIM], gl.float16))
    p_smem = gl.allocate_shared_memory(gl.float16, [8, BN], gl.NVMMASharedLayout.get_default_for([8, BN], gl.float16))
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, KW], gl.float16)
    q_smem = gl.allocate_shared_memory(gl.float16, [8, KW], q_smem_layout)
    qh_smem = gl.allocate_shared_memory(gl.float16, [8, KW], q_smem_layout)

    seq_len = gl.load(seq_lens_ptr + seq)
    start = 0
    if HAS_WINDOW:
        start = gl.maximum(seq_len - window, 0)
    first_tile = start // BN
    end_tile = (seq_len + BN - 1) // BN
    tiles_per_split = (end_tile - first_tile + num_splits - 1) // num_splits
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = gl.minimum(tile_lo + tiles_per_split, end_tile)

    # The GQA group's query (rotated and scaled for centroid keys) in fp16; two halves of the head for
    # 4-bit keys (byte j of the codes holds coordinates j and j + D/2).
    offs_qh = gl.arange(0, 8, layout=gl.SliceLayout(1, q_layout))
    offs_qd = gl.arange(0, KW, layout=gl.SliceLayout(0, q_layout))
    q_rows = q_ptr + seq * stride_qb + (kvh * GROUP + offs_qh)[:, None] * stride_qh + offs_qd[None, :]
    q_mask = (offs_qh < GROUP)[:, None]
    q_smem.store((gl.load(q_rows, mask=q_mask, other=0.0).to(gl.float32) * q_scale).to(gl.float16))
    if not KEY_FP8:
        qh_smem.store((gl.load(q_rows + HALF, mask=q_mask, other=0.0).to(gl.float32) * q_scale).to(gl.float16))
    fence_async_shared()
    gl.thread_barrier()

    m_i = gl.full([8], float("-inf"), gl.float32, layout=gl.SliceLayout(0, S_LAYOUT))
    l_part = gl.zeros([BN, 8], gl.float32, layout=S_LAYOUT)
    z_part = gl.zeros([BN, 8], gl.float32, layout=S_LAYOUT)
    acc = gl.zeros([HEAD_DIM, 8], gl.float32, layout=S_LAYOUT)

    # Software pipeline: the bytes of tile i+1 are loaded while tile i is computed, and the page ids of
    # tile i+2 one step earlier still (the loads the byte addresses depend on).
    bt_row = block_tables_ptr + seq * stride_bt
    RK: gl.constexpr = gl.SliceLayout(1, A_LAYOUT)
    RV: gl.constexpr = gl.SliceLayout(1, V_LAYOUT)
    bk = _slot_base(bt_row, tile_lo, seq_len, kvh, RK, BN, SLOT, NUM_KV)
    bv = _slot_base(bt_row, tile_lo, seq_len, kvh, RV, BN, SLOT, NUM_KV)
    bf = _slot_base(bt_row, tile_lo, seq_len, kvh, ROW_S, BN, SLOT, NUM_KV)
    kc, vc, knorm, vscale, vzero = _load_tile(cache_ptr, cache16_ptr, bk, bv, bf, KW, HALF, V_OFF, KNORM_OFF,
                                              VSCALE_OFF, VZERO_OFF, KEY_FP8, V_LAYOUT)
    bk = _slot_base(bt_row, tile_lo + 1, seq_len, kvh, RK, BN, SLOT, NUM_KV)
    bv = _slot_base(bt_row, tile_lo + 1, seq_len, kvh, RV, BN, SLOT, NUM_KV)
    bf = _slot_base(bt_row, tile_lo + 1, seq_len, kvh, ROW_S, BN, SLOT, NUM_KV)
    for tile in range(tile_lo, tile_hi):
        nkc, nvc, nknorm, nvscale, nvzero = _load_tile(cache_ptr, cache16_ptr, bk, bv, bf, KW, HALF, V_OFF,
                                                       KNORM_OFF, VSCALE_OFF, VZERO_OFF, KEY_FP8, V_LAYOUT)
        bk = _slot_base(bt_row, tile + 2, seq_len, kvh, RK, BN, SLOT, NUM_KV)
        bv = _slot_base(bt_row, tile + 2, seq_len, kvh, RV, BN, SLOT, NUM_KV)
        bf = _slot_base(bt_row, tile + 2, seq_len, kvh, ROW_S, BN, SLOT, NUM_KV)
        tile_start = tile * BN
        if (tile_start < start) | (tile_start + BN > seq_len):
            m_i, l_part, z_part, acc = _attend(kc, vc, knorm, vscale, vzero, q_smem, qh_smem, v16_smem, p_smem,
                                               m_i, l_part, z_part, acc, tile_start, seq_len, start, HEAD_DIM, BN,
                                               KEY_FP8, True)
        else:
            m_i, l_part, z_part, acc = _attend(kc, vc, knorm, vscale, vzero, q_smem, qh_smem, v16_smem, p_smem,
                                               m_i, l_part, z_part, acc, tile_start, seq_len, start, HEAD_DIM, BN,
                                               KEY_FP8, False)
        kc, vc, knorm, vscale, vzero = nkc, nvc, nknorm, nvscale, nvzero

    col: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    l_i = gl.sum(l_part, 0)
    z_i = gl.sum(z_part, 0)
    offs_h = gl.arange(0, 8, layout=col)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, S_LAYOUT))
    h_mask = offs_h < GROUP
    q_head = kvh * GROUP + offs_h
    # rows D/2.. hold 16 x the high-nibble codes; out = codes . (P * scale) + sum(P * zero)
    acc = acc * gl.where(offs_d < HALF, 1.0, 0.0625)[:, None] + z_i[None, :]
    if IS_SPLIT:
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        lse = m_i + gl.log2(l_i)  # -inf for an empty split: the merge gives it weight 0
        row = seq * (NUM_KV * GROUP) + q_head
        gl.store(part_lse_ptr + row * num_splits + split, lse, mask=h_mask)
        o = acc / l_safe[None, :]
        gl.store(part_out_ptr + ((row * num_splits + split) * HEAD_DIM)[None, :] + offs_d[:, None], o,
                 mask=h_mask[None, :])
    else:
        if HAS_SINKS:
            # The sink logit joins the denominator only.
            sink = gl.load(sinks_ptr + q_head, mask=h_mask, other=0.0) * 1.4426950408889634
            m_fin = gl.maximum(m_i, sink)
            corr = gl.exp2(m_i - m_fin)
            l_i = l_i * corr + gl.exp2(sink - m_fin)
            acc = acc * corr[None, :]
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[None, :]
        gl.store(out_ptr + seq * stride_ob + (q_head * stride_oh)[None, :] + offs_d[:, None],
                 o.to(out_ptr.dtype.element_ty), mask=h_mask[None, :])


@dataclass(frozen=True)
class TQGluonConfig:
    """Launch configuration of the Gluon TurboQuant kernel; `default_config` picks one."""

    block_n: int = 64
    """Tokens per tile (64 or 128): the M of the score MMA."""
    maxnreg: int | None = None
    """Register cap per thread (None: the compiler's choice); lower caps hold more programs per SM."""


def default_config(head_dim: int) -> TQGluonConfig:
    """64-token tiles, no register cap: the sm_90 compile of 128-token tiles needs 255 registers and
    spills with the next tile's bytes held in registers (bench/probe_tq_gluon.py sweeps both)."""
    return TQGluonConfig(block_n=64)


def smem_bytes(head_dim: int, cfg: TQGluonConfig) -> int:
    """Shared memory of one program: the fp16 value-code tile, P, the two query tiles and 1 KB of the
    compiler's scratch (the cross-warp max)."""
    return cfg.block_n * head_dim * 2 + 8 * cfg.block_n * 2 + 2 * 8 * head_dim * 2 + 1024


def programs_per_sm(head_dim: int, device: torch.device, cfg: TQGluonConfig) -> int:
    """Programs resident per SM: one warpgroup of `maxnreg` registers (the compile measured ~168 without a
    cap) and the shared memory."""
    from kvpolicy.kernels.decode_attention import resident_programs

    return resident_programs(cfg.maxnreg or 168, smem_bytes(head_dim, cfg), 4, device)


def supported(query: torch.Tensor, cache: torch.Tensor, fmt: str) -> tuple[bool, str]:
    """Whether this kernel decodes these tensors, and if not, why (the caller falls back to Triton; the
    device is `decode_attention.gluon_runs_on`'s to check)."""
    if fmt not in FORMATS:
        return False, f"it decodes {' and '.join(FORMATS)} only"
    _, page, heads, _ = cache.shape
    d = query.shape[2]
    if d not in HEAD_DIMS:
        return False, f"head_dim {d}: it takes {' or '.join(map(str, HEAD_DIMS))}"
    if query.shape[1] // heads > MAX_GROUP:
        return False, f"GQA groups above {MAX_GROUP} query heads per KV head"
    if page != PAGE:
        return False, f"it needs {PAGE}-token pages"
    return True, ""


def decode_tq_gluon(query: torch.Tensor, q16: torch.Tensor, q_scale: float, cache: torch.Tensor, fmt: str,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, *, sliding_window: int | None,
                    sinks: torch.Tensor | None, splits: int, out: torch.Tensor,
                    config: TQGluonConfig | None = None) -> torch.Tensor:
    """Run the kernel (and the shared merge when split). `q16`: the query the score MMA reads (the
    rotated fp16 query for centroid keys, `query` itself for FP8 keys), times `q_scale` in the kernel.
    Inputs already validated by `decode_attention_tq` (contiguous cache, 16-token pages)."""
    from kvpolicy.kernels.decode_attention import launch_merge, split_partials

    batch, num_q_heads, head_dim = query.shape
    cfg = config or default_config(head_dim)
    if cfg.block_n not in (64, 128):
        raise ValueError(f"TQGluonConfig: block_n must be 64 or 128, got {cfg}")
    lay = tq_layout(fmt, head_dim)
    num_kv_heads = cache.shape[2]
    part_out, part_lse = split_partials(out, splits)
    _tq_gluon_kernel[(num_kv_heads, splits, batch)](
        q16, cache, cache.view(torch.int16), block_tables, seq_lens, sinks if sinks is not None else seq_lens,
        out, part_out, part_lse, float(q_scale), int(sliding_window or 0), splits,
        q16.stride(0), q16.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, SLOT=lay.slot_bytes,
        BN=cfg.block_n, KEY_FP8=lay.key_fp8, V_OFF=lay.val_off, KNORM_OFF=max(lay.knorm_off, 0),
        VSCALE_OFF=lay.vscale_off, VZERO_OFF=lay.vzero_off,
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None and splits == 1,
        IS_SPLIT=splits > 1, num_warps=4, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    if splits > 1:
        launch_merge(part_out, part_lse, sinks, out, splits, pdl=False)
    return out
