"""Offline API: ``LLM(model, **engine_args).generate(prompts, sampling_params)`` in one process."""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path
from typing import Any

import msgspec

from minisgl.config.args import EngineArgs
from minisgl.device.worker.model_runner import ModelRunner
from minisgl.serve.parsers.reasoning import CLOSE as THINK_CLOSE
from minisgl.serve.parsers.reasoning import OPEN as THINK_OPEN
from minisgl.serve.scheduler.control import ControlError
from minisgl.serve.scheduler.grammar import GrammarBackend
from minisgl.serve.scheduler.output import prompt_scores
from minisgl.serve.scheduler.request import Req
from minisgl.serve.scheduler.scheduler import Scheduler
from minisgl.serve.tokenizer import eos_ids, load_tokenizer
from minisgl.serve.tokenizer.chat import encode_chat
from minisgl.serve.tokenizer.detokenizer import StopRegexTooSlow, TextStream, decode_ids
from minisgl.serve.workers import WorkerGroup
from minisgl.utils import hidden_state_rows
from minisgl.wire.control import (
    LoadLora,
    LoadWeights,
    LocalLora,
    LocalTensors,
    MemoryOccupation,
    ReadWeights,
    TensorWeights,
)
from minisgl.wire.options import RequestOptions
from minisgl.wire.sampling import SamplingParams
from minisgl.wire.steps import WorkerTask

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, **engine_args: Any):
        self.args = EngineArgs(model=model, **engine_args)
        if self.args.nnodes != 1:
            raise ValueError("the offline API runs on one host; serve with minisgl.launch to span hosts")
        # One process holds one tensor-parallel rank: with more, they run in worker processes
        # of this one's, driven as the server's scheduler drives its workers.
        self.runner: ModelRunner | WorkerGroup = (
            ModelRunner(self.args) if self.args.tp_size == 1 else WorkerGroup(self.args)
        )
        self.tokenizer = load_tokenizer(self.args.tokenizer or str(self.runner.model_dir), self.args.chat_template)
        self.eos_ids = eos_ids(self.runner.model_dir, self.tokenizer, overrides=self.args.model_overrides())
        self.grammar = GrammarBackend(lambda: self.tokenizer, self.runner.vocab_size, self.eos_ids)
        self.reset_scheduler()

    @property
    def _on_gpu(self) -> bool:
        runner = self.runner
        return runner.device.type == "cuda" if isinstance(runner, ModelRunner) else runner.on_gpu

    def reset_scheduler(self, disable_radix_cache: bool | None = None) -> None:
        """A fresh scheduler (empty prefix cache) over the same model and KV pool, optionally
        switching the radix cache on or off; used to compare both in one process."""
        if disable_radix_cache is not None:
            self.args.disable_radix_cache = disable_radix_cache
        old = getattr(self, "scheduler", None)
        while old is not None and old.has_work:  # (its steps still in flight)
            old.step()
        self.scheduler = Scheduler(
            self.args,
            self.runner.num_pages,
            self.runner.context_len,
            self.runner.vocab_size,
            self.eos_ids,
            self.runner,
            self.grammar,
            self.runner.num_host_pages,
            self.runner.storage_fingerprint,
            self.runner.kv_bytes_per_page,
            on_gpu=self._on_gpu,
            loras=old.loras if old is not None else None,  # (the workers keep the adapters)
            snapshot_rows=self.runner.snapshot_rows,
        )

    # ---- the RL control plane, under SGLang's Engine method names -------------------------------

    def _task(self, task: WorkerTask | LocalTensors, flush_cache: bool = True) -> tuple[bool, str]:
        try:
            reply = self.scheduler.control.run_task(task, flush_cache)
        except ControlError as e:
            return False, str(e)
        return reply.ok, reply.message

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        """Load a checkpoint of the same architecture into the live weights; (success, message).
        A local path (``~`` expanded), or the served model's own name."""
        if model_path != self.args.model:
            model_path = str(Path(model_path).expanduser().absolute())
        return self._task(LoadWeights(model_path, load_format or "auto"), flush_cache)

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, Any]], load_format: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        """Load (name, full tensor) pairs, any subset of the weights; (success, message)."""
        if isinstance(self.runner, ModelRunner):  # this process holds the weights: no handles to pass
            return self._task(LocalTensors(list(named_tensors)), flush_cache)
        from minisgl.device.worker.tensor_payload import encode_named_tensors

        payload = base64.b64decode(encode_named_tensors(named_tensors, load_format == "flattened_bucket"))
        return self._task(TensorWeights([payload] * self.args.tp_size, load_format or "direct"), flush_cache)

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> tuple[bool, str]:
        """Load a PEFT adapter under a name requests use (``enable_lora=True``); a ``pinned``
        one keeps a device slot for good; (success, message)."""
        try:
            reply = self.scheduler.control.load_lora(lora_name, lora_path, pinned)
        except ControlError as e:
            return False, str(e)
        return reply.ok, reply.message

    def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        tensors: dict[str, Any] | list[tuple[str, Any]],
        config_dict: dict[str, Any],
        load_format: str | None = None,
        pinned: bool = False,
    ) -> tuple[bool, str]:
        """Load an adapter a trainer holds in memory: PEFT's tensor names (``lora_A`` and
        ``lora_B`` weights) and its adapter_config.json fields (r, lora_alpha, ...), SGLang's
        Engine method; (success, message)."""
        named = dict(tensors)
        if isinstance(self.runner, ModelRunner):  # this process holds the model: no handles to pass
            task: LoadLora | LocalLora = LocalLora("", named, dict(config_dict))
        else:
            from minisgl.device.worker.tensor_payload import encode_named_tensors

            payload = base64.b64decode(encode_named_tensors(named.items(), load_format == "flattened_bucket"))
            task = LoadLora("", "", payload, json.dumps(config_dict), load_format or "direct")
        try:
            reply = self.scheduler.control.load_lora(lora_name, "", pinned, task)
        except ControlError as e:
            return False, str(e)
        return reply.ok, reply.message

    def unload_lora_adapter(self, lora_name: str) -> tuple[bool, str]:
        try:
            self.scheduler.control.unload_lora(lora_name)
        except ControlError as e:
            return False, str(e)
        return True, f"unloaded LoRA adapter {lora_name!r}"

    def release_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        """Give the device memory of ``tags`` (weights, kv_cache, cuda_graph; default all) back."""
        return self._task(MemoryOccupation(True) if tags is None else MemoryOccupation(True, tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        return self._task(MemoryOccupation(False) if tags is None else MemoryOccupation(False, tags))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first ``truncate_size`` rows of checkpoint tensor ``name`` as served now (nested
        lists of floats; fp8 weights dequantized), as SGLang's Engine returns them. ValueError
        for a name that is no weight of the model."""
        try:
            reply = self.scheduler.control.run_task(ReadWeights(name, truncate_size))
        except ControlError as e:
            raise ValueError(str(e)) from None
        if not reply.ok:
            raise ValueError(reply.message)
        return reply.values

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def pause_generation(self, mode: str = "abort") -> None:
        """Hold generation (``generate`` refuses to run until ``continue_generation``)."""
        self.scheduler.control.pause(mode)

    def continue_generation(self) -> None:
        self.scheduler.control.resume()

    def _think_markers(self, budget: int | None) -> list[list[int]]:
        """The reasoning markers' ids a thinking budget needs (none without a budget)."""
        if budget is None:
            return []
        return [self._encode(THINK_OPEN, special=False), self._encode(THINK_CLOSE, special=False)]

    def _encode(self, prompt: Prompt, special: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids instead of text")
            return self.tokenizer.encode(prompt, add_special_tokens=special)
        return list(prompt)

    def _result(self, req: Req, text: str | None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            # where the cached prompt tokens came from (SGLang's cached_tokens_details)
            "cached_tokens_details": {
                "device": req.cached_tokens - req.host_cached_tokens,
                "host": req.host_cached_tokens,
            },
            "finish_reason": req.finish_reason,
        }
        if req.error is not None:  # ended by an error (its grammar rejected a sampled token)
            meta["error"] = req.error
        if req.routed_from >= 0:
            meta["routed_experts"] = base64.b64encode(req.routed_experts()).decode()
        if req.options.hidden_states:
            meta["hidden_states"] = hidden_state_rows(req.hidden_states(), self.runner.hidden_size, len(req.prompt_ids))
        if req.options.entropy:
            meta["output_token_entropy"] = req.output_entropy
        if req.options.top_logprobs >= 0:
            meta["output_token_logprobs"] = req.output_logprobs
            if req.options.top_logprobs > 0:
                meta["output_top_logprobs"] = req.output_top_logprobs
        if req.logprob_start >= 0:  # position j's logprob given the tokens before it (None at 0)
            first, scores = prompt_scores(req) if req.scores_prompt else (max(req.logprob_start, 1), [])
            meta["input_token_logprobs"] = [None] * (first - req.logprob_start) + [lp for lp, _, _ in scores]
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | dict | list[SamplingParams | dict] | None = None,
        top_logprobs: int = -1,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[dict[str, Any]]:
        """``generate`` for conversations (one, or a list of them) through the checkpoint's chat
        template, as the server's /v1/chat/completions renders them (``tools``: OpenAI tool
        definitions shown to the model; its calls come back as text; ``continue_final_message``:
        the last message, an assistant's start, is continued rather than answered)."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template; use generate()")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            encode_chat(self.tokenizer, c, tools, chat_template_kwargs, continue_final=continue_final_message)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, top_logprobs)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | dict | list[SamplingParams | dict] | None = None,
        top_logprobs: int = -1,
        logprob_start: int = -1,
        cache_salt: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start: int = 0,
        predictions: list[Prompt | None] | None = None,
        return_hidden_states: bool = False,
        lora_path: str | list[str | None] | None = None,
        return_entropy: bool = False,
        max_thinking_tokens: int | None = None,
    ) -> list[dict[str, Any]]:
        """Generate for every prompt (text or token ids); results come back in prompt order.

        ``top_logprobs``: -1 for none, 0 for the chosen token's log-probability, n for the n
        most likely tokens as well. ``logprob_start`` >= 0: also the prompt's logprobs from
        that position on (``input_token_logprobs``). ``cache_salt``: these prompts share cached
        prefixes only with others of the same salt (the server's ``cache_salt`` / ``extra_key``).
        ``return_routed_experts`` (MoE, ``enable_return_routed_experts=True``): the expert ids per
        layer of each position from ``routed_experts_start`` on in ``meta_info["routed_experts"]``,
        as the server sends them (``utils.routed_experts_array`` decodes them).
        ``predictions``: per prompt, text (or ids) its answer will largely repeat (OpenAI's
        predicted output): drafts under ``speculative_algorithm="NGRAM"``, no result changes.
        ``return_hidden_states`` (``enable_return_hidden_states=True``): the last hidden state of
        every prompt position and every output token but the last in
        ``meta_info["hidden_states"]`` (the prompt's rows as one list, then one row per token).
        ``lora_path`` (``enable_lora=True``): the name of a loaded LoRA adapter for every prompt,
        or one per prompt (None: the base model). ``return_entropy``: each output token's
        distribution's entropy in ``meta_info["output_token_entropy"]`` (SGLang's return_entropy).
        ``max_thinking_tokens``: a reasoning model thinks (inside ``<think>``, open in the prompt or
        opened by the model) at most that many tokens before ``</think>`` is forced.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        predictions = predictions if predictions is not None else [None] * len(prompts)
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * len(prompts)
        for name, values in (("sampling_params", params), ("predictions", predictions), ("lora_path entries", loras)):
            if len(values) != len(prompts):
                raise ValueError(f"{len(values)} {name} for {len(prompts)} prompts")
        params = [p if isinstance(p, SamplingParams) else msgspec.convert(p or {}, SamplingParams) for p in params]
        if self.scheduler.held:
            raise ValueError(
                "generation is paused or its memory released: continue_generation / resume_memory_occupation first"
            )
        self.scheduler.take_events()  # (those of earlier calls)
        if max_thinking_tokens is not None and max_thinking_tokens < 0:
            raise ValueError("max_thinking_tokens must be >= 0")
        options = RequestOptions(
            top_logprobs=top_logprobs,
            logprob_start=logprob_start,
            cache_salt=cache_salt,
            routed_start=routed_experts_start if return_routed_experts else -1,
            hidden_states=return_hidden_states,
            entropy=return_entropy,
            think_budget=-1 if max_thinking_tokens is None else max_thinking_tokens,
            think_markers=self._think_markers(max_thinking_tokens),
        )
        reqs = self._queue(prompts, params, predictions, loras, options)
        texts = self._run(reqs)
        return [self._result(r, self._text(r, texts)) for r in reqs]

    def _queue(
        self, prompts: list, params: list[SamplingParams], predictions: list, loras: list, options: RequestOptions
    ) -> list[Req]:
        """Every prompt queued with its own copy of ``options``; all or nothing: a bad prompt
        leaves no queued work behind."""
        reqs: list[Req] = []
        try:
            for prompt, sp, predicted, lora in zip(prompts, params, predictions, loras):
                predicted_ids = (
                    self._encode(predicted, special=False)[: self.scheduler.context_len] if predicted else []
                )
                opts = msgspec.structs.replace(options, lora=lora, prediction_ids=predicted_ids)
                reqs.append(self.scheduler.add_request(self._encode(prompt), sp, opts))
        except ValueError:
            for req in reqs:
                self.scheduler.finish(req, "abort")
            raise
        return reqs

    def _run(self, reqs: list[Req]) -> dict[int, list[str]]:
        """Step the scheduler until ``reqs`` are done; returns the text pieces of those with stop
        strings, which are detokenized as they go so that a stop can end them (the others' text is
        decoded once at the end)."""
        streams = {}
        if self.tokenizer is not None:
            streams = {
                r.rid: TextStream.of(self.tokenizer, r.params)
                for r in reqs
                if r.params.stop_strings or r.params.stop_regexes
            }
        texts: dict[int, list[str]] = {rid: [] for rid in streams}
        # Done once every request is: host-tier copies still running are collected by the next
        # call's first step (the results do not wait for a cache's background copies).
        while self.scheduler.has_work and not self.scheduler.settled:
            if self.scheduler.only_compiling:
                self.scheduler.wait_compiled(timeout=1.0)
            events = self.scheduler.step()
            failed = [req for kind, req, _ in events if kind == "accepted" and req.error]
            if failed:
                for req in reqs:
                    self.scheduler.finish(req, "abort")
                while self.scheduler.has_work:  # let in-flight steps land before raising
                    self.scheduler.step()
                raise ValueError(failed[0].error)
            for kind, req, _ in events:
                if kind == "output" and req.rid in streams:
                    self._stream_text(req, streams, texts)
        return texts

    def _stream_text(self, req: Req, streams: dict, texts: dict[int, list[str]]) -> None:
        """The request's new text (``streams``' detokenizer), ending it at a stop string."""
        try:
            texts[req.rid].append(streams[req.rid].add(req.output_ids[-1:], req.finished))
        except StopRegexTooSlow as e:  # this request ends with the error, the others go on
            req.error = str(e)
            self.scheduler.finish(req, "abort")
            del streams[req.rid]
            return
        if streams[req.rid].stopped:
            # A stop string is a stop even when it ends on the last allowed token.
            if req.finished:
                req.finish_reason = "stop"
            self.scheduler.finish(req, "stop")

    def _text(self, req: Req, texts: dict[int, list[str]]) -> str | None:
        if self.tokenizer is None:
            return None
        if req.rid in texts:
            return "".join(texts[req.rid])
        p = req.params
        return decode_ids(self.tokenizer, req.output_ids, p.skip_special_tokens, p.spaces_between_special_tokens)
