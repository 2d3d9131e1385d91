"""The encoder's flat batch on tiny random encoders of each architecture: a sequence's states do not depend
on what else is in its step (padded attention, equal lengths, alone), and pooling picks the right rows."""

from __future__ import annotations

import pytest
import torch

from servelm.runtime.encoder_loader import PoolingSpec, _place, pool
from servelm.runtime.models.encoder import Encoder, EncoderBatch, EncoderConfig
from servelm.runtime.models.gemma_encoder import GemmaEncoder, GemmaEncoderConfig

SHAPES = {
    "bert": {"type_vocab_size": 2},
    "mpnet": {"position_offset": 2, "relative_buckets": 32},
    "nomic-bert": {"type_vocab_size": 2, "rope_theta": 1000.0, "gated": True},
}


def tiny(arch: str) -> Encoder | GemmaEncoder:
    torch.manual_seed(0)
    net: Encoder | GemmaEncoder
    if arch == "gemma3_text":  # a sliding window of 8 positions either way on two of its three layers
        gcfg = GemmaEncoderConfig(100, 32, 3, 4, 2, 16, 64, 160, 1e-6, 8, (True, False, True), 1e6, 1e4, 16.0)
        net = GemmaEncoder(gcfg).eval()
    else:
        net = Encoder(EncoderConfig(arch, 100, 32, 2, 4, 64, 160, 1e-12, **SHAPES[arch])).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3)
    return net


@pytest.mark.parametrize("arch", [*sorted(SHAPES), "gemma3_text"])
def test_a_sequence_is_the_same_alone_or_batched(arch: str) -> None:
    net = tiny(arch)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (7, 150, 1, 33, 33)]
    dev = torch.device("cpu")
    with torch.inference_mode():
        batch = EncoderBatch.build(seqs, dev)
        assert batch.pad_rows is not None and batch.max_len == 150
        together = net(batch)
        alone = torch.cat([net(EncoderBatch.build([s], dev)) for s in seqs])
        same_len = EncoderBatch.build(seqs[3:], dev)
        assert same_len.pad_rows is None  # equal lengths: no padding at all
        pair = net(same_len)
    torch.testing.assert_close(together, alone, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pair, alone[-66:], atol=2e-5, rtol=1e-4)


def test_pooling_modes() -> None:
    h = torch.arange(24, dtype=torch.float32).view(6, 4)  # two sequences: rows 0-1 and 2-5
    b = EncoderBatch.build([[1, 2], [3, 4, 5, 6]], torch.device("cpu"))
    want = {
        "mean": torch.stack([h[:2].mean(0), h[2:].mean(0)]),
        "cls": h[[0, 2]],
        "last": h[[1, 5]],
        "max": torch.stack([h[:2].amax(0), h[2:].amax(0)]),
        "mean_sqrt_len": torch.stack([h[:2].sum(0) / 2**0.5, h[2:].sum(0) / 2.0]),
    }
    for mode, expected in want.items():
        torch.testing.assert_close(pool(h, b, PoolingSpec(mode, False, 8)), expected)
    normed = pool(h, b, PoolingSpec("mean", True, 8))
    torch.testing.assert_close(normed, torch.nn.functional.normalize(want["mean"], dim=-1))


def test_float16_matrices_stay_as_stored_and_compute_as_float32() -> None:
    """A GGUF file's float16 matrices under float32 activations: held in float16, the same outputs bit for bit
    as the float32 network holding the same values (every float16 is exactly a float32)."""
    wide = tiny("nomic-bert")
    with torch.no_grad():
        for p in wide.parameters():
            p.copy_(p.half().float())
    narrow = tiny("nomic-bert")
    narrow.load_state_dict({k: v.half() if v.dim() == 2 else v for k, v in wide.state_dict().items()}, assign=True)
    narrow = _place(narrow, torch.device("cpu"), torch.float32)
    kept = {n: p.dtype for n, p in narrow.named_parameters()}
    assert all(kept[n] == (torch.float16 if p.dim() == 2 else torch.float32) for n, p in wide.named_parameters())
    batch = EncoderBatch.build([[1, 5, 9, 2], [3, 4]], torch.device("cpu"))
    with torch.inference_mode():
        assert torch.equal(narrow(batch), wide(batch))
    as_bf16 = _place(narrow, torch.device("cpu"), torch.bfloat16)  # a 16-bit run converts every weight to it
    assert {p.dtype for p in as_bf16.parameters()} == {torch.bfloat16}
