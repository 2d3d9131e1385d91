"""The Triton kernels compile for Hopper (sm_90) and Ampere (sm_80) without a GPU.

Triton's wheel bundles ptxas, so lowering a kernel to a cubin needs no device: this catches what the
interpreter (test_triton_kernels.py) cannot, i.e. code that only fails in real compilation (tile
shapes tl.dot refuses, constexpr misuse, type mismatches in the loop). Runs in a subprocess because
that module switches this process's Triton to the interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.slow,  # Triton compiles in a fresh Python process
]

COMPILE = textwrap.dedent(
    """
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from servelm.runtime.cuda import triton_decode as td, triton_kernels as tk

    def compile_kernel(fn, args, constexprs, arch, num_warps=4, num_stages=3, pdl=False):
        if "PDL" in fn.arg_names:  # the PDL-aware kernels (runtime.cuda.pdl)
            constexprs = dict(constexprs, PDL=pdl)
        sig = dict(args)
        sig.update({k: "constexpr" for k in constexprs})
        names = list(fn.arg_names)
        assert set(sig) == set(names), (sorted(set(names) - set(sig)), sorted(set(sig) - set(names)))
        sig = {k: sig[k] for k in names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
        options = {"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": pdl}
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)

    def pdl_order(kernel):
        # (global loads before griddepcontrol.wait, whether launch_dependents follows the wait) in the PTX
        lines = kernel.asm["ptx"].splitlines()
        waits = [i for i, l in enumerate(lines) if "griddepcontrol.wait" in l]
        releases = [i for i, l in enumerate(lines) if "griddepcontrol.launch_dependents" in l]
        if not waits:
            return None
        assert len(waits) == 1 and len(releases) == 1, (waits, releases)
        return sum(1 for l in lines[: waits[0]] if "ld.global" in l), releases[0] > waits[0]

    def check_pdl(fn, args, constexprs, arch=90, num_warps=4, num_stages=3, loads_before_wait=False):
        # Without PDL no grid dependency control at all; with it one wait, then the release, and no
        # activation read before the wait (only weights, where the kernel says so).
        assert pdl_order(compile_kernel(fn, args, constexprs, arch, num_warps, num_stages)) is None
        k = compile_kernel(fn, args, constexprs, arch, num_warps, num_stages, pdl=True)
        assert k.metadata.launch_pdl
        before, released_after = pdl_order(k)
        assert released_after, fn.__name__
        assert (before > 0) == loads_before_wait, (fn.__name__, before)

    def attention(dt, group, head_dim, page, decode, arch):
        group_pad = triton.next_power_of_2(group)
        block_q = max(1, (16 if decode else 64) // group_pad)
        ptrs = {n: "*" + dt for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        ptrs.update({n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "context_lens_ptr")})
        ints = {n: "i32" for n in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cache_block",
                                     "stride_cache_slot", "stride_cache_head", "stride_bt")}
        consts = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_q * group_pad, BLOCK_N=64,
                      HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), PAGE=page,
                      DOT_PRECISION="ieee")
        return compile_kernel(tk._paged_attention_kernel, {**ptrs, **ints, "softmax_scale_log2": "fp32"}, consts, arch)

    # Llama-3-8B decode and prefill (bf16, GQA 4, head_dim 128), a SmolLM-like fp16 shape with
    # flash-attn's 256-token pages (GQA 3, head_dim 64), and a float32 pool.
    for case in [("bf16", 4, 128, 16, True, 90), ("bf16", 4, 128, 16, False, 90),
                 ("fp16", 3, 64, 256, False, 80), ("fp32", 1, 64, 16, True, 90)]:
        attention(*case)
    store = {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "slot_ptr": "*i64",
             "stride_kt": "i32", "stride_vt": "i32", "stride_cache_block": "i32", "stride_cache_slot": "i32"}
    compile_kernel(tk._store_kv_kernel, store, dict(PAGE=16, ROW=1024, ROW_PAD=1024), 90)

    split = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "part_acc_ptr": "*fp32",
             "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
             "cos_ptr": "*bf16", "sin_ptr": "*bf16", "slot_ptr": "*i64",
             "softmax_scale_log2": "fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_cos": "i32",
             "stride_cache_block": "i32", "stride_cache_slot": "i32", "stride_cache_head": "i32", "stride_bt": "i32"}
    split_consts = dict(NUM_HEADS=32, NUM_KV_HEADS=8, GROUP=4, BLOCK_M=16, BLOCK_N=64, HEAD_DIM=128,
                        HEAD_DIM_PAD=128, PAGE=16, NUM_SPLITS=32, DOT_PRECISION="ieee")
    for rope_in in (False, True):  # q given, or RoPE + K/V store folded in (rope_paged_decode)
        compile_kernel(td._paged_decode_split_kernel, split, dict(split_consts, ROPE=rope_in), 90)
    reduce = {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "out_ptr": "*bf16",
              "stride_ot": "i32", "stride_oh": "i32"}
    compile_kernel(td._paged_decode_reduce_kernel, reduce, dict(NUM_HEADS=32, HEAD_DIM=128, HEAD_DIM_PAD=128,
                   NUM_SPLITS=32), 90)

    # runtime.cuda.triton_ops at the Llama-3-8B shape (hidden 4096, intermediate 14336, 32/8 heads of 128).
    from servelm.runtime.cuda import triton_ops as ops
    for dt in ("bf16", "fp32"):
        norm = {"x_ptr": "*" + dt, "res_ptr": "*" + dt, "w_ptr": "*" + dt, "out_ptr": "*" + dt,
                "stride_x": "i32", "stride_res": "i32", "stride_out": "i32", "n_cols": "i32", "eps": "fp32"}
        for has_res in (True, False):
            compile_kernel(ops._rms_norm_kernel, norm, dict(HAS_RESIDUAL=has_res, BLOCK=4096), 90, num_warps=16)
        silu = {"gu_ptr": "*" + dt, "out_ptr": "*" + dt, "stride_gu": "i32", "stride_out": "i32", "n_cols": "i32"}
        compile_kernel(ops._silu_mul_kernel, silu, dict(BLOCK=1024), 90)
        rope = {"qkv_ptr": "*" + dt, "cos_ptr": "*" + dt, "sin_ptr": "*" + dt, "q_out_ptr": "*" + dt,
                "k_cache_ptr": "*" + dt, "v_cache_ptr": "*" + dt, "slot_ptr": "*i64", "stride_qkv": "i32",
                "stride_cos": "i32", "stride_qo_t": "i32", "stride_cache_block": "i32", "stride_cache_slot": "i32"}
        compile_kernel(ops._rope_store_kernel, rope, dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64,
                       HEADS_PAD=64, KV_PAD=8, HALF_PAD=64, DIM_PAD=128, PAGE=16), 90)
    # runtime.cuda.triton_gemv: each op before the projection, 1 and 4 rows, every tile the autotuner tries.
    from servelm.runtime.cuda import triton_gemv as tg
    gemv = {n: "*bf16" for n in ("x_ptr", "res_ptr", "res_out_ptr", "nw_ptr", "w_ptr", "b_ptr", "y_ptr")}
    gemv.update({n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_rm", "stride_rom", "stride_wn", "stride_ym")})
    gemv["eps"] = "fp32"
    for prologue, has_res, has_bias in ((0, False, True), (1, True, False), (1, False, False), (2, False, False)):
        for rows_pad in (1, 4):
            for cfg in tg._configs(rows_pad):
                consts = dict(PROLOGUE=prologue, HAS_RESIDUAL=has_res, HAS_BIAS=has_bias, M_PAD=rows_pad,
                              DOT_PRECISION="tf32", **cfg.kwargs)
                compile_kernel(tg._decode_gemv_kernel, gemv, consts, 90, cfg.num_warps, cfg.num_stages)

    # Programmatic dependent launch (runtime.cuda.pdl): every kernel of a fused decode step.
    norm = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
            "stride_x": "i32", "stride_res": "i32", "stride_out": "i32", "n_cols": "i32", "eps": "fp32"}
    check_pdl(ops._rms_norm_kernel, norm, dict(HAS_RESIDUAL=True, BLOCK=4096), num_warps=16, loads_before_wait=True)
    check_pdl(ops._silu_mul_kernel, {"gu_ptr": "*bf16", "out_ptr": "*bf16", "stride_gu": "i32", "stride_out": "i32",
              "n_cols": "i32"}, dict(BLOCK=1024))
    rope = {k: v.replace("fp32", "bf16") for k, v in rope.items()}
    check_pdl(ops._rope_store_kernel, rope, dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64, HEADS_PAD=64,
              KV_PAD=8, HALF_PAD=64, DIM_PAD=128, PAGE=16))
    for rope_in in (False, True):  # the older K/V before the wait
        check_pdl(td._paged_decode_split_kernel, split, dict(split_consts, ROPE=rope_in), loads_before_wait=True)
    check_pdl(td._paged_decode_reduce_kernel, reduce, dict(NUM_HEADS=32, HEAD_DIM=128, HEAD_DIM_PAD=128, NUM_SPLITS=32))
    for tile in tg.ELEMENTWISE_TILES:  # a prefetch tile loads its first weight tile before the wait
        for prologue, has_res in ((0, False), (1, True), (2, False)):
            consts = dict(PROLOGUE=prologue, HAS_RESIDUAL=has_res, HAS_BIAS=False, M_PAD=1,
                          DOT_PRECISION="tf32", **tile.kwargs())
            check_pdl(tg._decode_gemv_kernel, gemv, consts, 90, tile.warps, tile.stages, loads_before_wait=tile.prefetch)
    print("compiled")
    """
)


def test_kernels_compile_for_nvidia_targets(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from a cache
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this Triton build has no ptxas to compile with")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("compiled")


SPECIALIZATION = textwrap.dedent(
    """
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    from servelm.runtime.cuda import triton_decode as td, triton_kernels as tk

    backend = make_backend(GPUTarget("cuda", 90, 32))

    def key(kernel, args, consts):
        # What Triton's launcher puts in the cache key for these arguments (types + specialisations).
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        return binder(*args, **consts)[1]

    q = torch.zeros(64, dtype=torch.bfloat16)
    meta = torch.zeros(64, dtype=torch.int32)

    def attention(stride_bt, meta_offset, stride_qt=4096):
        m = meta[meta_offset:]  # the prefill half of a step starts after its decodes: any 4-byte offset
        args = [q, q, q, q, m, m, m, m, 0.1, stride_qt, 128, 4096, 128, 1024, 16384, 128, stride_bt]
        consts = dict(GROUP=4, GROUP_PAD=4, BLOCK_Q=16, BLOCK_M=64, BLOCK_N=64, HEAD_DIM=128, HEAD_DIM_PAD=128,
                      PAGE=16, DOT_PRECISION="ieee")
        return key(tk._paged_attention_kernel, args, consts)

    def split(stride_bt, meta_offset):
        m = meta[meta_offset:]
        f = torch.zeros(64, dtype=torch.float32)
        slots = torch.zeros(8, dtype=torch.int64)[meta_offset % 2:]
        args = [q, q, q, f, f, f, m, m, q, q, slots, 0.1, 4096, 128, 64, 16384, 1024, 128, stride_bt]
        consts = dict(ROPE=True, NUM_KV_HEADS=8, NUM_HEADS=32, GROUP=4, BLOCK_M=16, BLOCK_N=64, HEAD_DIM=128,
                      HEAD_DIM_PAD=128, PAGE=16, NUM_SPLITS=8, DOT_PRECISION="ieee", PDL=False)
        return key(td._paged_decode_split_kernel, args, consts)

    # Block-table widths 16 / 17 / 1 and metadata at offsets 0 / 4 / 12 bytes: one variant.
    assert attention(16, 0) == attention(17, 1) == attention(1, 3), (attention(16, 0), attention(17, 1))
    assert split(16, 0) == split(17, 1) == split(1, 3)
    # Control: an argument left to specialise still splits the key (so the check above can fail).
    assert attention(16, 0, stride_qt=4096) != attention(16, 0, stride_qt=4097)
    print("one variant")
    """
)


def test_per_step_metadata_does_not_pick_a_kernel_variant() -> None:
    """Triton specialises integer arguments on == 1 / % 16 and pointers on 16-byte alignment; the
    attention kernels opt their per-step metadata out, so serving never compiles a new variant
    because a block table got wider or a prefill half started at an odd decode count."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", SPECIALIZATION], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("one variant")
