"""Write an FP8 copy of a local float checkpoint, laid out as the common FP8 checkpoints are.

    python scripts/quantize_checkpoint.py SRC DST --format compressed-tensors   # "-FP8-dynamic"
    python scripts/quantize_checkpoint.py SRC DST --format block                 # Qwen3 "-FP8"

compressed-tensors: each decoder linear weight in float8_e4m3fn with ``weight_scale`` [N, 1]
(float32, one per output channel), dynamic per-token activations, lm_head left out, as
llm-compressor's FP8_DYNAMIC scheme writes them. block: ``weight`` fp8 and ``weight_scale_inv``
[ceil(N / 128), ceil(K / 128)] (a multiplier per 128 x 128 tile), ``quant_method: fp8``,
dynamic activations. Embeddings, norms and the LM head stay in the source dtype. With
``--kv-scale`` each layer also gets ``self_attn.k_scale`` and ``v_scale`` (per-tensor KV cache
scales). No hub is reachable here: this makes the test checkpoints of both formats from the tiny
models and SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minisgl.device.layers.quantization import quantize_blocks, quantize_torch
from minisgl.device.models.loader import iter_weights

LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
LAYER = re.compile(r"layers\.(\d+)\.")
BLOCK = 128


def quantization_config(fmt: str) -> dict:
    if fmt == "block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
        }
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**fp8, "strategy": "channel", "dynamic": False, "observer": "minmax"},
                "input_activations": {**fp8, "strategy": "token", "dynamic": True, "observer": None},
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def convert(src: Path, dst: Path, fmt: str, kv_scale: float | None = None) -> Path:
    """Quantize ``src``'s decoder linear weights into ``dst`` (config, tokenizer files copied)."""
    dst.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    layers: set[int] = set()
    for name, tensor in iter_weights(src):
        if LINEAR.search(name) is None:
            out[name] = tensor.contiguous()
            continue
        layers.add(int(LAYER.search(name).group(1)))
        if fmt == "block":
            out[name], out[f"{name}_scale_inv"] = quantize_blocks(tensor, BLOCK)
        else:
            out[name], out[f"{name}_scale"] = quantize_torch(tensor)
    if kv_scale is not None:
        for i in sorted(layers):
            for kv in "kv":
                out[f"model.layers.{i}.self_attn.{kv}_scale"] = torch.tensor(kv_scale, dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="a float safetensors checkpoint folder")
    ap.add_argument("dst", type=Path)
    ap.add_argument("--format", choices=["compressed-tensors", "block"], default="compressed-tensors")
    ap.add_argument("--kv-scale", type=float, default=None, help="write this per-tensor K and V scale per layer")
    args = ap.parse_args()
    print(convert(args.src, args.dst, args.format, args.kv_scale))


if __name__ == "__main__":
    main()
