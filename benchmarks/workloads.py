"""Token-id workloads shared by the benchmarks (deterministic for a given seed)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]


def random_workload(vocab: int, num: int = 256, low: int = 100, high: int = 1024, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(num)]
    return Workload("random", prompts, [rng.randint(low, high) for _ in range(num)])


def shared_prefix_workload(
    vocab: int, groups: int = 16, per_group: int = 16, system_len: int = 2048, question_len: int = 128,
    output_len: int = 256, seed: int = 1,
) -> Workload:
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(vocab) for _ in range(system_len)]
        prompts += [system + [rng.randrange(vocab) for _ in range(question_len)] for _ in range(per_group)]
    rng.shuffle(prompts)
    return Workload("shared-prefix", prompts, [output_len] * len(prompts))


WORKLOADS = {"random": random_workload, "shared-prefix": shared_prefix_workload}


def save_result(data: dict, out: str | None, default_name: str) -> None:
    """Write a benchmark's JSON to ``out``, or to benchmarks/results/<default_name>.json."""
    import json
    from pathlib import Path

    path = Path(out or Path(__file__).parent / "results" / f"{default_name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    print(f"wrote {path}")
