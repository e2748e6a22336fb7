"""Launch flags under SGLang's names, with SGLang's meaning."""

from __future__ import annotations

import random

import pytest

from minisgl.launch import parse_args
from minisgl.serve.tokenizer.chat import encode_chat
from minisgl.wire.sampling import SamplingParams
from tests.test_scheduler import make_llm


def test_sglang_flag_names():
    args = parse_args(
        [
            "--model-path",
            "m",
            "--tokenizer-path",
            "t",
            "--tensor-parallel-size",
            "1",
            "--random-seed",
            "7",
            "--trust-remote-code",
            "--revision",
            "main",
            "--enable-metrics",
            "--enable-cache-report",
            "--chunked-prefill-size",
            "-1",
            "--max-prefill-tokens",
            "4096",
            "--disable-cuda-graph",
            "--skip-server-warmup",
            "--log-requests",
            "--stream-interval",
            "1",
            "--log-level",
            "critical",
            "--chat-template",
            "tpl.jinja",
        ]
    )
    assert (args.model, args.tokenizer, args.tp_size, args.seed, args.revision) == ("m", "t", 1, 7, "main")
    assert (args.chunked_prefill_size, args.max_prefill_tokens, args.disable_cuda_graph) == (-1, 4096, True)
    assert args.log_requests and args.log_level == "critical" and args.chat_template == "tpl.jinja"
    args.validate()


def test_json_model_override_args_edit_the_models_config(tiny_llama):
    """SGLang's --json-model-override-args: merged into config.json (nested objects key by key),
    for the model, its EOS ids and weight updates alike; anything but a JSON object is refused
    by name."""
    args = parse_args(["--model", "m", "--json-model-override-args", '{"num_hidden_layers": 1}'])
    assert args.model_overrides() == {"num_hidden_layers": 1}
    # (dummy weights: a real checkpoint's extra layers would have no place in the cut model)
    overrides = '{"num_hidden_layers": 1, "eos_token_id": 7}'
    llm = make_llm(tiny_llama, json_model_override_args=overrides, load_format="dummy")
    assert llm.runner.config.num_layers == 1 and 7 in llm.eos_ids
    out = llm.generate([[5, 6, 8]], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    assert len(out[0]["output_ids"]) == 4
    for bad, why in (("[1]", "JSON object"), ("{1:", "not valid JSON"), ("[" * 100000, "characters")):
        with pytest.raises(ValueError, match=why):
            parse_args(["--model", "m", "--json-model-override-args", bad]).validate()


def test_rl_frameworks_launch_flags_place_the_gpus(capsys):
    """slime, verl and NeMo-RL launch with SGLang's GPU placement and memory saver flags: rank r
    of a host runs on GPU base + r * step; --dp-size places its replicas itself."""
    args = parse_args(["--model", "m", "--tp-size", "2", "--base-gpu-id", "2", "--gpu-id-step", "2"])
    assert [args.gpu_index(r) for r in range(2)] == [2, 4] and not args.enable_memory_saver
    assert parse_args(["--model", "m", "--enable-memory-saver"]).enable_memory_saver
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", "m", "--dp-size", "2", "--base-gpu-id", "1"])
    assert e.value.code == 2 and "CUDA_VISIBLE_DEVICES" in capsys.readouterr().err
    with pytest.raises(ValueError, match="base_gpu_id"):
        parse_args(["--model", "m", "--base-gpu-id", "-1"]).validate()


def test_bad_flag_values_are_refused_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", "m", "--stream-interval", "0"])
    assert e.value.code == 2 and "--stream-interval must be >= 1" in capsys.readouterr().err
    assert parse_args(["--model", "m", "--stream-interval", "4"]).stream_interval == 4


def test_chunking_flags(tiny_llama):
    """-1 prefills a prompt in one step; --max-prefill-tokens caps a step's prompt tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(300)] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    outs = {}
    for name, kw in {
        "whole": dict(chunked_prefill_size=-1),
        "capped": dict(max_prefill_tokens=64),
        "default": {},
    }.items():
        llm = make_llm(tiny_llama, page_size=4, **kw)
        steps, launch = [], llm.runner.launch
        llm.runner.launch = lambda batch, launch=launch: (steps.append(list(batch.new_lens)), launch(batch))
        outs[name] = [r["output_ids"] for r in llm.generate(prompts, params)]
        prefill = [s for s in steps if max(s) > 1]
        if name == "whole":
            assert prefill[0][0] == 300, prefill
        if name == "capped":
            assert all(sum(s) <= 64 for s in prefill) and len(prefill) >= 300 * 3 // 64, prefill
    assert outs["whole"] == outs["capped"] == outs["default"]


def test_chat_template_flag(tiny_llama, tmp_path):
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    for value in (template, str(tmp_path / "t.jinja")):
        (tmp_path / "t.jinja").write_text(template)
        llm = make_llm(tiny_llama, chat_template=value)
        assert encode_chat(llm.tokenizer, [{"role": "user", "content": "hi"}]) == llm.tokenizer.encode(
            "[hi]", add_special_tokens=False
        )
    with pytest.raises(FileNotFoundError):
        make_llm(tiny_llama, chat_template="no-such-template")


def test_min_new_tokens_bans_what_would_end_the_request(tiny_llama):
    """The stop token the model picks first cannot end it before min_new_tokens tokens; greedy
    elsewhere unchanged (the ban only masks those tokens)."""
    llm = make_llm(tiny_llama)
    prompt = "Hello world"
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))[0]["output_ids"]
    stop = free[0]
    ended = llm.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[stop]))[0]
    assert ended["output_ids"] == [stop]
    held = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[stop], min_new_tokens=3)
    )[0]["output_ids"]
    assert stop not in held[:3] and len(held) >= 3
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=2, min_new_tokens=5).validate()


def test_check_model_name_refuses_other_models_only_when_asked():
    from minisgl.config.args import ServerArgs
    from minisgl.serve.api.errors import BadRequest
    from minisgl.serve.api.openai import OpenAIRoutes

    routes = object.__new__(OpenAIRoutes)
    routes.args = ServerArgs(model="/models/tiny", served_model_name="tiny")
    routes.adapters = {"a1": "/adapters/a1"}
    routes._check_model("gpt-4")  # SGLang's behaviour: any name is served
    routes.args.check_model_name = True
    for name in ("tiny", "/models/tiny", "default", "a1", "tiny:a1"):  # a LoRA adapter, by its name or SGLang's
        routes._check_model(name)
    with pytest.raises(BadRequest, match="no LoRA adapter named 'a2'"):
        routes._check_model("tiny:a2")
    with pytest.raises(BadRequest, match="'gpt-4' does not exist"):
        routes._check_model("gpt-4")
    assert parse_args(["--model", "m", "--check-model-name"]).check_model_name


def test_sglang_spellings_of_backends_and_limits():
    args = parse_args(
        [
            "--model",
            "m",
            "--attention-backend",
            "torch_native",
            "--grammar-backend",
            "xgrammar",
            "--max-payload-size",
            "1000",
            "--schedule-policy",
            "random",
            "--kv-cache-dtype",
            "auto",
        ]
    )
    assert (args.attention_backend, args.max_request_bytes, args.schedule_policy) == ("torch", 1000, "random")
    args.validate()
    for flag, value in (("--grammar-backend", "outlines"), ("--attention-backend", "no-such")):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", flag, value])


def test_decode_log_interval_logs_every_n_decode_steps(caplog):
    """--decode-log-interval N: the stats line after every N decode steps, however little time passed."""
    import logging
    import types

    from minisgl.config.args import EngineArgs
    from minisgl.serve.scheduler.process import SchedulerProcess

    proc = object.__new__(SchedulerProcess)
    proc.args = EngineArgs(model="m", decode_log_interval=3)
    stats = dict(running_requests=1, queued_requests=0, kv_usage=0.5, total_pages=10, cache_hit_rate=0.25)
    proc.sched = types.SimpleNamespace(
        counters=types.SimpleNamespace(decode_steps=0), stats=lambda: stats, has_work=True
    )
    proc._last_log, proc._tokens_since_log, proc._logged_steps = 0.0, 0, 0
    lines = []
    with caplog.at_level(logging.INFO, logger="minisgl.serve.scheduler.process"):
        for step in range(1, 10):
            proc.sched.counters.decode_steps = step
            proc._maybe_log_stats()
            lines.append(sum("cache hit rate 25.0%" in r.message for r in caplog.records))
    assert lines == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert parse_args(["--model", "m", "--decode-log-interval", "40"]).decode_log_interval == 40


def test_a_slow_template_render_is_refused_and_the_server_stays_up(tiny_llama, tmp_path):
    """A template whose work a client's variable sets (n x n steps) stops at the render bound:
    a 400 naming it, and the tokenizer process serves the next request."""
    import time

    import httpx

    from minisgl.serve.tokenizer.chat import RENDER_TIMEOUT_S
    from tests.server_utils import running_server

    template = (
        "{% for i in range(n | default(1)) %}{% for j in range(n | default(1)) %}{% endfor %}{% endfor %}"
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    (tmp_path / "slow.jinja").write_text(template)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with running_server(tiny_llama, "--chat-template", str(tmp_path / "slow.jinja")) as srv:
        start = time.monotonic()
        r = httpx.post(
            f"{srv.url}/v1/chat/completions", json={**body, "chat_template_kwargs": {"n": 100000}}, timeout=120
        )
        assert r.status_code == 400 and "chat template took longer than" in r.text, r.text
        assert time.monotonic() - start < RENDER_TIMEOUT_S + 10
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text


def test_the_flags_page_is_generated_from_the_parser():
    """docs/flags.md is what scripts/flags_doc.py writes now, and names every flag of --help."""
    import re
    from pathlib import Path

    from scripts.flags_doc import DOC, render

    assert DOC.read_text() == render(), "docs/flags.md is stale: run python scripts/flags_doc.py"
    from minisgl.config.args import build_parser

    flags = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    documented = set(re.findall(r"`(--[a-z0-9-]+)`", Path(DOC).read_text()))
    assert flags - {"--help"} <= documented


def test_argument_errors_print_a_short_usage():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "minisgl.launch"], capture_output=True, text=True)
    assert out.returncode == 2 and "--model" in out.stderr
    assert len(out.stderr.strip().splitlines()) <= 3, out.stderr  # not every flag in the usage line


def test_a_folder_above_the_checkpoint_is_named_before_anything_starts(tmp_path):
    """``--model checkpoints/smollm2`` (the folder the README unzips into, the model one level down)."""
    import subprocess
    import sys

    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "config.json").write_text("{}")
    out = subprocess.run(
        [sys.executable, "-m", "minisgl.launch", "--model", str(tmp_path), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert f"did you mean {tmp_path / 'inner'}" in out.stderr and "Traceback" not in out.stderr


def test_a_wrong_type_names_its_field():
    import pytest

    from minisgl.serve.api.errors import BadRequest
    from minisgl.serve.api.fields import GENERATE
    from minisgl.serve.api.protocol import GenerateRequest, decode

    with pytest.raises(BadRequest) as e:
        decode(b'{"text": "x", "sampling_params": {"temperature": "hot"}}', GenerateRequest, GENERATE)
    assert e.value.param == "sampling_params.temperature"


def test_sglang_launch_flags_never_end_in_a_bare_argparse_error(capsys):
    """Every SGLang flag minisgl has no flag of its own for is mapped, ignored with a warning,
    or refused naming itself and the reason: never 'unrecognized arguments'."""
    from minisgl.config.sglang_flags import INERT, MANY, REFUSED, SWITCH

    def argv(flag: str, takes: int) -> list[str]:
        return ["--model", "m", flag] + ([] if takes == SWITCH else ["a", "b"] if takes == MANY else ["1"])

    for flag, (takes, why) in INERT.items():
        args = parse_args(argv(flag, takes))
        assert not any(k.startswith("sglang_") for k in vars(args)), flag
    for flag, (takes, why) in REFUSED.items():
        if flag == "--ep-size":
            parse_args(argv(flag, takes))  # one expert-parallel rank is what minisgl does
            with pytest.raises(SystemExit):
                parse_args(["--model", "m", "--ep-size", "2"])
        else:
            with pytest.raises(SystemExit) as e:
                parse_args(argv(flag, takes))
            assert e.value.code == 2
        err = capsys.readouterr().err
        assert "unrecognized" not in err and (flag == "--ep-size" or f"{flag}: {why}" in err), err
    assert parse_args(["--model", "m", "--cuda-graph-bs", "1", "8", "32"]).cuda_graph_max_bs == 32
    for backend in ("triton", "fa3"):  # SGLang's attention backends: minisgl's own choice
        assert parse_args(["--model", "m", "--attention-backend", backend]).attention_backend == "auto"


def test_sglang_lora_flags():
    """SGLang's LoRA flags: --lora-paths in its three forms turns LoRA on; its backend knobs are
    accepted and ignored; fewer loaded adapters than slots is refused by name."""
    from minisgl.config.args import parse_lora_paths

    args = parse_args(
        ["--model", "m", "--lora-paths", "a=/x/a", "/x/b", '{"lora_name": "c", "lora_path": "/x/c", "pinned": true}']
        + ["--max-loras-per-batch", "4", "--lora-backend", "csgmv", "--max-lora-rank", "32"]
    )
    assert args.lora_enabled and not args.enable_lora and args.max_loras_per_batch == 4 and args.max_lora_rank == 32
    assert parse_lora_paths(args.lora_paths) == [("a", "/x/a", False), ("/x/b", "/x/b", False), ("c", "/x/c", True)]
    for bad, why in (
        (["--lora-paths", "a=/x", "a=/y"], "names an adapter twice"),
        (["--lora-paths", '{"lora_name": "a"}'], "lora_name and lora_path"),
        (["--enable-lora", "--lora-target-modules", "q_proj", "lm_head"], "lm_head"),
        (["--enable-lora", "--max-loras-per-batch", "4", "--max-loaded-loras", "3"], "max-loaded-loras"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_args(["--model", "m", *bad]).validate()


def test_an_abbreviated_flag_is_refused_not_guessed(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", "m", "--served-model-nam", "x"])
    assert e.value.code == 2 and "--served-model-nam" in capsys.readouterr().err
