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
    vocab: int,
    groups: int = 16,
    per_group: int = 16,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    seed: int = 1,
    shuffle: bool = True,
    name: str = "shared-prefix",
) -> Workload:
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(vocab) for _ in range(system_len)]
        prompts += [system + [rng.randrange(vocab) for _ in range(question_len)] for _ in range(per_group)]
    if shuffle:
        rng.shuffle(prompts)
    return Workload(name, prompts, [output_len] * len(prompts))


def generated_shared_prefix(vocab: int, shuffle: bool, groups: int = 64) -> Workload:
    """SGLang's bench_serving default generated-shared-prefix shape: 64 groups of 16 prompts,
    2048-token system prompt, 128-token question, 256 output tokens (``groups`` scales it)."""
    name = ("gsp-shuffled" if shuffle else "gsp") + ("" if groups == 64 else f"-{groups * 16}")
    return shared_prefix_workload(vocab, groups=groups, per_group=16, shuffle=shuffle, seed=2, name=name)


def multi_turn_workload(
    vocab: int, systems: int = 4, conversations: int = 16, turns: int = 4, system_len: int = 1024, seed: int = 3
) -> Workload:
    """Chat histories as conversation trees: each of ``systems`` system prompts opens
    ``conversations`` chats; turn t's prompt is the system prompt, every earlier turn's user
    message and (synthetic) answer, and a new user message. All turns arrive at once."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(systems):
        history_root = [rng.randrange(vocab) for _ in range(system_len)]
        for _ in range(conversations):
            history = list(history_root)
            for _ in range(turns):
                history += [rng.randrange(vocab) for _ in range(rng.randint(32, 192))]  # the user's message
                prompts.append(list(history))
                outputs.append(128)
                history += [rng.randrange(vocab) for _ in range(128)]  # the answer the next turn sees
    order = list(range(len(prompts)))
    rng.shuffle(order)
    return Workload("multi-turn", [prompts[i] for i in order], [outputs[i] for i in order])


def repeated_sampling(
    vocab: int, problems: int = 8, samples: int = 1024, prompt_len: int = 900, seed: int = 4
) -> Workload:
    """Repeated sampling (best-of-n, self-consistency, RL rollouts; the "Large Language Monkeys"
    shape): each problem's prompt sent ``samples`` times, outputs uniform in [64, 448], all at
    once, problem by problem."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(problems):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        prompts += [prompt] * samples
        outputs += [rng.randint(64, 448) for _ in range(samples)]
    return Workload(f"repeated-{problems}x{samples}", prompts, outputs)


def distinct_tokens(prompts: list[list[int]]) -> int:
    """Prompt tokens a perfect prefix cache computes once: the nodes of the prompts' token trie."""
    total, previous = 0, []
    for p in sorted(prompts):
        common = 0
        for a, b in zip(p, previous):
            if a != b:
                break
            common += 1
        total += len(p) - common
        previous = p
    return total


WORKLOADS = {
    "random": random_workload,
    "shared-prefix": shared_prefix_workload,
    "gsp": lambda vocab: generated_shared_prefix(vocab, shuffle=False),
    "gsp-shuffled": lambda vocab: generated_shared_prefix(vocab, shuffle=True),
    "gsp-4096": lambda vocab: generated_shared_prefix(vocab, shuffle=False, groups=256),  # 16x shared-prefix's requests
    "multi-turn": multi_turn_workload,
    "repeated": repeated_sampling,
}


def save_result(data: dict, out: str | None, default_name: str) -> None:
    """Write a benchmark's JSON to ``out``, or to benchmarks/results/<default_name>.json."""
    import json
    from pathlib import Path

    path = Path(out or Path(__file__).parent / "results" / f"{default_name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    print(f"wrote {path}")
