"""A step's inputs built on the host (``ModelRunner._metadata``): the Python path of a few decode
rows gives what the numpy path gives."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch

from minisgl.attention import base
from minisgl.messages import ForwardBatch
from minisgl.worker.model_runner import ModelRunner


def test_few_decode_rows_build_the_numpy_inputs(monkeypatch):
    rng = random.Random(0)
    page = 16
    table = np.arange(64 * 40, dtype=np.int32).reshape(64, 40)[:, ::-1].copy()  # pages not in order
    last = torch.arange(1000, 1064)
    for _ in range(50):
        rows = rng.randint(1, 32)
        slots = rng.sample(range(64), rows)
        batch = ForwardBatch(
            slots=slots,
            cached_lens=[rng.randrange(40 * page) for _ in slots],
            new_lens=[1] * rows,
            input_ids=[rng.choice([-1, rng.randrange(500)]) for _ in slots],
            sample=[True] * rows,
        )
        got = []
        for small in (base.FEW_ROWS, 0):
            monkeypatch.setattr(base, "FEW_ROWS", small)
            runner = SimpleNamespace(device=torch.device("cpu"), page_size=page, page_table_host=table, last_token=last)
            meta, ids = ModelRunner._metadata(runner, batch)
            got.append((meta.positions, meta.out_loc, ids))
        for a, b in zip(*got):
            assert torch.equal(a, b)
        # -1 takes the slot's last sampled token; KV slots come from the page table
        want = [last[s].item() if t < 0 else t for s, t in zip(slots, batch.input_ids)]
        assert got[0][2].tolist() == want
        kv_slots = [int(table[s, p // page]) * page + p % page for s, p in zip(slots, batch.cached_lens)]
        assert got[0][1].tolist() == kv_slots
