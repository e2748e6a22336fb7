"""The scheduler and offline API: same tokens under any cache size, policy or chunking."""

from __future__ import annotations

import logging
import random
import re

import pytest

from minisgl.llm import LLM
from minisgl.serve.scheduler.scheduler import ids_in_range
from minisgl.wire.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


class CheckedLLM(LLM):
    """Runs the scheduler's integrity check after every step."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        step = self.scheduler.step

        def checked_step():
            out = step()
            self.scheduler.check_integrity()
            return out

        self.scheduler.step = checked_step


def make_llm(path, **kw) -> CheckedLLM:
    kw = {"device": "cpu", "max_total_tokens": 16384, "max_running_requests": 64, **kw}
    return CheckedLLM(str(path), **kw)


def shared_prefix_prompts(groups: int, per_group: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        prefix = [rng.randrange(3, 1000) for _ in range(prefix_len)]
        for i in range(per_group):
            # Distinct first suffix token, so requests of a group share exactly the prefix.
            prompts.append(prefix + [10 + i] + [rng.randrange(3, 1000) for _ in range(rng.randint(2, 12))])
    rng.shuffle(prompts)
    return prompts


def tokens(results) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def test_small_pool_evicts_and_retracts_yet_matches_large_pool_and_naive(tiny_llama):
    prompts = shared_prefix_prompts(groups=8, per_group=8, prefix_len=40)
    ref = tokens(make_llm(tiny_llama, disable_radix_cache=True).generate(prompts, GREEDY))
    large = make_llm(tiny_llama)
    assert tokens(large.generate(prompts, GREEDY)) == ref
    small = make_llm(tiny_llama, max_total_tokens=400, page_size=4, chunked_prefill_size=128)
    assert tokens(small.generate(prompts, GREEDY)) == ref
    stats = small.scheduler.stats()
    assert stats["retractions"] > 0, "the pool was meant to force retraction"
    assert stats["prefix_hit_tokens"] > 0
    assert stats["running_requests"] == stats["queued_requests"] == stats["protected_pages"] == 0
    assert stats["free_pages"] + stats["evictable_pages"] == stats["total_pages"]


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_cached_tokens_are_what_the_tree_could_serve(tiny_llama, policy, page_size):
    prefix_len = 37
    prompts = shared_prefix_prompts(groups=4, per_group=4, prefix_len=prefix_len, seed=1)
    llm = make_llm(tiny_llama, page_size=page_size, schedule_policy=policy)
    results = llm.generate(prompts, GREEDY)
    cached = [r["meta_info"]["cached_tokens"] for r in results]
    shared = prefix_len - prefix_len % page_size
    by_prefix: dict[tuple, list[int]] = {}
    for p, c in zip(prompts, cached):
        by_prefix.setdefault(tuple(p[:prefix_len]), []).append(c)
    for group in by_prefix.values():
        # One request per group computes the prefix; the others, even in the same round, reuse it.
        assert sorted(group) == [0] + [shared] * 3
    stats = llm.scheduler.stats()
    assert stats["prefix_hit_tokens"] == sum(cached)
    assert stats["prefix_queried_tokens"] == sum(len(p) for p in prompts)
    # Asking again: everything but the last token of each prompt is cached, page-aligned.
    again = llm.generate(prompts, GREEDY)
    assert [r["meta_info"]["cached_tokens"] for r in again] == [
        (len(p) - 1) - (len(p) - 1) % page_size for p in prompts
    ]
    assert tokens(again) == tokens(results)


def test_chunk_smaller_than_shared_prefix(tiny_llama):
    prompts = shared_prefix_prompts(groups=2, per_group=5, prefix_len=70, seed=2)
    ref = tokens(make_llm(tiny_llama, disable_radix_cache=True).generate(prompts, GREEDY))
    for page_size in (1, 8):
        llm = make_llm(tiny_llama, page_size=page_size, chunked_prefill_size=24)
        assert tokens(llm.generate(prompts, GREEDY)) == ref


def test_retraction_keeps_seeded_sampling_identical(tiny_llama):
    prompts = shared_prefix_prompts(groups=4, per_group=6, prefix_len=30, seed=3)
    params = [
        SamplingParams(
            temperature=0.9,
            top_p=0.9,
            seed=i,
            max_new_tokens=16,
            ignore_eos=True,
            repetition_penalty=1.2 if i % 2 else 1.0,
        )
        for i in range(len(prompts))
    ]
    ref = tokens(make_llm(tiny_llama).generate(prompts, params))
    small = make_llm(tiny_llama, max_total_tokens=260, page_size=2)
    assert tokens(small.generate(prompts, params)) == ref
    assert small.scheduler.stats()["retractions"] > 0


def test_finish_reasons(tiny_llama):
    llm = make_llm(tiny_llama)
    free = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))[0]
    first = free["output_ids"][0]
    stop_tok = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[first]))[0]
    assert stop_tok["output_ids"] == [first] and stop_tok["meta_info"]["finish_reason"] == "stop"
    assert free["meta_info"]["finish_reason"] == "length" and len(free["output_ids"]) == 8
    # EOS ends generation unless ignore_eos.
    eos = sorted(llm.scheduler.eos_ids)[0]
    llm.scheduler.eos_ids = {first}
    assert llm.generate([[5, 6, 7]], GREEDY)[0]["meta_info"]["completion_tokens"] == 12
    assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0))[0]["output_ids"] == [first]
    llm.scheduler.eos_ids = {eos}
    # The context limit ends generation too.
    short = make_llm(tiny_llama, context_length=10)
    res = short.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True))[0]
    assert res["meta_info"]["finish_reason"] == "length" and len(res["output_ids"]) == 7
    zero = llm.generate([[5, 6]], SamplingParams(max_new_tokens=0))[0]
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == "length"


def test_text_prompts_stop_strings_and_logprobs(tiny_llama):
    llm = make_llm(tiny_llama)
    base = llm.generate("Hello world", SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True))[0]
    assert base["text"] == llm.tokenizer.decode(base["output_ids"], skip_special_tokens=True)
    stop = base["text"][3:6]
    res = llm.generate("Hello world", SamplingParams(temperature=0.0, max_new_tokens=16, stop=stop))[0]
    assert res["meta_info"]["finish_reason"] == "stop"
    assert stop not in res["text"] and base["text"].startswith(res["text"])
    kept = llm.generate(
        "Hello world", SamplingParams(temperature=0.0, max_new_tokens=16, stop=stop, no_stop_trim=True)
    )[0]
    assert kept["text"] == res["text"] + stop  # SGLang's no_stop_trim, as the server does
    lp = llm.generate([[5, 6, 7]], GREEDY, top_logprobs=2)[0]["meta_info"]
    assert len(lp["output_token_logprobs"]) == 12 and all(x <= 0 for x in lp["output_token_logprobs"])
    assert all(len(top) == 2 for top in lp["output_top_logprobs"])


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], SamplingParams(), "empty"),
        ([1] * 2000, SamplingParams(), "context length"),
        ([5, 99999], SamplingParams(), "input_ids"),
        ([5, -1], SamplingParams(), "input_ids"),
        ([2**40, 5], SamplingParams(), "input_ids"),
        ([1], SamplingParams(top_p=2.0), "top_p"),
        ([1], SamplingParams(stop_token_ids=[-3]), "stop_token_ids"),
    ],
)
def test_bad_requests_are_rejected(tiny_llama, prompt, params, match):
    llm = make_llm(tiny_llama)
    with pytest.raises(ValueError, match=match):
        llm.generate([[7, 8, 9], prompt], [SamplingParams(), params])
    assert not llm.scheduler.has_work
    assert llm.generate([[7, 8, 9]], GREEDY)[0]["meta_info"]["completion_tokens"] == 12


def test_ids_in_range():
    """The packed check agrees with 0 <= id < bound, and refuses what is not an integer."""
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randint(-3, 1003) for _ in range(rng.randint(1, 40))]
        assert ids_in_range(ids, 1000) == all(0 <= i < 1000 for i in ids)
    assert ids_in_range([], 10) and ids_in_range([0, 9], 10) and not ids_in_range([10], 10)
    assert not ids_in_range([2**32 + 1], 10) and not ids_in_range([1.0], 10) and not ids_in_range(["1"], 10)


def test_request_larger_than_the_pool_is_rejected(tiny_llama):
    llm = make_llm(tiny_llama, max_total_tokens=64)
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate([[1] * 60], SamplingParams(max_new_tokens=10))


def test_overlap_schedule_matches_synchronous(tiny_llama):
    """Launching step N+1 before step N's tokens are known changes nothing about the tokens,
    also when requests stop early (EOS, stop strings, short max_new_tokens) and get retracted."""
    prompts = shared_prefix_prompts(groups=4, per_group=6, prefix_len=30, seed=3)
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=1 + i % 9, ignore_eos=i % 2 == 0) for i in range(len(prompts))
    ]
    kw = {"max_total_tokens": 300, "page_size": 4, "chunked_prefill_size": 64}
    sync = make_llm(tiny_llama, disable_overlap_schedule=True, **kw)
    overlap = make_llm(tiny_llama, **kw)
    assert overlap.scheduler.overlap and not sync.scheduler.overlap
    want = sync.generate(prompts, params)
    got = overlap.generate(prompts, params)
    assert tokens(got) == tokens(want)
    assert [r["text"] for r in got] == [r["text"] for r in want]
    assert overlap.scheduler.stats()["retractions"] > 0
    overlap.scheduler.check_integrity()
    assert overlap.scheduler.stats()["protected_pages"] == 0


def test_chunk_smaller_than_a_page_is_refused(tiny_llama):
    """Chunks end on page boundaries: a chunk budget under one page never advanced (a hang)."""
    with pytest.raises(ValueError, match=r"chunked_prefill_size must be -1 \(no chunking\) or >= page_size"):
        make_llm(tiny_llama, page_size=16, chunked_prefill_size=8)
    llm = make_llm(tiny_llama, page_size=16, chunked_prefill_size=16)
    assert len(llm.generate([list(range(5, 60))], GREEDY)[0]["output_ids"]) == 12


def test_retraction_does_not_inflate_cache_hits(tiny_llama):
    """A retracted request re-admitted finds its own pages; that is no cache hit."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(4, 9))] for _ in range(24)]
    llm = make_llm(tiny_llama, max_total_tokens=160, page_size=2)
    results = llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True))
    stats = llm.scheduler.stats()
    assert stats["retractions"] > 0
    for p, r in zip(prompts, results):
        assert r["meta_info"]["cached_tokens"] <= len(p) - 1
    assert stats["prefix_queried_tokens"] == sum(len(p) for p in prompts)
    assert stats["prefix_hit_tokens"] == sum(r["meta_info"]["cached_tokens"] for r in results)
    assert stats["cache_hit_rate"] < 0.5


def test_stop_string_on_the_last_allowed_token_is_a_stop(tiny_llama):
    llm = make_llm(tiny_llama)
    n = 10
    free = llm.generate("Once upon", SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))[0]
    head = llm.tokenizer.decode(free["output_ids"][:-1], skip_special_tokens=True)
    text = free["text"]
    assert len(text) > len(head)
    # The shortest tail that starts inside the first n-1 tokens' text, ends the text and occurs once.
    stop = next(text[i:] for i in range(len(head) - 1, -1, -1) if text.count(text[i:]) == 1)
    res = llm.generate("Once upon", SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, stop=stop))[0]
    assert res["meta_info"]["finish_reason"] == "stop" and res["text"] == text[: len(text) - len(stop)]


def test_child_processes_use_one_thread():
    import subprocess
    import sys

    code = (
        "import torch; from minisgl.wire.ipc import become_child, cpu_worker_threads; become_child(); "
        "print(torch.get_num_threads(), cpu_worker_threads())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "1" and int(out[1]) >= 1


def test_deleting_an_llm_frees_its_model_and_pool(tiny_llama):
    import gc
    import weakref

    llm = make_llm(tiny_llama)
    llm.generate([[5, 6, 7]], GREEDY)
    model, pool = weakref.ref(llm.runner.model), weakref.ref(llm.runner.kv_cache.buffer)
    del llm
    gc.collect()
    assert model() is None and pool() is None


def test_prompt_logprobs_survive_chunks_cache_and_retraction(tiny_llama):
    """Prompt logprobs (logprob_start) equal transformers' with tiny prefill chunks, a shared
    cached prefix (recomputed where scored) and a pool small enough to retract."""
    from tests.test_api_compat import _reference_logprobs

    rng = random.Random(3)
    shared = [rng.randrange(3, 1000) for _ in range(30)]
    prompts = [shared + [rng.randrange(3, 1000) for _ in range(20 + i)] for i in range(6)]
    refs = [_reference_logprobs(tiny_llama, p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    for pool in (16384, 200):
        llm = make_llm(tiny_llama, page_size=4, chunked_prefill_size=8, max_total_tokens=pool)
        llm.generate(prompts[0], params)  # caches the shared prefix
        outs = llm.generate(prompts, params, logprob_start=0)
        for out, ref in zip(outs, refs):
            got = out["meta_info"]["input_token_logprobs"]
            assert got[0] is None and max(abs(g - r) for g, r in zip(got[1:], ref[1:])) < 1e-4
        if pool == 200:
            assert llm.scheduler.stats()["retractions"] > 0


def test_offline_cache_salt_keeps_prefixes_apart(tiny_llama):
    """LLM.generate's cache_salt: a salted prompt reuses only pages cached under its salt, and
    the tokens are the same whatever was reused."""
    llm = make_llm(tiny_llama)
    prompt = list(range(5, 5 + 96))
    plain = llm.generate([prompt], GREEDY)[0]
    first = llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    again = llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    other = llm.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    assert first["meta_info"]["cached_tokens"] == 0 and other["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] > 0
    assert plain["output_ids"] == first["output_ids"] == again["output_ids"] == other["output_ids"]


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_chunks_keep_tokens(tiny_llama, overlap, cheap_cascade):
    """--enable-mixed-chunk: while long prompts prefill chunk by chunk, the requests already past
    their prefill decode in the same steps (those sharing a prefix in cascade groups); greedy and
    seeded tokens equal the unmixed run's, with the radix cache's integrity checked after every
    step (CheckedLLM)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (20, 700, 45, 500, 9, 300)]
    prompts += shared_prefix_prompts(2, 3, 150, seed=2)
    params = [
        {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
        if i % 3
        else {"max_new_tokens": 24, "temperature": 0.9, "seed": i, "ignore_eos": True}
        for i in range(len(prompts))
    ]
    outs, stats, grouped = [], [], []
    for mixed in (False, True):
        llm = make_llm(
            tiny_llama,
            page_size=4,
            chunked_prefill_size=64,
            enable_mixed_chunk=mixed,
            disable_overlap_schedule=not overlap,
        )
        batches: list = []
        launch = llm.scheduler.executor.launch
        llm.scheduler.executor.launch = lambda batch: (batches.append(batch), launch(batch))[1]
        outs.append([r["output_ids"] for r in llm.generate(prompts, params)])
        stats.append(llm.scheduler.stats())
        assert max(len(b.input_ids) for b in batches) <= 64  # decode rows come out of the step's token budget
        grouped.append(sum(1 for b in batches if b.prefill_reqs and b.group_sizes))
    assert outs[1] == outs[0]
    assert stats[0]["mixed_steps"] == 0 and stats[1]["mixed_steps"] > 5
    assert grouped[1] > 0  # mixed steps whose decode rows attend in cascade groups


def test_debug_log_has_one_line_per_step_with_its_kind_and_time(tiny_llama, caplog):
    """At debug level each step gets one line, written when its tokens are back: its kind
    (prefill, mixed, decode), sizes and the time from launch to tokens, in the form
    ``benchmarks/step_times.py`` reads."""
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (300, 20, 200)]
    llm = make_llm(tiny_llama, page_size=4, chunked_prefill_size=64, enable_mixed_chunk=True)
    with caplog.at_level(logging.DEBUG, logger="minisgl.serve.scheduler.scheduler"):
        llm.generate(prompts, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    steps = [int(line.split(":")[0].removeprefix("step ")) for line in lines]
    assert sorted(steps) == list(range(llm.scheduler.counters.steps))  # one line each
    kinds = {line.split(": ")[1].split(" batch")[0] for line in lines}
    assert kinds == {"prefill", "mixed", "decode"}
    assert all(re.search(r"tokens back \d+\.\d ms after launch$", line) for line in lines)
    from benchmarks.step_times import LINE  # the summary script reads every one of them

    assert all(LINE.search(line) for line in lines)
