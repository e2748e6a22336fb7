"""Synthetic decode batches with chosen prefix sharing, for tests and benchmarks."""

from __future__ import annotations

import numpy as np
import torch

from minisgl.attention.base import AttentionMetadata
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
