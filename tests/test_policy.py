"""Admission order: lpm by radix subtree (no queue-length cliff), aging, and a shared prefix
computed once however it is chunked or queued."""

from __future__ import annotations

import itertools
import random

import pytest

from benchmarks.workloads import distinct_tokens
from minisgl.serve.cache import BaseCacheManager
from minisgl.serve.cache.radix_manager import RadixCacheManager
from minisgl.serve.scheduler.queue import AGING_STEPS, WaitingQueue
from minisgl.serve.scheduler.request import Req
from minisgl.wire.options import RequestOptions
from minisgl.wire.sampling import SamplingParams
from tests.test_scheduler import make_llm


def make_req(rid: int, ids: list[int], queued_step: int = 0, salt: str | None = None) -> Req:
    return Req(
        rid,
        ids,
        SamplingParams(),
        0,
        len(ids) + 8,
        queued_step=queued_step,
        options=RequestOptions(cache_salt=salt),
        kv_salt=salt,
    )


def fill_cache(cache: RadixCacheManager, prompts: list[list[int]]) -> None:
    next_page = 0
    for ids in prompts:
        n = len(ids) // cache.page_size
        cache.insert_prefix(ids, list(range(next_page, next_page + n)))
        next_page += n


def tree_shape(cache: RadixCacheManager) -> list:
    return sorted((n.depth, n.last_access, n.ref) for n in cache._nodes())


def order_waiting(reqs: list[Req], cache: BaseCacheManager, policy: str, step: int) -> list[Req]:
    """``reqs`` (in arrival order) queued afresh, in admission order at ``step``."""
    queue = WaitingQueue(policy, cache.page_size)
    for r in reqs:
        queue.push(r, r.queued_step)
    return list(queue.order(step, cache))


def reference_order(queued: list[tuple[int, Req]], cache: RadixCacheManager, step: int) -> list[Req]:
    """lpm by brute force over (sequence number, request) pairs: the aged tier first (queued
    AGING_STEPS ago, or retracted: a negative number), then the rest; within a tier by cached
    whole pages (the last token excluded), longest first; ties in the depth-first order of the
    trie of every queued prompt's whole pages (a salted prompt's behind a page of its salt), each
    node's requests and subtrees by their most senior request; a salted prompt's hit is read in
    its salt's tree."""
    page = cache.page_size

    def tokens(r: Req) -> list[int]:
        n = len(r.all_ids) - 1
        return r.all_ids[: n - n % page]

    def key(r: Req) -> list:
        return ([r.options.cache_salt] * page if r.options.cache_salt is not None else []) + tokens(r)

    def hit(r: Req) -> int:
        start = cache.start(r.options.cache_salt)
        return 0 if start is None else cache.advance(start, tokens(r))[1]

    def trie_order(group: list[tuple[int, Req]], depth: int) -> list[tuple[int, Req]]:
        own = [(s, r) for s, r in group if len(key(r)) == depth]
        subtrees: dict[tuple, list] = {}
        for s, r in group:
            if len(key(r)) > depth:
                subtrees.setdefault(tuple(key(r)[depth : depth + page]), []).append((s, r))
        items = [(s, [(s, r)]) for s, r in own]
        items += [(min(s for s, _ in members), trie_order(members, depth + page)) for members in subtrees.values()]
        return [x for _, part in sorted(items, key=lambda i: i[0]) for x in part]

    ranked = trie_order(queued, 0)
    out = []
    for aged in (True, False):
        tier = [r for s, r in ranked if (s < 0 or step - r.queued_step >= AGING_STEPS) == aged]
        out += sorted(tier, key=lambda r: -hit(r))  # stable: ties keep trie order
    return out


@pytest.mark.parametrize("seed", range(12))
def test_lpm_queue_matches_brute_force_as_requests_come_and_go(seed):
    """The incremental queue against the brute-force order, through arrivals, admissions,
    aborts, retractions (pushed in front) and a cache that grows and evicts between rounds."""
    rng = random.Random(seed)
    page = rng.choice([1, 2, 4])
    cache = RadixCacheManager(page)
    stems = [[rng.randrange(5) for _ in range(rng.randint(0, 24))] for _ in range(4)]

    def prompt() -> list[int]:
        return rng.choice(stems)[: rng.randint(0, 24)] + [rng.randrange(5) for _ in range(rng.randint(1, 10))]

    def salt() -> str | None:  # tenants: the same tokens under another salt share nothing
        return rng.choice([None, None, "a", "b"])

    queue, queued, next_page = WaitingQueue("lpm", page), {}, 0
    front, arrivals = itertools.count(-1, -1), itertools.count(0)
    for step in range(0, 40 * 30, 30):
        for _ in range(rng.randint(0, 6)):
            seq = next(arrivals)
            r = make_req(seq, prompt(), salt=salt())
            queue.push(r, step)
            queued[id(r)] = (seq, r)
        if queued and rng.random() < 0.3:  # a retraction: back in front of everyone
            s, r = queued.pop(rng.choice(list(queued)))
            queue.remove(r)
            r.output_ids = [rng.randrange(5) for _ in range(rng.randint(0, 3))]
            queue.push(r, step, front=True)
            queued[id(r)] = (next(front), r)
        if rng.random() < 0.5:
            ids = prompt()
            n = len(ids) // page
            cache.insert_prefix(ids, list(range(next_page, next_page + n)), salt=salt())
            next_page += n
        if rng.random() < 0.2 and cache.size_info().evictable:
            cache.evict(rng.randint(1, cache.size_info().evictable))
        seqs = sorted(queued.values(), key=lambda sr: sr[0])
        got = list(queue.order(step, cache))
        assert got == reference_order(seqs, cache, step)
        for r in got[: rng.randint(0, 3)]:  # admitted
            queue.remove(r)
            del queued[id(r)]
        for _ in range(rng.randint(0, 2)):  # aborted
            if queued:
                queue.remove(queued.pop(rng.choice(list(queued)))[1])
        assert len(queue) == len(queued)
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_cache_walk_equals_match_prefix_and_touches_nothing(page_size):
    rng = random.Random(page_size)
    stems = [[rng.randrange(50) for _ in range(rng.randint(0, 40))] for _ in range(6)]

    def seq() -> list[int]:
        return rng.choice(stems)[: rng.randint(0, 40)] + [rng.randrange(50) for _ in range(rng.randint(0, 30))]

    cache = RadixCacheManager(page_size)
    fill_cache(cache, [seq() for _ in range(40)])
    queries = [seq() for _ in range(200)]
    before = tree_shape(cache)
    walked = []
    for ids in queries:
        ids = ids[: len(ids) - len(ids) % page_size]
        walked.append(cache.advance(cache.start(), ids)[1])
    assert tree_shape(cache) == before, "ordering a queue must not split nodes or touch eviction order"
    assert walked == [cache.match_prefix(ids)[0].cached_len for ids in queries]
    cache.check_integrity()


def test_lpm_orders_long_queues_by_hit_then_subtree_oldest_first():
    rng = random.Random(0)
    cache = RadixCacheManager(4)
    systems = [[1000 + g] + [rng.randrange(900) for _ in range(63)] for g in range(20)]
    fill_cache(cache, systems[:3])  # groups 0-2 have their system prompt cached
    reqs = []
    for i in range(600):  # far beyond the old 128-request cliff
        g = rng.randrange(len(systems))
        reqs.append(make_req(i, systems[g] + [rng.randrange(900) for _ in range(rng.randint(2, 9))]))
    order = order_waiting(reqs, cache, "lpm", step=1)
    assert sorted(map(id, order)) == sorted(map(id, reqs))
    group = {id(r): r.prompt_ids[0] - 1000 for r in reqs}
    hits = [64 if group[id(r)] < 3 else 0 for r in order]
    assert hits == sorted(hits, reverse=True), "longest cached prefix first"
    runs = [group[id(order[0])]]
    for r in order[1:]:
        if group[id(r)] != runs[-1]:
            runs.append(group[id(r)])
    assert len(runs) == len(set(runs)) == 20, "each group's requests go together"
    first_seen = {}
    for i, r in enumerate(reqs):
        first_seen.setdefault(group[id(r)], i)
    uncached = [g for g in runs if g >= 3]
    assert uncached == sorted(uncached, key=first_seen.get), "uncached groups go oldest first"
    assert order_waiting(reqs, cache, "fcfs", step=1) == reqs


def test_aged_requests_go_first_in_arrival_order():
    cache = RadixCacheManager(1)
    cached = list(range(100, 140))
    fill_cache(cache, [cached])
    old = [make_req(0, [7, 8, 9], queued_step=0), make_req(1, [5, 6], queued_step=3)]
    young = [make_req(2 + i, cached + [i], queued_step=AGING_STEPS - 10) for i in range(4)]
    assert order_waiting(old + young, cache, "lpm", step=AGING_STEPS - 1)[:2] == young[:2]
    assert order_waiting(old + young, cache, "lpm", step=AGING_STEPS + 3)[:2] == old
    # Everyone aged (a long batch): lpm among them, no crash.
    assert order_waiting(old + young, cache, "lpm", step=10 * AGING_STEPS)[:4] == young


def test_nested_prompts_do_not_recurse():
    cache = RadixCacheManager(1)
    base = list(range(3000))
    reqs = [make_req(i, base[: 2 + i]) for i in range(2000)]  # each a prefix of the next
    order = order_waiting(reqs[::-1], cache, "lpm", step=0)
    assert len(order) == 2000 and order[0] is reqs[-1]  # the oldest (here: longest) leads its subtree


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
@pytest.mark.parametrize("chunk,page_size,running", [(48, 4, 64), (64, 1, 3), (200, 8, 5)])
def test_a_shared_prefix_is_computed_once(tiny_llama, policy, chunk, page_size, running):
    """Groups share a 150-token prefix, longer than a chunk; their requests arrive shuffled among
    unrelated ones, and few may run at once: still each prefix is prefilled once."""
    rng = random.Random(chunk)
    prompts = []
    for g in range(3):
        prefix = [rng.randrange(3, 1000) for _ in range(150)]
        prompts += [prefix + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    prompts += [[rng.randrange(3, 1000) for _ in range(rng.randint(20, 90))] for _ in range(6)]
    rng.shuffle(prompts)
    llm = make_llm(
        tiny_llama,
        page_size=page_size,
        chunked_prefill_size=chunk,
        schedule_policy=policy,
        max_running_requests=running,
    )
    llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True))
    computed = llm.scheduler.stats()["prefill_tokens"]
    # A request recomputes at most the partial page its cached prefix ends in.
    assert (
        distinct_tokens(prompts) <= computed <= distinct_tokens(prompts) + len(prompts) * (page_size - 1) + len(prompts)
    )


def test_random_policy_is_a_stable_permutation_with_retractions_in_front():
    """--schedule-policy random: an order drawn at arrival (the same on every read), every live
    request once, removals gone, a retracted request in front; the engine gives greedy tokens
    independent of the order."""
    cache = RadixCacheManager(4)
    reqs = [make_req(i, [3 + i, 4, 5, 6, 7]) for i in range(200)]
    queue = WaitingQueue("random", 4)
    for r in reqs:
        queue.push(r, 0)
    first = list(queue.order(0, cache))
    assert sorted(r.rid for r in first) == list(range(200)) and first != reqs
    assert list(queue.order(5, cache)) == first
    for r in first[:150:2]:
        queue.remove(r)
    assert list(queue.order(0, cache)) == [r for r in first if r not in first[:150:2]]
    back = first[0]
    queue.push(back, 3, front=True)
    assert next(iter(queue.order(3, cache))) is back and len(queue) == len(list(queue.order(3, cache)))


def test_random_policy_engine_tokens_match_fcfs(tiny_llama):
    prompts = [[5 + i, 17, 23, 42 + i, 7] for i in range(12)]
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    outs = [
        [
            r["output_ids"]
            for r in make_llm(tiny_llama, schedule_policy=p, max_running_requests=3).generate(prompts, params)
        ]
        for p in ("fcfs", "random")
    ]
    assert outs[0] == outs[1]
