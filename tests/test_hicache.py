"""The hierarchical cache: a host tier under the radix tree.

The fuzz drives the scheduler with an executor that keeps real page contents (each slot of a
device or host page holds the token id written there) and applies a batch's host copies the
way the worker orders them: after the previous step's compute, and before this step's compute
only when the batch says to wait (otherwise after it, the worst case of two streams). Every step
checks that each request's cached positions hold its own tokens, so a load from a reused host
page, a write of a page already overwritten or a missing wait shows up as a wrong token.
"""

from __future__ import annotations

import random
import shutil
import time

import pytest
import torch

from minisgl.config.args import EngineArgs
from minisgl.serve.cache import HiRadixCacheManager, HostTier
from minisgl.serve.scheduler.scheduler import Scheduler
from minisgl.wire.sampling import SamplingParams
from minisgl.wire.steps import ForwardBatch, StepOutput

EOS, VOCAB = 1, 100
POLICIES = ("write_through", "write_through_selective", "write_back")


class ContentExecutor:
    """A fake worker whose KV pages hold token ids; sampled tokens are a function of the whole
    sequence so far, read back from the pages, so wrong pages give different tokens."""

    def __init__(self, sched_ref: list, page_size: int, num_pages: int, num_host_pages: int):
        self.sched_ref, self.page_size = sched_ref, page_size
        self.device: list[list[int | None]] = [[None] * page_size for _ in range(num_pages)]
        self.host: list[list[int | None]] = [[None] * page_size for _ in range(num_host_pages)]
        self.table: dict[tuple[int, int], int] = {}
        self.last: dict[int, int] = {}
        self.outputs: list[list[int]] = []
        self.checked = 0

    def _copies(self, batch: ForwardBatch) -> None:
        for pages, pool in (
            (batch.kv_writes[0::2] + batch.kv_loads[1::2], self.device),
            (batch.kv_writes[1::2] + batch.kv_loads[0::2], self.host),
        ):
            assert all(0 <= p < len(pool) for p in pages), "a copy names a page outside its pool"
        for i in range(0, len(batch.kv_writes), 2):
            self.host[batch.kv_writes[i + 1]] = list(self.device[batch.kv_writes[i]])
        for i in range(0, len(batch.kv_loads), 2):
            self.device[batch.kv_loads[i + 1]] = list(self.host[batch.kv_loads[i]])

    def _compute(self, batch: ForwardBatch) -> list[int]:
        ps, by_slot = self.page_size, {r.slot: r for r in self.sched_ref[0].running}
        for s, c, p in zip(batch.table_slots, batch.table_cols, batch.table_pages):
            assert 0 <= p < len(self.device), f"page {p} is outside the device pool"
            self.table[(s, c)] = p
        at, tokens = 0, []
        for slot, cached, new, sample in zip(batch.slots, batch.cached_lens, batch.new_lens, batch.sample):
            ids = batch.input_ids[at : at + new]
            at += new
            ids = [self.last[slot] if t < 0 else t for t in ids]
            req = by_slot[slot]
            known = req.all_ids
            # What attention reads: every cached position in a prefill (where loaded pages are
            # first read), the last few in a decode step (a Python loop over all is too slow).
            seq = []
            for pos in range(0 if new > 1 else max(0, cached - 4), cached):
                value = self.device[self.table[(slot, pos // ps)]][pos % ps]
                if pos < len(known):
                    assert value == known[pos], f"request {req.rid}: position {pos} holds {value}, not {known[pos]}"
                    self.checked += 1
                seq.append(value)
            for k, t in enumerate(ids):
                pos = cached + k
                self.device[self.table[(slot, pos // ps)]][pos % ps] = t
            seq = (seq + ids)[-4:] + [cached + new]  # (the same however the prompt was chunked)
            if sample:
                tok = EOS if hash(tuple(seq)) % 40 == 0 else 2 + hash(tuple(seq)) % (VOCAB - 2)
                self.last[slot] = tok
                tokens.append(tok)
        return tokens

    def launch(self, batch: ForwardBatch) -> None:
        if batch.wait_kv_io:
            self._copies(batch)
            tokens = self._compute(batch)
        else:  # the copies may run beside (after) the compute
            tokens = self._compute(batch)
            self._copies(batch)
        self.outputs.append(tokens)

    def collect(self) -> StepOutput:
        return StepOutput(tokens=self.outputs.pop(0))

    def sample_masked(self, bitmask: bytes) -> None:
        raise AssertionError("no grammars here")


def run_fuzz(seed: int, policy: str, host_pages: int, num_pages: int) -> list[list[int]]:
    rng = random.Random(seed)
    page = rng.choice([1, 4, 16])
    args = EngineArgs(
        model="",
        page_size=page,
        max_running_requests=rng.choice([3, 16, 64]),
        chunked_prefill_size=rng.choice([page * 4, 64, 256]),
        schedule_policy=rng.choice(["lpm", "fcfs"]),
        disable_overlap_schedule=seed % 2 == 1,
        enable_hierarchical_cache=host_pages > 0,
        hicache_write_policy=policy,
    )
    num_pages //= page
    max_writes = rng.choice([1, 3, 256])  # (drawn in both runs: they see the same plan)
    ref: list = []
    executor = ContentExecutor(ref, page, num_pages, host_pages // page)
    sched = Scheduler(args, num_pages, 512, VOCAB, [EOS], executor, None, host_pages // page)
    if sched.memory.host is not None:  # writes spread over many batches, evictions pulling them forward
        sched.memory.host.max_writes = max_writes
    ref.append(sched)
    stems = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(30, 200))] for _ in range(6)]
    # What arrives, and which request is aborted, at each step: drawn up front, so runs with
    # other pools (other timings) see the same requests.
    plan = []
    for step in range(250):
        arrivals = []
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = rng.choice(stems)[: rng.randint(1, 200)] + [
                rng.randrange(2, VOCAB) for _ in range(rng.randint(0, 40))
            ]
            params = SamplingParams(max_new_tokens=rng.randint(1, 60), temperature=0.0, ignore_eos=rng.random() < 0.5)
            arrivals += [(prompt, params)] * rng.choice([1, 1, 3])
        plan.append((arrivals, rng.randrange(10**6) if rng.random() < 0.03 else None, rng.random() < 0.2))
    reqs = []
    for arrivals, abort, flush in plan:
        reqs += [sched.add_request(prompt, params) for prompt, params in arrivals]
        if abort is not None:
            sched.finish(reqs[abort % len(reqs)], "abort")
        if sched.has_work:
            sched.step()
        elif flush:
            assert sched.flush_cache()
        sched.check_integrity()
    while sched.has_work:
        sched.step()
        sched.check_integrity()
    info = sched.cache.size_info()
    assert info.protected == 0 and sched.allocator.num_free + info.evictable == num_pages, "device pages leaked"
    if sched.memory.host is not None:
        host = sched.memory.host
        assert host.allocator.num_free + len(sched.cache.host_pages()) == host.num_pages, "host pages leaked"
    assert executor.checked > 0
    return [None if r.finish_reason == "abort" else r.output_ids for r in reqs]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(2))
def test_fuzzed_scheduler_with_host_tier_reads_only_its_own_tokens(seed, policy):
    """Random arrivals over shared stems, aborts, retraction (small pools), flushes: integrity
    in both tiers after every step, nothing leaks, and the tokens equal those of a run whose
    device pool holds everything (the same requests arrive at the same steps; one aborted in
    either run is left out)."""
    small = run_fuzz(seed, policy, host_pages=1600, num_pages=700)
    big = run_fuzz(seed, policy, host_pages=0, num_pages=100000)
    both = [(a, b) for a, b in zip(small, big) if a is not None and b is not None]  # (not aborted in either)
    assert len(both) > len(small) // 2 and all(a == b for a, b in both)


def test_host_tier_is_used_by_the_fuzz():
    """The fuzz pool is small enough that the host tier both fills and serves hits."""
    rng_seed, loaded = 1, 0
    for seed in range(rng_seed, rng_seed + 3):
        ref: list = []
        args = EngineArgs(
            model="", page_size=4, max_running_requests=16, chunked_prefill_size=64, enable_hierarchical_cache=True
        )
        executor = ContentExecutor(ref, 4, 150, 400)
        sched = Scheduler(args, 150, 512, VOCAB, [EOS], executor, None, 400)
        ref.append(sched)
        rng = random.Random(seed)
        stems = [[rng.randrange(2, VOCAB) for _ in range(120)] for _ in range(8)]
        for round_ in range(4):
            for s in stems:
                sched.add_request(s + [rng.randrange(2, VOCAB) for _ in range(8)], SamplingParams(max_new_tokens=4))
                while sched.has_work:
                    sched.step()
                    sched.check_integrity()
        loaded += sched.stats()["prefix_host_hit_tokens"]
    assert loaded > 0


# ---- the tree's two tiers, step by step -----------------------------------------------------------


def make(policy: str = "write_through", host_pages: int = 8) -> tuple[HiRadixCacheManager, HostTier]:
    host = HostTier(host_pages, policy)
    return HiRadixCacheManager(1, host), host


def test_write_through_copies_on_insert_and_eviction_keeps_the_node_on_host():
    cache, host = make()
    cache.insert_prefix([1, 2, 3], [10, 11, 12])
    writes, loads, wait, _ = host.take()
    assert len(writes) == 6 and not loads and not wait
    assert cache.evict(3) == [10, 11, 12]
    handle, pages = cache.match_prefix([1, 2, 3])
    assert handle.cached_len == 0 and pages == []
    nodes = cache.match_host(handle, [1, 2, 3])
    assert [n.key for n in nodes] == [[1, 2, 3]]
    assert host.wait, "the write was not confirmed: the batch must wait before reusing the pages"
    cache.load(nodes, [20, 21, 22])
    handle, pages = cache.match_prefix([1, 2, 3])
    assert pages == [20, 21, 22]
    writes, loads, wait, _ = host.take()
    assert loads == [h for pair in zip(nodes[0].host, [20, 21, 22]) for h in pair] and wait
    cache.check_integrity()


def test_a_write_of_pages_being_computed_goes_with_the_next_batch():
    cache, host = make()
    cache.insert_prefix([1, 2], [10, 11], computing=True)
    assert host.take()[0] == []
    assert host.take()[0] == [10, cache.root.children[(1,)].host[0], 11, cache.root.children[(1,)].host[1]]


def test_writes_are_spread_over_batches_and_an_eviction_pulls_its_own_forward():
    cache, host = make(host_pages=16)
    host.max_writes = 2
    cache.insert_prefix([1, 2, 3, 4, 5], [10, 11, 12, 13, 14])
    node = cache.root.children[(1,)]
    assert node.io_step == host.step + 2, "five pages at two a batch: the third batch carries the last"
    assert host.take()[0][0::2] == [10, 11]
    assert not cache._host_evictable(node), "its copy is not all sent"
    cache.insert_prefix([7, 8], [20, 21])  # queued behind: batches two and three
    assert cache.evict(5) == [10, 11, 12, 13, 14]  # the older leaf
    writes, _, wait, _ = host.take()
    assert sorted(writes[0::2]) == [12, 13, 14] and wait, "the evicted pages' writes go with this batch"
    assert node.io_step == host.step - 1
    assert host.take()[0][0::2] == [20] and host.take()[0][0::2] == [21], "the others keep their batches"
    assert not host.pending
    cache.check_integrity()


def test_write_back_copies_only_at_eviction():
    cache, host = make("write_back")
    cache.insert_prefix([1, 2], [10, 11])
    assert host.take()[0] == []
    cache.evict(2)
    writes, _, wait, _ = host.take()
    assert writes[0::2] == [10, 11] and wait
    cache.check_integrity()


def test_selective_writes_prefixes_matched_twice():
    cache, host = make("write_through_selective")
    cache.insert_prefix([1, 2], [10, 11])
    for expected in (0, 4):
        handle, _ = cache.match_prefix([1, 2])
        cache.count_hit(handle)
        assert len(host.take()[0]) == expected


def test_inserting_over_a_host_only_prefix_adopts_the_callers_pages():
    cache, host = make()
    cache.insert_prefix([1, 2], [10, 11])
    host.take()
    cache.evict(2)
    cache.insert_prefix([1, 2, 3], [20, 21, 22])
    handle, pages = cache.match_prefix([1, 2, 3])
    assert pages == [20, 21, 22]
    cache.check_integrity()


def test_host_pool_full_evicts_least_recently_used_host_copies():
    cache, host = make(host_pages=4)
    cache.insert_prefix([1, 2], [10, 11])
    cache.insert_prefix([5, 6], [12, 13])
    host.take()
    host.take()  # both writes are in past batches: their host pages may go
    cache.evict(4)  # both on host only now
    cache.match_prefix([5, 6])  # touch [5, 6]
    cache.insert_prefix([7, 8], [14, 15])  # needs 2 host pages: the older [1, 2] goes
    assert cache.match_host(cache.root.handle, [1, 2]) == []
    assert [n.key for n in cache.match_host(cache.root.handle, [5, 6])] == [[5, 6]]
    assert host.evicted_pages == 2
    cache.check_integrity()


def test_host_copies_in_this_batch_are_never_reused_in_it():
    cache, host = make(host_pages=2)
    cache.insert_prefix([1, 2], [10, 11])  # its write goes with this batch
    cache.insert_prefix([5, 6], [12, 13])  # no host page may be taken from it: no copy for this one
    assert cache.root.children[(5,)].host is None
    cache.check_integrity()


def test_flush_frees_both_tiers():
    cache, host = make()
    cache.insert_prefix([1, 2, 3, 4], [10, 11, 12, 13])
    cache.insert_prefix([1, 2, 3, 5], [10, 11, 12, 14])
    assert cache.evict(1) in ([13], [14])  # one leaf goes to the host tier only
    freed = cache.reset()
    assert len(freed) == 4 and host.allocator.num_free == 8
    cache.check_integrity()


# ---- the real engine ----------------------------------------------------------------------------


def multi_turn(llm, rounds: int = 3, convs: int = 8, metas: list | None = None) -> list[list[int]]:
    """Conversations that come back after the others: each round appends a user turn and the
    answer to every history, so the working set outgrows a small device pool (``metas``: each
    result's meta_info is added to it)."""
    rng = random.Random(0)
    histories = [[rng.randrange(5, 500) for _ in range(200)] for _ in range(convs)]
    outs = []
    for _ in range(rounds):
        for h in histories:
            h += [rng.randrange(5, 500) for _ in range(40)]
        results = llm.generate(
            [list(h) for h in histories], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        )
        for h, r in zip(histories, results):
            h += r["output_ids"]
            outs.append(r["output_ids"])
            if metas is not None:
                metas.append(r["meta_info"])
        llm.scheduler.check_integrity()
    return outs


def test_engine_with_host_tier_gives_the_tokens_of_one_big_pool(tiny_llama):
    """Greedy tokens on the CPU engine: a device pool too small for the conversations plus the
    host tier, under each write policy, equal one pool that holds everything; the host tier
    serves hits (write_through), and copies really moved the bytes (the host pool's pages equal
    the device's for a cached prefix)."""
    from minisgl.llm import LLM

    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", max_total_tokens=100000)
    reference = multi_turn(llm)
    for policy in POLICIES:
        llm = LLM(
            str(tiny_llama),
            device="cpu",
            dtype="float32",
            max_total_tokens=1200,
            enable_hierarchical_cache=True,
            hicache_ratio=4,
            hicache_write_policy=policy,
        )
        metas: list[dict] = []
        assert multi_turn(llm, metas=metas) == reference, policy
        stats = llm.scheduler.stats()
        if policy == "write_through":
            assert stats["prefix_host_hit_tokens"] > 0 and stats["host_loaded_pages"] > 0
        # each request's cached tokens split by where they came from (SGLang's cached_tokens_details)
        details = [m["cached_tokens_details"] for m in metas]
        assert sum(d["host"] for d in details) == stats["prefix_host_hit_tokens"]
        assert all(d["device"] + d["host"] == m["cached_tokens"] and d["device"] >= 0 for d, m in zip(details, metas))
        cache, runner = llm.scheduler.cache, llm.runner
        for node in cache._nodes():
            if node.pages is not None and node.host is not None and node.io_step < cache.host.step:
                for d, h in zip(node.pages, node.host):
                    assert torch.equal(runner.kv_cache.buffer[:, :, d], runner.host_pool.buffer[h].transpose(0, 1))


def test_a_page_outside_either_pool_is_refused_before_any_copy():
    from minisgl.device.kvcache.host_pool import HostKVPool
    from minisgl.device.kvcache.mha_pool import MHAKVCache

    cache = MHAKVCache(8, 4, 2, 2, 8, torch.float32, torch.device("cpu"))
    host = HostKVPool(6, cache)
    host.buffer.normal_()  # (fresh memory may hold NaN patterns, which never compare equal)
    before = host.buffer.clone()
    for writes, loads in (([0, 6], []), ([8, 0], []), ([], [0, 8]), ([], [-1, 0]), ([1, 1, 2, 2], [5, 9])):
        with pytest.raises(IndexError, match="outside the pools"):
            host.transfer(cache, writes, loads)
    assert torch.equal(host.buffer, before)


@pytest.mark.cuda
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_page_copies_equal_the_torch_reference(io_backend, dtype):
    """Writes then loads through the page-copy kernel (or the 2D DMA copies) move exactly the
    bytes the torch reference moves, per-layer events included; a page written and then
    loaded in one batch round-trips."""
    from minisgl.device.kvcache.host_pool import HostKVPool
    from minisgl.device.kvcache.mha_pool import MHAKVCache

    def pools(device: str) -> tuple:
        cache = MHAKVCache(40, 16, 5, 2, 64, dtype, torch.device(device))
        raw = cache.buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 120, raw.shape, generator=torch.Generator().manual_seed(0), dtype=torch.uint8))
        host = HostKVPool(30, cache, io_backend)
        host.buffer.view(torch.uint8).fill_(7)
        return cache, host

    writes = [3, 0, 9, 5, 17, 29, 39, 11]  # (device, host) pairs
    loads = [0, 1, 5, 2, 11, 20, 13, 33]  # (host, device): two of them read pages written just before
    gpu, gpu_host = pools("cuda")
    cpu, cpu_host = pools("cpu")
    events = gpu_host.transfer(gpu, writes, loads)
    assert len(events) == 5
    cpu_host.transfer(cpu, writes, loads)
    torch.cuda.current_stream().wait_event(events[-1])
    torch.cuda.synchronize()
    assert torch.equal(gpu_host.buffer.view(torch.uint8), cpu_host.buffer.view(torch.uint8))
    assert torch.equal(gpu.buffer.view(torch.uint8).cpu(), cpu.buffer.view(torch.uint8))
    gpu_host.close()


@pytest.mark.cuda
@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_engine_with_host_tier_gives_the_tokens_of_one_big_pool(tiny_llama, policy, io_backend):
    """On the GPU (torch attention in fp32, overlap, copies on their own stream): a small device
    pool plus the host tier gives the greedy tokens of one big pool. FlashInfer with CUDA graphs
    and the host tier: test_piecewise.test_piecewise_graphs_wait_for_host_tier_loads."""
    from minisgl.llm import LLM

    common = dict(device="cuda", dtype="float32", attention_backend="torch", cuda_graph_max_bs=16)
    llm = LLM(str(tiny_llama), max_total_tokens=100000, **common)
    reference = multi_turn(llm)
    del llm
    llm = LLM(
        str(tiny_llama),
        max_total_tokens=1200,
        enable_hierarchical_cache=True,
        hicache_ratio=4,
        hicache_write_policy=policy,
        hicache_io_backend=io_backend,
        **common,
    )
    assert multi_turn(llm) == reference
    assert llm.scheduler.stats()["host_loaded_pages"] > 0 or policy == "write_through_selective"
    llm.runner.host_pool.close()


# ---- the storage tier -----------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_restarted_engine_finds_the_prompt_on_disk_and_skips_a_corrupt_file(tiny_llama, tmp_path, device):
    """Pages are written behind to the storage folder; a new engine on the same folder (a
    restart) serves a repeated prompt from it with the tokens of a cold run; a corrupted file is
    found, counted and removed, and the pages from there on are computed again."""
    from minisgl.llm import LLM

    engine = dict(
        device=device,
        dtype="float32",
        max_total_tokens=4000,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
        attention_backend="torch",
    )
    rng = random.Random(5)
    prompt = [rng.randrange(5, 500) for _ in range(900)]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    first = LLM(str(tiny_llama), **engine)
    cold = first.generate([prompt], params)[0]
    assert cold["meta_info"]["cached_tokens"] == 0
    # Written behind by a background thread: the last pages may land just after generate returns.
    deadline = time.monotonic() + 10
    while len(files := sorted(tmp_path.rglob("*.r0"))) < 900 // 16 - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(files) >= 900 // 16 - 1, "the prompt's pages were not written behind"
    del first

    again = LLM(str(tiny_llama), **engine)
    warm = again.generate([prompt], params)[0]
    assert warm["output_ids"] == cold["output_ids"]
    assert warm["meta_info"]["cached_tokens"] >= 0.9 * len(prompt)
    assert again.scheduler.stats()["prefix_disk_hit_tokens"] >= 0.9 * len(prompt)
    again.scheduler.check_integrity()

    by_age = sorted(files, key=lambda f: f.stat().st_mtime)
    data = bytearray(by_age[10].read_bytes())
    data[-1] ^= 0xFF  # one bit of the eleventh page's payload
    by_age[10].write_bytes(bytes(data))
    third = LLM(str(tiny_llama), **engine)
    out = third.generate([prompt], params)[0]
    assert out["output_ids"] == cold["output_ids"]
    stats = third.scheduler.stats()
    assert stats["disk_corrupt_files"] == 1
    assert out["meta_info"]["cached_tokens"] < 0.9 * len(prompt)


def test_tp2_engine_with_host_tier_gives_the_tokens_of_one_big_pool(tiny_llama):
    """Tensor parallel 2 (gloo): each rank keeps and moves its own heads' pages, and the tokens
    equal one big pool's at tp=1."""
    from minisgl.llm import LLM

    reference = multi_turn(LLM(str(tiny_llama), device="cpu", dtype="float32", max_total_tokens=100000))
    llm = LLM(
        str(tiny_llama),
        device="cpu",
        dtype="float32",
        max_total_tokens=1200,
        tp_size=2,
        enable_hierarchical_cache=True,
        hicache_ratio=4,
    )
    try:
        assert multi_turn(llm) == reference
        assert llm.scheduler.stats()["prefix_host_hit_tokens"] > 0
    finally:
        llm.runner.close()


def test_disk_keys_are_kept_per_node_and_equal_the_path_hash():
    """Each node's storage keys, computed once and sliced by splits, are the chained hash of
    the tokens from its tree's root (salted trees chain from their salt)."""
    from minisgl.serve.cache.disk_store import page_keys

    rng = random.Random(3)
    cache = HiRadixCacheManager(2, HostTier(8, "write_back"))  # (write_back: no host copies)
    stems = [[rng.randrange(6) for _ in range(12)] for _ in range(3)]
    page = 0
    for i in range(40):
        ids = rng.choice(stems)[: rng.randrange(0, 12, 2)] + [rng.randrange(6) for _ in range(rng.randrange(2, 10, 2))]
        salt = rng.choice([None, "t"])
        n = len(ids) // 2
        cache.insert_prefix(ids, list(range(page, page + n)), salt=salt)
        page += n
        for node in cache._nodes():
            if rng.random() < 0.3:
                cache._disk_keys(node)  # some computed early, then split by later inserts
    for node in cache._nodes():
        path, up = [], node
        while up.parent is not None:
            path[:0] = up.key
            up = up.parent
        salt = cache._salt_of[up]
        first = salt.encode() if salt is not None else b""
        assert cache._disk_keys(node) == page_keys(path, 2, first)[-len(node.key) // 2 :]


def _store(tmp_path, page_bytes: int = 64):
    from minisgl.serve.cache.disk_store import DiskStore, page_keys

    store = DiskStore(str(tmp_path / "kv"), "fp")
    keys = page_keys(list(range(8)), 2)
    return store, keys, page_bytes


def test_disk_files_are_reached_only_inside_the_folder(tmp_path):
    """Links in the folder (a page file, a subfolder) are never followed: a linked page is not
    found or read, a write into a linked subfolder fails rather than landing outside; a file
    past a page's size is refused before a byte of it is read."""
    store, keys, nbytes = _store(tmp_path)
    page = memoryview(bytearray(range(nbytes)))
    store.write_from(keys[0], 0, page)
    out = memoryview(bytearray(nbytes))
    [token] = store.stage(keys[:1], nbytes)
    store.read_staged(token, 0, out)
    assert bytes(out) == bytes(page)

    # A page file that is a link to a good file outside: not found, not read, the target kept.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(store.path(keys[0], 0).read_bytes())
    store.path(keys[1], 0).parent.mkdir(exist_ok=True)
    store.path(keys[1], 0).symlink_to(outside / "secret")
    assert not store.exists(keys[1]) and store.stage(keys[1:2], nbytes) == []
    assert (outside / "secret").is_file()

    # A subfolder that is a link: nothing is written through it.
    sub = store.path(keys[2], 0).parent
    if sub.exists():
        shutil.rmtree(sub)
    sub.symlink_to(outside, target_is_directory=True)
    with pytest.raises(OSError):
        store.write_from(keys[2], 0, page)
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]

    # An oversized (sparse) file: refused by its size, not read.
    big = store.path(keys[3], 0)
    big.parent.mkdir(exist_ok=True)
    with open(big, "wb") as f:
        f.truncate(8 << 30)
    start = time.perf_counter()
    assert store.stage(keys[3:4], nbytes) == [] and time.perf_counter() - start < 1.0


def test_a_file_changed_after_the_check_never_reaches_the_model(tmp_path):
    """The scheduler stages the bytes it checked: a page rewritten (here with a digest made for
    other content) or cut after the check leaves what the worker reads as it was checked; a page
    staged for no batch goes with ``unstage``."""
    from minisgl.serve.cache.disk_store import HEADER, MAGIC

    store, keys, nbytes = _store(tmp_path)
    good = bytes(range(nbytes))
    store.write_from(keys[0], 0, memoryview(good))
    [token] = store.stage(keys[:1], nbytes)
    forged = bytes([7]) * nbytes
    store.path(keys[0], 0).write_bytes(HEADER.pack(MAGIC, keys[0], nbytes, store._digest(keys[0], forged)) + forged)
    out = memoryview(bytearray(nbytes))
    store.read_staged(token, 0, out)
    assert bytes(out) == good
    with pytest.raises(OSError):  # read once: the staging file is gone
        store.read_staged(token, 0, out)
    store.path(keys[0], 0).write_bytes(store.path(keys[0], 0).read_bytes()[:-5])  # cut: not staged
    assert store.stage(keys[:1], nbytes) == []
    store.write_from(keys[1], 0, memoryview(good))
    tokens = store.stage(keys[1:2], nbytes)
    store.unstage(tokens)
    assert not any(p.is_file() for p in store.folder.glob(".stage-*/*"))


def test_a_page_forged_without_the_folders_secret_is_refused(tmp_path):
    """A file with a valid header whose digest was made without the folder's secret (a checksum
    recomputed for other bytes, or another folder's secret) is refused and removed; a second
    store on the folder (another process) shares the secret and reads the good pages."""
    import hmac

    from minisgl.serve.cache.disk_store import HEADER, MAGIC, DiskStore

    store, keys, nbytes = _store(tmp_path)
    forged = bytes([9]) * nbytes
    digest = hmac.new(b"x" * 32, keys[0] + forged, "sha256").digest()[:16]
    store.path(keys[0], 0).parent.mkdir(exist_ok=True)
    store.path(keys[0], 0).write_bytes(HEADER.pack(MAGIC, keys[0], nbytes, digest) + forged)
    assert store.stage(keys[:1], nbytes) == [] and store.corrupt == 1
    assert not store.path(keys[0], 0).exists()
    store.write_from(keys[1], 0, memoryview(bytes(range(nbytes))))
    other = DiskStore(str(store.folder.parent), store.folder.name)
    assert other._secret == store._secret and len(other.stage(keys[1:2], nbytes)) == 1
    assert (store.folder / ".secret").stat().st_mode & 0o777 == 0o600


def test_the_storage_folder_is_private_and_must_be_this_users(tmp_path):
    import os
    import stat

    from minisgl.serve.cache.disk_store import DiskStore

    store = DiskStore(str(tmp_path / "kv"), "fp")
    assert stat.S_IMODE(os.stat(store.folder).st_mode) == 0o700
    if os.getuid() != 0:
        pytest.skip("giving the folder to another user needs root")
    other = tmp_path / "other"
    other.mkdir()
    os.chown(other, 12345, -1)
    with pytest.raises(PermissionError, match="not a folder of this user"):
        DiskStore(str(other), "fp")


def test_a_checkpoint_rewritten_in_place_gets_another_storage_folder(tmp_path):
    """The disk tier's folder is keyed by the weights' files, not only the model's path."""
    import os

    from minisgl.device.tiny_model import make_tiny_model
    from minisgl.llm import LLM

    path = make_tiny_model("llama", tmp_path / "m", seed=0)
    first = LLM(str(path), device="cpu", max_total_tokens=2048).runner.storage_fingerprint
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data)  # new contents would do the same: the file's identity changes
    os.utime(weights, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    assert LLM(str(path), device="cpu", max_total_tokens=2048).runner.storage_fingerprint != first
