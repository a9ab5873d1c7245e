"""Range checks the kernels' entry points run before launching.

A kernel trusts its indices: a block id past the cache, a slot past the segment or a
`seq_len` beyond the block table reads or writes out of bounds (a segfault or silent
garbage), and a scale of 0, NaN or below 0 turns every output of a head into NaN.
These checks read the index tensors' extremes in one host sync; they are skipped while
a CUDA graph is being captured (a sync is illegal there, and the eager call before
capture has already been checked), and inside `unchecked()`: a caller whose indices
come from its own allocator (the runtime) skips the sync, which otherwise serialises
the host with the GPU on every eager call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_enabled = True


@contextmanager
def unchecked() -> Iterator[None]:
    """Skip the range checks inside the block (indices the caller built and trusts)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def skipped() -> bool:
    """Whether the checks are off: inside `unchecked()`, or while the current CUDA stream captures a graph."""
    return not _enabled or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_paged_ranges(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int,
                       sliding_window: int | None = None) -> None:
    """ValueError unless every seq_len is in 1..capacity and every block it attends is in 0..num_blocks-1."""
    if seq_lens.numel() == 0 or skipped():
        return
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    lens = seq_lens.to(torch.int64)
    n_blocks = (lens + block_size - 1) // block_size
    cols = torch.arange(max_blocks, device=block_tables.device)[None, :]
    used = cols < n_blocks[:, None]
    if sliding_window is not None:
        first = (lens - sliding_window).clamp(min=0) // block_size
        used &= cols >= first[:, None]
    ids = block_tables.to(torch.int64)
    bad_block = used & ((ids < 0) | (ids >= num_blocks))
    lo, hi, bad = torch.stack([lens.min(), lens.max(), bad_block.sum()]).tolist()
    if lo < 1 or hi > capacity:
        raise ValueError(f"seq_lens must be in 1..{capacity} (block table of {max_blocks} blocks x {block_size} "
                         f"tokens); got values in {lo}..{hi}")
    if bad:
        seq, col = (bad_block.nonzero()[0]).tolist()
        raise ValueError(f"block_tables[{seq}, {col}] = {int(ids[seq, col])} is outside the cache's "
                         f"{num_blocks} blocks ({bad} attended entries are)")


def check_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """ValueError unless every slot is below `num_slots` (negative slots are padding and skipped)."""
    if slot_mapping.numel() == 0 or skipped():
        return
    hi = int(slot_mapping.max())
    if hi >= num_slots:
        raise ValueError(f"slot_mapping holds slot {hi}; the cache has {num_slots} slots (0..{num_slots - 1})")


def check_scales(**scales: torch.Tensor | None) -> None:
    """ValueError unless every given scale tensor is finite and positive."""
    given = {name: s for name, s in scales.items() if s is not None and s.numel()}
    if not given or skipped():
        return
    ok = torch.stack([(torch.isfinite(s) & (s > 0)).all() for s in given.values()]).tolist()
    for (name, s), good in zip(given.items(), ok):
        if not good:
            shown = s.detach().flatten()[:4].tolist()
            raise ValueError(f"{name} must be finite and positive; got {shown}{' ...' if s.numel() > 4 else ''}")
