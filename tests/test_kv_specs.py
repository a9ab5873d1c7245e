"""KV bytes, groups, blocks and capacity of real configs, against vLLM 0.33's formulas and its own code.

Two independent checks of `kvpolicy.facts.kv_memory`:

- `HAND`: for every fixture (tests/fixtures/hf, sources in SOURCES.md), the numbers worked
  out by hand from vLLM's formulas, written as the arithmetic itself (vllm-kvspec notation:
  H KV heads per rank, D/Dv head sizes, bs block tokens, L = max_model_len, MIF = in-flight
  tokens = 2 x max_num_batched_tokens = 16384 on H100). Sliding layers hold
  cdiv(min(W - 1 + MIF, L), bs) + 1 blocks, chunked cdiv(min(C + MIF, L), bs), Mamba groups
  3 blocks (2 + a prefill checkpoint block: Mamba-2, FlashInfer GDN) or 2 (Mamba-1).
- `test_vllm_plans_the_same_cache`: where vLLM 0.33's CPU build is installed (`VLLM033_PYTHON`,
  default /work/venv033/bin/python; skipped otherwise), `tests/vllm033_planning.py` builds vLLM's
  own specs for the same layers and runs its block-size alignment, grouping and capacity code.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvpolicy.facts.kv_memory import Layout, indexer_bytes_per_token, plan
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.catalog import resolve_gpu
from kvpolicy.inputs.hfconfig import arch_from_hf_config, load_hf_config

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
H100, B200, A100 = resolve_gpu("h100"), resolve_gpu("b200"), resolve_gpu("a100")
AVAILABLE = 40 << 30
"""A KV budget per rank for the capacity checks (vLLM's `available_memory`)."""
L = 32768
MIF = 16384


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sw(window: int, bs: int = 16, mif: int = MIF, length: int = L) -> int:
    """Blocks one request holds in a sliding-window group (SlidingWindowSpec.max_admission_blocks_per_request)."""
    return cdiv(min(window - 1 + mif, length), bs) + 1


def arch_of(name: str) -> ModelArch:
    return load_hf_config(FIXTURES / name)


# (fixture, dtype, skip layers, gpu, expected). Expected: bytes/token/rank per kind, the block size after
# vLLM's alignment, bytes per block (the widest group), blocks per request at L = 32k, and the part of the
# request held as recurrent state. Defaults: BF16 model dtype (2 bytes), TP 1, H100 (MIF 16384).
HAND: list[tuple[str, str, tuple[str, ...], Any, dict[str, Any]]] = [
    # Llama-3.1-8B: 32 full layers, H 8, D 128: 8*(128+128)*2 = 4096 B/token/layer; page 16 x 4096.
    ("llama-3.1-8b-instruct", "auto", (), H100,
     dict(kinds={"full": 32 * 8 * 256 * 2}, block=16, bpb=32 * 16 * 4096, bpr=L // 16)),
    ("llama-3.1-8b-instruct", "fp8", (), H100,
     dict(kinds={"full": 32 * 8 * 256}, block=16, bpb=32 * 16 * 2048, bpr=L // 16)),
    # int8_per_token_head: (D + Dv) + 2 fp32 scales per head (TritonAttentionBackend.customize_spec).
    ("llama-3.1-8b-instruct", "int8_per_token_head", (), H100,
     dict(kinds={"full": 32 * 8 * (256 + 8)}, block=16, bpb=32 * 16 * 8 * 264, bpr=L // 16)),
    # nvfp4: K and V slots of D/2 + D/16 bytes each (FlashInferBackend.customize_spec): 2*(64+8) = 144 per head.
    ("llama-3.1-8b-instruct", "nvfp4", (), H100,
     dict(kinds={"full": 32 * 8 * 144}, block=16, bpb=32 * 16 * 8 * 144, bpr=L // 16)),
    # turboquant_k8v4: slot 128 + (64 + 4) = 196; boundary layers 0, 1, 30, 31 stay BF16 (4096). Layer 0's
    # backend is FA: primary page 8*256*1 = 2048, padded 4096 -> block 16*cdiv(4096*16, 16*2048) = 32;
    # one mixed group: 4*32*4096 + 28*32*8*196.
    ("llama-3.1-8b-instruct", "turboquant_k8v4", (), H100,
     dict(kinds={"full": 4 * 4096 + 28 * 8 * 196}, block=32, bpb=4 * 32 * 4096 + 28 * 32 * 1568, bpr=L // 32)),
    ("llama-3.3-70b-instruct", "auto", (), H100,
     dict(kinds={"full": 80 * 4096}, block=16, bpb=80 * 16 * 4096, bpr=L // 16)),
    ("mistral-7b-instruct-v0.3", "auto", (), H100,
     dict(kinds={"full": 32 * 4096}, block=16, bpb=32 * 16 * 4096, bpr=L // 16)),
    ("mixtral-8x7b", "auto", (), H100, dict(kinds={"full": 32 * 4096}, block=16, bpb=32 * 16 * 4096, bpr=L // 16)),
    # Phi-4: 40 layers, H 10, D 128 (hidden 5120 / 40): 10*256*2 = 5120.
    ("phi-4", "auto", (), H100, dict(kinds={"full": 40 * 5120}, block=16, bpb=40 * 16 * 5120, bpr=L // 16)),
    ("devstral-small-2-24b-instruct", "auto", (), H100,
     dict(kinds={"full": 40 * 4096}, block=16, bpb=40 * 16 * 4096, bpr=L // 16)),
    # Qwen2.5-VL-7B: 28 layers, H 4, D 128 (3584 / 28): 4*256*2 = 2048.
    ("qwen2.5-vl-7b-instruct", "auto", (), H100,
     dict(kinds={"full": 28 * 2048}, block=16, bpb=28 * 16 * 2048, bpr=L // 16)),
    ("qwen3-8b", "auto", (), H100, dict(kinds={"full": 36 * 4096}, block=16, bpb=36 * 16 * 4096, bpr=L // 16)),
    ("qwen3-30b-a3b", "auto", (), H100, dict(kinds={"full": 48 * 2048}, block=16, bpb=48 * 16 * 2048, bpr=L // 16)),
    ("qwen3-30b-a3b-instruct-2507", "auto", (), H100,
     dict(kinds={"full": 48 * 2048}, block=16, bpb=48 * 16 * 2048, bpr=L // 16)),
    # ModelOpt kv_cache_quant_algo FP8 (hf_quant_config.json): auto becomes fp8_e4m3, 4*256*1 per layer.
    ("qwen3-30b-a3b-nvfp4", "auto", (), H100,
     dict(kinds={"full": 48 * 1024}, block=16, bpb=48 * 16 * 1024, bpr=L // 16)),
    ("qwen3-vl-235b-a22b-thinking", "auto", (), H100,
     dict(kinds={"full": 94 * 2048}, block=16, bpb=94 * 16 * 2048, bpr=L // 16)),
    ("glm-4.5-air", "auto", (), H100, dict(kinds={"full": 46 * 4096}, block=16, bpb=46 * 16 * 4096, bpr=L // 16)),
    ("glm-4.7-fp8", "auto", (), H100, dict(kinds={"full": 92 * 4096}, block=16, bpb=92 * 16 * 4096, bpr=L // 16)),
    ("minimax-m2", "auto", (), H100, dict(kinds={"full": 62 * 4096}, block=16, bpb=62 * 16 * 4096, bpr=L // 16)),
    # ModelOpt NVFP4 weights without a KV scheme: auto stays BF16.
    ("minimax-m2.7-nvfp4", "auto", (), H100,
     dict(kinds={"full": 62 * 4096}, block=16, bpb=62 * 16 * 4096, bpr=L // 16)),
    ("hy3-fp8", "auto", (), H100, dict(kinds={"full": 80 * 4096}, block=16, bpb=80 * 16 * 4096, bpr=L // 16)),
    # gpt-oss-20b: even layers sliding (W 128), H 8, D 64: 8*128*2 = 2048; 12 + 12 layers -> 2 groups of 12.
    # Sliding: cdiv(min(127 + 16384, 32768), 16) + 1 = 1033 blocks (16,528 tokens held).
    ("gpt-oss-20b", "auto", (), H100,
     dict(kinds={"full": 12 * 2048, "sliding": 12 * 2048}, block=16, bpb=12 * 16 * 2048, bpr=L // 16 + sw(128))),
    # fp8 + skip sliding_window: primary page 1024, padded 2048 -> block 16*cdiv(2048*16, 16*1024) = 32; the BF16
    # sliding layers keep 16-token blocks padded to 32*1024; full layers fp8 with 32-token blocks.
    ("gpt-oss-20b", "fp8", ("sliding_window",), H100,
     dict(kinds={"full": 12 * 1024, "sliding": 12 * 2048}, block=32, bpb=12 * 32 * 1024, bpr=L // 32 + sw(128))),
    # B200 (>= 160 GiB): max_num_batched_tokens 16384, MIF 32768: the window reaches L.
    ("gpt-oss-20b", "auto", (), B200,
     dict(kinds={"full": 12 * 2048, "sliding": 12 * 2048}, block=16, bpb=12 * 16 * 2048,
          bpr=L // 16 + sw(128, mif=32768))),
    # A100 (name a100): max_num_batched_tokens 2048, MIF 4096.
    ("gpt-oss-20b", "auto", (), A100,
     dict(kinds={"full": 12 * 2048, "sliding": 12 * 2048}, block=16, bpb=12 * 16 * 2048,
          bpr=L // 16 + sw(128, mif=4096))),
    ("gpt-oss-120b", "auto", (), H100,
     dict(kinds={"full": 18 * 2048, "sliding": 18 * 2048}, block=16, bpb=18 * 16 * 2048, bpr=L // 16 + sw(128))),
    # Gemma-3-12B: layers 5, 11, ... full (8), 40 sliding W 1024; H 8, D 256: 8*512*2 = 8192; 1 full + 5
    # sliding groups of 8 layers.
    ("gemma-3-12b-it", "auto", (), H100,
     dict(kinds={"full": 8 * 8192, "sliding": 40 * 8192}, block=16, bpb=8 * 16 * 8192,
          bpr=L // 16 + 5 * sw(1024))),
    ("gemma-3-12b-it", "fp8", ("sliding_window",), H100,
     dict(kinds={"full": 8 * 4096, "sliding": 40 * 8192}, block=32, bpb=8 * 16 * 8192,
          bpr=L // 32 + 5 * sw(1024))),
    # Gemma-3-4B (Gemma3TextConfig defaults: H 4, D 256): 5 full + 29 sliding -> 6 sliding groups of 5 (1 padding).
    ("gemma-3-4b-it", "auto", (), H100,
     dict(kinds={"full": 5 * 4096, "sliding": 29 * 4096}, block=16, bpb=5 * 16 * 4096, bpr=L // 16 + 6 * sw(1024))),
    # Gemma-3-27B: 10 full + 52 sliding (H 16, D 128: 8192) -> 6 sliding groups of 10 slots (8 padding layers).
    ("gemma-3-27b-it", "auto", (), H100,
     dict(kinds={"full": 10 * 8192, "sliding": 52 * 8192}, block=16, bpb=10 * 16 * 8192,
          bpr=L // 16 + 6 * sw(1024))),
    ("medgemma-27b-it", "auto", (), H100,
     dict(kinds={"full": 10 * 8192, "sliding": 52 * 8192}, block=16, bpb=10 * 16 * 8192,
          bpr=L // 16 + 6 * sw(1024))),
    # Gemma-4-31B: sliding H 16, D 256 (16384 B); full H 4 (num_global_key_value_heads), D 512
    # (global_head_dim): 4*1024*2 = 8192; the full page divides the sliding one -> full block 32.
    ("gemma-4-31b-it", "auto", (), H100,
     dict(kinds={"full": 10 * 8192, "sliding": 50 * 16384}, block=16, bpb=10 * 16 * 16384,
          bpr=L // 32 + 5 * sw(1024))),
    # Gemma-4-E2B: layers 15-34 share KV (no spec); 12 sliding (1 head x 256: 1024 B), 3 full (1 x 512: 2048 B);
    # sliding block scaled to 32 tokens; 4 sliding groups of 3 layers.
    ("gemma-4-e2b", "auto", (), H100,
     dict(kinds={"full": 3 * 2048, "sliding": 12 * 1024}, block=16, bpb=3 * 16 * 2048,
          bpr=L // 16 + 4 * sw(512, bs=32))),
    # MiMo-V2.5: 9 full (H 4, D 192, Dv 128: 4*320*2 = 2560), 39 SWA (H 8 swa heads: 5120, W 128). The full page
    # (16 x 2560) divides the SWA page -> full block 32; 5 sliding groups of 9 slots (6 padding layers).
    ("mimo-v2.5", "auto", (), H100,
     dict(kinds={"full": 9 * 2560, "sliding": 39 * 5120}, block=16, bpb=9 * 16 * 5120,
          bpr=L // 32 + 5 * sw(128))),
    ("mimo-v2.5-pro", "auto", (), H100,
     dict(kinds={"full": 10 * 5120, "sliding": 60 * 5120}, block=16, bpb=10 * 16 * 5120,
          bpr=L // 16 + 6 * sw(128))),
    # Llama-4-Scout: no_rope_layers 0 every 4th layer -> 12 global, 36 chunked local (C 8192); H 8, D 128.
    # Chunked: cdiv(min(8192 + 16384, L), 16) = 1536 blocks; 3 chunked groups.
    ("llama-4-scout-17b-16e-instruct", "auto", (), H100,
     dict(kinds={"full": 12 * 4096, "chunked": 36 * 4096}, block=16, bpb=12 * 16 * 4096,
          bpr=L // 16 + 3 * cdiv(8192 + MIF, 16))),
    # DeepSeek-V3: 61 MLA layers, latent (512 + 64) x 2 = 1152; FLASH_ATTN_MLA block 16.
    ("deepseek-v3", "auto", (), H100, dict(kinds={"mla": 61 * 1152}, block=16, bpb=61 * 16 * 1152, bpr=L // 16)),
    # fp8: FLASHMLA (kernel block 64), 576 bytes.
    ("deepseek-v3", "fp8", (), H100, dict(kinds={"mla": 61 * 576}, block=64, bpb=61 * 64 * 576, bpr=L // 64)),
    ("kimi-k2-instruct", "auto", (), H100, dict(kinds={"mla": 61 * 1152}, block=16, bpb=61 * 16 * 1152, bpr=L // 16)),
    ("kimi-k2.5", "auto", (), H100, dict(kinds={"mla": 61 * 1152}, block=16, bpb=61 * 16 * 1152, bpr=L // 16)),
    ("glm-4.7-flash", "auto", (), H100, dict(kinds={"mla": 47 * 1152}, block=16, bpb=47 * 16 * 1152, bpr=L // 16)),
    # DeepSeek-V3.2: sparse MLA + indexer (128 + 128/128*4 = 132 B, not TP-split) in every layer; block 64;
    # one uniform-type group of 61 + 61 specs.
    ("deepseek-v3.2-exp-ptpc", "auto", (), H100,
     dict(kinds={"mla": 61 * 1152, "indexer": 61 * 132}, block=64, bpb=61 * 64 * (1152 + 132), bpr=L // 64)),
    # fp8 on H100 -> FLASHMLA_SPARSE turns it into fp8_ds_mla: 656 B.
    ("deepseek-v3.2-exp-ptpc", "fp8", (), H100,
     dict(kinds={"mla": 61 * 656, "indexer": 61 * 132}, block=64, bpb=61 * 64 * (656 + 132), bpr=L // 64)),
    # On B200 FLASHINFER_MLA_SPARSE keeps plain fp8: 576 B.
    ("deepseek-v3.2-exp-ptpc", "fp8", (), B200,
     dict(kinds={"mla": 61 * 576, "indexer": 61 * 132}, block=64, bpb=61 * 64 * (576 + 132), bpr=L // 64)),
    ("glm-5-fp8", "auto", (), H100,
     dict(kinds={"mla": 78 * 1152, "indexer": 78 * 132}, block=64, bpb=78 * 64 * (1152 + 132), bpr=L // 64)),
    # Qwen3-Next: 12 full (H 2, D 256: 2048 B) + 36 GDN. GDN state: conv (3, 2*16*128 + 32*128) bf16 = 49152,
    # ssm (32, 128, 128) bf16 = 1048576 -> 1097728. FlashInfer GDN prefill (SM90) aligns to 64:
    # block 64*cdiv(1097728, 64*2048) = 576; 1 full + 3 GDN groups of 12; GDN groups hold 3 blocks.
    ("qwen3-next-80b-a3b-thinking", "auto", (), H100,
     dict(kinds={"full": 12 * 2048}, block=576, bpb=12 * 576 * 2048, bpr=cdiv(L, 576) + 9,
          state=9 * 12 * 576 * 2048)),
    # fp8 attention (state unaffected): block 64*cdiv(1097728, 64*1024) = 1088.
    ("qwen3-next-80b-a3b-thinking", "fp8", (), H100,
     dict(kinds={"full": 12 * 1024}, block=1088, bpb=12 * 1088 * 1024, bpr=cdiv(L, 1088) + 9,
          state=9 * 12 * 1088 * 1024)),
    # Qwen3.5-27B (this config has no mamba_ssm_dtype: state in bf16): conv (3, 4096 + 6144) = 61440,
    # ssm (48, 128, 128) bf16 = 1572864 -> 1634304; full H 4, D 256: 4096 B; block 64*cdiv(1634304, 64*4096) = 448.
    ("qwen3.5-27b", "auto", (), H100,
     dict(kinds={"full": 16 * 4096}, block=448, bpb=16 * 448 * 4096, bpr=cdiv(L, 448) + 9,
          state=9 * 16 * 448 * 4096)),
    # Qwen3.5-397B: GDN Hv 64: conv (3, 4096 + 8192) = 73728, ssm (64,128,128) bf16 = 2097152 -> 2170880;
    # full H 2: 2048 B; block 64*cdiv(2170880, 64*2048) = 1088.
    ("qwen3.5-397b-a17b", "auto", (), H100,
     dict(kinds={"full": 15 * 2048}, block=1088, bpb=15 * 1088 * 2048, bpr=cdiv(L, 1088) + 9,
          state=9 * 15 * 1088 * 2048)),
    # Falcon-H1-0.5B: attention (H 2, D 64: 512 B) AND Mamba-2 in all 36 layers. Mamba-2: conv (3, 1536 + 2*128)
    # bf16 = 10752, ssm (24, 64, 128) bf16 = 393216 -> 403968; block 16*cdiv(403968, 16*512) = 800;
    # 1 attention + 1 Mamba group of 36; Mamba-2 holds 3 blocks (prefill checkpoint).
    ("falcon-h1-0.5b", "auto", (), H100,
     dict(kinds={"full": 36 * 512}, block=800, bpb=36 * 800 * 512, bpr=cdiv(L, 800) + 3, state=3 * 36 * 800 * 512)),
    # Falcon-H1-7B: H 2, D 128 (1024 B); Mamba-2 conv (3, 3072 + 512) = 21504, ssm (24, 128, 256) = 1572864 ->
    # 1594368; block 16*cdiv(1594368, 16*1024) = 1568.
    ("falcon-h1-7b-instruct", "auto", (), H100,
     dict(kinds={"full": 44 * 1024}, block=1568, bpb=44 * 1568 * 1024, bpr=cdiv(L, 1568) + 3,
          state=3 * 44 * 1568 * 1024)),
    # Jamba-1.5-Mini: 4 attention (H 8, D 128), 28 Mamba-1: conv (3, 8192) bf16 = 49152, ssm (8192, 16) = 262144
    # -> 311296; block 16*cdiv(311296, 16*4096) = 80; 7 Mamba groups of 4 x 2 blocks (no checkpoint block).
    ("ai21-jamba-1.5-mini", "auto", (), H100,
     dict(kinds={"full": 4 * 4096}, block=80, bpb=4 * 80 * 4096, bpr=cdiv(L, 80) + 14, state=14 * 4 * 80 * 4096)),
    # Nemotron-H-8B: 4 attention (H 8, D 128), 24 Mamba-2 (128 heads x 64, 8 groups, N 128; SSM state float32):
    # conv (3, 8192 + 2048) bf16 = 61440, ssm (128, 64, 128) fp32 = 4194304 -> 4255744;
    # block 16*cdiv(4255744, 16*4096) = 1040; 6 Mamba groups of 4.
    ("nemotron-h-8b-base-8k", "auto", (), H100,
     dict(kinds={"full": 4 * 4096}, block=1040, bpb=4 * 1040 * 4096, bpr=cdiv(L, 1040) + 18,
          state=18 * 4 * 1040 * 4096)),
    ("nemotron-h-8b", "auto", (), H100,
     dict(kinds={"full": 4 * 4096}, block=1040, bpb=4 * 1040 * 4096, bpr=cdiv(L, 1040) + 18,
          state=18 * 4 * 1040 * 4096)),
    # Nemotron-Nano-9B-v2: 27 Mamba-2 (128 x 80): conv (3, 10240 + 2048) = 73728, ssm (128, 80, 128) fp32 = 5242880
    # -> 5316608; block 16*cdiv(5316608, 65536) = 1312; 7 Mamba groups of 4 (1 padding layer).
    ("nvidia-nemotron-nano-9b-v2", "auto", (), H100,
     dict(kinds={"full": 4 * 4096}, block=1312, bpb=4 * 1312 * 4096, bpr=cdiv(L, 1312) + 21,
          state=21 * 4 * 1312 * 4096)),
]


def _case_id(case: tuple) -> str:
    name, dtype, skips, gpu, _ = case
    return f"{name}-{dtype}{'-skip' if skips else ''}-{gpu.id}"


@pytest.mark.parametrize("case", HAND, ids=[_case_id(c) for c in HAND])
def test_bytes_blocks_and_capacity_match_the_hand_derivation(case):
    name, dtype, skips, gpu, want = case
    arch = arch_of(name)
    layout = Layout.of(arch, dtype, skips, 1, gpu)
    kv_plan = plan(arch, layout, L, gpu)
    assert layout.bytes_by_kind() == want["kinds"]
    assert (kv_plan.block_size, kv_plan.bytes_per_block, kv_plan.blocks_per_request) == \
        (want["block"], want["bpb"], want["bpr"])
    assert kv_plan.request_bytes == want["bpb"] * want["bpr"]
    assert kv_plan.state_request_bytes == want.get("state", 0)
    cap = kv_plan.capacity(AVAILABLE)
    blocks = AVAILABLE // want["bpb"]
    assert cap.num_blocks == blocks and cap.max_concurrency == blocks / want["bpr"]
    assert cap.tokens == int(blocks / want["bpr"] * L)  # vLLM's "GPU KV cache size"
    assert kv_plan.problem is None


def test_the_hand_table_covers_every_fixture_and_every_cache_kind():
    fixtures = {p.name for p in FIXTURES.iterdir() if p.is_dir() and p.name != "broken-no-layers"}
    assert len(fixtures) >= 25 and fixtures <= {c[0] for c in HAND}
    kinds = {k for c in HAND for k in arch_of(c[0]).kind_counts}
    assert {"full", "sliding", "chunked", "mla", "mamba", "gdn", "shared", "none"} <= kinds


def test_research_worked_examples_at_128k():
    """vllm-kvspec.md section 6: the bytes vLLM reserves per request of L = 131072."""
    big = 131072
    cases = [
        ("llama-3.1-8b-instruct", "auto", (), 17_179_869_184),
        ("llama-3.1-8b-instruct", "turboquant_k8v4", (), 7_902_068_736),
        ("gpt-oss-20b", "auto", (), 3_627_417_600),
        ("gpt-oss-20b", "fp8", ("sliding_window",), 2_016_804_864),
        ("gemma-3-12b-it", "auto", (), 14_299_430_912),
        ("gemma-3-12b-it", "fp8", ("sliding_window",), 10_004_463_616),
        ("qwen3-next-80b-a3b-thinking", "auto", (), 3_354_918_912),
        ("qwen3-next-80b-a3b-thinking", "fp8", (), 1_738_014_720),
        ("deepseek-v3", "auto", (), 9_210_691_584),
        ("deepseek-v3", "fp8", (), 4_605_345_792),
        ("deepseek-v3.2-exp-ptpc", "auto", (), 10_266_083_328),
        ("deepseek-v3.2-exp-ptpc", "fp8", (), 6_300_368_896),
    ]
    for name, dtype, skips, expected in cases:
        arch = arch_of(name)
        assert plan(arch, Layout.of(arch, dtype, skips, 1, H100), big, H100).request_bytes == expected, name


def test_qwen35_with_float32_ssm_state_matches_the_research_example():
    """vllm-kvspec.md 6.4: with mamba_ssm_dtype float32 (models/config.py copies it), Qwen3.5-27B's GDN state is
    61440 + 3145728 = 3207168 B; block 64*cdiv(3207168, 64*4096) = 832; 32k: (40 + 9) x 16*832*4096."""
    config = json.loads((FIXTURES / "qwen3.5-27b" / "config.json").read_text())
    config["text_config"]["mamba_ssm_dtype"] = "float32"
    arch = arch_from_hf_config(config, "qwen3.5-27b-fp32-state", "test")
    kv_plan = plan(arch, Layout.of(arch, "auto", (), 1, H100), L, H100)
    assert kv_plan.block_size == 832 and kv_plan.bytes_per_block == 16 * 832 * 4096 == 54_525_952
    assert kv_plan.request_bytes == (40 + 9) * 54_525_952 == 2_671_771_648


def test_tensor_parallelism_splits_kv_heads_but_not_latents_or_the_indexer():
    llama = arch_of("llama-3.1-8b-instruct")
    assert Layout.of(llama, "auto", (), 2, H100).bytes_by_kind() == {"full": 32 * 4 * 512}
    assert Layout.of(llama, "auto", (), 16, H100).bytes_by_kind() == {"full": 32 * 1 * 512}  # replicated heads
    dsa = arch_of("deepseek-v3.2-exp-ptpc")
    assert Layout.of(dsa, "auto", (), 8, H100).bytes_by_kind() == {"mla": 61 * 1152, "indexer": 61 * 132}
    assert indexer_bytes_per_token(128) == 132
    # Mamba-2 with 1 group at TP 2: groups are replicated to 2 (extra_groups_for_head_shards).
    falcon = arch_of("falcon-h1-0.5b")
    state = next(s.state for s in falcon.layers if s.state)
    assert state.shapes(2) == ((3, (1536 + 2 * 2 * 128) // 2), (12, 64, 128))


def test_max_concurrency_is_whole_blocks_not_bytes():
    """A sliding-window model's concurrency is num_blocks / blocks per request, not budget / bytes per token."""
    arch = arch_of("gpt-oss-20b")
    kv_plan = plan(arch, Layout.of(arch, "auto", (), 1, H100), L, H100)
    cap = kv_plan.capacity(AVAILABLE)
    assert cap.max_concurrency == (AVAILABLE // (12 * 16 * 2048)) / (2048 + 1033)
    assert cap.requests_that_fit == (cap.num_blocks - 1) // (2048 + 1033)
    assert cap.fits_one


def test_a_given_block_size_replaces_the_backend_default():
    """`--block-size 128` (vLLM's CPU default): 128-token pages, blocks per request at that granularity."""
    arch = arch_of("llama-3.1-8b-instruct")
    kv_plan = plan(arch, Layout.of(arch, "fp8", (), 1, H100), 1000, H100, block_size=128)
    assert (kv_plan.block_size, kv_plan.blocks_per_request) == (128, cdiv(1000, 128))
    assert kv_plan.bytes_per_block == 32 * 128 * 8 * 2 * 128  # layers x tokens x H x (K, V) x D, one byte each
    assert plan(arch, Layout.of(arch, "fp8", (), 1, H100), 1000, H100).block_size == 16


# -- decisions priced with the real layers ------------------------------------------------------


def test_mimo_fp8_with_skipped_sliding_layers_is_priced_with_its_swa_heads_and_refused_by_vllm():
    """MiMo-V2's SWA layers have 8 KV heads (swa_num_key_value_heads) of 192/128 dims; kept BF16 they cost
    8*320*2 = 5120 B/token. vLLM sizes the shared skip page from the model-level heads (4 x (192+192) x 1 x 32
    tokens = 49152 B), below a 16-token SWA page (81920 B): AttentionSpec.page_size_bytes asserts."""
    arch = arch_of("mimo-v2.5")
    layout = Layout.of(arch, "fp8", ("sliding_window",), 1, H100)
    assert layout.bytes_by_kind() == {"full": 9 * 4 * 320, "sliding": 39 * 5120}
    kv_plan = plan(arch, layout, L, H100)
    assert kv_plan.problem is not None and "49,152" in kv_plan.problem and "81,920" in kv_plan.problem


def test_turboquant_boundary_layers_only_for_dense_models():
    dense = Layout.of(arch_of("llama-3.1-8b-instruct"), "turboquant_4bit_nc", (), 1, H100)
    assert dense.skip_layers == ("0", "1", "30", "31")
    assert [f.name for f in dense.formats[:3]] == ["auto", "auto", "turboquant_4bit_nc"]
    hybrid = Layout.of(arch_of("qwen3-next-80b-a3b-thinking"), "turboquant_4bit_nc", (), 1, H100)
    assert hybrid.skip_layers == ()


def test_compressed_tensors_kv_scheme_turns_auto_into_fp8_except_for_mla():
    base = json.loads((FIXTURES / "llama-3.1-8b-instruct" / "config.json").read_text())
    base["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                   "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                       "dynamic": False, "symmetric": True}}
    arch = arch_from_hf_config(base, "ct", "test")
    assert arch.auto_kv_dtype == "fp8" and arch.kv_cache_scheme.strategy == "tensor"
    assert Layout.of(arch, "auto", (), 1, H100).bytes_by_kind() == {"full": 32 * 8 * 256}
    mla = json.loads((FIXTURES / "deepseek-v3" / "config.json").read_text())
    mla["quantization_config"] = base["quantization_config"]
    mla_arch = arch_from_hf_config(mla, "ct-mla", "test")
    assert mla_arch.auto_kv_dtype == "auto"
    assert Layout.of(mla_arch, "auto", (), 1, H100).bytes_by_kind() == {"mla": 61 * 1152}


# -- vLLM's own code ----------------------------------------------------------------------------

VLLM033 = Path(os.environ.get("VLLM033_PYTHON", "/work/venv033/bin/python"))
ORACLE = Path(__file__).parent / "vllm033_planning.py"

ORACLE_CASES = [(c[0], c[1], c[2], c[3], L, 1) for c in HAND if c[3] is H100]
ORACLE_CASES += [
    ("llama-3.1-8b-instruct", "auto", (), H100, 131072, 2),
    ("llama-3.1-8b-instruct", "fp8", ("0", "31"), H100, L, 1),
    ("gpt-oss-20b", "fp8", ("sliding_window",), H100, 4096, 1),
    ("gemma-3-27b-it", "fp8", ("sliding_window",), H100, 131072, 1),
    ("gemma-3-27b-it", "auto", (), H100, 4096, 1),
    ("gemma-4-31b-it", "fp8", (), H100, L, 2),
    ("mimo-v2.5", "fp8", (), H100, 131072, 1),
    ("qwen3-next-80b-a3b-thinking", "auto", (), H100, 131072, 4),
    ("qwen3.5-27b", "fp8", (), H100, L, 2),
    ("falcon-h1-7b-instruct", "auto", (), H100, 8192, 2),
    ("nvidia-nemotron-nano-9b-v2", "fp8", (), H100, L, 1),
    ("ai21-jamba-1.5-mini", "fp8", (), H100, 131072, 1),
    ("llama-4-scout-17b-16e-instruct", "fp8", (), H100, 131072, 8),
    ("deepseek-v3", "auto", (), H100, 131072, 8),
    ("deepseek-v3.2-exp-ptpc", "fp8", (), H100, 131072, 8),
    ("qwen3-8b", "turboquant_3bit_nc", (), H100, L, 1),
    ("qwen3-8b", "int4_per_token_head", (), H100, L, 1),
    ("mistral-7b-instruct-v0.3", "fp8_per_token_head", (), H100, L, 1),
]


def _oracle_case(name: str, dtype: str, skips: tuple[str, ...], gpu: Any, length: int, tp: int) -> dict[str, Any]:
    arch = arch_of(name)
    layout = Layout.of(arch, dtype, skips, tp, gpu)
    kv_plan = plan(arch, layout, length, gpu)
    modules = []
    for spec, fmt in zip(arch.layers, layout.module_formats):
        if spec.kind in ("shared", "none"):
            continue
        m: dict[str, Any] = {"index": spec.index, "kind": spec.kind, "head_size": spec.head_size,
                             "head_size_v": spec.head_size_v, "kv_heads_per_rank": spec.kv_heads_per_rank(tp),
                             "window": spec.window, "chunk": spec.chunk, "indexer_head_dim": spec.indexer_head_dim}
        if fmt is not None:
            m["dtype"] = fmt.name
        if spec.state is not None:
            m["state"] = spec.state.model_dump()
        modules.append(m)
    mla = arch.attention == "mla"
    model_head = (arch.kv_lora_rank or 0) + (arch.qk_rope_head_dim or 0) if mla else arch.head_dim
    engine = next((f.name for f in layout.module_formats if f is not None and f.name != "auto"), "auto")
    return {"case": {"modules": modules, "tp": tp, "max_model_len": length,
                     "in_flight_tokens": kv_plan.defaults.in_flight_tokens, "engine_dtype": engine,
                     "skip_layers": list(layout.skip_layers), "mla": mla, "model_kv_heads": arch.num_kv_heads,
                     "model_head_size": model_head, "block_size": kv_plan.defaults.block_size,
                     "checkpoint_alignment": kv_plan.defaults.checkpoint_alignment, "available": AVAILABLE},
            "plan": kv_plan, "layout": layout}


@pytest.fixture(scope="module")
def vllm_results():
    if not VLLM033.exists():
        pytest.skip(f"vLLM 0.33 CPU build not found at {VLLM033} (set VLLM033_PYTHON)")
    cases = [_oracle_case(*c) for c in ORACLE_CASES]
    stdin = "\n".join(json.dumps(c["case"]) for c in cases) + "\n"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([str(VLLM033), str(ORACLE)], input=stdin, capture_output=True, text=True, env=env,
                          timeout=600)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == len(cases), proc.stderr[-3000:]
    return list(zip(ORACLE_CASES, cases, lines))


@pytest.mark.parametrize("index", range(len(ORACLE_CASES)),
                         ids=[f"{c[0]}-{c[1]}{'-skip' if c[2] else ''}-{c[4]}-tp{c[5]}" for c in ORACLE_CASES])
def test_vllm_plans_the_same_cache(vllm_results, index):
    spec, mine, got = vllm_results[index]
    assert "ok" in got, got.get("error")
    v = got["ok"]
    assert v["vllm"].startswith("0.33"), v["vllm"]
    kv_plan = mine["plan"]
    assert v["bytes_per_token"] == mine["layout"].bytes_per_token()
    assert v["block_size"] == kv_plan.block_size
    assert v["bytes_per_block"] == kv_plan.bytes_per_block
    assert v["blocks_per_request"] == kv_plan.blocks_per_request
    assert v["num_groups"] == len(kv_plan.groups)
    cap = kv_plan.capacity(AVAILABLE)
    assert (v["num_blocks"], v["tokens"]) == (cap.num_blocks, cap.tokens)
    assert math.isclose(v["max_concurrency"], cap.max_concurrency, rel_tol=0, abs_tol=1e-12)


def test_vllm_refuses_the_mimo_skip_page_too(vllm_results):
    """The MiMo fp8 + skip-sliding plan kvpolicy flags fails in vLLM's own spec code."""
    if not VLLM033.exists():
        pytest.skip("no vLLM 0.33")
    case = _oracle_case("mimo-v2.5", "fp8", ("sliding_window",), H100, L, 1)["case"]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([str(VLLM033), str(ORACLE)], input=json.dumps(case) + "\n", capture_output=True,
                          text=True, env=env, timeout=600)
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("{")))
    assert "error" in out and out["error"].startswith("AssertionError"), out


# -- the config as transformers reads it (vLLM reads the transformers config object) -----------------

_TRANSFORMERS_PROBE = r"""
import glob, json, os, sys
from transformers import AutoConfig
for folder in sorted(glob.glob(sys.argv[1] + "/*/")):
    name = os.path.basename(folder[:-1])
    try:
        text = AutoConfig.from_pretrained(folder).get_text_config()
    except Exception as exc:
        print(json.dumps({"name": name, "skip": type(exc).__name__})); continue
    def get(key):
        try: return getattr(text, key, None)
        except Exception: return None
    per_layer = None
    try:
        per_layer = [[c.head_dim, c.num_key_value_heads] for c in text.per_layer_config]
    except Exception:
        pass
    print(json.dumps({"name": name, "layer_types": get("layer_types"), "per_layer": per_layer,
                      "kv": get("num_key_value_heads"), "head_dim": get("head_dim"),
                      "sliding_window": get("sliding_window"), "max_pos": get("max_position_embeddings"),
                      "layers": get("num_hidden_layers")}))
"""
_KIND = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
         "linear_attention": {"gdn", "mamba"}, "hybrid": "full", "mlp": "none", "indexed_attention": "mla",
         "attention": "full"}


def test_layer_kinds_heads_and_dims_match_transformers_config():
    """transformers (the version vLLM 0.33's CPU build carries) derives layer_types and per-layer geometry
    (Gemma-4 per_layer_config) from each config; kvpolicy's layers must say the same."""
    if not VLLM033.exists():
        pytest.skip(f"vLLM 0.33 environment not found at {VLLM033}")
    proc = subprocess.run([str(VLLM033), "-c", _TRANSFORMERS_PROBE, str(FIXTURES)], capture_output=True, text=True,
                          timeout=600)
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    checked = 0
    for row in rows:
        if "skip" in row or row["name"] == "broken-no-layers":
            continue
        arch = arch_of(row["name"])
        assert arch.num_layers == row["layers"], row["name"]
        if row["max_pos"] is not None:
            assert arch.max_position_embeddings == row["max_pos"], row["name"]
        attention = {s.index: s for s in arch.layers if s.kind in ("full", "sliding", "chunked", "mla", "shared")}
        if isinstance(row["layer_types"], list):
            for i, kind in enumerate(row["layer_types"]):
                want = _KIND[kind]
                mine = {s.kind for s in arch.layers if s.index == i}
                if arch.layer_types[i] == "shared":
                    continue
                assert (mine & want) if isinstance(want, set) else (want in mine), (row["name"], i, kind, mine)
        if row["per_layer"]:
            for i, (hd, kv) in enumerate(row["per_layer"]):
                if i in attention and attention[i].kind not in ("shared", "mla") and hd:  # MLA caches the latent
                    assert (attention[i].head_size, attention[i].num_kv_heads) == (hd, kv), (row["name"], i)
        elif row["head_dim"] and arch.attention != "mla" and not row["name"].startswith("mimo"):
            assert arch.head_dim == row["head_dim"] and arch.num_kv_heads == row["kv"], row["name"]
        checked += 1
    assert checked >= 30
