"""The CPU paged decode-attention kernel against its torch reference, and the reference against SDPA."""

from __future__ import annotations

import itertools
import logging
import math
import shutil
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from servelm.runtime.cpu import paged_attention as cpu_kernel
from servelm.runtime.cpu.extension import cpu_flags
from servelm.runtime.cpu.paged_attention import paged_decode_attention_reference as reference

POOL_TOKENS = 16000  # a pool of 1000 blocks of 16 (500 of 32)


class Case:
    """A decode batch whose sequences' K/V are known contiguously and also scattered into a pool.

    Pool slots no sequence owns (other blocks, the tail of each last block) hold NaN and the
    block-table columns past each sequence's last block hold wild values, so an implementation
    that reads anything it should not produces NaN or crashes.
    """

    def __init__(self, gen, lens, group, kv_heads, head_dim, block_size, dtype=torch.float32, num_blocks=None):
        num_blocks = num_blocks or POOL_TOKENS // block_size
        self.lens = list(lens)
        batch = len(self.lens)
        heads = group * kv_heads
        need = [math.ceil(n / block_size) for n in self.lens]
        assert sum(need) <= num_blocks
        width = max(need) + 2
        self.k_seqs = [torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for n in self.lens]
        self.v_seqs = [torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for n in self.lens]
        self.q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.block_tables = torch.randint(-(2**30), 2**30, (batch, width), generator=gen, dtype=torch.int32)
        perm = torch.randperm(num_blocks, generator=gen)
        start = 0
        for b, n in enumerate(self.lens):
            blocks = perm[start : start + need[b]]
            start += need[b]
            self.block_tables[b, : need[b]] = blocks.to(torch.int32)
            for cache, seq in ((self.k_cache, self.k_seqs[b]), (self.v_cache, self.v_seqs[b])):
                padded = torch.full((need[b] * block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
                padded[:n] = seq
                cache[blocks] = padded.view(need[b], block_size, kv_heads, head_dim)
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32)
        self.scale = head_dim**-0.5

    def args(self):
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.scale

    def naive(self, window: int = 0) -> torch.Tensor:
        """Per-request SDPA over contiguous K/V with the KV heads repeated: independent of paging.
        ``window`` > 0: over the last ``window`` tokens only."""
        outs = []
        group = self.q.shape[1] // self.k_seqs[0].shape[1]
        for b in range(len(self.lens)):
            lo = max(0, self.lens[b] - window) if window > 0 else 0
            k = self.k_seqs[b][lo:].float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, n, D]
            v = self.v_seqs[b][lo:].float().transpose(0, 1).repeat_interleave(group, dim=0)
            q = self.q[b].float()[:, None, :]  # [H, 1, D]
            outs.append(F.scaled_dot_product_attention(q, k, v, scale=self.scale)[:, 0, :])
        return torch.stack(outs)


def draw_lens(gen, batch: int, must: list[int] | None = None) -> list[int]:
    """Context lengths uniform in 1..300, the first ones replaced by ``must``."""
    lens = torch.randint(1, 301, (batch,), generator=gen).tolist()
    for i, n in enumerate((must or [])[:batch]):
        lens[i] = n
    return lens


def edge_lens(block_size: int) -> list[int]:
    # one token, exact multiples of the block size, a partly-filled last block, the maximum
    return [1, block_size, block_size + 1, 2 * block_size, 2 * block_size - 1, 300, 7 * block_size]


def random_cases(seed: int, head_dim: int, block_size: int, group: int, draws: int = 3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for d in range(draws):
        batch = [33, 1, int(torch.randint(2, 33, (1,), generator=gen))][d % 3]
        kv_heads = int(torch.randint(1, 4, (1,), generator=gen))
        lens = draw_lens(gen, batch, must=edge_lens(block_size) if d == 0 else None)
        cases.append(Case(gen, lens, group, kv_heads, head_dim, block_size, dtype=dtype))
    return cases


@pytest.fixture(scope="module")
def kernel():
    fn = cpu_kernel.load_kernel()
    if fn is None:
        pytest.skip("the CPU kernel did not build or load here (see the warning logged by load_kernel)")
    return fn


@pytest.fixture(scope="module")
def portable(kernel):
    return cpu_kernel.load_portable_kernel()


def test_kernel_builds_where_a_compiler_exists():
    # Otherwise a compile error in the .cpp would only show up as skipped tests.
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja on this machine")
    if cpu_kernel._disabled():
        pytest.skip(f"{cpu_kernel.DISABLE_ENV} is set")
    assert cpu_kernel.load_kernel() is not None, "the kernel failed to build; see the logged warning"
    module = cpu_kernel._loader.get()
    flags = cpu_flags() or set()
    if "avx512f" in flags:
        assert module.has_avx512, "built without the AVX-512 path on an AVX-512 CPU"
    elif {"avx2", "fma", "f16c"} <= flags:
        assert module.has_avx2, "built without the AVX2 path on an AVX2 CPU"


SHAPES = [
    pytest.param(head_dim, block_size, group, id=f"d{head_dim}-bs{block_size}-gqa{group}")
    for head_dim in (64, 128)
    for block_size in (16, 32)
    for group in (1, 3, 4)
]


@pytest.mark.parametrize("head_dim,block_size,group", SHAPES)
def test_reference_matches_per_request_sdpa(head_dim, block_size, group):
    for case in random_cases(1, head_dim, block_size, group, draws=2):
        got = reference(*case.args())
        assert not got.isnan().any()
        torch.testing.assert_close(got, case.naive(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("head_dim,block_size,group", SHAPES)
def test_kernel_matches_reference(kernel, portable, head_dim, block_size, group):
    for case in random_cases(2, head_dim, block_size, group):
        want = reference(*case.args())
        for fn in (kernel, portable):
            got = fn(*case.args())
            assert got.shape == case.q.shape and got.dtype == torch.float32
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["kernel", "portable"])
@pytest.mark.parametrize("head_dim", [16, 40, 96, 256])
def test_other_head_dims(request, impl, head_dim):
    # 96 and 256 take the AVX-512 path with a run-time chunk count, 40 the portable loop.
    fn = request.getfixturevalue(impl)
    gen = torch.Generator().manual_seed(head_dim)
    case = Case(gen, [1, 16, 17, 100, 250], group=2, kv_heads=2, head_dim=head_dim, block_size=16, num_blocks=64)
    torch.testing.assert_close(fn(*case.args()), reference(*case.args()), atol=1e-5, rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group,head_dim", [(6, 72), (5, 256), (8, 64)])
def test_query_groups_beyond_four(kernel, group, head_dim, cache_dtype):
    # The AVX2 path scores 4 queries per pass over a K row: 5, 6 and 8 take a second pass; 72 leaves
    # a chunk of 8 after the 16-wide loop and no 64-wide one.
    gen = torch.Generator().manual_seed(group)
    case = Case(gen, [1, 15, 16, 33, 200], group=group, kv_heads=2, head_dim=head_dim, block_size=16, num_blocks=64)
    q, k_cache, v_cache, *rest = case.args()
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    want = reference(q, k_cache.float(), v_cache.float(), *rest)
    torch.testing.assert_close(kernel(q, k_cache, v_cache, *rest), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_size", [1, 5, 64])
def test_unusual_block_sizes(kernel, block_size):
    # Tiles of 16 tokens span several blocks (1, 5) or part of one (64).
    gen = torch.Generator().manual_seed(block_size)
    case = Case(
        gen,
        [1, 5, 16, 33, 129, 200],
        group=3,
        kv_heads=3,
        head_dim=64,
        block_size=block_size,
        num_blocks=max(300, 6 * (200 // block_size + 1)),
    )
    torch.testing.assert_close(kernel(*case.args()), reference(*case.args()), atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["kernel", "portable"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bfloat16(request, impl, head_dim):
    fn = request.getfixturevalue(impl)
    for case in random_cases(3, head_dim, 16, 3, draws=2, dtype=torch.bfloat16):
        got = fn(*case.args())
        assert got.dtype == torch.bfloat16
        q, k, v, tables, lens, scale = case.args()
        exact = reference(q.float(), k.float(), v.float(), tables, lens, scale)
        # Only the final rounding to bfloat16 may differ: half an ulp is 2^-9 relative.
        torch.testing.assert_close(got.float(), exact, atol=1e-5, rtol=2**-8)
        torch.testing.assert_close(reference(*case.args()).float(), exact, atol=1e-5, rtol=2**-8)


@pytest.mark.parametrize("impl", ["kernel", "portable"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_16_bit_cache_under_float32_queries(request, impl, kv_dtype, head_dim):
    """--kv-cache-dtype: float32 queries over a bf16/f16 cache give float32 attention over the
    cache's values as stored (summation order is all that differs)."""
    fn = request.getfixturevalue(impl)
    for case in random_cases(4, head_dim, 16, 3, draws=2, dtype=kv_dtype):
        q32 = case.q.float()
        got = fn(q32, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
        assert got.dtype == torch.float32
        exact = reference(q32, case.k_cache.float(), case.v_cache.float(), case.block_tables, case.seq_lens, case.scale)
        torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)


def test_writes_into_out(kernel):
    case = random_cases(4, 64, 16, 3, draws=1)[0]
    want = reference(*case.args())
    out = torch.full_like(case.q, float("nan"))
    assert kernel(*case.args(), out=out) is out
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    # A non-contiguous destination is filled too.
    batch, heads, head_dim = case.q.shape
    strided = torch.full((heads, batch, head_dim), float("nan")).transpose(0, 1)
    assert kernel(*case.args(), strided) is strided
    torch.testing.assert_close(strided, want, atol=1e-5, rtol=0)
    ref_out = torch.empty_like(case.q)
    assert reference(*case.args(), out=ref_out) is ref_out
    torch.testing.assert_close(ref_out, want, atol=0, rtol=0)


def test_query_split_from_a_fused_projection(kernel):
    # q as the runner produces it: a strided view into a fused qkv tensor.
    case = random_cases(9, 64, 16, 3, draws=1)[0]
    batch, heads, head_dim = case.q.shape
    kv = case.k_cache.shape[2] * head_dim
    qkv = torch.randn(batch, heads * head_dim + 2 * kv)
    qkv[:, : heads * head_dim] = case.q.reshape(batch, -1)
    q = qkv[:, : heads * head_dim].view(batch, heads, head_dim)
    assert not q.is_contiguous()
    args = (q,) + case.args()[1:]
    torch.testing.assert_close(kernel(*args), reference(*case.args()), atol=1e-5, rtol=0)


def test_same_result_on_one_and_two_threads(kernel):
    # With enough (sequence, KV head) pairs each is computed by one thread start to end: the result
    # is bitwise stable.
    case = random_cases(5, 64, 16, 3, draws=1)[0]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(*case.args())
        torch.set_num_threads(2)
        two = kernel(*case.args())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("lens", [[500], [700, 1], [64, 900], [1000, 1000, 3]], ids=str)
def test_few_sequences_are_split_over_their_context_and_merged(kernel, lens):
    """Batch 1-2 on two threads: too few (sequence, KV head) pairs to share evenly, so each context is
    cut into slices computed apart and merged (a 1-token sequence among them: empty slices)."""
    # 3 KV heads for one sequence, 1 for more: fewer pairs than twice the threads either way.
    case = Case(torch.Generator().manual_seed(len(lens) * 7 + lens[0]), lens, 3, 3 if len(lens) == 1 else 1, 64, 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = kernel(*case.args())
        torch.set_num_threads(1)
        one = kernel(*case.args())  # whole contexts, one thread
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(two.double(), case.naive().double(), atol=1e-5, rtol=0)
    torch.testing.assert_close(two, one, atol=2e-6, rtol=0)  # another summation order, same result
    assert not torch.equal(two, one)  # ... and so not the same bits: the slices did run


@pytest.mark.parametrize("window", [1, 5, 16, 100, 299, 5000])
def test_sliding_window_attends_to_the_last_tokens_only(kernel, portable, window):
    """window > 0: each query attends to its last ``window`` tokens (transformers' sliding window); the
    tokens before are never read (NaN there would show). Split contexts (few sequences) too."""
    cases = random_cases(11, 64, 16, 3, draws=3) + [Case(torch.Generator().manual_seed(3), [900], 3, 3, 64, 16)]
    for case in cases:
        want = case.naive(window)
        bs = case.k_cache.shape[1]
        for b, n in enumerate(case.lens):  # poison what the window leaves out: it must not be read
            for t in range(max(0, n - window)):
                block = int(case.block_tables[b, t // bs])
                case.k_cache[block, t % bs] = float("nan")
                case.v_cache[block, t % bs] = float("nan")
        before = torch.get_num_threads()
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                torch.testing.assert_close(
                    kernel(*case.args(), window=window).double(), want.double(), atol=1e-5, rtol=0
                )
        finally:
            torch.set_num_threads(before)
        torch.testing.assert_close(portable(*case.args(), window=window).double(), want.double(), atol=1e-5, rtol=0)
        torch.testing.assert_close(reference(*case.args(), window=window).double(), want.double(), atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="window"):
        kernel(*cases[0].args(), window=-1)


def test_empty_batch(kernel):
    q = torch.empty(0, 9, 64)
    cache = torch.zeros(4, 16, 3, 64)
    got = kernel(q, cache, cache, torch.empty(0, 3, dtype=torch.int32), torch.empty(0, dtype=torch.int32), 0.125)
    assert got.shape == (0, 9, 64)


def _small_case():
    gen = torch.Generator().manual_seed(6)
    return Case(gen, [20, 3], group=3, kv_heads=3, head_dim=64, block_size=16, num_blocks=8)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (
            lambda a: a.update(
                block_tables=a["block_tables"]
                .clone()
                .index_put_((torch.tensor(0), torch.tensor(1)), torch.tensor(8, dtype=torch.int32))
            ),
            "outside the pool",
        ),
        (
            lambda a: a.update(
                block_tables=a["block_tables"]
                .clone()
                .index_put_((torch.tensor(1), torch.tensor(0)), torch.tensor(-1, dtype=torch.int32))
            ),
            "outside the pool",
        ),
        (lambda a: a.update(seq_lens=torch.tensor([0, 3], dtype=torch.int32)), "at least one token"),
        (lambda a: a.update(seq_lens=torch.tensor([20, 16 * 4 + 1], dtype=torch.int32)), "columns"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "int32"),
        (lambda a: a.update(q=torch.randn(2, 8, 64)), "multiple"),
        (lambda a: a.update(q=a["q"].double()), "float32 or bfloat16"),
        (lambda a: a.update(v_cache=a["v_cache"][:, :8].contiguous()), "differs"),
        (lambda a: a.update(k_cache=a["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
    ],
)
def test_rejects_bad_input(kernel, mutate, message):
    case = _small_case()
    args = dict(zip(["q", "k_cache", "v_cache", "block_tables", "seq_lens", "scale"], case.args()))
    mutate(args)
    with pytest.raises(RuntimeError, match=message):
        kernel(**args)


def test_releases_the_gil(kernel):
    # While one thread is inside the kernel, another Python thread must keep running.
    gen = torch.Generator().manual_seed(7)
    batch, length, block_size, pool = 64, 8000, 16, 256
    k_cache = torch.randn(pool, block_size, 3, 64, generator=gen)
    v_cache = torch.randn(pool, block_size, 3, 64, generator=gen)
    tables = torch.randint(0, pool, (batch, length // block_size), generator=gen, dtype=torch.int32)
    args = (
        torch.randn(batch, 9, 64, generator=gen),
        k_cache,
        v_cache,
        tables,
        torch.full((batch,), length, dtype=torch.int32),
        0.125,
    )
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        kernel(*args)
        duration = time.perf_counter() - t0
        worker = threading.Thread(target=lambda: [kernel(*args) for _ in range(3)])
        stamps = [time.perf_counter()]
        worker.start()
        while worker.is_alive():
            stamps.append(time.perf_counter())
        worker.join()
    finally:
        torch.set_num_threads(before)
    longest_gap = max(b - a for a, b in itertools.pairwise(stamps))
    assert duration > 0.02, "case too small to tell"
    assert longest_gap < 0.6 * duration, (longest_gap, duration)


def test_env_var_disables_the_kernel(monkeypatch):
    monkeypatch.setenv(cpu_kernel.DISABLE_ENV, "1")
    assert cpu_kernel.load_kernel() is None
    case = _small_case()
    assert torch.equal(cpu_kernel.paged_decode_attention(*case.args()), reference(*case.args()))


def test_dispatcher_uses_the_kernel(kernel):
    case = random_cases(8, 64, 16, 3, draws=1)[0]
    torch.testing.assert_close(cpu_kernel.paged_decode_attention(*case.args()), kernel(*case.args()), atol=0, rtol=0)


def test_build_failure_returns_none_with_a_warning(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernel, "SOURCE", broken)
    monkeypatch.setenv("SERVELM_CACHE", str(tmp_path / "cache"))
    loader = cpu_kernel._KernelLoader()
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.__name__):
        assert loader.get() is None
        assert loader.get() is None  # remembered: no second build, no second warning
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()


def test_rope_write_decode_equals_the_unfused_ops(kernel):
    """RoPE + K/V store + attention in one call == the model's apply_rope, index_copy_ and the
    reference attention; the cache rows it writes are bit-identical (no fused multiply-add)."""
    from servelm.runtime.models.layers import apply_rope

    fused = cpu_kernel.load_rope_decode()
    assert fused is not None
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, bs, nblocks = 6, 2, 64, 16, 40
    batch = 5
    k_cache = torch.randn(nblocks, bs, kv_heads, d, generator=g)
    v_cache = torch.randn(nblocks, bs, kv_heads, d, generator=g)
    lens = torch.tensor([1, 17, 33, 64, 5], dtype=torch.int32)
    perm = torch.randperm(nblocks, generator=g).to(torch.int32)
    tables = perm[: batch * 4].view(batch, 4).contiguous()
    slots = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens.tolist())])
    slots[4] = -1  # a padding row: nothing written
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * d, generator=g)
    cos = torch.randn(batch, 1, d // 2, generator=g)
    sin = torch.randn(batch, 1, d // 2, generator=g)

    kc, vc = k_cache.clone(), v_cache.clone()
    out = fused(qkv, cos, sin, kc, vc, slots, tables, lens, heads, 0.125)

    qk = apply_rope(qkv[:, : (heads + kv_heads) * d].view(batch, heads + kv_heads, d), (cos, sin))
    v = qkv[:, (heads + kv_heads) * d :].view(batch, kv_heads, d)
    rk, rv = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    rk.view(-1, kv_heads, d).index_copy_(0, slots[keep], qk[keep, heads:])
    rv.view(-1, kv_heads, d).index_copy_(0, slots[keep], v[keep])
    want = reference(qk[:, :heads], rk, rv, tables, lens, 0.125)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="outside the pool"):
        fused(qkv, cos, sin, kc, vc, slots + nblocks * bs, tables, lens, heads, 0.125)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_write_decode_with_qk_norms_and_a_16_bit_cache(kernel, cache_dtype):
    """Qwen3's and Gemma 3's q/k RMSNorms before RoPE, and a 16-bit pool (k and v stored rounded): the
    fused call equals F.rms_norm per head, apply_rope, the rounded store and attention over that pool."""
    from servelm.runtime.models.layers import apply_rope

    fused = cpu_kernel.load_rope_decode()
    assert fused is not None
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, d, bs, nblocks, batch, eps = 4, 1, 256, 16, 24, 3, 1e-6
    k_cache = torch.randn(nblocks, bs, kv_heads, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(nblocks, bs, kv_heads, d, generator=g).to(cache_dtype)
    lens = torch.tensor([1, 30, 70], dtype=torch.int32)
    tables = torch.randperm(nblocks, generator=g).to(torch.int32)[: batch * 5].view(batch, 5).contiguous()
    slots = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens.tolist())])
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * d, generator=g) * 3
    cos = torch.randn(batch, 1, d // 2, generator=g)
    sin = torch.randn(batch, 1, d // 2, generator=g)
    q_w = 1 + torch.randn(d, generator=g) * 0.1
    k_w = 1 + torch.randn(d, generator=g) * 0.1

    kc, vc = k_cache.clone(), v_cache.clone()
    out = fused(
        qkv, cos, sin, kc, vc, slots, tables, lens, heads, 0.0625, window=48, q_norm=q_w, k_norm=k_w, norm_eps=eps
    )

    qk = qkv[:, : (heads + kv_heads) * d].view(batch, heads + kv_heads, d)
    qk = torch.cat((F.rms_norm(qk[:, :heads], (d,), q_w, eps), F.rms_norm(qk[:, heads:], (d,), k_w, eps)), dim=1)
    qk = apply_rope(qk, (cos, sin))
    v = qkv[:, (heads + kv_heads) * d :].view(batch, kv_heads, d)
    rk, rv = k_cache.clone(), v_cache.clone()
    rk.view(-1, kv_heads, d).index_copy_(0, slots, qk[:, heads:].to(cache_dtype))
    rv.view(-1, kv_heads, d).index_copy_(0, slots, v.to(cache_dtype))
    # The norm's sum may round apart from F.rms_norm's by an ulp; the rounded rows then differ by one
    # step of their type at most.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[cache_dtype]
    torch.testing.assert_close(kc.float(), rk.float(), atol=tol, rtol=tol)
    assert torch.equal(vc, rv)
    want = reference(qk[:, :heads], rk.float(), rv.float(), tables, lens, 0.0625, window=48)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="q_norm"):
        fused(qkv, cos, sin, kc, vc, slots, tables, lens, heads, 0.0625, q_norm=q_w[:-1], k_norm=k_w, norm_eps=eps)
