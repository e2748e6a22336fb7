"""RequestOptions, the one struct that carries a request's options from the route that parses its
body to the worker and back into meta_info: what /generate's fields become, that it survives the
wire unchanged, and the options that act in the API process itself (no_logs)."""

from __future__ import annotations

import logging

import msgspec

from minisgl.serve.api import base
from minisgl.serve.api.base import Run
from minisgl.serve.api.fields import GENERATE
from minisgl.serve.api.metrics import Metrics, RequestTimer
from minisgl.serve.api.protocol import GenerateRequest, decode
from minisgl.wire.options import RequestOptions
from minisgl.wire.requests import GenerateBatch, GenerateReq, ReqUpdate
from minisgl.wire.sampling import SamplingParams


def _options(body: bytes) -> list[RequestOptions]:
    return [item.options for item in decode(body, GenerateRequest, GENERATE).items()]


def test_generate_fields_become_options():
    (opts,) = _options(
        b'{"text": "x", "return_logprob": true, "top_logprobs_num": 2, "logprob_start_len": 1, '
        b'"token_ids_logprob": [3, 4], "return_text_in_logprobs": true, "return_entropy": true, '
        b'"return_prompt_token_ids": true, "extra_key": "k", "no_logs": true}'
    )
    assert opts == RequestOptions(
        top_logprobs=2,
        logprob_start=1,
        logprob_ids=[3, 4],
        text_in_logprobs=True,
        entropy=True,
        prompt_ids=True,
        cache_salt="k",
        no_logs=True,
    )
    # Logprob fields mean nothing without return_logprob; the defaults ask for nothing.
    (plain,) = _options(b'{"text": "x", "top_logprobs_num": 2, "token_ids_logprob": [3]}')
    assert plain == RequestOptions() and not plain.logprobs


def test_options_cross_the_wire_unchanged():
    opts = RequestOptions(top_logprobs=0, lora="a", think_budget=8, think_markers=[[1], [2]], no_logs=True)
    msg = GenerateBatch([GenerateReq("r", SamplingParams(), opts, text="hi")])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=GenerateBatch)
    assert back.reqs[0].options == opts
    # Only what differs from the defaults travels.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(RequestOptions())) == {}


class _Stream:
    rid = "r"


def _finish(options: RequestOptions, caplog) -> list[str]:
    metrics = Metrics()
    run = Run(_Stream(), ReqUpdate("r"), options, metrics, RequestTimer(metrics), log=True)
    with caplog.at_level(logging.INFO, logger=base.logger.name):
        caplog.clear()
        run.apply(ReqUpdate("r", text="ok", token_ids=[5], finish_reason="length", prompt_tokens=3))
    return [r.getMessage() for r in caplog.records]


def test_no_logs_keeps_a_request_out_of_the_request_log(caplog):
    assert any("request r: length" in line for line in _finish(RequestOptions(), caplog))
    assert _finish(RequestOptions(no_logs=True), caplog) == []
