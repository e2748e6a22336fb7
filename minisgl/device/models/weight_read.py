"""Checkpoint tensors read back from the served model (SGLang's /get_weights_by_name): the reverse
of ``WeightMap.load``, so a trainer can check what an update left in place.

Each sharding layer says which rows or columns of the full checkpoint tensor its rank holds
(``checkpoint_piece``, cut to the first rows asked for before it is converted), the pieces are
stacked over the tensor-parallel ranks and laid back in place. FP8 weights come back dequantized.
For checks, not for moving weights: the rows travel as JSON.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.device.distributed import get_tp_info, stack_over_ranks
from minisgl.device.layers.linear import Piece
from minisgl.device.models.loader import WeightMap
from minisgl.wire.control import MAX_READ_ROWS


def read_weight(model: nn.Module, name: str, rows: int) -> torch.Tensor:
    """The first ``rows`` rows (along the first dimension) of checkpoint tensor ``name`` as the
    model holds it now, float32 on every rank. Raises ValueError for a name that is no weight."""
    if not 0 <= rows <= MAX_READ_ROWS:
        raise ValueError(f"truncate_size must be between 0 and {MAX_READ_ROWS}, got {rows}")
    if name.endswith(("_scale", "_scale_inv")):
        raise ValueError(f"{name!r}: fp8 scales are not read back (the weights come back dequantized)")
    wmap = WeightMap(model)
    if name == "lm_head.weight":  # (tied to the embedding, or an fp8 head whose float copy is freed)
        found = ("model.embed_tokens.weight" if wmap.tied else "lm_head.weight", None)
    else:
        found = wmap.target(name)
    if found is None:
        raise ValueError(f"{name!r} is not a weight of this model")
    param_name, part = found
    module_name, _, attr = param_name.rpartition(".")
    module = model.get_submodule(module_name)
    piece_of = getattr(module, "checkpoint_piece", None)
    if piece_of is None:  # a weight every rank holds whole (norms, the router)
        return wmap.params[param_name].data[:rows].float()
    return _gather_rows(piece_of(attr, part, rows), _full_shape(module, wmap, param_name, part), rows)


def _full_shape(module: nn.Module, wmap: WeightMap, param_name: str, part) -> tuple[int, ...]:
    if param_name == "lm_head.weight" and "lm_head.weight" not in wmap.params:
        return module.checkpoint_shape("weight")
    return wmap.full_shape(param_name, part)


def _gather_rows(piece: Piece, shape: tuple[int, ...], rows: int) -> torch.Tensor:
    """The first ``rows`` rows of the full tensor of ``shape`` from every rank's piece."""
    values, dim, start, length = piece  # (values: at most ``rows`` tall, as tall on every rank)
    if dim is None:
        return values
    if dim == 0:  # the ranks split the rows: each keeps those of its share among the first ones
        length = max(0, min(length, rows - start))
    values = values.contiguous()
    out = values.new_zeros(min(shape[0], rows), *shape[1:])
    tp = get_tp_info()
    table = stack_over_ranks(values) if tp.size > 1 else values[None]
    where = stack_over_ranks(values.new_tensor([start, length])) if tp.size > 1 else [(start, length)]
    for piece_values, (at, n) in zip(table, where):
        n = int(n)
        if n > 0:
            out.narrow(dim, int(at), n).copy_(piece_values.narrow(dim, 0, n))
    return out
