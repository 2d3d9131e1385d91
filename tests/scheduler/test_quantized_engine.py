"""``--quantization int8`` on the default model (SmolLM2-135M-Instruct): sane answers, the same tokens
batched as alone (few-row int8 kernel and the dequantized prefill path are one model), no block leaked."""

from __future__ import annotations

import pytest

from servelm.runtime.cpu import linear as cpu_linear
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # engines on the default model

QUESTIONS = [
    "What is the capital of France?",
    "Name the largest planet of the solar system.",
    "What colour is the sky on a clear day?",
    "How many legs does a spider have?",
]


def _chat(engine: Engine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


def test_int8_engine_answers_and_batching_does_not_change_its_tokens() -> None:
    if cpu_linear.few_row_int8_kernel() is None:
        pytest.skip("no int8 kernel here (the dequantized path is covered by tests/runtime/test_quantization.py)")
    engine = Engine(EngineConfig(quantization="int8", kv_cache_memory=128 * 2**20, max_model_len=1024))
    assert engine.runner.weight_bytes < 0.3 * 538_060_032  # a quarter of the float32 weights, plus scales
    assert engine._step_cost.weight_bytes == engine.runner.weight_bytes  # MBU counts the int8 bytes
    prompts = [_chat(engine, q) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    together = [r.outputs[0] for r in engine.generate(prompts, params)]
    alone = [engine.generate([p], params)[0].outputs[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert "Paris" in together[0].text, [o.text for o in together]
    assert engine.block_manager.num_used_blocks == 0
    # /metrics says what runs: the info series carries the quantization.
    from prometheus_client import generate_latest

    from servelm.server.app import create_prometheus_observer

    observer = create_prometheus_observer(engine)
    assert observer is not None
    assert 'quantization="int8"' in generate_latest(observer.registry).decode()


def test_int4_is_the_default_models_own_precision_same_weights_and_tokens_as_float32() -> None:
    """The default model ships as Q4_1 projections and a Q8_0 embedding: int4 (groups of 32 with fp16
    scale and minimum, head in int8 groups) holds exactly those weights, so ``--quantization auto``
    takes it, every dequantized projection equals the float32 checkpoint's bit for bit, and the greedy
    tokens are the float32 engine's, at a sixth of the bytes a step reads."""
    if not cpu_linear.quantized_kernels():
        pytest.skip("no quantized kernels here (the dequantized path is covered by tests/runtime/test_quantization.py)")
    import torch

    from servelm.runtime.models.layers import Linear

    f32 = Engine(EngineConfig(quantization="none", kv_cache_memory=64 * 2**20, max_model_len=1024))
    # auto (the default) finds the weights on int4's grid and takes it.
    q4 = Engine(EngineConfig(kv_cache_memory=64 * 2**20, max_model_len=1024))
    assert q4.config.quantization == "auto"
    assert q4.runner.quantization == "int4" and f32.runner.quantization is None
    assert q4.runner.weight_bytes < 0.2 * f32.runner.weight_bytes
    dense = {n: m for n, m in f32.runner.model.named_modules() if isinstance(m, Linear)}
    quantized = {n: m for n, m in q4.runner.model.named_modules() if isinstance(m, Linear)}
    assert dense.keys() == quantized.keys() and len(quantized) == 4 * 30
    for name, module in quantized.items():
        assert module.method.parts.quant is not None and module.method.parts.quant.scheme == "int4"
        reference = dense[name].weight  # kept beside the packed copy for the few-row kernel
        assert reference is not None and torch.equal(module.method.parts.quant.dequantize(), reference), name
    head = q4.runner.model.head_method.parts.quant
    assert head is not None and head.scheme == "int8_groups"
    assert torch.equal(head.dequantize(), f32.runner.model.model.embed_tokens.weight)
    prompts = [_chat(q4, q) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    want = [r.outputs[0].token_ids for r in f32.generate(prompts, params)]
    del f32
    together = [r.outputs[0].token_ids for r in q4.generate(prompts, params)]
    alone = [q4.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert together == want and alone == want
    assert q4.block_manager.num_used_blocks == 0
    from prometheus_client import generate_latest

    from servelm.server.app import create_prometheus_observer

    observer = create_prometheus_observer(q4)
    assert observer is not None
    assert 'quantization="int4"' in generate_latest(observer.registry).decode()  # what runs, not "auto"
