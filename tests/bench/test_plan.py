"""``servelm plan``: capacity and roofline bounds from a config alone."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from servelm.bench import plan as plan_cmd
from servelm.runtime.capacity import flops_per_token
from servelm.runtime.config import ModelConfig

# Llama-2-7B's config.json as published (the fields that matter).
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float16", "tie_word_embeddings": False,
}  # fmt: skip


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    rc = plan_cmd.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_llama2_7b_from_config_alone(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "Llama-2-7b-hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA2_7B))
    for model in (str(folder), str(folder / "config.json")):
        rc, out, _ = plan(capsys, "--model", model, "--dtype", "float16", "--device", "a100-80g")
        assert rc == 0
        assert "KV per token     512.0 KiB" in out
        assert "KV per request   2.00 GiB for 4096 tokens" in out
        assert "Llama-2-7b-hf" in out
    rc, out, _ = plan(capsys, "--model", str(folder), "--dtype", "float16", "--device", "a100-80g", "--json")
    p = json.loads(out)
    assert p["kv_bytes_per_token"] == 512 * 1024
    assert p["kv_bytes_per_request"] == 2 * 2**30
    assert p["weight_bytes"] == 6_738_415_616 * 2  # Llama-2-7B's parameter count


def test_llama2_13b_on_an_80gb_card(capsys) -> None:
    rc, out, _ = plan(capsys, "--preset-model", "llama-2-13b", "--device", "a100-80g", "--dtype", "float16", "--json")
    assert rc == 0
    p = json.loads(out)
    per_token = 2 * 40 * 40 * 128 * 2
    kv_pool = int(80e9 * 0.9) - 13_015_864_320 * 2
    blocks = kv_pool // (per_token * 16)
    assert p["kv_bytes_per_token"] == per_token and p["num_blocks"] == blocks
    assert p["max_concurrent_requests"] == blocks // (4096 // 16) == 13
    rc, out, _ = plan(capsys, "--preset-model", "llama-2-13b", "--device", "a100-80g", "--dtype", "float16")
    assert "max concurrent   13 requests of 4096 tokens" in out


def test_roofline_bounds(capsys) -> None:
    rc, out, _ = plan(capsys, "--preset-model", "llama-3-8b", "--device", "h100-80g", "--context-len", "2048",
                      "--batch", "16", "--json")  # fmt: skip
    assert rc == 0
    p = json.loads(out)
    cfg = ModelConfig.from_hf_dict(plan_cmd.PRESET_MODELS["llama-3-8b"])
    assert p["dtype"] == "bfloat16" and p["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    weights, kv = cfg.num_params * 2, 2048 * p["kv_bytes_per_token"]
    d1, d16 = p["decode"]
    assert d1["batch"] == 1 and d1["bound_by"] == "memory"
    assert d1["seconds_per_token"] == pytest.approx((weights + kv) / 3.35e12)
    assert d16["seconds_per_token"] == pytest.approx((weights + 16 * kv) / 3.35e12)
    assert d16["tokens_per_s"] == pytest.approx(16 / d16["seconds_per_token"])
    # Prefill: each position through the layers (causal attention over itself and what precedes it),
    # the LM head once; summed position by position here.
    lm_head = 2.0 * cfg.vocab_size * cfg.hidden_size
    by_position = sum(flops_per_token(cfg, p_ + 1) - lm_head for p_ in range(2048)) + lm_head
    assert p["prefill_flops"] == pytest.approx(by_position)
    assert p["prefill_seconds"] == pytest.approx(by_position / 989e12)


def test_custom_memory_and_not_fitting(capsys) -> None:
    rc, out, err = plan(capsys, "--preset-model", "llama-2-7b", "--memory", "24GiB", "--dtype", "float16", "--json")
    assert rc == 0
    p = json.loads(out)
    assert p["memory_bytes"] == 24 * 2**30 and p["device"] == "custom"
    assert p["prefill_seconds"] is None  # no bandwidth or peak known
    rc, out, err = plan(capsys, "--preset-model", "llama-2-70b", "--device", "a100-80g")
    assert rc == 1 and "not even one 4096-token request fits" in err
    rc, out, err = plan(
        capsys, "--preset-model", "smollm2-135m", "--kv-cache-memory", "2GiB", "--context-len", "2048", "--json"
    )
    p = json.loads(out)
    assert p["device"] == "cpu" and p["dtype"] == "float32" and p["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert p["num_blocks"] == 2 * 2**30 // (46080 * 16)


def test_bad_model_is_one_line(tmp_path: Path, capsys) -> None:
    rc, _, err = plan(capsys, "--model", str(tmp_path / "missing"))
    assert rc == 2 and err.startswith("servelm plan:")


def test_parse_size_and_registration() -> None:
    assert plan_cmd.parse_size("24GiB") == 24 * 2**30
    assert plan_cmd.parse_size("80GB") == 80 * 10**9
    assert plan_cmd.parse_size("512 MiB") == 512 * 2**20
    with pytest.raises(argparse.ArgumentTypeError):
        plan_cmd.parse_size("lots")
    parser = argparse.ArgumentParser()
    plan_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", "--preset-model", "llama-2-7b"])
    assert args.func is plan_cmd.run and args.batch == 32 and args.block_size == 16
