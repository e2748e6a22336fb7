"""Synthetic steps (prefill, decode with chosen prefix sharing, and both mixed), for tests and benchmarks."""

from __future__ import annotations

import numpy as np
import torch

from minisgl.device.attention.base import AttentionMetadata
from minisgl.utils import cdiv


def decode_metadata(
    page_size: int,
    groups: list[tuple[int, list[int]]],
    loose: list[int],
    device: torch.device | str,
    first_page: int = 0,
    cascade: bool = True,
) -> AttentionMetadata:
    """Decode metadata for synthetic batches (tests and benchmarks): ``groups`` holds (shared
    pages, sequence lengths of its members), whose page-table rows start with the same pages;
    ``loose`` holds the lengths of requests that share nothing. Pages are numbered from
    ``first_page`` in order; ``cascade=False`` gives the same batch as a plain decode step."""
    rows, sizes, shared, page = [], [], [], first_page
    for num_shared, lens in groups:
        prefix = list(range(page, page + num_shared))
        page += num_shared
        for n in lens:
            own = cdiv(n, page_size) - num_shared
            assert own >= 1, "every request needs a page of its own past the shared ones"
            rows.append(prefix + list(range(page, page + own)))
            page += own
        sizes.append(len(lens))
        shared.append(num_shared)
    for n in loose:
        rows.append(list(range(page, page + cdiv(n, page_size))))
        page += len(rows[-1])
    seq_lens = [n for _, lens in groups for n in lens] + list(loose)
    table = np.zeros((len(rows), max(map(len, rows))), dtype=np.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    positions = np.array([n - 1 for n in seq_lens], dtype=np.int64)
    out_loc = table[np.arange(len(rows)), positions // page_size].astype(np.int64) * page_size + positions % page_size
    return AttentionMetadata(
        slots=list(range(len(rows))),
        cached_lens=[n - 1 for n in seq_lens],
        new_lens=[1] * len(rows),
        page_table_host=table,
        positions=torch.from_numpy(positions).to(device),
        out_loc=torch.from_numpy(out_loc).to(device),
        group_sizes=sizes if cascade else [],
        group_pages=shared if cascade else [],
    )


def prefill_metadata(
    page_size: int, cached: list[int], new: list[int], pages: int, device: torch.device | str
) -> AttentionMetadata:
    """A prefill step of requests with the given cached/new lengths, each on random pages below
    ``pages``."""
    seq = [c + n for c, n in zip(cached, new)]
    table = torch.zeros(len(seq), max(cdiv(n, page_size) for n in seq), dtype=torch.int32)
    perm, used = torch.randperm(pages), 0
    for i, n in enumerate(seq):
        table[i, : cdiv(n, page_size)] = perm[used : used + cdiv(n, page_size)].to(torch.int32)
        used += cdiv(n, page_size)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)])
    req = torch.repeat_interleave(torch.arange(len(seq)), torch.tensor(new))
    out_loc = table[req, positions // page_size].long() * page_size + positions % page_size
    return AttentionMetadata(
        slots=list(range(len(seq))),
        cached_lens=cached,
        new_lens=new,
        page_table_host=table.numpy(),
        positions=positions.to(device),
        out_loc=out_loc.to(device),
    )


def mixed_metadata(prefill: AttentionMetadata, decode: AttentionMetadata) -> AttentionMetadata:
    """One mixed step (--enable-mixed-chunk) of a prefill step's rows, then a decode step's (whose
    pages must differ from the prefill's)."""
    a, b = prefill.page_table_host, decode.page_table_host
    table = np.zeros((len(a) + len(b), max(a.shape[1], b.shape[1])), dtype=np.int32)
    table[: len(a), : a.shape[1]] = a
    table[len(a) :, : b.shape[1]] = b
    return AttentionMetadata(
        slots=prefill.slots + [len(a) + s for s in decode.slots],
        cached_lens=prefill.cached_lens + decode.cached_lens,
        new_lens=prefill.new_lens + decode.new_lens,
        page_table_host=table,
        positions=torch.cat([prefill.positions, decode.positions]),
        out_loc=torch.cat([prefill.out_loc, decode.out_loc]),
        group_sizes=decode.group_sizes,
        group_pages=decode.group_pages,
        prefill_reqs=prefill.num_reqs,
    )
