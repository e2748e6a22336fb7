"""The real model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same file:
same logits, same greedy tokens, the chat template applied as apply_chat_template does, and
answers that stop at the end-of-turn token."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from minisgl.checkpoint.gguf_file import converted_checkpoint
from minisgl.llm import LLM
from minisgl.wire.sampling import SamplingParams
from tests.grammar_cases import EBNF, EBNF_REGEX, MAX_NEW, REGEXES, schemas
from tests.helpers import prefill_batch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors:",
    "1, 2, 3, 4,",
    "Translate to French: good morning",
    "Q: What is 12 * 12?\nA:",
    "The quick brown fox",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of Italy?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a fruit."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a fun fact about cats."},
    ],
]


@pytest.fixture(scope="module")
def hf(smollm2_gguf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=smollm2_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), dtype=torch.float32, **kw).eval()
    model.generation_config.eos_token_id = None  # run the full length, as ignore_eos does (no EOS masking)
    return model, AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), **kw)


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> LLM:
    return LLM(str(smollm2_gguf), device="cpu", max_total_tokens=16384, page_size=4)


def test_logits_equal_transformers(llm: LLM, hf):
    model, tok = hf
    prompts = [tok.encode(p) for p in PROMPTS]
    runner = llm.runner
    hidden_logits = runner.forward(prefill_batch(runner, prompts))
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(hidden_logits[i], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("radix", [True, False])
def test_greedy_tokens_equal_transformers(smollm2_gguf: Path, llm: LLM, hf, radix: bool):
    model, tok = hf
    texts = PROMPTS + [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHATS]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    engine = llm if radix else LLM(str(smollm2_gguf), device="cpu", max_total_tokens=16384, disable_radix_cache=True)
    got = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True))
    for ids, res in zip(prompts, got):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert res["output_ids"] == out[0, len(ids) :].tolist()
    engine.scheduler.check_integrity()


def test_chat_stops_at_end_of_turn_without_special_tokens(llm: LLM, hf):
    """The chat template as apply_chat_template renders it; the answer is transformers' answer,
    ends at <|im_end|> with finish_reason stop, and shows no special token."""
    model, tok = hf
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for chat in CHATS:
        res = llm.chat(chat, SamplingParams(temperature=0.0, max_new_tokens=200))[0]
        ids = tok.encode(
            tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), add_special_tokens=False
        )
        assert res["meta_info"]["prompt_tokens"] == len(ids)
        with torch.no_grad():
            want = model.generate(
                torch.tensor([ids]), max_new_tokens=200, do_sample=False, eos_token_id=end, pad_token_id=0
            )[0, len(ids) :].tolist()
        assert res["output_ids"] == want
        assert res["meta_info"]["finish_reason"] == "stop" and res["output_ids"][-1] == end
        assert "<|im_" not in res["text"] and res["text"].strip()


def test_conversion_is_cached(smollm2_gguf: Path, llm: LLM):
    folder = converted_checkpoint(smollm2_gguf)
    assert folder == llm.runner.model_dir and (folder / "tokenizer.json").is_file()
    assert (folder / "chat_template.jinja").is_file() or "chat_template" in (
        folder / "tokenizer_config.json"
    ).read_text()


def test_eos_ids_read_from_files_equal_the_loaded_tokenizers(smollm2_gguf: Path, llm: LLM, tiny_models):
    """The scheduler process reads EOS ids from the tokenizer's files (loading it would cost the
    process torch); they equal what the loaded tokenizer gives, here and on every tiny model."""
    from minisgl.serve.tokenizer import eos_ids, load_tokenizer

    for folder in [llm.runner.model_dir, *tiny_models.values()]:
        assert eos_ids(folder, tokenizer_dir=folder) == eos_ids(folder, load_tokenizer(folder))


def test_structured_output_on_the_real_model(llm: LLM):
    """50 JSON schemas of varied shape, every regex and an EBNF grammar, asked of the instruct
    model through its chat template: each answer ends by its grammar, parses and validates."""
    import jsonschema

    shapes = schemas(50, seed=11)
    chats = [
        [{"role": "user", "content": f"Give record {i} as JSON matching this schema: {json.dumps(s)}"}]
        for i, s in enumerate(shapes)
    ]
    chats += [[{"role": "user", "content": f"Give one example string matching {p}"}] for p in REGEXES]
    chats.append([{"role": "user", "content": "Greet someone in a few words."}])
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, json_schema=json.dumps(s)) for s in shapes]
    params += [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, regex=p) for p in REGEXES]
    params.append(SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ebnf=EBNF))
    results = llm.chat(chats, params)
    for res, sp in zip(results, params):
        assert res["meta_info"]["finish_reason"] == "stop", res
        if sp.json_schema is not None:
            jsonschema.validate(json.loads(res["text"]), json.loads(sp.json_schema))
        else:
            pattern = sp.regex if sp.regex is not None else EBNF_REGEX
            assert re.fullmatch(pattern, res["text"]), (pattern, res["text"])


def test_forced_tool_calls_on_the_real_model(llm: LLM):
    """tool_choice "required" as the server runs it: the tools described to the model (its
    template ignores them), the answer constrained to calls, read back by the parser."""
    import jsonschema

    from minisgl.serve.parsers.tool_calls import ToolCallParser, deltas, required_schema
    from tests.test_tool_calls import PARAMS, TOOLS

    asks = ["What is the weather in Oslo, in C?", "Add 2 and 5.", "Is it raining in Lima?"]
    schema = json.dumps(required_schema(TOOLS, parallel=False))
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, json_schema=schema)
    results = llm.chat([[{"role": "user", "content": a}] for a in asks], params, tools=TOOLS)
    for res in results:
        parser = ToolCallParser("array")
        content, calls = deltas(parser.feed(res["text"]) + parser.finish())
        assert res["meta_info"]["finish_reason"] == "stop" and content == "" and len(calls) == 1, res
        call = calls[0]["function"]
        jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])


def test_conversion_cache_is_keyed_by_content_and_drops_stale_folders(smollm2_gguf: Path, tmp_path: Path):
    """A copy of the file (new path, new mtime) finds the same folder, which then loads from the
    copy; folders made from an earlier content of the path, or by older versions without a
    source record, are removed; the folder holds no weights (they stay in the file) and an older
    version's float32 copy of them is deleted."""
    import shutil

    from minisgl.checkpoint.gguf_file import gguf_source
    from minisgl.device.models.loader import iter_weights

    cache = tmp_path / "cache"
    copy = tmp_path / "a" / smollm2_gguf.name
    copy.parent.mkdir()
    shutil.copy(smollm2_gguf, copy)
    stale = cache / f"{copy.stem}-0000000000000000"
    old_format = cache / f"{copy.stem}-1111111111111111"
    for folder in (stale, old_format):
        folder.mkdir(parents=True)
    (stale / "source.json").write_text(json.dumps({"path": str(copy.resolve()), "sha256": "0" * 64}))
    folder = converted_checkpoint(copy, cache)
    assert not stale.exists() and not old_format.exists() and gguf_source(folder) == copy.resolve()
    assert sum(f.stat().st_size for f in folder.iterdir()) < 8 << 20  # config and tokenizer only
    second = tmp_path / "b" / smollm2_gguf.name
    second.parent.mkdir()
    shutil.copy(smollm2_gguf, second)
    made = (folder / "config.json").stat().st_mtime_ns
    (folder / "model.safetensors").write_bytes(b"an older version's float32 weights")
    assert converted_checkpoint(second, cache) == folder
    assert (folder / "config.json").stat().st_mtime_ns == made  # not converted again
    assert gguf_source(folder) == second.resolve() and not (folder / "model.safetensors").exists()
    copy.unlink()  # the folder loads from where the file was last found
    name, tensor = next(iter(iter_weights(folder)))
    assert tensor.dtype == torch.float32 and tensor.numel() > 0
    second.unlink()
    with pytest.raises(FileNotFoundError, match="pass the .gguf file again"):
        next(iter(iter_weights(folder)))
