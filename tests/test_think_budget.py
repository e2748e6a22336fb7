"""Thinking budgets (SGLang's max_thinking_tokens): the close marker is forced once the budget is
spent, token by token, and the answer goes on as the model continues that text; free otherwise."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from minisgl.llm import LLM
from minisgl.serve.scheduler.think_budget import ThinkBudget, masks
from tests.server_utils import running_server
from tests.test_server import idle_and_clean, server  # noqa: F401 (fixture)

OPEN, CLOSE = [7, 8], [9, 10, 11]


def test_the_budget_forces_the_close_marker_and_continues_a_begun_one():
    think = ThinkBudget(3, OPEN, CLOSE, open_at_start=False)
    for token in (1, 2, 7, 8):
        assert think.forced() is None
        think.accept(token)
    assert think.thinking and think.used == 0  # opened by the marker
    for token in (4, 5):
        think.accept(token)
        assert think.forced() is None
    think.accept(9)  # the model begins the close marker itself as its budget ends
    assert think.forced() == 10
    think.accept(10)
    assert think.forced() == 11
    think.accept(11)
    assert not think.thinking and think.done and think.forced() is None
    think.accept(7)  # thinking happens once
    assert not think.thinking
    assert ThinkBudget.open_in([1, 7, 8, 3], OPEN, CLOSE) and not ThinkBudget.open_in([7, 8, 9, 10, 11], OPEN, CLOSE)
    spent = ThinkBudget(0, OPEN, CLOSE, open_at_start=True)
    assert spent.forced() == 9 and spent.near(0) and not ThinkBudget(5, OPEN, CLOSE, False).near(10)


def test_masks_allow_only_the_forced_token():
    forced, free = ThinkBudget(0, OPEN, CLOSE, True), ThinkBudget(9, OPEN, CLOSE, True)
    words = np.frombuffer(masks([(None, False, forced), (None, False, free), (None, False, None)], None, 70), np.int32)
    bits = np.unpackbits(words.reshape(3, -1).view(np.uint8), bitorder="little").reshape(3, -1)[:, :70]
    assert bits[0].nonzero()[0].tolist() == [9]
    assert bits[1].all() and bits[2].all()


@pytest.fixture(scope="module")
def thinking_server(tiny_llama):
    with running_server(tiny_llama, "--reasoning-parser", "qwen3", "--max-total-tokens", "8192") as srv:
        yield srv


def test_max_thinking_tokens_over_http(thinking_server, tiny_llama):
    """A prompt that leaves <think> open thinks for the budget, then gets </think> and goes on
    as the offline engine continues that text; a prompt that does not is untouched; budget 0
    closes at once; refusals name the field."""
    llm = LLM(str(tiny_llama), device="cpu", max_total_tokens=8192)
    tok = llm.tokenizer
    close = tok.encode("</think>", add_special_tokens=False)
    url, params = thinking_server.url, {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    for budget in (5, 0):
        prompt = tok.encode("Question: why?<think>\n")
        r = httpx.post(
            f"{url}/generate", json={"input_ids": prompt, "sampling_params": params, "max_thinking_tokens": budget}
        )
        out = r.json()["output_ids"]
        free = llm.generate(prompt, {**params, "max_new_tokens": budget})[0]["output_ids"] if budget else []
        assert out[:budget] == free and out[budget : budget + len(close)] == close, (budget, out)
        head = out[: budget + len(close)]
        rest = llm.generate(prompt + head, {**params, "max_new_tokens": 20 - len(head)})[0]["output_ids"]
        assert out[len(head) :] == rest
        offline = llm.generate(prompt, params, max_thinking_tokens=budget)[0]["output_ids"]
        assert offline == out  # the offline engine takes the budget too
    plain = tok.encode("Question: why?")
    body = {"input_ids": plain, "sampling_params": params, "max_thinking_tokens": 2}
    assert httpx.post(f"{url}/generate", json=body).json()["output_ids"] == llm.generate(plain, params)[0]["output_ids"]
    for bad, word in ((-1, "max_thinking_tokens"), (3, "structured output")):
        extra = {"sampling_params": {**params, "regex": "[a-z]+"}} if word != "max_thinking_tokens" else {}
        r = httpx.post(f"{url}/generate", json={**body, "max_thinking_tokens": bad, **extra})
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
    idle_and_clean(thinking_server)


def test_max_thinking_tokens_needs_a_reasoning_parser(server):  # noqa: F811
    for field, value in (("max_thinking_tokens", 4), ("require_reasoning", True)):
        r = httpx.post(f"{server.url}/generate", json={"text": "a", field: value})
        assert r.status_code == 400 and "--reasoning-parser" in r.json()["error"]["message"], r.text


def test_require_reasoning_holds_the_grammar_until_the_thinking_closes(thinking_server, tiny_llama):
    """SGLang's require_reasoning: the output starts in the thinking, which the grammar leaves
    free (the tokens are the unconstrained ones), and the grammar constrains what follows the
    close marker (here forced by a budget of 5)."""
    import re

    llm = LLM(str(tiny_llama), device="cpu", max_total_tokens=8192)
    tok = llm.tokenizer
    close = tok.encode("</think>", add_special_tokens=False)
    prompt = tok.encode("Question: why?")
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": prompt, "sampling_params": {**params, "regex": "[a-z]+"}, "require_reasoning": True}
    out = httpx.post(f"{thinking_server.url}/generate", json={**body, "max_thinking_tokens": 5}, timeout=60).json()
    ids = out["output_ids"]
    free = llm.generate(prompt, {**params, "max_new_tokens": 5})[0]["output_ids"]
    assert ids[:5] == free and ids[5 : 5 + len(close)] == close, ids
    answer = tok.decode(ids[5 + len(close) :], skip_special_tokens=True)
    assert re.fullmatch("[a-z]+", answer), answer
    # A prompt whose thinking is already closed (a template that turned it off): the grammar holds at once.
    closed = tok.encode("Question: why?<think>\n\n</think>\n\n")
    out = httpx.post(f"{thinking_server.url}/generate", json={**body, "input_ids": closed}, timeout=60).json()
    assert re.fullmatch("[a-z]+", out["text"]), out["text"]
    idle_and_clean(thinking_server)


def sglang_processor(cls_name: str, protocol: int = 4) -> str:
    """What SGLang's ``CustomLogitProcessor.to_str()`` sends for one of its classes (the class
    pickled by reference, hex inside JSON), made here without SGLang."""
    import json
    import pickle
    import sys
    import types

    module = "sglang.srt.sampling.custom_logit_processor"
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    cls = type(cls_name, (), {"__module__": module})
    setattr(sys.modules[module], cls_name, cls)
    return json.dumps({"callable": pickle.dumps(cls, protocol=protocol).hex()})


class _RunsCode:
    def __reduce__(self):
        import os

        return (os.getpid, ())


def test_processor_payloads_are_read_never_run():
    import json
    import pickle

    from minisgl.serve.api.errors import BadRequest
    from minisgl.serve.api.logit_processors import is_thinking_budget, named_class

    for protocol in (2, 4):
        assert is_thinking_budget(sglang_processor("Qwen3ThinkingBudgetLogitProcessor", protocol))
    assert named_class(sglang_processor("DisallowedTokensLogitsProcessor")).endswith(".DisallowedTokensLogitsProcessor")
    with pytest.raises(BadRequest, match="never run"):
        is_thinking_budget(sglang_processor("DisallowedTokensLogitsProcessor"))
    for payload in (
        json.dumps({"callable": pickle.dumps(_RunsCode()).hex()}),  # calls a function when unpickled
        json.dumps({"callable": pickle.dumps((int, str)).hex()}),  # names two classes
        json.dumps({"callable": "zz"}),
        "not json",
        json.dumps({"other": 1}),
        "[" * 30_000 + "]" * 30_000,  # nested past the JSON parser's depth
    ):
        with pytest.raises(BadRequest, match="SGLang's serialized processor"):
            named_class(payload)


def test_sglang_thinking_budget_processor_over_http(thinking_server, server):  # noqa: F811
    """SGLang's thinking-budget processor with custom_params.thinking_budget gives the tokens of
    max_thinking_tokens; no or a bad thinking_budget is no budget; other processors, both fields
    at once, and a server without --reasoning-parser are refused by name."""
    url, params = thinking_server.url, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    prompt = httpx.post(f"{url}/tokenize", json={"prompt": "Question: why?<think>\n"}).json()["tokens"]
    processor = sglang_processor("Qwen3ThinkingBudgetLogitProcessor")

    def run(**body) -> httpx.Response:
        return httpx.post(f"{url}/generate", json={"input_ids": prompt, **body}, timeout=60)

    budgeted = run(sampling_params=params, max_thinking_tokens=4).json()["output_ids"]
    free = run(sampling_params=params).json()["output_ids"]
    assert budgeted != free
    with_params = {**params, "custom_params": {"thinking_budget": 4}}
    assert run(sampling_params=with_params, custom_logit_processor=processor).json()["output_ids"] == budgeted
    for unset in ({}, {"thinking_budget": "4"}, {"thinking_budget": -1}):
        body = {"sampling_params": {**params, "custom_params": unset}, "custom_logit_processor": processor}
        assert run(**body).json()["output_ids"] == free
    for body, word in (
        ({"custom_logit_processor": sglang_processor("DisallowedTokensLogitsProcessor")}, "never run"),
        ({"custom_logit_processor": processor, "max_thinking_tokens": 3}, "not both"),
        ({"custom_logit_processor": "{}"}, "serialized processor"),
    ):
        r = run(sampling_params=with_params, **body)
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.url}/generate", json={"text": "a", "custom_logit_processor": processor})
    assert r.status_code == 400 and "--reasoning-parser" in r.json()["error"]["message"]
    chat = {"model": "m", "messages": [{"role": "user", "content": "a"}], "custom_logit_processor": processor}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat)
    assert r.status_code == 400 and "--reasoning-parser" in r.json()["error"]["message"]
    completion = {"model": "m", "prompt": "a", "custom_logit_processor": processor}
    r = httpx.post(f"{url}/v1/completions", json=completion)
    assert r.status_code == 400 and "custom_logit_processor" in r.json()["error"]["message"]
    # Chat completions: the answer continued inside an open <think> thinks 4 tokens, as /generate's budget does.
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "why?"}, {"role": "assistant", "content": "<think>\n"}],
        "continue_final_message": True,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "separate_reasoning": False,
        "custom_logit_processor": processor,
        "custom_params": {"thinking_budget": 4},
    }
    choice = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    prompt_ids = choice["prompt_token_ids"]
    budgeted = httpx.post(
        f"{url}/generate", json={"input_ids": prompt_ids, "sampling_params": params, "max_thinking_tokens": 4}
    ).json()
    free = httpx.post(f"{url}/generate", json={"input_ids": prompt_ids, "sampling_params": params}).json()
    assert choice["token_ids"] == budgeted["output_ids"] != free["output_ids"]
    idle_and_clean(thinking_server)


def test_chat_with_an_always_thinking_model_holds_its_grammar_until_the_thinking_closes(tiny_llama):
    """Chat with a grammar on a server whose reasoning parser says the model always starts
    thinking (qwen3-thinking): the thinking (closed here by a budget of 4) is free, the answer
    after it follows the grammar."""
    import re

    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "why?"}],
        "max_tokens": 24,
        "temperature": 0,
        "regex": "[a-z]+",
        "custom_logit_processor": sglang_processor("Qwen3ThinkingBudgetLogitProcessor"),
        "custom_params": {"thinking_budget": 4},
    }
    with running_server(tiny_llama, "--reasoning-parser", "qwen3-thinking", "--max-total-tokens", "8192") as srv:
        message = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        thinking, answer = message["reasoning_content"], message["content"]
        assert re.fullmatch("[a-z]+", answer) and not re.fullmatch("[a-z]+", thinking), message
        idle_and_clean(srv)
