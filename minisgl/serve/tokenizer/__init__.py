"""Tokenizer side of the server: loading the checkpoint's tokenizer, incremental detokenization,
stop strings, and the tokenizer process itself."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from minisgl.checkpoint.model_config import ModelConfig

logger = logging.getLogger(__name__)


def read_chat_template(template: str) -> str:
    """``--chat-template``: a Jinja file, or the template text itself."""
    if "{%" in template or "{{" in template:
        return template
    path = Path(template).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--chat-template {template!r} is neither a file nor a Jinja template")
    return path.read_text()


def load_tokenizer(path: str | Path, chat_template: str | None = None) -> Any:
    """The checkpoint's Hugging Face tokenizer (with ``chat_template`` in place of its own), or
    None when the folder has none (dummy configs)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        logger.warning("no usable tokenizer at %s (%s): only token-id prompts will work", path, type(e).__name__)
        return None
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def _file_eos_id(folder: Path) -> int | None:
    """The tokenizer's EOS id from tokenizer_config.json and tokenizer.json, read as files: the
    scheduler process needs only this, and loading a tokenizer through transformers costs a
    process some 350 MB (it imports torch)."""
    try:
        eos = json.loads((folder / "tokenizer_config.json").read_text()).get("eos_token")
        vocab = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return None
    for added in vocab.get("added_tokens", []):
        if added.get("content") == eos:
            return added["id"]
    model_vocab = (vocab.get("model") or {}).get("vocab")
    return model_vocab.get(eos) if isinstance(model_vocab, dict) else None


def eos_ids(
    model_dir: str | Path, tokenizer: Any = None, tokenizer_dir: str | Path | None = None, overrides: dict | None = None
) -> list[int]:
    """EOS ids from config.json (with --json-model-override-args), generation_config.json and
    the tokenizer (a loaded one, or ``tokenizer_dir``'s files read without loading it), merged."""
    model_dir = Path(model_dir)
    ids = set(ModelConfig.from_path(model_dir, overrides).eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    if tokenizer is None and tokenizer_dir is not None:
        eos = _file_eos_id(Path(tokenizer_dir))
        if eos is not None:
            return sorted(ids | {eos})
        tokenizer = load_tokenizer(tokenizer_dir)  # a hub id, or files this reader does not know
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
