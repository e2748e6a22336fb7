"""The Gated DeltaNet decode kernels (``kernels/gdn_step.py``) against the layer's torch
reference: same outputs, same state rows updated in place, other rows untouched. On CPU they run
under Triton's interpreter; on the GPU as compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.interpreter import run_interpreted


def check_step(device: str = "cpu", hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 24, seed: int = 0) -> None:
    """One decode step of 5 requests in scattered slots of an 8-row pool (one row twice as the
    graphs' padding does not: each slot once), fp32, against the reference."""
    from minisgl.device.kernels.gdn_step import conv_step, delta_step
    from minisgl.device.layers.gated_delta import causal_conv_step, gated_delta_rule, l2norm

    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    b, rows, width = 5, 8, 3
    c = 2 * hk * dk + hv * dv
    slots = torch.tensor([6, 1, 3, 0, 7], device=device)
    x, weight, conv = rand(b, c), rand(c, width + 1), rand(rows, c, width)
    ssm = rand(rows, hv, dk, dv) * 0.1
    a, beta_in, a_log, dt_bias = rand(b, hv), rand(b, hv), rand(hv) * 0.5, rand(hv)
    conv_ref, ssm_ref = conv.clone(), ssm.clone()

    mixed = conv_step(x, weight, conv, slots)
    o = delta_step(mixed, a, beta_in, a_log, dt_bias, ssm, slots, hk)

    states = conv_ref[slots]
    mixed_ref = causal_conv_step(x, weight, states)
    conv_ref[slots] = states
    q, k, v = mixed_ref.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = l2norm(q.reshape(b, hk, dk)).repeat_interleave(hv // hk, dim=1) * dk**-0.5
    k = l2norm(k.reshape(b, hk, dk)).repeat_interleave(hv // hk, dim=1)
    g = -a_log.exp() * F.softplus(a + dt_bias)
    h = ssm_ref[slots]
    o_ref = gated_delta_rule(
        q[:, None], k[:, None], v.reshape(b, hv, dv)[:, None], g[:, None], beta_in.sigmoid()[:, None], h
    )[:, 0]
    ssm_ref[slots] = h
    torch.testing.assert_close(mixed, mixed_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv, conv_ref, atol=0, rtol=0)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ssm, ssm_ref, atol=1e-5, rtol=1e-4)


def test_decode_kernels_match_reference_interpreted():
    run_interpreted(
        "from tests.test_gdn_step import check_step; check_step(); check_step(hk=4, hv=4, dk=32, dv=16, seed=1)"
    )


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(2, 4, 16, 24), (16, 32, 128, 128), (16, 48, 128, 128)])
def test_decode_kernels_match_reference_cuda(shape):
    hk, hv, dk, dv = shape
    torch.backends.cuda.matmul.allow_tf32 = False
    check_step("cuda", hk, hv, dk, dv)
