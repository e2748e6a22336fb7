"""Gated activation of the Llama-family MLP."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x holds [gate | up] along the last dim; returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
