"""Host memory that is resident only where it is written."""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

_libc = ctypes.CDLL(None, use_errno=True)


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in private anonymous pages: the kernel hands out zero-filled pages on first write, so a
    large KV pool costs resident memory as its blocks fill, not its whole size at start, while every
    read of an unwritten position still sees 0 (``torch.zeros`` would write, and so touch, all of it)."""
    numel = math.prod(shape)
    # Private: a shared anonymous map would count as shared memory and be shared with forked children.
    buffer = mmap.mmap(-1, max(numel * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE)
    # frombuffer holds a reference to the map, which lives as long as any view of the tensor.
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def forget(address: int, nbytes: int) -> None:
    """Hand back the whole pages inside ``[address, address + nbytes)`` of a ``lazily_zeroed`` map: they
    leave resident memory and read 0 until written again. Pages only partly inside are kept, since
    their other part may hold live data."""
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    if end > start and _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on the KV pool")
