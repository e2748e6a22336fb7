"""A step's inputs built on the host (``ModelRunner._metadata``): the Python path of a few decode
rows gives what the numpy path gives, and rows that gain on the device end where rows planned
at their lengths do."""

from __future__ import annotations

import functools
import random
from types import SimpleNamespace

import numpy as np
import torch

from minisgl.device.attention import base
from minisgl.device.attention.base import Gains
from minisgl.device.layers.lora import LoraRows
from minisgl.device.worker.model_runner import ModelRunner
from minisgl.wire.steps import ForwardBatch


def fake_runner(
    page: int, table: np.ndarray, last: torch.Tensor, gains: Gains | None = None, lora: bool = False
) -> SimpleNamespace:
    """What ``ModelRunner._metadata`` reads of a runner; with ``lora``, slot s's requests under
    adapter s % 3 (-1 for s % 4 == 3)."""
    runner = SimpleNamespace(
        device=torch.device("cpu"), page_size=page, page_table_host=table, last_token=last, _gains=gains
    )
    runner.lora_rows = LoraRows(64, 3, 16, runner.device) if lora else None
    runner.adapter_of_slot = np.asarray([-1 if s % 4 == 3 else s % 3 for s in range(len(table))], dtype=np.int64)
    runner._add_gains = functools.partial(ModelRunner._add_gains, runner)
    return runner


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
            runner = fake_runner(page, table, last, lora=True)
            meta, ids = ModelRunner._metadata(runner, batch)
            got.append((meta.positions, meta.out_loc, ids))
            # each row's LoRA slot: its request's
            assert runner.lora_rows.current[:rows].tolist() == runner.adapter_of_slot[slots].tolist()
            # a step none of whose rows uses an adapter skips them (and replays graphs without them)
            assert runner.lora_rows.active == any(s % 4 != 3 for s in slots)
        for a, b in zip(*got):
            assert torch.equal(a, b)
        # -1 takes the slot's last sampled token; KV slots come from the page table
        want = [last[s].item() if t < 0 else t for s, t in zip(slots, batch.input_ids)]
        assert got[0][2].tolist() == want
        kv_slots = [int(table[s, p // page]) * page + p % page for s, p in zip(slots, batch.cached_lens)]
        assert got[0][1].tolist() == kv_slots


def test_rows_that_gain_on_the_device_take_their_positions_and_kv_slots(monkeypatch):
    """``Gains``: rows planned at their shortest, moved on by what the device knows, get the
    positions and KV slots (from the page table, across page ends) of rows planned at their
    real lengths; the metadata carries the gains to the attention backend."""
    rng = random.Random(1)
    page = 4
    table = np.arange(64 * 40, dtype=np.int32).reshape(64, 40)[:, ::-1].copy()
    last = torch.arange(1000, 1064)
    for _ in range(40):
        n = rng.randint(1, 40)
        slots = rng.sample(range(64), n)
        real = [rng.randrange(10, 30 * page) for _ in slots]
        rows = np.asarray(sorted(rng.sample(range(n), rng.randint(1, n))), dtype=np.int64)
        most = np.asarray([rng.randint(0, 9) for _ in rows], dtype=np.int64)
        gain = np.asarray([rng.randint(0, m) for m in most], dtype=np.int64)
        short = list(real)
        for r, m, g in zip(rows.tolist(), most.tolist(), gain.tolist()):
            short[r] = real[r] - g  # planned as if every row the run might reject was rejected
        ids = [rng.randrange(500) for _ in slots]
        for small in (base.FEW_ROWS, 0):
            monkeypatch.setattr(base, "FEW_ROWS", small)
            want, _ = ModelRunner._metadata(
                fake_runner(page, table, last), ForwardBatch(slots, real, [1] * n, ids, [True] * n)
            )
            gains = Gains(rows, most, torch.from_numpy(gain), torch.from_numpy(rows))
            got, _ = ModelRunner._metadata(
                fake_runner(page, table, last, gains), ForwardBatch(slots, short, [1] * n, ids, [True] * n)
            )
            assert torch.equal(got.positions, want.positions) and torch.equal(got.out_loc, want.out_loc)
            assert got.gains is gains and want.gains is None
