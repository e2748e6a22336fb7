"""SGLang's custom logit processors (/generate ``custom_logit_processor``), recognized by name and
never run. SGLang sends the processor's class pickled (dill, as hex inside JSON) and unpickles it
on the server, which runs whatever code the request carries; here the pickle's opcodes are only
read (``pickletools``) to find the one class it names. SGLang's thinking-budget processors
(``ThinkingBudgetLogitProcessor`` and its per-model subclasses) are served as a thinking budget
(``custom_params.thinking_budget``, the same as ``max_thinking_tokens``); anything else is refused.
"""

from __future__ import annotations

import json
import pickletools
from typing import Any

from minisgl.serve.api.errors import BadRequest

SGLANG_PROCESSORS = "sglang.srt.sampling.custom_logit_processor"
THINKING_BUDGET = "ThinkingBudgetLogitProcessor"
MAX_PAYLOAD_CHARS = 1 << 16
MAX_THINK_BUDGET = (1 << 31) - 1  # (a larger thinking_budget never ends thinking either)
# Opcodes that call or build objects: a pickle naming a class by reference has none of them.
_CALLS = {"REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX"}


def named_class(payload: str) -> str:
    """``module.Class`` that a serialized processor names, read from its pickle's opcodes without
    running it; BadRequest when it is not SGLang's form or the pickle does more than name one
    class."""
    bad = BadRequest(
        "custom_logit_processor must be SGLang's serialized processor (JSON with the class's pickle as "
        "hex under 'callable') naming one class by reference",
        param="custom_logit_processor",
    )
    if len(payload) > MAX_PAYLOAD_CHARS:
        raise bad
    try:
        data = bytes.fromhex(json.loads(payload)["callable"])
    except (ValueError, KeyError, TypeError, RecursionError):  # (JSON nested past the parser's depth)
        raise bad from None
    names, strings = [], []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in _CALLS:
                raise bad
            if op.name == "GLOBAL":
                names.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
    except ValueError:  # (not a pickle)
        raise bad from None
    if len(names) != 1:
        raise bad
    return names[0]


def is_thinking_budget(payload: str) -> bool:
    """Whether the processor is one of SGLang's thinking-budget ones; BadRequest naming any other
    (none is run here)."""
    name = named_class(payload)
    module, _, cls = name.rpartition(".")
    if module == SGLANG_PROCESSORS and cls.endswith(THINKING_BUDGET):
        return True
    raise BadRequest(
        f"custom_logit_processor {name}: request code is never run here; SGLang's thinking-budget "
        "processors (custom_params.thinking_budget) are served, as max_thinking_tokens is",
        param="custom_logit_processor",
    )


def thinking_budget(processor: str, custom_params: dict[str, Any] | None) -> int:
    """The thinking budget SGLang's thinking-budget processor reads from ``custom_params`` (-1:
    none, as that processor takes an unset, negative or non-integer one); BadRequest for any
    other processor."""
    is_thinking_budget(processor)
    budget = (custom_params or {}).get("thinking_budget")
    if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0:
        return min(budget, MAX_THINK_BUDGET)
    return -1
