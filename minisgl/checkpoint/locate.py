"""Where a checkpoint is: a local folder, a .gguf file (converted once into a cached folder), or
a hub id. Torch-free: the launcher checks ``--model`` before it starts any process."""

from __future__ import annotations

from pathlib import Path

from minisgl.checkpoint.gguf_file import converted_checkpoint, find_gguf

MAX_PATH_CHARS = 4096  # PATH_MAX on Linux: a longer path a client sends is refused unread
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def resolve_model_path(model: str, load_format: str = "auto", revision: str | None = None) -> Path:
    """A local folder is used as is; a .gguf file (or a folder holding one) is converted once
    into a cached folder; anything else that looks like ``org/name`` is fetched from the hub."""
    gguf = find_gguf(model) if load_format in ("auto", "gguf") else None
    if gguf is not None:
        return converted_checkpoint(gguf)
    if load_format == "gguf":
        raise FileNotFoundError(f"--load-format gguf: no .gguf file at {model!r}")
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(_not_a_checkpoint(path))
        return path
    if path.exists():
        raise ValueError(f"--model {model!r} is a file; pass the checkpoint folder or a .gguf file")
    # A hub id is org/name; a path that starts like one, or whose first part is a local folder
    # (checkpoints/x), is a missing folder, never sent to the hub.
    if model.startswith((".", "/", "~")) or model.count("/") != 1 or Path(model.split("/")[0]).is_dir():
        raise FileNotFoundError(f"model folder {model!r} does not exist and is not a hub id (org/name)")
    from huggingface_hub import snapshot_download

    patterns = HUB_PATTERNS if load_format != "dummy" else [p for p in HUB_PATTERNS if "safetensors" not in p]
    try:
        return Path(snapshot_download(model, allow_patterns=patterns, revision=revision))
    except Exception as e:  # offline, unknown repo, gated repo: all end here with the hub's reason
        raise FileNotFoundError(f"could not get {model!r} from the Hugging Face hub: {e}") from e


def client_checkpoint(path: str, load_format: str = "auto") -> Path:
    """A checkpoint a client names (a weight update; ``serve/api/client_paths.py`` checked the
    path): a folder with config.json or a .gguf file. Anything else gets one answer, whatever is
    or is not there, so that no answer tells a client what exists."""
    try:
        gguf = find_gguf(path) if load_format in ("auto", "gguf") else None
        if gguf is not None:
            return converted_checkpoint(gguf)
        folder = Path(path)
        if load_format != "gguf" and folder.is_dir() and (folder / "config.json").is_file():
            return folder
    except (OSError, ValueError):  # (a name too long, a loop of links, several .gguf files)
        pass
    raise FileNotFoundError(f"no checkpoint at {path[:300]!r} (a folder with config.json, or a .gguf file)")


def _not_a_checkpoint(folder: Path) -> str:
    """What to say of a folder with no config.json: the checkpoints one level down, if any."""
    inside = sorted(
        p for p in folder.iterdir() if p.is_dir() and ((p / "config.json").is_file() or any(p.glob("*.gguf")))
    )
    hint = f"; did you mean {' or '.join(str(p) for p in inside[:3])}?" if inside else ""
    return f"{folder} holds no config.json, .safetensors or .gguf checkpoint{hint}"
