"""Greedy-token agreement between two runs of the same prompts, as every agreement benchmark
reports it: how many outputs are identical, and where each other one first differs."""

from __future__ import annotations


def agreement(got: list[list[int]], ref: list[list[int]]) -> dict:
    """``identical`` of ``of`` outputs equal; ``first_divergences`` lists (prompt, token index),
    the shorter length where one output is a prefix of the other."""
    first = [
        (i, next((j for j, (x, y) in enumerate(zip(u, v)) if x != y), min(len(u), len(v))))
        for i, (u, v) in enumerate(zip(got, ref))
        if u != v
    ]
    return {"identical": len(ref) - len(first), "of": len(ref), "first_divergences": first}
