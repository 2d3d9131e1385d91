"""Time one layer of decode attention over a paged pool on CPU, per implementation.

Shape of the default model (9 query heads, 3 KV heads, head_dim 64, fp32), block_size 16, each
sequence's blocks scattered at random in an 8192-block pool, contexts uniform in 128..256.
Compares the compiled kernel (AVX-512 and portable builds), the pure-torch reference
(gather + masked softmax), gather + SDPA, and SDPA over a contiguous padded cache (no paging).

    .venv/bin/python scripts/bench_cpu_attention.py --batch 32 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # checkout.py, also when imported as a module
import checkout

checkout.use_checkout()

from servelm.runtime.cpu import paged_attention as cpu_kernel  # noqa: E402


def time_ms(
    fn: Callable[[], object],
    iters: int,
    stat: str = "median",
    before: Callable[[], object] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    warmup: int = 5,
) -> float:
    """Median (or minimum) time of one call in ms by ``clock``; ``before`` runs untimed."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1e3)
    return min(times) if stat == "min" else statistics.median(times)


def gather_sdpa(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """What a torch backend without the kernel does: index_select the blocks, then masked SDPA."""
    batch, _num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    width = block_tables.shape[1]
    idx = block_tables.reshape(-1).long()
    k = k_cache.index_select(0, idx).view(batch, width * block_size, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, idx).view(batch, width * block_size, num_kv_heads, head_dim).transpose(1, 2)
    mask = torch.arange(width * block_size) < seq_lens[:, None].long()
    return F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    ).squeeze(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stat", choices=["median", "min"], default="median")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time, steadier on a shared machine (use with --threads 1)",
    )
    ap.add_argument(
        "--cold", action="store_true", help="evict the caches before each call, as the other layers of a real step do"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    heads, kv_heads, head_dim, block_size, pool_blocks = 9, 3, 64, 16, 8192
    scale = head_dim**-0.5
    gen = torch.Generator().manual_seed(args.seed)
    k_cache = torch.randn(pool_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(pool_blocks, block_size, kv_heads, head_dim, generator=gen)
    kernel = cpu_kernel.load_kernel()
    portable = cpu_kernel.load_portable_kernel()
    print(
        f"threads={torch.get_num_threads()} kernel={'yes' if kernel else 'unavailable'} caches={'cold' if args.cold else 'warm'}"
    )
    evict = torch.zeros(32 * 2**20)  # 128 MB, several times the last-level cache
    before = (lambda: evict.add_(1.0)) if args.cold else None
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(
        f"{'batch':>5} {'kernel':>9} {'portable':>9} {'reference':>9} {'gath+sdpa':>9} {'contig':>9}  ({args.stat} {args.clock} ms / layer)"
    )

    for batch in args.batch:
        lens = torch.randint(128, 257, (batch,), generator=gen, dtype=torch.int32)
        width = (int(lens.max()) + block_size - 1) // block_size
        perm = torch.randperm(pool_blocks, generator=gen)[: batch * width]
        tables = perm.view(batch, width).to(torch.int32).contiguous()
        q = torch.randn(batch, heads, head_dim, generator=gen)
        out = torch.empty_like(q)
        # The no-paging baseline: each sequence's context contiguous, padded to the longest.
        ctx = width * block_size
        k_contig = k_cache[tables.long()].view(batch, ctx, kv_heads, head_dim).transpose(1, 2).contiguous()
        v_contig = v_cache[tables.long()].view(batch, ctx, kv_heads, head_dim).transpose(1, 2).contiguous()
        mask = (torch.arange(ctx) < lens[:, None].long())[:, None, None, :]
        q4 = q[:, :, None, :]

        def contiguous_sdpa():
            return F.scaled_dot_product_attention(q4, k_contig, v_contig, attn_mask=mask, scale=scale, enable_gqa=True)

        ref = cpu_kernel.paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
        row = []
        for fn in (kernel, portable):
            if fn is None:
                row.append(float("nan"))
                continue
            err = (fn(q, k_cache, v_cache, tables, lens, scale, out) - ref).abs().max().item()
            assert err < 1e-5, f"kernel differs from the reference by {err}"
            row.append(
                time_ms(
                    lambda fn=fn: fn(q, k_cache, v_cache, tables, lens, scale, out),
                    args.iters,
                    args.stat,
                    before,
                    clock,
                )
            )
        row.append(
            time_ms(
                lambda: cpu_kernel.paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale),
                args.iters,
                args.stat,
                before,
                clock,
            )
        )
        row.append(
            time_ms(lambda: gather_sdpa(q, k_cache, v_cache, tables, lens, scale), args.iters, args.stat, before, clock)
        )
        row.append(time_ms(contiguous_sdpa, args.iters, args.stat, before, clock))
        print(f"{batch:>5} " + " ".join(f"{x:>9.3f}" for x in row))


if __name__ == "__main__":
    main()
