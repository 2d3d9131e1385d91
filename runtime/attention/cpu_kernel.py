"""Decode attention over the paged KV pool on CPU: a compiled kernel and its pure-torch reference.

A decode token attends over its sequence's whole context. Gathering the context's blocks and
calling SDPA copies every K/V row every layer every step; the C++ kernel in
``csrc/paged_attention_cpu.cpp`` instead reads each row straight from the pool through the block
table (see FACTS.md: ~4x faster than gather + SDPA at batch 32). It is JIT-built with
``torch.utils.cpp_extension`` on first use and cached on disk; where it cannot be built or run,
``paged_decode_attention`` falls back to ``paged_decode_attention_reference``.

Shapes (shared by every function here):
    q             [B, H, D]                           float32 or bfloat16 (any strides)
    k_cache       [num_blocks, block_size, KVH, D]    same dtype, contiguous (v_cache alike)
    block_tables  [B, max_blocks] int32               entries past ceil(seq_len/block_size) are never read
    seq_lens      [B] int32                           context length incl. the token just written, >= 1
    returns       [B, H, D]                           written into ``out`` when given
Query head h uses KV head h // (H // KVH) (GQA; K/V are never repeated).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from runtime.model_files import cache_dir

log = logging.getLogger(__name__)

DISABLE_ENV = "SERVELM_DISABLE_CPU_KERNEL"
SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

# (q, k_cache, v_cache, block_tables, seq_lens, scale, out=None) -> Tensor
PagedDecodeAttention = Callable[..., torch.Tensor]


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pure torch: gather each sequence's blocks, then masked attention (SDPA) in float32.

    The test oracle for the kernel and the fallback where it is unavailable. Like the kernel it
    reads only the pool rows of each sequence's own tokens: garbage table entries past its last
    block and stale (even NaN) rows are never touched.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if batch == 0:
        return q.new_empty(q.shape) if out is None else out
    lens = seq_lens.to(torch.int64)
    if int(lens.min()) < 1:
        raise ValueError("every sequence needs at least one token (seq_lens >= 1)")
    blocks_used = (lens + block_size - 1) // block_size  # [B]
    width = int(blocks_used.max())
    if width > block_tables.shape[1]:
        raise ValueError(f"seq_lens need {width} blocks but block_tables has {block_tables.shape[1]} columns")
    # Pool slot of every context position; only positions inside a sequence are gathered, so
    # table entries past its last block and stale rows of its last block are never read.
    ctx = width * block_size
    pos = torch.arange(ctx)
    valid = pos < lens[:, None]  # [B, ctx]
    table = block_tables[:, :width].to(torch.int64)
    slots = table.gather(1, (pos // block_size).expand(batch, ctx)) * block_size + pos % block_size
    dst = valid.view(-1).nonzero().squeeze(1)
    src = slots.view(-1)[dst]

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache.reshape(-1, num_kv_heads, head_dim).index_select(0, src).float()
        padded = rows.new_zeros(batch * ctx, num_kv_heads, head_dim).index_copy_(0, dst, rows)
        return padded.view(batch, ctx, num_kv_heads, head_dim)

    k, v = gather(k_cache), gather(v_cache)
    # GQA without repeating K/V: a KV head's query heads become the rows of one attention problem.
    group = num_heads // num_kv_heads
    qf = q.float().reshape(batch, num_kv_heads, group, head_dim)
    attn = F.scaled_dot_product_attention(
        qf, k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None, :], scale=scale
    )  # [B, KVH, G, D]
    result = attn.reshape(batch, num_heads, head_dim).to(q.dtype)
    if out is None:
        return result
    return out.copy_(result)


def _cpu_flags() -> set[str] | None:
    """The running CPU's feature flags (Linux), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _build_name(source: bytes) -> str:
    """Extension name keyed on everything that changes the binary: source, flags, torch, CPU."""
    h = hashlib.sha256(source)
    flags = _cpu_flags()
    for part in (CFLAGS, LDFLAGS, [torch.__version__, platform.machine(), platform.python_version()],
                 sorted(flags or [])):
        h.update("\0".join(part).encode())
    return f"servelm_paged_attention_{h.hexdigest()[:16]}"


def _self_check(fn: PagedDecodeAttention) -> str | None:
    """Compare the compiled kernel against the reference on a small case; a reason if it differs."""
    gen = torch.Generator().manual_seed(0)
    for dtype, head_dim, tol in ((torch.float32, 64, 1e-5), (torch.float32, 40, 1e-5), (torch.bfloat16, 64, 2e-2)):
        k_cache = torch.randn(8, 4, 2, head_dim, generator=gen).to(dtype)
        v_cache = torch.randn(8, 4, 2, head_dim, generator=gen).to(dtype)
        q = torch.randn(2, 6, head_dim, generator=gen).to(dtype)
        tables = torch.tensor([[3, 0, 5, 7, 1], [6, 2, 4, -1, -1]], dtype=torch.int32)
        lens = torch.tensor([19, 9], dtype=torch.int32)
        got = fn(q, k_cache, v_cache, tables, lens, 0.125)
        want = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.125)
        if not torch.allclose(got.float(), want.float(), atol=tol, rtol=0):
            return f"self-check failed ({dtype}, head_dim {head_dim})"
    return None


def _one_line(exc: Exception) -> str:
    """The telling line of a build failure: the compiler's first error, else the message's first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return errors[0] if errors else (lines[0] if lines else type(exc).__name__)


class _KernelLoader:
    """Builds the extension at most once per process and remembers the outcome (module or None)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried = False
        self._module = None

    def get(self, verbose: bool = False):
        with self._lock:
            if not self._tried:
                self._module = self._build(verbose)
                self._tried = True
            return self._module

    @staticmethod
    def _build(verbose: bool):
        """Build (or reuse the cached build of) the extension; None, with one warning, if impossible."""
        try:
            from torch.utils import cpp_extension

            name = _build_name(SOURCE.read_bytes())
            build_dir = cache_dir() / "torch_extensions" / name
            build_dir.mkdir(parents=True, exist_ok=True)
            module = cpp_extension.load(
                name=name,
                sources=[str(SOURCE)],
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                build_directory=str(build_dir),
                verbose=verbose,
            )
            flags = _cpu_flags()
            missing = sorted(set(module.compiled_isa()) - flags) if flags is not None else []
            if missing:
                log.warning("CPU paged-attention kernel disabled: this CPU lacks %s", ", ".join(missing))
                return None
            problem = _self_check(module.paged_decode_attention)
            if problem:
                log.warning("CPU paged-attention kernel disabled: %s", problem)
                return None
            return module
        except Exception as exc:  # a missing compiler, ninja or header must only cost speed
            log.warning("CPU paged-attention kernel unavailable, using the torch path: %s", _one_line(exc))
            return None


_loader = _KernelLoader()


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip() not in ("", "0")


def load_kernel(verbose: bool = False) -> PagedDecodeAttention | None:
    """The compiled ``paged_decode_attention``, or None where it cannot be used. Never raises.

    Builds once per process (cached on disk under ``$SERVELM_CACHE/torch_extensions``; the first
    build takes tens of seconds). ``SERVELM_DISABLE_CPU_KERNEL=1`` forces None.
    """
    if _disabled():
        return None
    module = _loader.get(verbose)
    return None if module is None else module.paged_decode_attention


def load_portable_kernel() -> PagedDecodeAttention | None:
    """The compiled plain-loop implementation (no intrinsics), for tests and benchmarks."""
    if _disabled():
        return None
    module = _loader.get()
    return None if module is None else module.paged_decode_attention_portable


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode attention over the paged pool: the compiled kernel where available, else the reference."""
    fn = load_kernel()
    if fn is None:
        fn = paged_decode_attention_reference
    return fn(q, k_cache, v_cache, block_tables, seq_lens, scale, out)
