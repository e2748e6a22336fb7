"""Batched sampling with per-request parameters kept on the device, indexed by request slot.

Parameters are written once when a request starts (``set_request``); each step only gathers
them by slot. Randomness comes from a counter-based hash of (seed, position, token id), so a
seeded request samples the same tokens whatever else is in its batch, on CPU and GPU alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minisgl.device import batch_invariant
from minisgl.wire.sampling import SamplingParams

_M32 = 0xFFFFFFFF
SAMPLE_BLOCK = 512  # rows sampled at once (see Sampler.sample)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_hash(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each row's 32-bit hash of (seed, position), which the noise of its tokens starts from."""
    return _mix32((seeds & _M32) ^ _mix32(((seeds >> 32) + positions * 0x9E3779B1) & _M32))


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, vocab]: argmax(p / noise) draws from p (the exponential-race trick)."""
    row = row_hash(seeds, positions)
    cols = torch.arange(vocab, device=seeds.device, dtype=torch.int64) * 0x632BE5AB
    bits = _mix32((row[:, None] + cols[None, :]) & _M32) >> 9  # 23 random bits
    # (bits + 0.5) / 2**23 is exact in float32 and lies in (0, 1): the noise is never 0, so a
    # token of probability 0 scores 0 and can never win (with 24 bits it could round to 1.0).
    uniform = (bits.float() + 0.5) * (1.0 / (1 << 23))
    return -torch.log(uniform)


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] log-probability of each chosen token
    entropy: torch.Tensor | None = None  # [B] entropy of each row's distribution (the logprobs')
    top_ids: torch.Tensor | None = None  # [B, n] most likely tokens
    top_logprobs: torch.Tensor | None = None  # [B, n]
    id_logprobs: torch.Tensor | None = None  # [B, len(id_union)]: logprobs of requested token ids
    id_union: list[int] | None = None  # every id some request of the batch asked for, sorted


class Sampler:
    def __init__(self, max_slots: int, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        # Per-slot parameters live in two tables, written on the host by ``set_request`` and
        # uploaded in one copy each before the next sample: a device write per field would be a
        # synchronous copy that stalls the host behind the step in flight.
        self._host_f = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0, 0.0]] * max_slots, dtype=torch.float32)
        self._host_i = torch.tensor([[vocab_size, 0, 1]] * max_slots, dtype=torch.int64)
        self._dev_f, self._dev_i = self._host_f.to(device), self._host_i.to(device)
        self._dirty: set[int] = set()
        self.temperature, self.top_p, self.min_p = self._dev_f[:, 0], self._dev_f[:, 1], self._dev_f[:, 2]
        self.rep_penalty, self.freq_penalty, self.pres_penalty = self._dev_f[:, 3], self._dev_f[:, 4], self._dev_f[:, 5]
        self.top_k, self.seed, self.greedy = self._dev_i[:, 0], self._dev_i[:, 1], self._dev_i[:, 2]
        # Host mirrors so each step can pick the cheapest path without reading the device
        # (numpy, so a step over thousands of slots checks them without a Python loop).
        self.h_greedy = np.ones(max_slots, dtype=bool)
        self.h_truncate = np.zeros(max_slots, dtype=bool)
        self.h_min_p = np.zeros(max_slots, dtype=bool)
        self.h_penalty = np.zeros(max_slots, dtype=bool)
        self.h_top_n = np.full(max_slots, -1, dtype=np.int64)  # -1: no logprobs, 0: chosen token only, n: plus top-n
        self.h_ids: list[list[int]] = [[] for _ in range(max_slots)]  # token ids whose logprobs it wants
        self.h_entropy = np.zeros(max_slots, dtype=bool)  # its distributions' entropies come back
        self.h_bias = np.zeros(max_slots, dtype=bool)
        self.h_min_len = np.zeros(max_slots, dtype=np.int64)  # sequence length below which the slot's ban applies
        self.h_plain = np.ones(max_slots, dtype=bool)  # greedy, and nothing asked of the logits but the argmax
        self.ban: torch.Tensor | None = None  # [max_slots, vocab] bool, made on first use
        self.bias: torch.Tensor | None = None  # [max_slots, vocab] float32 logit_bias, made on first use
        self.out_counts: torch.Tensor | None = None  # [max_slots, vocab] int32, made on first use
        self.seen: torch.Tensor | None = None  # [max_slots, vocab] bool: prompt or output tokens

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Copy a fresh host tensor without blocking the host (pinned first on CUDA)."""
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def set_request(
        self,
        slot: int,
        params: SamplingParams,
        prompt_ids: list[int],
        output_ids: list[int],
        seed: int,
        top_logprobs: int = -1,
        prompt_len: int = 0,
        ban_ids: list[int] | None = None,
        logprob_ids: list[int] | None = None,
        entropy: bool = False,
    ) -> None:
        """Install a request's parameters in ``slot``; ``seed`` is used when params.seed is None.
        ``ban_ids`` are never sampled before it has ``params.min_new_tokens`` tokens past its
        ``prompt_len``-token prompt; ``logprob_ids``' logprobs come with each sampled token, and
        with ``entropy`` the entropy of the distribution it was sampled from."""
        p = params
        self._host_f[slot] = torch.tensor(
            [
                p.temperature if p.temperature > 0 else 1.0,
                p.top_p,
                p.min_p,
                p.repetition_penalty,
                p.frequency_penalty,
                p.presence_penalty,
            ]
        )
        top_k = min(p.top_k, self.vocab_size) if p.top_k > 0 else self.vocab_size
        self._host_i[slot] = torch.tensor([top_k, p.seed if p.seed is not None else seed, int(p.is_greedy)])
        self._dirty.add(slot)
        self.h_greedy[slot] = p.is_greedy
        self.h_truncate[slot] = p.top_p < 1.0 or 0 < p.top_k < self.vocab_size
        self.h_min_p[slot] = p.min_p > 0.0
        self.h_top_n[slot] = top_logprobs
        self.h_ids[slot] = list(logprob_ids or [])
        self.h_entropy[slot] = entropy
        self.h_penalty[slot] = p.has_penalty
        if p.has_penalty:
            self._init_penalty(slot, prompt_ids, output_ids)
        self._set_ban(slot, ban_ids if p.min_new_tokens else None, prompt_len + p.min_new_tokens)
        self._set_bias(slot, p.logit_bias)
        self.h_plain[slot] = (
            p.is_greedy
            and not p.has_penalty
            and not p.logit_bias
            and not logprob_ids
            and top_logprobs < 0
            and not entropy
        )

    def _set_ban(self, slot: int, ban_ids: list[int] | None, until: int) -> None:
        """Tokens the slot may not sample before it holds ``until`` tokens (min_new_tokens)."""
        self.h_min_len[slot] = 0
        if not ban_ids:
            return
        if self.ban is None:
            self.ban = torch.zeros(self._dev_f.shape[0], self.vocab_size, dtype=torch.bool, device=self.device)
        self.ban[slot].zero_()
        self.ban[slot, self._to_device(torch.tensor(ban_ids, dtype=torch.int64))] = True
        self.h_min_len[slot] = until

    def _set_bias(self, slot: int, logit_bias: dict | None) -> None:
        """The slot's logit_bias row (cleared if its last request had one)."""
        if self.h_bias[slot]:
            self.bias[slot].zero_()
        self.h_bias[slot] = bool(logit_bias)
        if not logit_bias:
            return
        if self.bias is None:
            self.bias = torch.zeros(self._dev_f.shape[0], self.vocab_size, dtype=torch.float32, device=self.device)
        ids = torch.tensor([int(k) for k in logit_bias], dtype=torch.int64)
        self.bias[slot, self._to_device(ids)] = self._to_device(torch.tensor(list(logit_bias.values())))

    def _upload(self) -> None:
        if not self._dirty:
            return
        rows = torch.tensor(sorted(self._dirty), dtype=torch.int64)
        self._dirty.clear()
        rows_d = self._to_device(rows)
        self._dev_f[rows_d] = self._to_device(self._host_f[rows])
        self._dev_i[rows_d] = self._to_device(self._host_i[rows])

    def _init_penalty(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        if self.out_counts is None:
            n = self._dev_f.shape[0]
            self.out_counts = torch.zeros(n, self.vocab_size, dtype=torch.int32, device=self.device)
            self.seen = torch.zeros(n, self.vocab_size, dtype=torch.bool, device=self.device)
        self.out_counts[slot].zero_()
        self.seen[slot].zero_()
        # index_fill_ rather than ``seen[slot, ids] = True``: a Python value in an indexed
        # assignment is copied to the device synchronously.
        seen = self._to_device(torch.tensor(prompt_ids + output_ids, dtype=torch.int64))
        self.seen[slot].index_fill_(0, seen, True)
        out = self._to_device(torch.tensor(output_ids, dtype=torch.int64))
        self.out_counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def _apply_penalties(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Repetition (HF rule) over prompt+output; frequency and presence over output tokens."""
        counts = self.out_counts[slots].float()
        rep = self.rep_penalty[slots, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(self.seen[slots], penalized, logits)
        logits = logits - self.freq_penalty[slots, None] * counts
        return logits - self.pres_penalty[slots, None] * (counts > 0).float()

    def plain_greedy(self, slots: np.ndarray, seq_lens: np.ndarray) -> bool:
        """Whether the step's tokens are just the argmax of the raw logits (every request greedy,
        nothing asked of the logits but their argmax), so the caller may find it cheaper."""
        return bool(self.h_plain[slots].all() and (seq_lens >= self.h_min_len[slots]).all())

    def sample(
        self,
        logits: torch.Tensor,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        masks: tuple[list[int], torch.Tensor] | None = None,
        shift: torch.Tensor | None = None,
    ) -> SampleOutput:
        """logits [B, V] for requests in ``slots_list``; ``seq_lens`` give each one's position,
        plus ``shift`` (int64 [B] on the device) where only the device knows it (rows that grew
        there after the host planned them; the stop-token ban of min_new_tokens must not depend
        on it). ``masks`` (rows, int32 bit words [rows, ceil(V / 32)] on the host): those rows may only
        take the tokens whose bit is set (structured output). Batches larger than SAMPLE_BLOCK
        rows go in blocks: the float32 copies of [B, V] logits are what sampling's memory
        costs, and the pool is sized with one block's."""
        self._upload()
        slots, seq_lens = np.asarray(slots, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)
        if masks is None and self.plain_greedy(slots, seq_lens):
            return SampleOutput(tokens=logits.argmax(dim=-1))  # exact on 16-bit logits: no float copy
        top_n = int(self.h_top_n[slots].max())
        id_union = sorted({t for s in slots.tolist() for t in self.h_ids[s]})
        if len(slots) <= SAMPLE_BLOCK:
            return self._sample(logits, slots, seq_lens, masks, top_n, id_union, shift)
        parts = []
        for at in range(0, len(slots), SAMPLE_BLOCK):
            end = at + SAMPLE_BLOCK
            block_masks = None
            if masks is not None:
                keep = [i for i, r in enumerate(masks[0]) if at <= r < end]
                block_masks = ([masks[0][i] - at for i in keep], masks[1][keep]) if keep else None
            block_shift = None if shift is None else shift[at:end]
            parts.append(
                self._sample(logits[at:end], slots[at:end], seq_lens[at:end], block_masks, top_n, id_union, block_shift)
            )
        joined = SampleOutput(tokens=torch.cat([p.tokens for p in parts]), id_union=parts[0].id_union)
        for name in ("logprobs", "entropy", "top_ids", "top_logprobs", "id_logprobs"):
            if getattr(parts[0], name) is not None:
                setattr(joined, name, torch.cat([getattr(p, name) for p in parts]))
        return joined

    def _sample(
        self,
        logits: torch.Tensor,
        slots_np: np.ndarray,
        seq_lens: np.ndarray,
        masks: tuple[list[int], torch.Tensor] | None,
        top_n: int,
        id_union: list[int],
        shift: torch.Tensor | None = None,
    ) -> SampleOutput:
        penalized = bool(self.h_penalty[slots_np].any())
        all_greedy = bool(self.h_greedy[slots_np].all())
        biased = bool(self.h_bias[slots_np].any())
        banning = seq_lens < self.h_min_len[slots_np]
        truncating = bool(self.h_truncate[slots_np].any() or self.h_min_p[slots_np].any())
        entropy = bool(self.h_entropy[slots_np].any())
        if logits.is_cuda and not (
            masks or penalized or biased or banning.any() or truncating or top_n >= 0 or id_union or entropy
        ):
            # Nothing changes the logits and only tokens come back: one kernel takes the raw logits.
            return SampleOutput(tokens=self._race(logits, slots_np, seq_lens, shift))
        if masks is not None:
            logits = self._apply_masks(logits, *masks)
        slots = self._to_device(torch.from_numpy(slots_np))
        logits = logits.float()
        if biased:  # OpenAI's logit_bias: added to the logits before penalties and sampling
            logits = logits + self.bias[slots]
        if banning.any():  # min_new_tokens: EOS and stop tokens cannot come yet
            active = self._to_device(torch.from_numpy(banning))
            banned = logits.masked_fill(self.ban[slots] & active[:, None], float("-inf"))
            # ...unless a grammar allows nothing else (its output is complete): the grammar wins.
            logits = torch.where(banned.isfinite().any(dim=-1, keepdim=True), banned, logits) if masks else banned
        if penalized:
            logits = self._apply_penalties(logits, slots)
        if all_greedy:
            tokens = logits.argmax(dim=-1)
        elif logits.is_cuda and not truncating:  # (greedy rows too: the kernel takes their argmax)
            tokens = self._race(logits, slots_np, seq_lens, shift)
        else:
            sampled = self._sample_random(logits, slots, slots_np, seq_lens, shift)
            tokens = torch.where(self.greedy[slots].bool(), logits.argmax(dim=-1), sampled)
        out = SampleOutput(tokens=tokens)
        if top_n >= 0 or id_union or entropy:
            self._logprobs(out, logits, top_n, id_union, entropy)
        if penalized:
            self._record_outputs(slots, tokens, slots_np)
        return out

    def _logprobs(
        self, out: SampleOutput, logits: torch.Tensor, top_n: int, id_union: list[int], entropy: bool
    ) -> None:
        """The sampled tokens' logprobs into ``out``, and as asked the top ``top_n``, those of
        ``id_union`` and the entropy of the distribution they were sampled from."""
        logprobs = batch_invariant.log_softmax(logits)
        out.logprobs = logprobs.gather(1, out.tokens[:, None]).squeeze(1)
        if entropy:  # -sum p log p over the logprobs' distribution (masked tokens add 0)
            probs = logprobs.exp()
            out.entropy = -batch_invariant.rowwise(lambda p: torch.special.xlogy(p, p).sum(dim=-1), probs)
        if top_n > 0:
            out.top_logprobs, out.top_ids = logprobs.topk(top_n, dim=-1)
        if id_union:
            out.id_union = id_union
            out.id_logprobs = logprobs[:, self._to_device(torch.tensor(id_union, dtype=torch.int64))]

    def _apply_masks(self, logits: torch.Tensor, rows: list[int], words: torch.Tensor) -> torch.Tensor:
        vocab = logits.shape[-1]
        words = self._to_device(words)
        shifts = torch.arange(32, device=self.device, dtype=torch.int32)
        allowed = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
        rows_t = self._to_device(torch.tensor(rows, dtype=torch.int64))
        logits = logits.clone()
        logits[rows_t] = logits[rows_t].masked_fill(~allowed, float("-inf"))
        return logits

    def _sample_random(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        slots_np: np.ndarray,
        seq_lens: np.ndarray,
        shift: torch.Tensor | None = None,
    ) -> torch.Tensor:
        positions = self._to_device(torch.from_numpy(seq_lens))
        if shift is not None:
            positions = positions + shift
        probs = batch_invariant.softmax(logits / self.temperature[slots, None])
        if self.h_truncate[slots_np].any():
            probs = self._top_k_top_p(probs, self.top_k[slots], self.top_p[slots])
        if self.h_min_p[slots_np].any():
            floor = self.min_p[slots, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = exponential_noise(self.seed[slots], positions, probs.shape[-1])
        return (probs / noise).argmax(dim=-1)

    def _race(
        self, logits: torch.Tensor, slots_np: np.ndarray, seq_lens: np.ndarray, shift: torch.Tensor | None
    ) -> torch.Tensor:
        """Each row's token by the fused exponential race (``minisgl.device.kernels.sample``; CUDA):
        temperature rows draw, greedy rows take the argmax, slots and positions go up in one copy."""
        from minisgl.device.kernels.sample import race_sample

        rows = self._to_device(torch.from_numpy(np.stack([slots_np, seq_lens])))
        return race_sample(logits, rows, shift, self.temperature, self.seed, self.greedy)

    @staticmethod
    def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Zero every token outside the k most likely and outside the smallest set with mass >= p."""
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        # top_p = 1 keeps everything: the float32 cumsum can pass 1.0 before the tail, and a
        # row must not lose tokens because another row in its batch truncates.
        drop = (rank >= top_k[:, None]) | ((mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0))
        drop[:, 0] = False  # the most likely token always survives
        return torch.zeros_like(probs).scatter_(1, order, sorted_p.masked_fill(drop, 0.0))

    def _record_outputs(self, slots: torch.Tensor, tokens: torch.Tensor, slots_np: np.ndarray) -> None:
        keep_t = self._to_device(torch.from_numpy(np.flatnonzero(self.h_penalty[slots_np])))
        rows, toks = slots[keep_t], tokens[keep_t]
        self.out_counts[rows, toks] += 1
        self.seen.index_put_((rows, toks), torch.ones_like(toks, dtype=torch.bool))
