"""What a weight sync costs a running server, against restarting it (GPU).

Writes a bf16 safetensors checkpoint of random weights in a real shape, then measures:
- the disk's read rate (the files dropped from the page cache first);
- a server restart on that checkpoint (launch to ready, the baseline);
- /update_weights_from_disk of it into the running server (cold and warm page cache), GB/s;
- /update_weights_from_tensor from this process on the same GPU (CUDA IPC handles), per tensor
  and as one flattened bucket;
- /release_memory_occupation: the engine's GPU memory (nvidia-smi) before and after, the time
  to release and resume (CUDA graphs captured again), and whether the same prompts give the
  same tokens after resume.

    python benchmarks/weight_sync.py --model benchmarks/configs/llama3.1-8b --out results.json
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.server import start_server  # noqa: E402
from minisgl.device.worker.tensor_payload import BucketEntry, encode_named_tensors  # noqa: E402

SHARD_BYTES = 4 << 30


def hf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """A Llama-family checkpoint's tensor names and shapes."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        out[name] = t.fill_(1.0) if "norm" in name else t.normal_(0.0, 0.02, generator=gen)
    return out


def drop_from_page_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_checkpoint(folder: Path, config: dict, seed: int) -> list[Path]:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    weights = random_weights(hf_shapes(config), seed)
    shards, current, size = [], {}, 0
    for name, t in weights.items():
        current[name] = t.cpu()
        size += t.nbytes
        if size >= SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
    shards += [current] if current else []
    files, index = [], {}
    for k, shard in enumerate(shards):
        f = folder / f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(f))
        files.append(f)
        index.update({n: f.name for n in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return files


def read_rate(files: list[Path]) -> float:
    """GB/s reading the files from disk (dropped from the page cache first)."""
    drop_from_page_cache(files)
    start, total = time.perf_counter(), 0
    buf = bytearray(64 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total / (time.perf_counter() - start) / 1e9


def gpu_used_mib() -> int:
    out = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=memory.used",
            "--format=csv,noheader,nounits",
            "-i",
            os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[0])


class Server:
    def __init__(self, model: str, port: int, flags: list[str], load_format: str = "auto"):
        start = time.perf_counter()
        self.proc, self.url = start_server(model, port, flags, load_format)
        self.start_s = time.perf_counter() - start
        self.http = httpx.Client(timeout=3600)

    def post(self, path: str, body: dict) -> dict:
        r = self.http.post(f"{self.url}{path}", json=body)
        assert r.status_code == 200, (path, r.status_code, r.text)
        return r.json()

    def timed(self, path: str, body: dict) -> float:
        start = time.perf_counter()
        self.post(path, body)
        return time.perf_counter() - start

    def tokens(self, prompts: list[list[int]]) -> list[list[int]]:
        out = self.post(
            "/generate", {"input_ids": prompts, "sampling_params": {"max_new_tokens": 32, "temperature": 0.0}}
        )
        return [o["output_ids"] for o in out]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def flattened_payload(weights: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    """One uint8 bucket holding every tensor, built in place (no second copy of the weights)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401

    total = sum(t.nbytes for t in weights.values())
    flat = torch.empty(total, dtype=torch.uint8, device="cuda")
    meta, at = [], 0
    for name, t in weights.items():
        flat[at : at + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
        e = BucketEntry()
        e.name, e.shape, e.dtype, e.start_idx, e.end_idx, e.numel = name, t.shape, t.dtype, at, at + t.nbytes, t.nbytes
        meta.append(e)
        at += t.nbytes
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": meta})
    return base64.b64encode(buf.getvalue()).decode(), flat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/llama3.1-8b", help="a config folder (dummy weights)")
    ap.add_argument("--ckpt", default="/tmp/minisgl-weight-sync-ckpt")
    ap.add_argument("--port", type=int, default=31100)
    ap.add_argument("--mem-fraction-static", type=float, default=0.5, help="leaves room for this process's tensors")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "model": args.model}
    baseline_mib = gpu_used_mib()  # this process's own context
    config = json.loads((Path(args.model) / "config.json").read_text())
    flags = ["--mem-fraction-static", str(args.mem_fraction_static), "--enable-weight-update-from-tensor"]
    prompts = [[1000 + i, 2000 + i, 3000 + i, 4000 + i] * 8 for i in range(4)]

    # A first start compiles the kernels (cached after), so the restart below is a warm one.
    warm = Server(args.model, args.port, flags, "dummy")
    res["first_start_s"] = warm.start_s
    warm.stop()

    ckpt = Path(args.ckpt)
    shutil.rmtree(ckpt, ignore_errors=True)
    start = time.perf_counter()
    files = write_checkpoint(ckpt, config, seed=1)
    nbytes = sum(f.stat().st_size for f in files)
    res.update(checkpoint_gb=nbytes / 1e9, write_s=time.perf_counter() - start, disk_read_gbps=read_rate(files))
    drop_from_page_cache(files)

    srv = Server(str(ckpt), args.port, flags)  # the baseline: a restart on the new checkpoint
    res["restart_on_checkpoint_s"] = srv.start_s
    try:
        res["tokens_before"] = srv.tokens(prompts)
        drop_from_page_cache(files)
        t = srv.timed("/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "disk-cold"})
        res.update(update_from_disk_cold_s=t, update_from_disk_cold_gbps=nbytes / t / 1e9)
        t = srv.timed("/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "disk-warm"})
        res.update(update_from_disk_warm_s=t, update_from_disk_warm_gbps=nbytes / t / 1e9)
        assert srv.tokens(prompts) == res["tokens_before"], "the same checkpoint gave other tokens"

        weights = random_weights(hf_shapes(config), seed=2)
        start = time.perf_counter()
        payload = encode_named_tensors(weights.items())
        res["tensor_direct_encode_s"] = time.perf_counter() - start
        res["update_from_tensor_direct_s"] = srv.timed(
            "/update_weights_from_tensor", {"serialized_named_tensors": [payload], "weight_version": "tensor"}
        )
        res["tokens_after_tensor"] = srv.tokens(prompts)
        start = time.perf_counter()
        payload, flat = flattened_payload(weights)
        res["tensor_bucket_encode_s"] = time.perf_counter() - start
        del weights  # (the bucket holds a copy)
        torch.cuda.empty_cache()
        res["update_from_tensor_bucket_s"] = srv.timed(
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [payload], "load_format": "flattened_bucket", "weight_version": "bucket"},
        )
        assert srv.tokens(prompts) == res["tokens_after_tensor"], "the bucket gave other tokens than the same tensors"
        del flat, payload
        torch.cuda.empty_cache()

        time.sleep(1)
        before = gpu_used_mib()
        res["release_s"] = srv.timed("/release_memory_occupation", {})
        time.sleep(1)
        after = gpu_used_mib()
        res["resume_s"] = srv.timed("/resume_memory_occupation", {})
        res.update(
            gpu_mib_baseline=baseline_mib,
            gpu_mib_before_release=before,
            gpu_mib_after_release=after,
            engine_mib=before - baseline_mib,
            released_share=(before - after) / max(before - baseline_mib, 1),
        )
        res["same_tokens_after_resume"] = srv.tokens(prompts) == res["tokens_after_tensor"]
        res["server_log_hint"] = "the server logs release/resume and graph capture times"
    finally:
        srv.stop()
        shutil.rmtree(ckpt, ignore_errors=True)
    for k in ("tokens_before", "tokens_after_tensor"):
        res[k] = res[k][:1]
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
