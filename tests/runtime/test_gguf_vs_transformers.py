"""Tiny GGUF files of every architecture servelm serves from GGUF, in every block format, served AS STORED
(quantized projections, embedding and head kept in the file's memory-mapped blocks) and dequantized
(``quantization="none"``): our logits equal transformers' logits of the same file (issue 22).

The reference is transformers loading the GGUF file itself (``from_pretrained(dir, gguf_file=name)``,
dequantized to float32), run over each whole sequence at once; ours is a batched prefill of two prompts
(20 and 13 tokens) on scattered KV blocks, then 4 decode steps of both. Gemma 3's 16-token sliding window
is crossed by the 24-token sequence.

Each file is written once per module (``gguf_models.write_tiny_gguf``, the configs it can write so that
transformers reads them back as the source model). Every file carries the default model's tokenizer: its
folder's tokenizer is built from the first file and reused (``_fast_gguf_parsing``).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf_models import Case, save_tiny_model_for_gguf, tensor_format, write_tiny_gguf

from servelm.runtime.models.layers import Linear

# Second tier (docs/testing.md): reference comparisons through GGUF files written as llama.cpp's converter
# writes them and read back by transformers' GGUF loader, 2-3 s a case before its first test (the int8
# references 5-8 s a case more, an engine a flag set 5-6 s); nearly every test here reads those files.
pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")


CASES: dict[str, Case] = {
    # llama.cpp's q/k row permutation over K-quant and 32-element blocks; an untied quantized head
    "llama_untied": Case(
        "llama_untied",
        "llama",
        True,
        {
            "attn_q": Q.Q4_K,
            "attn_k": Q.Q4_0,
            "attn_v": Q.Q5_1,
            "attn_output": Q.Q6_K,
            "ffn_gate": Q.Q5_K,
            "ffn_up": Q.Q4_1,
            "ffn_down": Q.Q8_0,
            "token_embd": Q.Q8_0,
            "output": Q.Q6_K,
        },
    ),
    # Mistral, written as llama (transformers reads it back as Mistral by the file's name)
    "mistral": Case(
        "mistral",
        "llama",
        False,
        {"attn": Q.Q5_0, "ffn_down": Q.F16, "ffn": Q.Q4_1, "token_embd": Q.BF16, "output": Q.Q8_0},
    ),
    # q/k/v biases; a tied head read from a quantized embedding
    "qwen2": Case(
        "qwen2",
        "qwen2",
        False,
        {
            "attn_q": Q.Q8_0,
            "attn_k": Q.Q4_0,
            "attn_v": Q.Q5_1,
            "attn_output": Q.BF16,
            "ffn": Q.Q5_0,
            "token_embd": Q.Q4_1,
        },
    ),
    # q/k norms, head_dim 128; the K-quant mix of a Q4_K_M file
    "qwen3": Case("qwen3", "qwen3", True, {"attn": Q.Q4_K, "ffn_down": Q.Q6_K, "ffn": Q.Q5_K, "token_embd": Q.Q8_0}),
    # norms stored as 1 + w, sliding window 16 on layers 0-4, head_dim 256
    "gemma3": Case(
        "gemma3",
        "gemma3",
        True,
        {
            "attn_q": Q.Q6_K,
            "attn_k": Q.Q6_K,
            "attn_v": Q.Q8_0,
            "attn_output": Q.Q4_K,
            "ffn_gate": Q.Q4_0,
            "ffn_up": Q.Q5_K,
            "ffn_down": Q.F16,
            "token_embd": Q.Q6_K,
        },
    ),
}
FORMATS = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16}

# Two prompts (20 and 13 tokens) prefilled together, then DECODE_STEPS tokens of each decoded one at a time.
DECODE_STEPS = 4
PROMPT_LENGTHS = (20, 13)
RTOL_OF_MAX = 1e-4  # atol = RTOL_OF_MAX * max |logit|: float32 summation-order noise


def sequences(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(22)
    return [rng.integers(0, vocab, n + DECODE_STEPS).tolist() for n in PROMPT_LENGTHS]


@contextlib.contextmanager
def _fast_gguf_parsing() -> Iterator[None]:
    """Parsing the 49,152-token vocabulary every tiny file carries dominates building a case (~15 s a file
    as shipped). While the cases are built: gguf-py's reader gets the file's bytes as a plain array instead
    of ``np.memmap`` slices (~3x faster, same parse); each file is parsed once for transformers' two loads
    and the folder's config; and the folders' tokenizer is built once, from the first file, since every file
    holds the same ``tokenizer.*`` keys (the default model's). Weights are read as usual afterwards."""
    import gguf
    import gguf.gguf_reader as gguf_reader

    from servelm.runtime.gguf import folder

    fake_np = types.ModuleType("numpy_plain_map")
    fake_np.__dict__.update(np.__dict__)
    fake_np.memmap = lambda path, mode="r", **_: np.fromfile(path, dtype=np.uint8)
    real_reader = gguf.GGUFReader
    readers: dict[tuple[str, int, int], Any] = {}

    def cached_reader(path: Any, mode: str = "r") -> Any:
        p = Path(path).resolve()
        st = p.stat()
        key = (str(p), st.st_size, st.st_mtime_ns)
        if key not in readers:
            readers[key] = real_reader(p, mode)
        return readers[key]

    real_tokenizer = transformers.AutoTokenizer.from_pretrained
    tokenizers: list[Any] = []

    def tokenizer_once(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("gguf_file"):
            return real_tokenizer(*args, **kwargs)
        if not tokenizers:
            tokenizers.append(real_tokenizer(*args, **kwargs))
        return tokenizers[0]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_reader, "np", fake_np)
        mp.setattr(gguf, "GGUFReader", cached_reader)
        mp.setattr(folder, "GGUFReader", cached_reader)
        mp.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(tokenizer_once))
        yield


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread, as the scheduler's HF comparisons use: this shared 2-core machine runs other
    processes, and two threads competing with them make every step slower and erratic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Served:
    case: Case
    path: Path  # the GGUF file
    folder: Path  # its prepared folder (config, tokenizer, gguf.json)
    seqs: list[list[int]]
    reference: list[torch.Tensor]  # transformers' logits over each whole sequence [len, vocab]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Served]:
    """``served(case_id)``: the case's GGUF file, its prepared folder and transformers' logits (built once)."""
    from servelm.runtime.gguf.folder import prepare_folder

    cache: dict[str, Served] = {}

    def get(case_id: str) -> Served:
        if case_id not in cache:
            case = CASES[case_id]
            root = tmp_path_factory.mktemp(f"gguf-{case_id}")
            with _fast_gguf_parsing():
                hf_dir = save_tiny_model_for_gguf(case.variant, root / "hf", wide=case.wide)
                (root / "file").mkdir()
                path = write_tiny_gguf(hf_dir, root / "file" / f"tiny-{case_id}.gguf", arch=case.arch, qtype=case.qtype)
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, dtype=torch.float32
                ).eval()
                # resolve_model_path's preparation, into the test's own folder rather than the user's cache
                folder = prepare_folder(path, root / "prepared")
            seqs = sequences(model.config.vocab_size)
            with torch.inference_mode():
                reference = [model(torch.tensor([s])).logits[0].float() for s in seqs]
            del model
            cache[case_id] = Served(case, path, folder, seqs, reference)
        return cache[case_id]

    return get


def run_ours(runner: Any, rt: Any, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Prefill all but the last DECODE_STEPS tokens of every sequence in one batch, then decode them one
    step at a time; per sequence, the logits of all its positions [len, vocab]."""
    from servelm.runtime.batch import BatchItem

    blocks = rt.ScatteredBlocks(runner.kv_pool.num_blocks, runner.block_size, seed=3)
    fakes = [rt.FakeSeq(seq_id=i, token_ids=list(s[:-DECODE_STEPS])) for i, s in enumerate(seqs)]
    for f, s in zip(fakes, seqs):
        blocks.grow(f, len(s))
    per_seq: list[list[torch.Tensor]] = [[] for _ in seqs]
    for i, logits in enumerate(rt.step_logits(runner, [BatchItem(f, len(f.token_ids), sample=True) for f in fakes])):
        per_seq[i].append(logits)
    for step in range(DECODE_STEPS - 1, -1, -1):
        for f, s in zip(fakes, seqs):
            f.token_ids.append(s[len(s) - 1 - step])  # the next token of the sequence (not our sample)
        for i, logits in enumerate(rt.step_logits(runner, [BatchItem(f, 1, sample=True) for f in fakes])):
            per_seq[i].append(logits)
    # the last decode step's logits follow the last token: compared positions are 0 .. len - 1
    return [torch.cat(parts) for parts in per_seq]


def assert_logits_match(ours: list[torch.Tensor], theirs: list[torch.Tensor], label: str) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape, (label, i, a.shape, b.shape)
        scale = b.abs().max().item()
        atol = RTOL_OF_MAX * scale
        err = (a - b).abs()
        worst = int(err.max(dim=-1).values.argmax())
        assert err.max().item() <= atol, (
            f"{label} seq {i}: max |ours - transformers| {err.max().item():.3e} at position {worst} "
            f"> atol {atol:.3e} (max |logit| {scale:.3f}); per position: "
            f"{[round(x, 6) for x in err.max(dim=-1).values.tolist()]}"
        )
        # argmax equal, except where transformers' own top two are within the tolerance of each other
        top = b.topk(2, dim=-1)
        tie = (top.values[:, 0] - top.values[:, 1]) <= atol
        differ = (a.argmax(-1) != top.indices[:, 0]) & ~tie
        assert not differ.any(), f"{label} seq {i}: argmax differs at positions {differ.nonzero().flatten().tolist()}"


def test_cases_cover_every_architecture_and_format() -> None:
    assert {c.variant for c in CASES.values()} == {"llama_untied", "mistral", "qwen2", "qwen3", "gemma3"}
    assert {c.arch for c in CASES.values()} == {"llama", "qwen2", "qwen3", "gemma3"}
    assert {q for c in CASES.values() for q in c.qtype.values()} == FORMATS
    for c in CASES.values():
        assert len(set(c.qtype.values())) >= 3, c  # mixed formats within each model
    # the spec says what each tensor gets: e.g. qwen3's ffn_down is Q6_K, its other ffn weights Q5_K
    assert tensor_format("blk.0.ffn_down.weight", (256, 512), CASES["qwen3"].qtype) == Q.Q6_K
    assert tensor_format("blk.0.ffn_up.weight", (512, 256), CASES["qwen3"].qtype) == Q.Q5_K


@pytest.mark.parametrize("case_id", list(CASES))
def test_served_as_stored_equals_transformers(case_id: str, served, build_runner, rt) -> None:
    s = served(case_id)
    runner = build_runner(s.folder, num_blocks=8)
    assert runner.weights_as_stored
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert sum(m.method.parts.stored is not None for m in linears) >= len(linears) // 2  # the block formats stay blocks
    if s.case.qtype["token_embd"] not in (Q.F16, Q.BF16):
        assert runner.model.stored_embedding is not None  # rows read from the file's blocks
    assert_logits_match(run_ours(runner, rt, s.seqs), s.reference, f"{case_id} as stored")


@pytest.mark.parametrize("case_id", list(CASES))
def test_dequantized_equals_transformers(case_id: str, served, build_runner, rt) -> None:
    s = served(case_id)
    runner = build_runner(s.folder, num_blocks=8, quantization="none")
    assert not runner.weights_as_stored
    assert all(m.method.parts.stored is None for m in runner.model.modules() if isinstance(m, Linear))
    assert_logits_match(run_ours(runner, rt, s.seqs), s.reference, f"{case_id} dequantized")


# --gguf-activations int8 rounds each quantized projection's input to int8 per block, as llama.cpp
# does. Its reference is transformers on the same file with the same rounding applied to the input of
# every Linear whose weight the file quantizes (a forward pre-hook). Summation noise still moves an x
# across a rounding half-step now and then (about one element in 10^5), and a flipped element's change
# of one step then spreads to later positions through the KV cache: so the first position, which no
# earlier flip reaches, must match to summation noise, and the rest must be nearer the rounded
# reference than the float32 one.
# On CPUs with AMX a step of many rows (here the prefill of both prompts, 33 rows) takes bfloat16 tiles
# instead: those positions' products are bf16(x) bf16(W), the decode steps' x' W.
def int8_reference(s: Served, amx: bool = False) -> list[torch.Tensor]:
    """transformers' logits over ``s.seqs`` with every quantized Linear's input rounded as the int8 path
    rounds it (per 32 elements, or 256 for K-quant weights; float weights take x as it is); with ``amx``,
    the prefilled positions' inputs and weights rounded to bfloat16 instead."""
    from servelm.runtime.gguf.names import hf_tensor_names
    from servelm.runtime.gguf.projection import activation_block
    from servelm.runtime.gguf.reader import read_gguf_tensors

    tensors = read_gguf_tensors(s.path)
    hf = {v.removesuffix(".weight"): tensors[k].qtype for k, v in hf_tensor_names(list(tensors), s.case.arch).items()}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(s.path.parent), gguf_file=s.path.name, dtype=torch.float32
    ).eval()
    if "lm_head" not in hf:  # a tied head multiplies by the embedding's blocks
        hf["lm_head"] = tensors["token_embd.weight"].qtype
    hooked = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and activation_block(hf.get(name, Q.F32)):
            block = activation_block(hf[name])
            module.register_forward_hook(lambda m, args, _out, block=block: rounded_linear(m, args[0], block, amx))
            hooked += 1
    assert hooked >= 4, f"only {hooked} Linear modules matched the file's quantized tensors"
    with torch.inference_mode():
        return [model(torch.tensor([q])).logits[0].float() for q in s.seqs]


def rounded_linear(m: torch.nn.Linear, x: torch.Tensor, block: int, amx: bool) -> torch.Tensor:
    """``m(x)`` as the int8 mode computes it: x rounded per block, or with ``amx`` the prefilled
    positions (all but the last DECODE_STEPS) as bf16(x) bf16(W)."""
    from servelm.runtime.gguf.projection import round_activations

    flat = x.reshape(-1, x.shape[-1])
    out = F.linear(round_activations(flat, block), m.weight, m.bias)
    if amx:
        prefilled = flat.shape[0] - DECODE_STEPS
        out[:prefilled] = F.linear(flat[:prefilled].bfloat16().float(), m.weight.bfloat16().float(), m.bias)
    return out.reshape(*x.shape[:-1], -1)


@pytest.fixture(params=("int8", "amx"))
def int8_mode_path(request):
    """The int8 mode's many-row steps through the int8 kernels (AMX off), or where the CPU has AMX,
    its bfloat16 tiles as by default."""
    from servelm.runtime.cpu import gguf_kernels as kernels

    module = kernels.load()
    if module is None:
        pytest.skip("the GGUF kernel extension cannot be built here")
    if request.param == "amx" and not module.amx_available():
        pytest.skip("this CPU (or build, or kernel) has no AMX bfloat16 tiles")
    rows = module.set_amx_min_rows(1 << 62 if request.param == "int8" else -1)
    yield request.param
    module.set_amx_min_rows(rows)


@pytest.mark.parametrize("case_id", list(CASES))
def test_int8_activations_equal_transformers_with_rounded_inputs(
    case_id: str, int8_mode_path: str, served, build_runner, rt
) -> None:
    s = served(case_id)
    runner = build_runner(s.folder, num_blocks=8, gguf_activations="int8")
    assert runner.gguf_activations == "int8"
    ours = run_ours(runner, rt, s.seqs)
    rounded = int8_reference(s, amx=int8_mode_path == "amx")
    to_float = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, s.reference))
    to_rounded = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, rounded))
    assert to_float > 10 * RTOL_OF_MAX, f"{case_id}: the int8 path looks unused ({to_float:.2e} of max from float32)"
    assert_logits_match([a[:1] for a in ours], [b[:1] for b in rounded], f"{case_id} int8, first position")
    assert to_rounded <= 0.75 * to_float, (
        f"{case_id}: {to_rounded:.2e} of max from the rounded reference, {to_float:.2e} from float32"
    )


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({}, ("int8", torch.float16)),  # the default: llama.cpp's arithmetic and cache
        ({"gguf_activations": "float32"}, ("float32", torch.float32)),  # exact mode, float32 cache
        ({"kv_cache_dtype": "float32"}, ("int8", torch.float32)),
        ({"gguf_activations": "float32", "kv_cache_dtype": "bfloat16"}, ("float32", torch.bfloat16)),
        ({"quantization": "none"}, ("float32", torch.float32)),  # dequantized: no stored weights to round for
    ],
)
def test_a_gguf_file_runs_llama_cpps_arithmetic_unless_asked_otherwise(
    flags: dict[str, Any], expected: tuple[str, torch.dtype], served, tmp_path, monkeypatch
) -> None:
    from servelm.scheduler.config import EngineConfig
    from servelm.scheduler.engine import Engine

    s = served(next(iter(CASES)))
    monkeypatch.setenv("SERVELM_CACHE", str(tmp_path))  # (the file's prepared folder goes there)
    engine = Engine(EngineConfig(model=str(s.path), kv_cache_memory=2 * 2**20, max_model_len=128, **flags))
    assert (engine.runner.gguf_activations, engine.runner.kv_dtype) == expected
    assert (engine.config.gguf_activations, engine.config.kv_cache_dtype) == (
        expected[0],
        str(expected[1]).removeprefix("torch."),
    )


def test_a_plain_folder_is_exact_by_default(tiny_llama_dir: Path) -> None:
    from servelm.scheduler.config import EngineConfig
    from servelm.scheduler.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=2 * 2**20, max_model_len=128))
    assert (engine.runner.gguf_activations, engine.runner.kv_dtype) == ("float32", torch.float32)


def test_int8_activations_need_a_gguf_file_as_stored(served, build_runner) -> None:
    s = served(next(iter(CASES)))
    with pytest.raises(ValueError, match="gguf-activations int8 applies to a GGUF file served as stored"):
        build_runner(s.folder, num_blocks=8, gguf_activations="int8", quantization="none")


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_compiled_layer_step_equals_the_layers_own_forward(
    case_id: str, activations: str, served, build_runner, rt
) -> None:
    """The few-row step in compiled calls (``runtime.gguf.layer``: each norm inside the projection after
    it, the activation and Gemma 3's post-feedforward norm inside the down projection) gives the
    layer's own forward's logits within float32 rounding, on every architecture and format mix."""
    s = served(case_id)
    runner = build_runner(s.folder, num_blocks=8, gguf_activations=activations)
    layers = runner.model.model.layers
    steps = [layer.fused_step for layer in layers]
    stored = all(
        lin.method.parts.stored is not None
        for layer in layers
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    )
    assert all(steps) == stored, f"{case_id}: every projection stored: {stored}, steps: {steps}"
    if not stored:
        pytest.skip(f"{case_id}: some projections are dense parameters")
    # The prefill (33 rows) takes the compiled step too where every projection takes any number of
    # rows in one call (int8 activations on quantized weights); float parts keep it to pass_rows.
    prefill_compiled = sum(len(q) - DECODE_STEPS for q in s.seqs) <= steps[0].max_rows
    fused = run_ours(runner, rt, s.seqs)
    for layer in layers:
        layer.fused_step = None
    plain = run_ours(runner, rt, s.seqs)
    decode = []  # per compiled position (decodes; the prefill too where compiled): |fused - plain| / max
    for a, b in zip(fused, plain):
        if not prefill_compiled:
            assert torch.equal(a[:-DECODE_STEPS], b[:-DECODE_STEPS])  # the prefill is the layers' own forward
        compared = slice(None) if prefill_compiled else slice(-DECODE_STEPS, None)
        decode += ((a - b)[compared].abs().max(dim=-1).values / b.abs().max()).tolist()
    shown = [f"{d:.1e}" for d in decode]
    if activations == "float32":
        assert max(decode) <= 2e-5, f"{case_id}: per decode position {shown}"
        return
    # int8: a norm summed in another order may move an element across a rounding step, and a flip
    # spreads through these random layers (measured up to half the int8 effect, on Qwen2), so the two
    # agree only as far as those flips allow; they must still be nearer each other than to float32
    # activations (a compiled step that lost the rounding would be as far as float32 is).
    runner32 = build_runner(s.folder, num_blocks=8)
    for layer in runner32.model.model.layers:
        layer.fused_step = None
    float32 = run_ours(runner32, rt, s.seqs)
    apart = max(float((a - b)[compared].abs().max() / b.abs().max()) for a, b in zip(float32, plain))
    print(f"{case_id} int8: compiled vs plain {max(decode):.1e}, float32 vs int8 {apart:.1e}")
    assert max(decode) <= 0.75 * apart, (
        f"{case_id} int8: per decode position {shown}; float32 activations {apart:.1e} apart"
    )


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_decode_stack_equals_the_layer_steps(case_id: str, activations: str, served, build_runner, rt) -> None:
    """A decode step through every layer in one compiled call (``runtime.gguf.layer.DecodeStack``) makes
    the layers' compiled calls in the same order: the same logits, bit for bit, on every architecture
    (Gemma 3's sliding layers and local RoPE, Qwen3's q/k norms, Qwen2's biases)."""
    s = served(case_id)
    runner = build_runner(s.folder, num_blocks=8, gguf_activations=activations)
    stack = runner.model.decode_stack
    if not all(layer.fused_step for layer in runner.model.model.layers):
        assert stack is None, f"{case_id}: a stack over layers without compiled steps"
        pytest.skip(f"{case_id}: some projections are dense parameters")
    assert stack is not None and stack.bound is not None, f"{case_id}: no decode stack bound"
    taken: list[bool] = []
    forward = stack.forward

    def counted(*args: Any) -> Any:
        out = forward(*args)
        taken.append(out is not None)
        return out

    stack.forward = counted
    stacked = run_ours(runner, rt, s.seqs)
    assert taken == [False] + [True] * DECODE_STEPS, (
        f"{case_id}: the stack ran on steps {taken} (the prefill, then the decodes)"
    )
    runner.model.decode_stack = None
    layered = run_ours(runner, rt, s.seqs)
    for i, (a, b) in enumerate(zip(stacked, layered)):
        assert torch.equal(a, b), f"{case_id} {activations}, sequence {i}: {float((a - b).abs().max()):.2e} apart"
