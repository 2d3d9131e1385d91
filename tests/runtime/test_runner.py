"""ModelRunner.execute: batching, ordering, mixed steps, and greedy parity with Hugging Face generate."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

from servelm.runtime.batch import PENDING_TOKEN, BatchItem
from servelm.runtime.cpu.torch_backend import TorchAttentionBackend
from servelm.runtime.runner import ModelRunner

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves falling in a quiet park.",
    "List three everyday uses of a paperclip.",
]


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy_loop(
    runner: ModelRunner,
    rt: SimpleNamespace,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    token_budget: int,
    eos_ids: tuple[int, ...],
) -> list[list[int]]:
    """A minimal stand-in for the engine: decodes first, then prompt chunks under a token budget."""
    blocks = rt.ScatteredBlocks(runner.kv_pool.num_blocks, runner.block_size, seed=11)
    seqs = [rt.FakeSeq(seq_id=i, token_ids=list(p)) for i, p in enumerate(prompts)]
    finished = [False] * len(seqs)
    while not all(finished):
        live = [s for s in seqs if not finished[s.seq_id]]
        live.sort(key=lambda s: len(s.token_ids) - s.num_computed_tokens != 1)  # decodes first
        items, left = [], token_budget
        for s in live:
            remaining = len(s.token_ids) - s.num_computed_tokens
            n = min(remaining, left)
            if n == 0:
                continue
            blocks.grow(s, s.num_computed_tokens + n)
            items.append(BatchItem(s, n, sample=n == remaining))
            left -= n
        items.reverse()  # hand the runner prefills before decodes: it must reorder and map back
        out = runner.execute(items)
        for it, tok in zip(items, out.sampled_token_ids):
            s = it.seq
            s.num_computed_tokens += it.num_new_tokens
            assert (tok is None) == (not it.sample)
            if tok is not None:
                s.token_ids.append(tok)
                n_out = len(s.token_ids) - s.num_prompt_tokens
                if tok in eos_ids or n_out >= max_new_tokens:
                    finished[s.seq_id] = True
                    blocks.release(s)
    return [s.token_ids[s.num_prompt_tokens :] for s in seqs]


@pytest.mark.slow  # the default model against transformers
def test_greedy_matches_hf_generate_batched(
    default_model_dir: Path, build_runner: Callable[..., ModelRunner], rt: SimpleNamespace
) -> None:
    from servelm.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    prompts = [
        list(
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        for p in PROMPTS
    ]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for ids in prompts:  # one at a time: no padding in the reference
            out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
            refs.append(out[0, len(ids) :].tolist())
    del hf
    runner = build_runner(default_model_dir, num_blocks=64, max_num_batched_tokens=64)
    ours = greedy_loop(
        runner, rt, prompts, max_new_tokens=32, token_budget=64, eos_ids=runner.model_config.eos_token_ids
    )
    assert ours == refs
    assert "Paris" in tok.decode(ours[0])


@pytest.fixture(params=["kernel_if_built", "torch_fallback"])
def tiny_runner(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, build_runner: Callable[..., ModelRunner]
) -> ModelRunner:
    use_kernel = request.param == "kernel_if_built"
    return build_runner(tiny_llama_dir, num_blocks=128, backend=TorchAttentionBackend(16, use_kernel=use_kernel))


def test_mixed_batch_equals_each_sequence_alone(tiny_runner: ModelRunner, rt: SimpleNamespace) -> None:
    """Decodes of different lengths + a fresh prompt + a continuing chunk, in one step, equal each alone."""
    runner = tiny_runner
    blocks = rt.ScatteredBlocks(runner.kv_pool.num_blocks, runner.block_size, seed=2)
    # (prompt length, tokens computed before the step, new tokens in the step)
    plans = [(20, 19, 1), (45, 44, 1), (33, 32, 1), (50, 0, 37), (60, 23, 30), (17, 16, 1)]

    def make(plan_idx: int, seed_offset: int) -> Any:
        n_prompt, done, _ = plans[plan_idx]
        s = rt.FakeSeq(seq_id=plan_idx + seed_offset, token_ids=random_ids(n_prompt, seed=plan_idx))
        blocks.grow(s, n_prompt)
        if done:  # bring the sequence to its state before the step, alone
            rt.step_logits(runner, [BatchItem(s, done, sample=False)])
        return s

    alone = []
    for i, (n_prompt, done, new) in enumerate(plans):
        s = make(i, 0)
        alone.append(rt.step_logits(runner, [BatchItem(s, new, sample=done + new == n_prompt)])[0])

    seqs = [make(i, 100) for i in range(len(plans))]
    items = [BatchItem(s, new, sample=done + new == n) for s, (n, done, new) in zip(seqs, plans)]
    order = [3, 0, 4, 1, 5, 2]  # interleave prefills and decodes in the caller's order
    mixed = rt.step_logits(runner, [items[i] for i in order])
    for pos, i in enumerate(order):
        torch.testing.assert_close(mixed[pos], alone[i], atol=2e-5, rtol=0)
        assert torch.equal(mixed[pos].argmax(-1), alone[i].argmax(-1))


def test_execute_returns_results_in_item_order(tiny_runner: ModelRunner, rt: SimpleNamespace) -> None:
    runner = tiny_runner
    blocks = rt.ScatteredBlocks(runner.kv_pool.num_blocks, runner.block_size, seed=4)
    a = rt.FakeSeq(seq_id=1, token_ids=random_ids(30, seed=1))  # prefill chunk that stops short
    b = rt.FakeSeq(seq_id=2, token_ids=random_ids(12, seed=2))  # full prompt: samples
    c = rt.FakeSeq(seq_id=3, token_ids=random_ids(9, seed=3))  # decode: samples
    for s in (a, b, c):
        blocks.grow(s, len(s.token_ids))
    rt.step_logits(runner, [BatchItem(c, 8, sample=False)])
    items = [BatchItem(a, 20, sample=False), BatchItem(b, 12, sample=True), BatchItem(c, 1, sample=True)]
    expected = [None] + [int(lg[-1].argmax()) for lg in rt.step_logits(runner, items)[1:]]
    # Replay the same step from the same state through execute().
    a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens = 0, 0, 8
    out = runner.execute(items)
    assert out.sampled_token_ids == expected
    assert out.logprobs == [None, None, None]  # greedy without logprobs asked
    assert runner.execute([]).sampled_token_ids == []


@pytest.mark.parametrize("graphs", ["eager", "graphs", "graphs with the head"])
def test_pending_tokens_come_from_the_last_sampling_step(
    tiny_runner: ModelRunner, rt: SimpleNamespace, graphs: str
) -> None:
    """Scheduling ahead: a decode whose input is PENDING_TOKEN reads the token the runner's previous
    sampling step drew for that sequence, and gives what the known token gives; with decode steps
    staged into (stand-in) CUDA-graph buffers too, padded (3 rows run as 4), with the head inside."""
    runner = tiny_runner
    try:
        if graphs != "eager":
            runner.graph_runner = _EagerGraphStandIn(runner, 4, 64, head_max=4 if "head" in graphs else 0)
        _check_pending_tokens(runner, rt)
        if graphs != "eager":
            assert runner.graph_runner.replayed
    finally:
        runner.graph_runner = None


def _check_pending_tokens(runner: ModelRunner, rt: SimpleNamespace) -> None:
    blocks = rt.ScatteredBlocks(runner.kv_pool.num_blocks, runner.block_size, seed=6)
    prompts = [random_ids(n, seed=10 + i) for i, n in enumerate((11, 27, 5))]
    steps = 6

    def items_of(seqs: list[Any]) -> list[BatchItem]:
        return [BatchItem(s, len(s.token_ids) - s.num_computed_tokens, sample=True) for s in seqs]

    def advance(items: list[BatchItem]) -> None:
        for it in items:
            it.seq.num_computed_tokens += it.num_new_tokens

    # Tokens known before each step (the synchronous engine).
    known = [rt.FakeSeq(seq_id=i, token_ids=list(p)) for i, p in enumerate(prompts)]
    for s in known:
        blocks.grow(s, len(s.token_ids) + steps)
    for _ in range(steps):
        items = items_of(known)
        out = runner.execute(items)
        advance(items)
        for s, tok in zip(known, out.sampled_token_ids):
            s.token_ids.append(tok)

    # The engine's order when scheduling ahead: launch step k with step k-1's tokens pending, then read
    # step k-1's tokens, then sample step k. Rows are reversed every other step, so a pending token is
    # read from another row than the one it sits in.
    ahead = [rt.FakeSeq(seq_id=100 + i, token_ids=list(p)) for i, p in enumerate(prompts)]
    for s in ahead:
        blocks.grow(s, len(s.token_ids) + steps)
    in_flight = None
    for k in range(steps):
        items = items_of(ahead if k % 2 else ahead[::-1])
        launched = runner.launch(items)
        if in_flight is not None:
            for it, tok in zip(in_flight[0], in_flight[1].result().sampled_token_ids):
                assert it.seq.token_ids[-1] == PENDING_TOKEN
                it.seq.token_ids[-1] = tok
        in_flight = (items, runner.sample(launched))
        advance(items)
        for it in items:
            it.seq.token_ids.append(PENDING_TOKEN)
    for it, tok in zip(in_flight[0], in_flight[1].result().sampled_token_ids):
        it.seq.token_ids[-1] = tok
    assert [s.token_ids for s in ahead] == [s.token_ids for s in known]

    # A pending token the last sampling step did not draw, or one inside a chunk, is refused.
    stranger = rt.FakeSeq(seq_id=999, token_ids=[*prompts[0], PENDING_TOKEN], num_prompt_tokens=11)
    blocks.grow(stranger, 12)
    runner.execute(items_of([rt.FakeSeq(seq_id=7, token_ids=prompts[2], block_table=list(stranger.block_table))]))
    stranger.num_computed_tokens = 11
    with pytest.raises(ValueError, match="did not sample"):
        runner.launch([BatchItem(stranger, 1, sample=True)])
    stranger.num_computed_tokens = 0
    with pytest.raises(ValueError, match="pending token inside"):
        runner.launch([BatchItem(stranger, 12, sample=True)])


def test_invalid_steps_are_refused(tiny_llama_dir: Path, build_runner: Callable[..., ModelRunner], rt: Any) -> None:
    runner = build_runner(tiny_llama_dir, num_blocks=16, max_num_batched_tokens=32, max_num_seqs=2)
    s = rt.FakeSeq(seq_id=0, token_ids=random_ids(40, seed=0), block_table=[3])  # one block: 16 tokens
    with pytest.raises(ValueError, match="blocks cannot hold"):
        runner.execute([BatchItem(s, 20, sample=False)])
    s.block_table = [3, 5, 7]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        runner.execute([BatchItem(s, 40, sample=True)])
    with pytest.raises(ValueError, match="cannot compute tokens"):
        runner.execute([BatchItem(s, 41, sample=True)])
    seqs = [rt.FakeSeq(seq_id=i, token_ids=[5, 6], block_table=[i]) for i in range(3)]
    with pytest.raises(ValueError, match="max_num_seqs"):
        runner.execute([BatchItem(x, 2, sample=True) for x in seqs])


def test_runner_reports_sizes(tiny_llama_dir: Path, build_runner: Callable[..., ModelRunner]) -> None:
    from servelm.runtime.capacity import kv_bytes_per_token

    runner = build_runner(tiny_llama_dir, num_blocks=10)
    cfg = runner.model_config
    assert runner.weight_bytes == cfg.num_params * 4
    assert runner.kv_pool.bytes_per_token == kv_bytes_per_token(cfg, torch.float32)
    assert runner.kv_pool.nbytes == 10 * 16 * runner.kv_pool.bytes_per_token
    with pytest.raises(ValueError, match="block_size"):
        ModelRunner(
            tiny_llama_dir,
            cfg,
            device=torch.device("cpu"),
            dtype=torch.float32,
            block_size=16,
            num_blocks=4,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            backend=TorchAttentionBackend(32),
        )


class _EagerGraphStandIn:
    """Plays ``CudaGraphRunner`` on CPU: same ``can_run`` / ``padded`` / ``inputs`` / ``replay`` contract,
    an eager forward over the staged input buffers inside.

    Proves the runner's dispatch (which steps replay) and its staging (what the graphs would read);
    the capture itself needs a GPU. Padded sizes are powers of two, as captured."""

    def __init__(self, runner: ModelRunner, max_bs: int, max_blocks: int, head_max: int = 0) -> None:
        from servelm.runtime.cuda.graph_inputs import GraphInputs, capture_sizes

        self.runner, self.max_bs, self.max_blocks, self.head_max = runner, max_bs, max_blocks, head_max
        self.sizes = capture_sizes(max_bs)
        self.inputs = GraphInputs.allocate(max_bs, max_blocks, torch.device("cpu"))
        self.replayed: list[int] = []

    def returns_logits(self, num_decodes: int) -> bool:
        return self.padded(num_decodes) <= self.head_max

    def can_run(self, num_decodes: int, num_tokens: int, block_table_width: int) -> bool:
        return num_tokens == num_decodes and 0 < num_decodes <= self.max_bs and block_table_width <= self.max_blocks

    def padded(self, num_decodes: int) -> int:
        return next(b for b in self.sizes if b >= num_decodes)

    def replay(self, n: int):
        from servelm.runtime.attention.base import AttentionMetadata

        self.replayed.append(n)
        b, bs = self.inputs, self.padded(n)  # the whole padded batch, as a graph computes it
        lens = b.seq_lens[:bs].tolist()
        meta = AttentionMetadata(
            num_tokens=bs,
            num_decodes=bs,
            num_decode_tokens=bs,
            slot_mapping=b.slot_mapping[:bs],
            query_start_loc=b.query_start_loc[: bs + 1],
            seq_lens=b.seq_lens[:bs],
            context_lens=b.context_lens[:bs],
            block_tables=b.block_tables[:bs],
            max_query_len=1,
            max_seq_len=max(lens),
            query_lens_list=[1] * bs,
            seq_lens_list=lens,
        )
        hidden = self.runner.model(b.input_ids[:bs], b.positions[:bs], self.runner.backend.build_metadata(meta))
        out = self.runner.model.compute_logits(hidden) if self.returns_logits(n) else hidden
        return out[:n]


def test_decode_only_steps_replay_graphs_others_run_eager(tiny_runner: ModelRunner, rt: SimpleNamespace) -> None:
    prompts = [random_ids(n, seed=40 + n) for n in (9, 23, 17)]
    run = dict(max_new_tokens=6, token_budget=64, eos_ids=())
    eager = greedy_loop(tiny_runner, rt, prompts, **run)
    fits = _EagerGraphStandIn(tiny_runner, max_bs=4, max_blocks=8)
    too_small = _EagerGraphStandIn(tiny_runner, max_bs=2, max_blocks=8)
    with_head = _EagerGraphStandIn(tiny_runner, max_bs=4, max_blocks=8, head_max=4)  # returns logits
    try:
        tiny_runner.graph_runner = fits
        graphed = greedy_loop(tiny_runner, rt, prompts, **run)
        tiny_runner.graph_runner = too_small
        unfit = greedy_loop(tiny_runner, rt, prompts, **run)
        tiny_runner.graph_runner = with_head
        headed = greedy_loop(tiny_runner, rt, prompts, **run)
    finally:
        tiny_runner.graph_runner = None
    assert graphed == eager and unfit == eager and headed == eager
    # One prefill step (all 49 prompt tokens fit the budget: eager), then 5 decode-only steps of 3.
    assert fits.replayed == [3] * 5 and with_head.replayed == [3] * 5
    assert too_small.replayed == []  # 3 decodes > the largest "captured" batch: eager


def test_weights_first_then_pool(tiny_llama_dir: Path, build_runner: Callable[..., ModelRunner], rt: Any) -> None:
    """``num_blocks=None`` loads weights only; ``warm_up`` runs the largest step on a scratch pool and
    leaves nothing bound; the pool allocated afterwards serves steps like a runner built in one go."""
    late = build_runner(tiny_llama_dir, num_blocks=None, max_num_batched_tokens=96, max_num_seqs=8)
    assert late.kv_pool is None
    scratch = late.warm_up()
    from servelm.runtime.capacity import kv_bytes_per_token

    assert scratch == kv_bytes_per_token(late.model_config, torch.float32) * 6 * 16  # 96 tokens in 16-token blocks
    assert all(layer.self_attn.k_cache is None for layer in late.model.model.layers)
    late.allocate_kv_pool(32)
    with pytest.raises(RuntimeError, match="already"):
        late.allocate_kv_pool(32)
    with pytest.raises(RuntimeError, match="before"):
        late.warm_up()
    eager = build_runner(tiny_llama_dir, num_blocks=32, max_num_batched_tokens=96, max_num_seqs=8)
    prompts = [random_ids(n, seed=70 + n) for n in (12, 30)]
    run = dict(max_new_tokens=5, token_budget=96, eos_ids=())
    assert greedy_loop(late, rt, prompts, **run) == greedy_loop(eager, rt, prompts, **run)


def test_fused_decode_path_is_taken_for_decode_only_steps(
    tiny_llama_dir: Path, build_runner: Callable[..., ModelRunner], rt: SimpleNamespace
) -> None:
    """Decode-only float32 steps go through the backend's one-call RoPE + store + attention; prefill
    and mixed steps do not; the tokens are the same either way."""
    fused_runner = build_runner(tiny_llama_dir, num_blocks=32)
    backend = fused_runner.backend
    if getattr(backend, "rope_decode", None) is None:
        pytest.skip("the CPU kernel did not build here")
    calls: list[int] = []
    inner = backend.rope_decode
    backend.rope_decode = lambda qkv, *a: calls.append(qkv.shape[0]) or inner(qkv, *a)
    plain_runner = build_runner(tiny_llama_dir, num_blocks=32)
    plain_runner.backend.rope_decode = None
    prompts = [random_ids(n, seed=90 + n) for n in (7, 19)]
    run = dict(max_new_tokens=4, token_budget=64, eos_ids=())
    assert greedy_loop(fused_runner, rt, prompts, **run) == greedy_loop(plain_runner, rt, prompts, **run)
    layers = fused_runner.model_config.num_layers
    assert calls == [2] * (3 * layers)  # 1 prefill step (not fused), then 3 decode steps of 2


class _ClockEvent:
    """torch.cuda.Event stand-in (the capture-time A/B times replays with it): every replay 'takes' 1 ms."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _ClockEvent) -> float:
        return (end.t - self.t) * 1e3


def test_the_real_graph_runner_with_capture_emulated_gives_the_eager_tokens(
    tiny_llama_dir: Path, build_runner: Callable[..., ModelRunner], rt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``CudaGraphRunner`` as the runner builds it on CUDA (few-row kernels and their A/B, PDL, the head
    inside batch 1's graph), on CPU: a 'graph' replays the forward it was captured with, frozen as CUDA
    would freeze it (the few-row switch, PDL). The capture, its A/B on real decodes, the staging of
    each step and the sampling from the graphs' logits must give the eager engine's tokens."""
    import torch.nn.functional as F

    from servelm.runtime.cpu import linear as cpu_linear
    from servelm.runtime.cuda import pdl
    from servelm.runtime.cuda.graphs import CudaGraphRunner
    from servelm.runtime.model_kernels import FewRowKernels

    def norm_linear(x, residual, nw, eps, w, b=None):
        h = x if residual is None else x + residual
        return F.linear(F.rms_norm(h, nw.shape, nw, eps), w, b), h

    def silu_linear(gu, w, b=None):
        g, u = gu.chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, w, b)

    with monkeypatch.context() as m:
        m.setattr(cpu_linear, "onednn_linear_available", lambda dtype: False)  # dense weights, as on CUDA
        runner = build_runner(tiny_llama_dir, num_blocks=128, backend=TorchAttentionBackend(16, use_kernel=False))
    prompts = [random_ids(n, seed=70 + n) for n in (9, 23, 17)]
    run = dict(max_new_tokens=6, token_budget=64, eos_ids=())
    eager = greedy_loop(runner, rt, prompts, **run)

    kernels = FewRowKernels(F.linear, norm_linear, silu_linear, max_rows=0)
    runner.model.use_few_row_kernels(kernels)
    replays: list[tuple[int, int, bool]] = []

    def capture_one(self, bs, meta):
        ids, pos = self.inputs.input_ids[:bs], self.inputs.positions[:bs]
        head = self.head if bs <= self.head_max else None
        frozen_rows, frozen_pdl = kernels.max_rows, pdl.active()

        def step() -> torch.Tensor:
            # The CPU attention backend reads host-side lengths, which a CUDA backend never does inside
            # a graph: rebuilt from the staged buffers at each "replay" (device-side, the same views).
            now = self.backend.build_metadata(
                self.inputs.metadata(bs, self.max_blocks_per_seq, self.inputs.seq_lens[:bs].tolist())
            )
            saved, kernels.max_rows = kernels.max_rows, frozen_rows
            try:
                h = self.model(ids, pos, now)
                return head(h) if head is not None else h
            finally:
                kernels.max_rows = saved

        out = step().clone()

        class Graph:
            def replay(self) -> None:
                replays.append((bs, frozen_rows, frozen_pdl))
                out.copy_(step())

        return Graph(), out

    monkeypatch.setattr(CudaGraphRunner, "_capture_one", capture_one)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "Event", _ClockEvent)
    graphs = CudaGraphRunner(
        runner.model, runner.backend, 4, 8, runner.block_size, runner.device, few_rows=kernels, few_rows_max=1,
        pdl=True, num_kv_blocks=runner.kv_pool.num_blocks, head=runner.model.compute_logits,
    )  # fmt: skip
    graphs.capture()
    v = graphs.variants[1]
    assert v.rel_diff < 1e-5 and v.pdl_identical  # same math three ways, on real decodes
    assert graphs.returns_logits(1) and not graphs.returns_logits(2) and kernels.max_rows == 0
    runner.graph_runner = graphs
    try:
        replays.clear()
        # Batch 1 (the head in its graph), then 3 rows padded to 4 (hidden states out).
        single = greedy_loop(runner, rt, prompts[:1], **run)
        assert {r[0] for r in replays} == {1}
        replays.clear()
        graphed = greedy_loop(runner, rt, prompts, **run)
        assert {r[0] for r in replays} == {4}
    finally:
        runner.graph_runner = None
    assert graphed == eager and single == eager[:1]


@pytest.mark.parametrize("use_kernel", [True, False], ids=["cpp-decode", "torch-decode"])
def test_drafts_are_verified_as_one_decode_row_per_position(
    tiny_llama_dir: Path, build_runner: Callable[..., ModelRunner], rt: SimpleNamespace, use_kernel: bool
) -> None:
    """A sequence's last token and 3 drafts after it, computed in one step beside a decode and a prefill
    chunk: each row's logits equal feeding those tokens one step at a time, and each row is sampled."""
    runner = build_runner(tiny_llama_dir, num_blocks=64, backend=TorchAttentionBackend(16, use_kernel=use_kernel))
    ids, draft = random_ids(40, seed=3), [11, 4000, 11]
    blocks = rt.ScatteredBlocks(runner.kv_pool.num_blocks, runner.block_size, seed=5)

    def seq(i: int, tokens: list[int], computed: int) -> Any:
        s = rt.FakeSeq(seq_id=i, token_ids=list(tokens))
        blocks.grow(s, len(tokens) + len(draft))
        if computed:
            rt.step_logits(runner, [BatchItem(s, computed, sample=False)])
        return s

    alone = seq(0, ids, 39)
    want = [rt.step_logits(runner, [BatchItem(alone, 1, sample=True)])[0]]
    for t in draft:  # one decode step at a time
        alone.token_ids.append(t)
        want.append(rt.step_logits(runner, [BatchItem(alone, 1, sample=True)])[0])
    want = torch.cat(want)

    spec, other, fresh = seq(1, ids, 39), seq(2, ids[:20], 19), seq(3, ids[:25], 0)
    items = [
        BatchItem(other, 1, sample=True),
        BatchItem(spec, 1 + len(draft), sample=True, draft=list(draft)),
        BatchItem(fresh, 25, sample=True),
    ]
    inputs = runner.prepare(items)
    assert inputs.meta.num_decodes == 1 + 4 and inputs.meta.decode_rows_share_sequences
    assert inputs.sample_items == [0, 1, 1, 1, 1, 2]
    got = rt.step_logits(runner, items)
    # step_logits advanced them: run the same step once more, for its samples.
    spec.num_computed_tokens, other.num_computed_tokens, fresh.num_computed_tokens = 39, 19, 0
    torch.testing.assert_close(got[1], want, atol=1e-4, rtol=0)
    out = runner.execute(items)
    assert out.sampled_token_ids[1] == int(want[0].argmax())
    assert [t for t, _ in out.draft_samples[1]] == want[1:].argmax(-1).tolist()
    assert out.draft_samples[0] is None and out.draft_samples[2] is None
    assert spec.token_ids == ids  # the drafts are not written into the sequence


@pytest.mark.parametrize("use_kernel", [True, False], ids=["cpp-decode", "torch-decode"])
def test_decode_only_step_of_shared_rows(
    tiny_llama_dir: Path, build_runner: Callable[..., ModelRunner], rt: SimpleNamespace, use_kernel: bool
) -> None:
    """Drafts and a ``decode_rows`` catch-up (4 tokens past a cached context, as a draft model catches
    up) beside a plain decode, with no prefill in the step: the fused decode call takes the rows that
    share a sequence, every row's logits equal feeding its tokens one step at a time, and the catch-up
    samples its last row only."""
    runner = build_runner(tiny_llama_dir, num_blocks=64, backend=TorchAttentionBackend(16, use_kernel=use_kernel))
    ids, extra = random_ids(40, seed=7), [11, 4000, 11, 7]
    blocks = rt.ScatteredBlocks(runner.kv_pool.num_blocks, runner.block_size, seed=9)

    def seq(i: int, tokens: list[int], computed: int) -> Any:
        s = rt.FakeSeq(seq_id=i, token_ids=list(tokens))
        blocks.grow(s, len(tokens) + len(extra))
        rt.step_logits(runner, [BatchItem(s, computed, sample=False)])
        return s

    alone = seq(0, ids, 39)
    want = [rt.step_logits(runner, [BatchItem(alone, 1, sample=True)])[0]]
    for t in extra:  # one decode step at a time
        alone.token_ids.append(t)
        want.append(rt.step_logits(runner, [BatchItem(alone, 1, sample=True)])[0])
    one_by_one = torch.cat(want)

    spec, other, catch = seq(1, ids, 39), seq(2, ids[:20], 19), seq(3, ids + extra[:3], 40)
    items = [
        BatchItem(other, 1, sample=True),
        BatchItem(spec, 1 + len(extra), sample=True, draft=list(extra)),
        BatchItem(catch, 3, sample=True, decode_rows=True),
    ]
    inputs = runner.prepare(items)
    assert inputs.meta.num_decodes == inputs.meta.num_tokens == 1 + 5 + 3 and inputs.meta.decode_rows_share_sequences
    assert inputs.sample_items == [0, 1, 1, 1, 1, 1, 2]
    assert (runner.backend.fused_decode_args(inputs.meta) is not None) == use_kernel
    got = rt.step_logits(runner, items)
    torch.testing.assert_close(got[1], one_by_one, atol=1e-4, rtol=0)
    torch.testing.assert_close(got[2], one_by_one[1:4], atol=1e-4, rtol=0)  # after ids + extra[:1], [:2], [:3]
