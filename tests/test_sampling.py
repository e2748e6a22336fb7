"""Sampler: each parameter does what it says, per request, reproducibly."""

from __future__ import annotations

import pytest
import torch

from minisgl.device.sampler import Sampler, exponential_noise
from minisgl.wire.sampling import SamplingParams
from tests.interpreter import run_interpreted

V = 50


def sampler_with(*params: SamplingParams, prompts=None, outputs=None) -> Sampler:
    s = Sampler(max_slots=8, vocab_size=V, device=torch.device("cpu"))
    for slot, p in enumerate(params):
        s.set_request(slot, p, (prompts or {}).get(slot, []), (outputs or {}).get(slot, []), seed=slot)
    return s


def draw(sampler: Sampler, logits: torch.Tensor, slot: int, n: int) -> list[int]:
    """n draws for one slot at different positions."""
    return [sampler.sample(logits[None], [slot], [pos]).tokens.item() for pos in range(n)]


def test_exponential_noise_is_exp1_and_deterministic():
    seeds, pos = torch.tensor([1, 2**40 + 3]), torch.tensor([5, 9])
    a, b = exponential_noise(seeds, pos, 20000), exponential_noise(seeds, pos, 20000)
    assert torch.equal(a, b)
    assert (a > 0).all()
    assert abs(a.mean().item() - 1.0) < 0.03 and abs(a.var().item() - 1.0) < 0.08
    assert not torch.equal(a[0], a[1])


def test_greedy_and_temperature_zero_take_argmax():
    logits = torch.randn(3, V)
    s = sampler_with(SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=0.0))
    assert torch.equal(s.sample(logits, [0, 1, 2], [1, 1, 1]).tokens, logits.argmax(-1))


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (V - 3))
    logits = probs.clamp_min(1e-30).log()
    s = sampler_with(SamplingParams(temperature=1.0))
    draws = torch.tensor(draw(s, logits, 0, 4000))
    freq = torch.bincount(draws, minlength=V)[:3].float() / len(draws)
    torch.testing.assert_close(freq, probs[:3], atol=0.03, rtol=0)


def test_top_k_top_p_min_p_restrict_support():
    logits = torch.linspace(3.0, -3.0, V)  # token 0 most likely, descending
    probs = logits.softmax(-1)
    top_p_keep = int((probs.cumsum(0) < 0.6).sum().item()) + 1
    floor = 0.2 * probs[0]
    cases = [
        (SamplingParams(top_k=3), set(range(3))),
        (SamplingParams(top_p=0.6), set(range(top_p_keep))),
        (SamplingParams(min_p=0.2), {i for i in range(V) if probs[i] >= floor}),
    ]
    for params, allowed in cases:
        seen = set(draw(sampler_with(params), logits, 0, 600))
        assert seen <= allowed and len(seen) > 1, (params, seen, allowed)


@pytest.mark.parametrize("block", [512, 4])
def test_positions_shifted_on_the_device_draw_as_the_positions_themselves(monkeypatch, block):
    """Rows whose positions grew on the device after the host planned them (speculation's
    ``Gains``) draw what a row given the whole position draws, in blocks too."""
    monkeypatch.setattr("minisgl.device.sampler.SAMPLE_BLOCK", block)
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0.8, top_p=0.9)] * 3
    want = sampler_with(*params).sample(logits, list(range(6)), [5, 9, 12, 3, 40, 8]).tokens
    shift = torch.tensor([0, 3, 1, 0, 7, 2])
    got = sampler_with(*params).sample(logits, list(range(6)), [5, 6, 11, 3, 33, 6], shift=shift).tokens
    assert torch.equal(got, want)


def test_seed_makes_draws_independent_of_batch():
    logits = torch.randn(4, V)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = sampler_with(seeded).sample(logits[2:3], [0], [17]).tokens
    crowd = sampler_with(SamplingParams(temperature=0.5), SamplingParams(), seeded, SamplingParams(top_p=0.5))
    together = crowd.sample(logits, [0, 1, 2, 3], [3, 9, 17, 4]).tokens
    assert together[2] == alone[0]
    other_seed = sampler_with(SamplingParams(temperature=1.0, seed=99))
    runs = [draw(sampler_with(seeded), logits[2], 0, 30), draw(other_seed, logits[2], 0, 30)]
    assert runs[0] == draw(sampler_with(seeded), logits[2], 0, 30)
    assert runs[0] != runs[1]


def test_per_request_parameters_in_one_batch():
    logits = torch.randn(3, V)
    s = sampler_with(SamplingParams(temperature=0.0), SamplingParams(top_k=2, seed=5), SamplingParams(temperature=0.0))
    for pos in range(50):
        out = s.sample(logits, [0, 1, 2], [pos] * 3).tokens
        assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
        assert out[1] in logits[1].topk(2).indices


def test_penalties_follow_their_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0] + [-5.0] * (V - 4)])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    s = sampler_with(params, prompts={0: [1]}, outputs={0: [0, 0, 2]})
    got = s._apply_penalties(logits.clone(), torch.tensor([0]))[0]
    expected = logits[0].clone()
    expected[0] = 2.0 / 2 - 0.5 * 2 - 0.25  # seen, positive, output twice
    expected[1] = -1.0 * 2  # seen in the prompt, negative
    expected[2] = 0.5 / 2 - 0.5 - 0.25
    torch.testing.assert_close(got, expected)
    # Penalties steer greedy choice away from repeated tokens and record new outputs.
    first = s.sample(logits, [0], [4]).tokens.item()
    assert first == 3
    assert s.out_counts[0, 3] == 1 and s.seen[0, 3]


def test_logprobs_and_top_logprobs():
    logits = torch.randn(2, V)
    s = Sampler(max_slots=4, vocab_size=V, device=torch.device("cpu"))
    s.set_request(0, SamplingParams(temperature=0.0), [], [], seed=0, top_logprobs=3)
    s.set_request(1, SamplingParams(temperature=0.7, seed=1), [], [], seed=0, top_logprobs=0)
    out = s.sample(logits, [0, 1], [1, 1])
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.tokens[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs[0], ref[0].topk(3).values)
    assert out.top_ids[0, 0] == out.tokens[0]


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 3.0),
        ("presence_penalty", -2.5),
        ("max_new_tokens", -1),
        ("seed", -1),
    ],
)
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()
    SamplingParams().validate()


def test_noise_is_never_zero_so_filtered_tokens_never_win():
    """uniform = 1.0 made the noise -0.0 and a zero-probability token score NaN (argmax picks
    it): at a 152k vocabulary about 1% of rows. Checked over 76M noise values."""
    vocab = 152_064
    for chunk in range(10):
        seeds = torch.arange(chunk * 50, (chunk + 1) * 50, dtype=torch.int64) * 7919 + 3
        noise = exponential_noise(seeds, torch.full_like(seeds, chunk + 11), vocab)
        assert bool((noise > 0).all()) and bool(noise.isfinite().all())


def test_filtered_tokens_are_never_sampled_over_two_million_draws():
    vocab, rows = 256, 8192
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab) * 4
    params = [
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.3),
        SamplingParams(min_p=0.5),
        SamplingParams(temperature=0.05),
    ]
    s = Sampler(max_slots=rows, vocab_size=vocab, device=torch.device("cpu"))
    for slot in range(rows):
        s.set_request(slot, params[slot % 4], [], [], seed=slot)
    probs = logits.softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    for kind in range(4):
        r = torch.arange(kind, rows, 4)
        if kind == 0:
            keep = torch.zeros(len(r), vocab, dtype=torch.bool)
            keep[:, :5] = True
        elif kind == 1:
            keep = (sorted_p[r].cumsum(-1) - sorted_p[r]) < 0.3
        elif kind == 2:
            keep = sorted_p[r] >= 0.5 * sorted_p[r, :1]
        else:  # temperature 0.05: whatever has nonzero probability after scaling
            keep = (logits[r] / 0.05).softmax(-1).gather(1, order[r]) > 0
        allowed[r] = torch.zeros_like(keep).scatter_(1, order[r], keep)
    slots = list(range(rows))
    for step in range(250):  # two million draws
        tokens = s.sample(logits, slots, [step] * rows).tokens
        assert bool(allowed[torch.arange(rows), tokens].all()), f"a filtered token was sampled at step {step}"


def test_top_p_one_keeps_every_token_in_a_truncating_batch():
    """float32 cumsum passes 1.0 before the tail of a 152k vocabulary; a top_p = 1 row must keep
    its tail even when another row of the batch truncates."""
    torch.manual_seed(0)
    probs = (torch.randn(2, 152_064) * 3).softmax(-1)
    out = Sampler._top_k_top_p(probs, torch.tensor([152_064, 152_064]), torch.tensor([1.0, 0.5]))
    assert torch.equal(out[0], probs[0])
    assert (out[1] == 0).any()


def test_seeded_top_p_one_is_the_same_alone_and_in_a_mixed_batch():
    vocab = 152_064
    torch.manual_seed(1)
    logits = torch.randn(3, vocab) * 3
    seeded = SamplingParams(top_p=1.0, seed=77)
    mates = [SamplingParams(top_p=0.5, seed=1), SamplingParams(top_k=10, min_p=0.1)]
    s_alone = Sampler(max_slots=3, vocab_size=vocab, device=torch.device("cpu"))
    s_alone.set_request(0, seeded, [], [], seed=0)
    s_mixed = Sampler(max_slots=3, vocab_size=vocab, device=torch.device("cpu"))
    for slot, p in enumerate([mates[0], seeded, mates[1]]):
        s_mixed.set_request(slot, p, [], [], seed=slot)
    for pos in range(40):
        alone = s_alone.sample(logits[1:2], [0], [pos]).tokens[0]
        mixed = s_mixed.sample(logits, [0, 1, 2], [pos, pos, pos]).tokens[1]
        assert alone == mixed, pos


def race_check(device: str) -> None:
    """The fused sampling kernel picks what the torch path picks: for a temperature row the
    argmax of softmax(logits / T) / noise on the same noise, for a greedy row the argmax; each
    row reads its slot's parameters (strided tables) at its position plus its shift."""
    from minisgl.device.kernels.sample import race_sample

    gen = torch.Generator().manual_seed(0)
    rows, vocab = (96, 50_000) if device == "cuda" else (6, 3000)  # the interpreter is slow
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(device)
    logits[1, 17] = float("-inf")  # banned or masked tokens never win
    slots_n = 2 * rows
    table_f = torch.rand(slots_n, 6, generator=gen) + 0.3  # temperature in column 0, as Sampler keeps it
    table_i = torch.randint(0, 2**62, (slots_n, 3), generator=gen)  # seed in column 1, greedy flag in 2
    table_i[:, 2] = torch.arange(slots_n) % 3 == 0
    table_f, table_i = table_f.to(device), table_i.to(device)
    slots = torch.randperm(slots_n, generator=gen)[:rows]
    positions = torch.arange(rows) * 7 + 3
    shift = torch.randint(0, 9, (rows,), generator=gen)
    temps, seeds, greedy = table_f[:, 0], table_i[:, 1], table_i[:, 2]
    s_d = slots.to(device)

    def reference(at: torch.Tensor) -> torch.Tensor:  # the torch path's tokens at positions ``at``
        drawn = torch.softmax(logits / temps[s_d][:, None], dim=-1) / exponential_noise(seeds[s_d], at, vocab)
        return torch.where(greedy[s_d].bool(), logits.argmax(-1), drawn.argmax(-1))

    assert greedy[s_d].any() and not greedy[s_d].all()
    rows_t = torch.stack([slots, positions]).to(device)
    got = race_sample(logits, rows_t, shift.to(device), temps, seeds, greedy)
    assert torch.equal(got, reference((positions + shift).to(device)))
    assert torch.equal(race_sample(logits, rows_t, None, temps, seeds, greedy), reference(positions.to(device)))
    half = logits.to(torch.bfloat16)  # 16-bit logits are read as they are (their float32 values)
    assert torch.equal(
        race_sample(half, rows_t, shift.to(device), temps, seeds, greedy),
        race_sample(half.float(), rows_t, shift.to(device), temps, seeds, greedy),
    )


@pytest.mark.cuda
def test_race_sampling_kernel_matches_torch_on_cuda():
    race_check("cuda")


def test_race_sampling_kernel_under_the_interpreter():
    """The kernel's logic (the hash, the race, ties) on CPU: Triton's interpreter must be on
    before triton loads, so it runs in a child process."""
    run_interpreted("from tests.test_sampling import race_check; race_check('cpu')", timeout=600)
