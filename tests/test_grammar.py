"""Structured output (xgrammar): JSON schemas, regexes and EBNF grammars constrain the tokens;
constrained and free requests share batches (also retracted ones) without changing each
other's tokens; bad grammars are refused by name."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from minisgl.wire.sampling import SamplingParams
from tests.grammar_cases import EBNF, EBNF_REGEX, MAX_NEW, REGEXES, schemas
from tests.test_api_compat import BASES
from tests.test_scheduler import make_llm, shared_prefix_prompts, tokens
from tests.test_server import idle_and_clean, server  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


def test_json_schemas_regexes_and_ebnf_hold(llm):
    """50 schemas (greedy and sampled), every regex and the grammar, in one mixed batch."""
    import jsonschema

    prompts, params, checks = [], [], []
    for i, schema in enumerate(schemas(50)):
        prompts.append(f"Record {i}:")
        params.append(
            SamplingParams(
                max_new_tokens=MAX_NEW, temperature=0.0 if i % 2 else 0.9, seed=i, json_schema=json.dumps(schema)
            )
        )
        checks.append(lambda text, s=schema: jsonschema.validate(json.loads(text), s))
    for i, pattern in enumerate(REGEXES):
        prompts.append(f"Answer {i}:")
        params.append(SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=i, regex=pattern))
        checks.append(lambda text, p=pattern: re.fullmatch(p, text) or pytest.fail(f"{text!r} !~ {p}"))
    prompts.append("Say hello:")
    params.append(SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=1, ebnf=EBNF))
    checks.append(lambda text: re.fullmatch(EBNF_REGEX, text) or pytest.fail(f"{text!r} !~ grammar"))
    results = llm.generate(prompts, params)
    for r, check in zip(results, checks):
        assert r["meta_info"]["finish_reason"] == "stop", r
        check(r["text"])
    assert not llm.scheduler.has_work


def test_mixed_batches_with_retraction_match_each_request_alone(tiny_llama):
    """Constrained and free requests together, in a pool small enough to retract some, give each
    request the tokens it gets alone; free requests are unchanged by the feature; overlap off
    gives the same tokens."""
    prompts = shared_prefix_prompts(groups=4, per_group=6, prefix_len=40)
    shapes = schemas(len(prompts), seed=3)
    params = [
        SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
        if i % 3 == 0
        else SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, json_schema=json.dumps(shapes[i]))
        if i % 3 == 1
        else SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, seed=i, regex=REGEXES[i % 6])
        for i in range(len(prompts))
    ]
    alone = make_llm(tiny_llama)
    ref = [alone.generate([p], [sp])[0]["output_ids"] for p, sp in zip(prompts, params)]
    small = make_llm(tiny_llama, max_total_tokens=480, page_size=4, chunked_prefill_size=96)
    assert tokens(small.generate(prompts, params)) == ref
    assert small.scheduler.stats()["retractions"] > 0, "the pool was meant to force retraction"
    plain = make_llm(tiny_llama, disable_overlap_schedule=True)
    assert tokens(plain.generate(prompts, params)) == ref
    free = [i for i in range(len(prompts)) if i % 3 == 0]
    unconstrained = make_llm(tiny_llama).generate([prompts[i] for i in free], [params[i] for i in free])
    assert tokens(unconstrained) == [ref[i] for i in free]


def test_grammar_with_penalties(llm):
    """A constrained request with repetition, frequency or presence penalties (the sampler
    updates its counts when the masked batch samples), next to a free one with a penalty."""
    params = [
        SamplingParams(max_new_tokens=8, temperature=0.0, regex="[a-z]+", repetition_penalty=1.2),
        SamplingParams(
            max_new_tokens=8, temperature=0.7, seed=1, regex="[a-z]+", frequency_penalty=0.5, presence_penalty=0.3
        ),
        SamplingParams(max_new_tokens=8, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
    ]
    results = llm.generate([[5, 6, 7]] * 3, params)
    for r in results[:2]:
        assert re.fullmatch("[a-z]+", r["text"]), r
    assert len(results[2]["output_ids"]) == 8
    assert not llm.scheduler.has_work
    llm.scheduler.check_integrity()


def test_bad_grammars_are_refused_offline(llm):
    for field, text in (
        ("json_schema", "{not json"),
        ("regex", "(unclosed"),
        ("ebnf", "root ::= missing_rule"),
        ("json_schema", '{"$ref": "#"}'),  # no value satisfies it: not an empty "success"
        ("json_schema", '{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}'),
    ):
        with pytest.raises(ValueError, match=field):
            llm.generate("Hi", SamplingParams(max_new_tokens=4, **{field: text}))
    with pytest.raises(ValueError, match="cannot be combined"):
        llm.generate("Hi", SamplingParams(max_new_tokens=4, regex="a", ebnf='root ::= "a"'))
    assert not llm.scheduler.has_work
    llm.scheduler.check_integrity()


def test_structural_tags_hold(llm):
    """SGLang's structural_tag: a tag's content follows its JSON schema; xgrammar's format and
    SGLang's older structures-and-triggers both (free text outside the tags, any tag entered at
    its trigger)."""
    import jsonschema

    # (scalars: xgrammar's tag content admits any whitespace inside JSON, where a random-weight
    # model can wander until max_new_tokens; objects are checked on strings below)
    for schema in ({"enum": ["red", "green", "blue"]}, {"type": "integer", "minimum": 0, "maximum": 999}):
        tag = {"begin": "<call>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</call>"}
        fmt = json.dumps({"type": "structural_tag", "format": {"type": "tag", **tag}})
        for i in range(4):
            params = SamplingParams(max_new_tokens=64, temperature=0.8 * (i % 2), seed=i, structural_tag=fmt)
            r = llm.generate(f"Call {i}:", params)[0]
            assert r["meta_info"]["finish_reason"] == "stop", r
            inner = re.fullmatch("<call>(.*)</call>", r["text"], re.S)
            assert inner, r["text"]
            jsonschema.validate(json.loads(inner.group(1)), schema)
    legacy = {
        "type": "structural_tag",
        "structures": [
            {
                "begin": "<f=get>",
                "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                "end": "</f>",
            }
        ],
        "triggers": ["<f="],
    }
    grammar = llm.scheduler.grammar
    compiled = grammar.compile("structural_tag", json.dumps(legacy)).result()
    assert grammar.matcher(compiled).accept_string('Sure. <f=get>{"a": 1}</f> done')
    assert not grammar.matcher(compiled).accept_string('Sure. <f=get>{"b": 1}')
    assert not grammar.matcher(compiled).accept_string("<f=nope>")  # past the trigger only a tag's begin
    for bad in ("{not json", "[1]", '{"type": "structural_tag", "structures": [{"schema": {}}], "triggers": []}'):
        with pytest.raises(ValueError, match="structural_tag"):
            llm.generate("Hi", SamplingParams(max_new_tokens=4, structural_tag=bad))
    assert not llm.scheduler.has_work
    llm.scheduler.check_integrity()


def test_structured_output_over_http(server):  # noqa: F811
    """SGLang's fields on /generate, OpenAI's response_format (json_object, json_schema) through
    the openai client, streamed and not; bad grammars answer 400 naming the field; the server
    stays clean."""
    import jsonschema
    import openai

    schema = schemas(1, seed=5)[0]
    r = httpx.post(
        f"{server.url}/generate",
        json={
            "text": "Data:",
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "json_schema": json.dumps(schema)},
        },
        timeout=60,
    ).json()
    jsonschema.validate(json.loads(r["text"]), schema)
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": r["meta_info"]["finish_reason"]["matched"]}
    r = httpx.post(
        f"{server.url}/generate",
        json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 32, "temperature": 1.0, "regex": REGEXES[0]}},
        timeout=60,
    ).json()
    assert all(re.fullmatch(REGEXES[0], x["text"]) for x in r)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=MAX_NEW,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "rec", "schema": schema, "strict": True}}
    streamed = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "JSON"}],
        max_tokens=MAX_NEW,
        temperature=0,
        response_format=fmt,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    jsonschema.validate(json.loads(text), schema)
    done = client.completions.create(
        model="tiny", prompt="x", max_tokens=32, temperature=0, extra_body={"regex": REGEXES[1]}
    )
    assert re.fullmatch(REGEXES[1], done.choices[0].text)
    # a structural tag as SGLang's response_format (xgrammar's format), and in sampling_params
    number = {"type": "integer", "minimum": 0, "maximum": 999}
    tagged = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<r>",
            "content": {"type": "json_schema", "json_schema": number},
            "end": "</r>",
        },
    }
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "tag"}],
        max_tokens=64,
        temperature=0,
        response_format=tagged,
    )
    jsonschema.validate(json.loads(re.fullmatch("<r>(.*)</r>", out.choices[0].message.content, re.S).group(1)), number)
    params = {"max_new_tokens": 64, "temperature": 0, "structural_tag": json.dumps(tagged)}
    r = httpx.post(f"{server.url}/generate", json={"text": "tag", "sampling_params": params}, timeout=60).json()
    assert re.fullmatch("<r>(.*)</r>", r["text"], re.S), r
    bad = [
        ("/generate", {"text": "x", "sampling_params": {"structural_tag": "{oops"}}, "structural_tag"),
        (
            "/v1/chat/completions",
            {**BASES["/v1/chat/completions"], "response_format": {"type": "structural_tag"}},
            "response_format",
        ),
        ("/generate", {"text": "x", "sampling_params": {"regex": "(unclosed"}}, "regex"),
        ("/generate", {"text": "x", "sampling_params": {"json_schema": "{oops"}}, "json_schema"),
        ("/v1/chat/completions", {**BASES["/v1/chat/completions"], "ebnf": "root ::= nothing_here"}, "ebnf"),
        ("/v1/completions", {**BASES["/v1/completions"], "regex": "a", "json_schema": "{}"}, "regex"),
        (
            "/v1/chat/completions",
            {**BASES["/v1/chat/completions"], "response_format": {"type": "json_schema"}},
            "response_format",
        ),
    ]
    for route, body, field in bad:
        for stream in (False, True):
            resp = httpx.post(f"{server.url}{route}", json={**body, "stream": stream}, timeout=60)
            assert resp.status_code == 400 and field in resp.json()["error"]["message"], (route, resp.text)
    idle_and_clean(server)


def test_constrained_request_done_in_its_first_step_without_overlap(tiny_llama):
    """Without overlap a constrained request can be admitted, run and finished in the step that
    accepts it (its grammar compiled just before): acceptance, then its token and finish."""
    from tests.server_utils import running_server

    with running_server(tiny_llama, "--disable-overlap-schedule") as srv:
        for _ in range(3):
            r = httpx.post(
                f"{srv.url}/generate",
                json={
                    "input_ids": [5, 6, 7],
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0, "regex": "(yes|no)"},
                },
                timeout=60,
            )
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["completion_tokens"] == 1
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200


def _mixed_bodies(count: int, seed: int) -> list[dict]:
    """/generate bodies mixing every sampling feature: plain greedy, regexes, penalties, logit
    biases, seeded sampling, and combinations of them."""
    import random

    rng = random.Random(seed)
    bodies = []
    for i in range(count):
        sp: dict = {"max_new_tokens": rng.randint(4, 24), "temperature": 0.0, "ignore_eos": True}
        for feature in rng.sample(["regex", "penalty", "bias", "seeded"], rng.randint(0, 3)):
            if feature == "regex":
                sp.pop("ignore_eos")
                sp["regex"] = REGEXES[i % len(REGEXES)]
            elif feature == "penalty":
                sp[rng.choice(["repetition_penalty", "frequency_penalty", "presence_penalty"])] = 1.3
            elif feature == "bias":
                sp["logit_bias"] = {str(rng.randrange(3, 900)): 5.0, str(rng.randrange(3, 900)): -100.0}
            else:
                sp.update(temperature=0.8, seed=rng.randrange(1000))
        bodies.append(
            {"text": f"Request {i} asks about {rng.choice(['rivers', 'trees', 'stars'])}:", "sampling_params": sp}
        )
    return bodies


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_features_under_load_equal_each_request_alone(tiny_llama, overlap):
    """Issue 31's fuzz: constrained, penalized, logit-biased, seeded and plain requests at once
    in one server (overlap on and off); it stays healthy and every request gets the tokens it
    gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.server_utils import running_server

    bodies = _mixed_bodies(24, seed=5)
    extra = () if overlap else ("--disable-overlap-schedule",)
    with running_server(tiny_llama, "--max-total-tokens", "8192", *extra) as srv:

        def post(body: dict) -> dict:
            r = httpx.post(f"{srv.url}/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        alone = [post(b)["output_ids"] for b in bodies]
        with ThreadPoolExecutor(len(bodies)) as pool:
            together = [r["output_ids"] for r in pool.map(post, bodies)]
        assert together == alone
        assert httpx.get(f"{srv.url}/health_generate", timeout=60).status_code == 200
        idle_and_clean(srv)


def test_grammar_compiles_are_bounded_and_small_ones_never_wait_for_big_ones(tiny_llama, monkeypatch):
    """A grammar text over the size limit is refused before any work; a compile past
    --grammar-compile-timeout-secs ends its request with an error naming the flag (and its
    pages and slot are free); a small grammar compiles while big ones hold their threads; a
    request that goes away before its compile starts cancels it."""
    import threading
    import time

    from minisgl.serve.scheduler import grammar as grammar_mod

    llm = make_llm(tiny_llama, grammar_compile_timeout_secs=0.5)
    backend = llm.scheduler.grammar
    release = threading.Event()
    real = backend._compile

    def slow_for_big(kind: str, text: str):
        if len(text) > grammar_mod.SMALL_GRAMMAR_BYTES:
            release.wait(30)
        return real(kind, text)

    monkeypatch.setattr(backend, "_compile", slow_for_big)
    with pytest.raises(ValueError, match="regex: .* over the limit"):
        llm.generate("Hi", SamplingParams(max_new_tokens=4, regex="a" * (grammar_mod.MAX_GRAMMAR_BYTES + 1)))
    big = [f"(x|{'y' * (grammar_mod.SMALL_GRAMMAR_BYTES + i)})" for i in range(3)]
    start = time.monotonic()
    with pytest.raises(ValueError, match="--grammar-compile-timeout-secs"):
        llm.generate("Hi", SamplingParams(max_new_tokens=4, regex=big[0]))
    assert time.monotonic() - start < 10
    # Both big threads are held now (the first compile and a second one); a small grammar still compiles.
    held = backend.compile("regex", big[1])
    queued = backend.compile("regex", big[2])
    [out] = llm.generate(["Hi"], SamplingParams(max_new_tokens=4, regex="(yes|no)"))
    assert out["text"] in ("yes", "no")
    req = llm.scheduler.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, regex=big[2]))
    assert req.grammar_future is queued and not queued.running()
    llm.scheduler.finish(req, "abort")
    assert queued.cancelled() and not held.cancelled()
    release.set()
    assert not llm.scheduler.has_work
    llm.scheduler.check_integrity()


def test_request_events_come_in_order_for_every_reader(tiny_llama):
    """The scheduler's one event stream (what the scheduler process and the offline API both
    read): a constrained request that compiles, runs and finishes within one step without
    overlap is accepted before its output; one with nothing to generate is accepted ended; a
    grammar that fails is accepted ended with its error."""
    sched = make_llm(tiny_llama, disable_overlap_schedule=True).scheduler
    sched.take_events()
    done = sched.add_request([5, 6, 7], SamplingParams(max_new_tokens=0))
    constrained = sched.add_request([5, 6, 7], SamplingParams(max_new_tokens=1, temperature=0.0, regex="(yes|no)"))
    broken = sched.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, regex="(unclosed"))
    events = []
    while sched.has_work:
        if sched.only_compiling:
            sched.wait_compiled(timeout=1.0)
        events += sched.step()
    mine = lambda req: [(kind, ended) for kind, r, ended in events if r is req]  # noqa: E731
    assert mine(done) == [("accepted", True)]
    assert mine(constrained) == [("accepted", False), ("output", False)] and constrained.finished
    assert mine(broken) == [("accepted", True)] and "regex" in broken.error
    sched.check_integrity()


def test_structured_output_without_xgrammar_is_refused_by_name(llm):
    """xgrammar is an extra (it brings triton on Linux): without it a constrained request is
    refused naming its field and the extra, and plain requests run."""
    backend = llm.scheduler.grammar
    backend.available = False
    try:
        with pytest.raises(ValueError, match=r"json_schema: .*pip install xgrammar"):
            llm.generate("Hi", SamplingParams(max_new_tokens=4, json_schema='{"type": "object"}'))
        assert llm.generate("Hi", SamplingParams(max_new_tokens=2))[0]["output_ids"]
    finally:
        backend.available = True
