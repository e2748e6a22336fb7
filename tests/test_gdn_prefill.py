"""The Gated DeltaNet prefill kernels (``kernels/gdn_prefill.py``) against the layer's torch
reference: the batched causal conv with its L2 norms and the states it leaves (at each request's
end and at part-way snapshot points, some before a request's first ``width`` tokens), the gates,
and the gated output norm. On CPU under Triton's interpreter; on the GPU as compiled."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.interpreter import run_interpreted


def check_prefill(device: str = "cpu", hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 24, seed: int = 0) -> None:
    from minisgl.device.kernels.fused import rmsnorm_torch
    from minisgl.device.kernels.gdn_prefill import conv_prefill, gated_norm, gates
    from minisgl.device.kvcache.state_pool import StatePool, StateShape
    from minisgl.device.layers.gated_delta import l2norm, varlen_conv

    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    width, c = 3, 2 * hk * dk + hv * dv
    pool = StatePool(StateShape(2, c, width, hv, dk, dv), 10, torch.float32, torch.float32, torch.device(device))
    pool.conv.copy_(rand(*pool.conv.shape))
    # four requests, one of a single token and one of two; slots 3 and 0 save snapshots part-way
    # (into rows 8 and 9), slot 0's after its first token: its state reaches back into kept inputs
    meta = SimpleNamespace(slots=[5, 3, 0, 7], new_lens=[7, 1, 9, 2], cached_lens=[4, 4, 4, 4])
    pool.prepare(meta, [], splits=[3, 8, 1, 0, 9, 1])
    t = sum(meta.new_lens)
    qkv, weight = rand(t, c), rand(c, width + 1)
    for base in (None, pool.layer_base[1]):
        conv = pool.conv[0] if base is None else pool.conv.flatten(0, 1)
        ref_conv = conv.clone()
        q, k, v = conv_prefill(qkv, weight, conv, pool.prefill, base, (hk, dk, hv, dv))
        mixed = varlen_conv(qkv, weight, ref_conv, pool.prefill, base)
        q_ref, k_ref = l2norm(mixed[:, : 2 * hk * dk].reshape(t, 2 * hk, dk)).split(hk, dim=1)
        torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, mixed[:, 2 * hk * dk :].reshape(t, hv, dv), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv, ref_conv, atol=0, rtol=0)

    ab = rand(t, 3 * hv)  # (strided rows, as a fused projection's slices are)
    a, b, a_log, dt_bias = ab[:, :hv], ab[:, 2 * hv :], rand(hv) * 0.5, rand(hv) * 10
    g, beta = gates(a, b, a_log, dt_bias)
    torch.testing.assert_close(g, -a_log.exp() * F.softplus(a + dt_bias), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(beta, b.sigmoid(), atol=1e-6, rtol=1e-6)

    o, z, norm = rand(t, hv, dv), rand(t, hv, dv), rand(dv)
    y = gated_norm(o, z, norm, 1e-6)
    torch.testing.assert_close(y, (rmsnorm_torch(o, norm, 1e-6) * F.silu(z)).reshape(t, -1), atol=1e-5, rtol=1e-5)


def test_prefill_kernels_match_reference_interpreted():
    run_interpreted(
        "from tests.test_gdn_prefill import check_prefill; check_prefill(); "
        "check_prefill(hk=4, hv=4, dk=32, dv=16, seed=1)"
    )


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(2, 4, 16, 24), (16, 32, 128, 128)])
def test_prefill_kernels_match_reference_cuda(shape):
    check_prefill("cuda", *shape)
