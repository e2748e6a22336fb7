"""Grammars for the structured-output tests (CPU and CUDA): bounded JSON schemas and regexes."""

from __future__ import annotations

import random

MAX_NEW = 400  # tokens: room for the largest of these outputs with the tiny tokenizer


def schemas(count: int, seed: int = 0) -> list[dict]:
    """Varied JSON schemas whose every value is bounded (a random-weight model must still end)."""
    rng = random.Random(seed)
    leaves = [
        lambda: {"type": "integer", "minimum": -50, "maximum": 999},
        lambda: {"type": "boolean"},
        lambda: {"type": "string", "maxLength": rng.randint(1, 8)},
        lambda: {"enum": rng.sample(["red", "green", "blue", "cyan", "black"], rng.randint(2, 4))},
        lambda: {"type": "null"},
        lambda: {"type": "string", "enum": ["yes", "no"]},
        lambda: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        lambda: {"type": "string", "pattern": "^[a-z]{1,5}$"},
        lambda: {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    ]

    def obj(depth: int) -> dict:
        names = rng.sample(
            ["id", "name", "ok", "tags", "color", "size", "meta", "n", "flag", "kind"], rng.randint(1, 4)
        )
        props = {k: (obj(depth + 1) if depth < 2 and rng.random() < 0.25 else rng.choice(leaves)()) for k in names}
        required = [k for k in names if rng.random() < 0.8]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    out = []
    for i in range(count):
        if i % 7 == 6:
            out.append({"type": "array", "items": obj(1), "minItems": 1, "maxItems": 2})
        else:
            out.append(obj(0))
    return out


REGEXES = [
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"[a-z]{2,8}@[a-z]{3,6}\.(com|org)",
    r"#[0-9a-f]{6}",
    r"(\+|-)?[1-9][0-9]{0,3}\.[0-9]{2}",
    r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}",
]

# An EBNF grammar and a regex for the same language, to check its outputs.
EBNF = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi" | "hey"\nname ::= [a-z] [a-z]? [a-z]? [a-z]?\n'
EBNF_REGEX = r"(hello|hi|hey) [a-z]{1,4}!"
