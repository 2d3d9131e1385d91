"""The paged KV pool: per-layer key and value tensors in flash-attn's paged layout."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servelm.runtime.platform import platform_of


class KVPool:
    """Fixed-size blocks of K/V for every layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` each.

    One allocation backs all layers; ``k_cache[l]`` and ``v_cache[l]`` are views into it. The pool is
    zero-filled on purpose: attention reads whole blocks (a partly filled last block, padded block-table
    entries) and masks the extra positions, and masked garbage would still poison the result if it
    were NaN (0 * NaN = NaN). On the CPU its pages become resident as blocks are first written.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self._storage = platform_of(self.device).zeroed_pool(
            (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim), dtype, self.device
        )
        self.k_cache: list[torch.Tensor] = list(self._storage[0].unbind(0))
        self.v_cache: list[torch.Tensor] = list(self._storage[1].unbind(0))
        self._forget = platform_of(self.device).page_forgetter()

    @property
    def releases_pages(self) -> bool:
        """Whether ``release`` hands memory back (a CPU pool) or does nothing."""
        return self._forget is not None

    def release(self, blocks: Sequence[int], layers: Sequence[int]) -> None:
        """Hand back the memory of ``blocks`` in ``layers`` (K and V): blocks that every sliding window
        has left. They read 0 afterwards and are resident again once written; a page shared with a
        block not released is kept. One call per run of consecutive blocks, layer and side."""
        if self._forget is None or not blocks:
            return
        runs: list[tuple[int, int]] = []  # [lo, hi) of consecutive block ids
        for b in sorted(set(blocks)):
            if runs and runs[-1][1] == b:
                runs[-1] = (runs[-1][0], b + 1)
            else:
                runs.append((b, b + 1))
        block_bytes = self.block_size * self.num_kv_heads * self.head_dim * self._storage.element_size()
        for side in (self.k_cache, self.v_cache):
            for layer in layers:
                base = side[layer].data_ptr()
                for lo, hi in runs:
                    self._forget(base + lo * block_bytes, (hi - lo) * block_bytes)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's K and V in every layer (copy on write of a beam's shared
        block) on the pool's device, before the forward that writes the copies. One strided copy a block: a
        step has a few, and one indexed copy of them all was slower on the CPU (scripts/bench_beam_search.py)."""
        for src, dst in copies:
            self._storage[:, :, dst].copy_(self._storage[:, :, src])

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self._storage.element_size()

    @property
    def nbytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def __repr__(self) -> str:
        return (
            f"KVPool(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"{self.nbytes / 2**20:.1f} MiB)"
        )
