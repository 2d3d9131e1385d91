"""Which attention backend a device gets, and that the CPU path never imports CUDA-only packages."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CUDA_ONLY = ("flash_attn", "flash_attn_2_cuda", "triton")


def run_python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (so sys.modules starts clean); it prints one JSON line last."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a fresh Python process
def test_cpu_gets_the_torch_backend_and_imports_nothing_cuda_only() -> None:
    got = run_python(
        """
        import json, sys, torch
        from servelm.runtime.platform import platform_of
        backend = platform_of("cpu").attention_backend(block_size=16, dtype=None, head_dim=None, use_cpu_kernel=True)
        print(json.dumps({"backend": type(backend).__name__, "modules": sorted(sys.modules)}))
        """
    )
    assert got["backend"] == "TorchAttentionBackend"
    assert not [m for m in got["modules"] if m.split(".")[0] in CUDA_ONLY]


@pytest.mark.slow  # a fresh Python process
def test_cuda_modules_import_without_cuda_packages() -> None:
    # The platform seam and the runner may import these on any machine; only building a CUDA backend
    # (or capturing graphs) may pull triton / flash_attn in.
    got = run_python(
        """
        import importlib.util, json, sys
        flash = bool(importlib.util.find_spec("flash_attn") and importlib.util.find_spec("triton"))
        import torch
        import servelm.runtime.cuda.flash_backend as fb, servelm.runtime.cuda.graphs, servelm.runtime.cuda.memory
        import servelm.runtime.cuda.platform, servelm.runtime.cuda.setup
        block = fb.default_cuda_block_size(torch.bfloat16, 128)
        print(json.dumps({"modules": sorted(sys.modules), "block": block, "flash": flash}))
        """
    )
    assert not [m for m in got["modules"] if m.split(".")[0] in CUDA_ONLY]
    assert got["block"] == (256 if got["flash"] else 16)


def _install_fake(root: Path, files: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.syspath_prepend(str(root))
    for m in [m for m in sys.modules if m.split(".")[0] == "flash_attn"]:
        monkeypatch.delitem(sys.modules, m)


FA2_INTERFACE = "def flash_attn_varlen_func(*a, **k): ...\ndef flash_attn_with_kvcache(*a, **k): ...\n"


@pytest.fixture
def fake_flash_attn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make flash-attn 2 findable (its two entry points, doing nothing) so availability checks can be exercised."""
    _install_fake(
        tmp_path,
        {
            "flash_attn/__init__.py": "from flash_attn.flash_attn_interface import flash_attn_varlen_func, flash_attn_with_kvcache\n",
            "flash_attn/flash_attn_interface.py": FA2_INTERFACE,
        },
        monkeypatch,
    )


def test_flash_backend_states_why_it_cannot_serve(fake_flash_attn: None) -> None:
    from servelm.runtime.cuda.flash_backend import FlashAttentionBackend, default_cuda_block_size

    if importlib.util.find_spec("triton") is None:
        assert "triton" in (FlashAttentionBackend.supports(torch.bfloat16, 128) or "")
        return
    assert FlashAttentionBackend.supports(torch.bfloat16, 128) is None
    assert FlashAttentionBackend.supports(torch.float16, 64, block_size=512) is None
    assert "float32" in (FlashAttentionBackend.supports(torch.float32, 128) or "")
    assert "head_dim" in (FlashAttentionBackend.supports(torch.bfloat16, 100) or "")
    assert "256" in (FlashAttentionBackend.supports(torch.bfloat16, 128, block_size=16) or "")
    # A float32 model on CUDA goes to the Triton fallback, which takes the small block size.
    assert default_cuda_block_size(torch.bfloat16, 128) == 256
    assert default_cuda_block_size(torch.float32, 128) == 16


def test_without_flash_attn_the_block_size_is_tritons(monkeypatch: pytest.MonkeyPatch) -> None:
    from servelm.runtime.cuda import flash_backend

    monkeypatch.setattr(flash_backend, "flash_attn_importable", lambda: False)
    assert "not installed" in (flash_backend.FlashAttentionBackend.supports(torch.bfloat16, 128) or "")
    assert flash_backend.default_cuda_block_size(torch.bfloat16, 128) == flash_backend.TRITON_BLOCK_SIZE


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the fallback needs triton")
def test_flash_attn_4_alone_or_a_broken_install_falls_back_to_triton(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """flash-attn-4 installs only ``flash_attn.cute`` (a namespace package without the paged-KV
    functions): not taken for flash-attn 2. An install that is there but does not load (an extension
    built for another torch) is reported and the server still starts, on the Triton fallback."""
    from servelm.runtime.cuda import flash_backend
    from servelm.runtime.platform import platform_of

    def select_backend(device: str, *, block_size: int, dtype: torch.dtype, head_dim: int) -> object:
        return platform_of(device).attention_backend(
            block_size=block_size, dtype=dtype, head_dim=head_dim, use_cpu_kernel=True
        )

    _install_fake(tmp_path / "fa4", {"flash_attn/cute/__init__.py": ""}, monkeypatch)
    assert importlib.util.find_spec("flash_attn") is not None and not flash_backend.flash_attn_importable()
    assert "flash-attn-4" in (flash_backend.FlashAttentionBackend.supports(torch.bfloat16, 128) or "")
    assert flash_backend.default_cuda_block_size(torch.bfloat16, 128) == flash_backend.TRITON_BLOCK_SIZE
    # Selection builds no CUDA tensors: it runs here for a CUDA device.
    assert isinstance(
        select_backend("cuda", block_size=16, dtype=torch.bfloat16, head_dim=128), flash_backend.TritonPagedBackend
    )

    _install_fake(
        tmp_path / "broken",
        {
            "flash_attn/__init__.py": "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice')\n",
            "flash_attn/flash_attn_interface.py": FA2_INTERFACE,
        },
        monkeypatch,
    )
    assert flash_backend.flash_attn_importable()
    with caplog.at_level("WARNING"):
        backend = select_backend("cuda", block_size=256, dtype=torch.bfloat16, head_dim=128)
    assert isinstance(backend, flash_backend.TritonPagedBackend) and backend.block_size == 256
    assert "does not load" in caplog.text and "undefined symbol" in caplog.text


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the backend's store kernel needs triton")
def test_a_loadable_flash_attn_2_is_chosen(fake_flash_attn: None) -> None:
    from servelm.runtime.cuda import flash_backend
    from servelm.runtime.platform import platform_of

    backend = platform_of("cuda").attention_backend(
        block_size=256, dtype=torch.bfloat16, head_dim=128, use_cpu_kernel=True
    )
    assert isinstance(backend, flash_backend.FlashAttentionBackend)


def test_only_a_gpu_server_shortens_the_gil_switch_interval() -> None:
    """The engine thread feeding a GPU must not wait Python's 5 ms for the HTTP thread after each CUDA
    call; on CPU the default stays (no gain measured there)."""
    from servelm.runtime.platform import platform_of

    assert platform_of(torch.device("cpu")).gil_switch_interval is None
    got = platform_of(torch.device("cuda", 0)).gil_switch_interval
    assert got is not None and 0 < got < sys.getswitchinterval()
