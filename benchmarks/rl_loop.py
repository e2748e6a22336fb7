"""A small GRPO-style RL loop against the server, timing each phase of a step.

Each step: roll out ``--samples`` completions of each of ``--prompts`` prompts (the engine's
repeated sampling), score them with a toy reward, take one optimizer step in this process (the
trainer: transformers' model of the same checkpoint, on the same device), and push the new
weights into the running engine by one of SGLang's three paths, in turn or as ``--paths`` says:

- ``tensor``: colocated, CUDA IPC handles (shared memory on CPU), one flattened bucket;
- ``disk``: a safetensors checkpoint written, then /update_weights_from_disk;
- ``distributed``: a broadcast from this process (rank 0) over a group the engine joined.

The engine's side of a sync is pause (in_place), the update (with its cache flush), and
continue; it is reported apart from the trainer's own step (and, with ``--release-memory``,
from releasing the engine's GPU memory while the trainer trains and taking it back). Runs on CPU with a tiny model:

    python scripts/make_tiny_model.py --arch llama --out checkpoints/tiny-llama
    python benchmarks/rl_loop.py --model checkpoints/tiny-llama --steps 3

and on a GPU with dummy weights in a real shape:

    python benchmarks/rl_loop.py --model benchmarks/configs/llama3.2-1b --load-format dummy \\
        --prompts 8 --samples 256 --steps 5 --paths tensor
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.server import start_server  # noqa: E402
from minisgl.device.distributed.weight_group import init_weight_group  # noqa: E402
from minisgl.device.worker.tensor_payload import encode_named_tensors  # noqa: E402

PATHS = ("tensor", "disk", "distributed")


class Trainer:
    """The policy being trained: the checkpoint's transformers model, one SGD step per RL step."""

    def __init__(self, model: str, load_format: str, device: torch.device, lr: float, seed: int):
        from transformers import AutoConfig, AutoModelForCausalLM

        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        torch.manual_seed(seed)
        if load_format == "dummy":  # random weights in the real shape; the first push syncs the engine
            config = AutoConfig.from_pretrained(model)
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        self.model.to(device).train()
        self.model.config.use_cache = False
        self.device = device
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)

    def step(self, samples: list[tuple[list[int], list[int], float]], micro_batch: int) -> float:
        """One policy-gradient step on (prompt, completion, advantage) triples; returns the loss."""
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for at in range(0, len(samples), micro_batch):
            part = samples[at : at + micro_batch]
            width = max(len(p) + len(c) for p, c, _ in part)
            ids = torch.zeros(len(part), width, dtype=torch.long)
            mask = torch.zeros(len(part), width)
            adv = torch.tensor([a for _, _, a in part])
            for i, (p, c, _) in enumerate(part):
                ids[i, : len(p) + len(c)] = torch.tensor(p + c)
                mask[i, len(p) : len(p) + len(c)] = 1.0  # the completion's tokens (predicted from the one before)
            ids, mask, adv = ids.to(self.device), mask.to(self.device), adv.to(self.device)
            logits = self.model(input_ids=ids).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            m = mask[:, 1:]
            loss = -(adv[:, None] * logp * m).sum() / max(float(m.sum()), 1.0) * len(part) / len(samples)
            loss.backward()
            total += float(loss.detach())
        self.opt.step()
        return total

    def train_subset(self, samples: list, count: int, micro_batch: int) -> float:
        """``step`` on ``count`` samples drawn from the rollout (the trainer's cost stays bounded)."""
        chosen = random.Random(len(samples)).sample(samples, min(count, len(samples)))
        return self.step(chosen, micro_batch)

    def named(self) -> list[tuple[str, torch.Tensor]]:
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        return [(n, p.detach()) for n, p in self.model.named_parameters() if not (tied and n == "lm_head.weight")]


def toy_reward(completion: list[int], vocab: int) -> float:
    """The share of tokens from the lower half of the vocabulary: learnable, and cheap."""
    return sum(t < vocab // 2 for t in completion) / max(len(completion), 1)


class Loop:
    def __init__(self, args: argparse.Namespace, url: str, trainer: Trainer, vocab: int):
        self.args, self.url, self.trainer, self.vocab = args, url, trainer, vocab
        self.http = httpx.Client(timeout=3600)
        self.group: dist.ProcessGroup | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="minisgl-rl-"))
        rng = random.Random(args.seed)
        self.prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]

    def post(self, path: str, body: dict) -> dict:
        r = self.http.post(f"{self.url}{path}", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {r.text}")
        return r.json()

    def rollout(self) -> list[tuple[list[int], list[int], float]]:
        """n samples per prompt, one request per prompt (all at once); GRPO advantages."""
        params = {"temperature": 1.0, "max_new_tokens": self.args.max_new_tokens, "ignore_eos": True}

        def one(prompt: list[int]) -> list[list[int]]:  # the prompt n times in one batch (n caps at 64)
            out = self.post("/generate", {"input_ids": [prompt] * self.args.samples, "sampling_params": params})
            return [o["output_ids"] for o in out]

        with ThreadPoolExecutor(len(self.prompts)) as pool:
            groups = list(pool.map(one, self.prompts))
        samples = []
        for prompt, outs in zip(self.prompts, groups):
            rewards = [toy_reward(o, self.vocab) for o in outs]
            mean = sum(rewards) / len(rewards)
            std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) or 1.0
            samples += [(prompt, o, (r - mean) / std) for o, r in zip(outs, rewards)]
        return samples

    def push(self, path: str, version: str) -> None:
        body = {"flush_cache": True, "weight_version": version}
        named = self.trainer.named()
        if path == "tensor":
            payload = encode_named_tensors(named, flattened=True)
            self.post(
                "/update_weights_from_tensor",
                {**body, "serialized_named_tensors": [payload] * self.args.tp_size, "load_format": "flattened_bucket"},
            )
        elif path == "disk":
            from safetensors.torch import save_file

            self.trainer.model.config.save_pretrained(self.tmp)
            save_file({n: t.contiguous() for n, t in named}, str(self.tmp / "model.safetensors"))
            self.post("/update_weights_from_disk", {**body, "model_path": str(self.tmp)})
        else:
            if self.group is None:
                self._join()
            spec = {
                "names": [n for n, _ in named],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named],
                "group_name": "rl_loop",
            }
            with ThreadPoolExecutor(1) as pool:
                done = pool.submit(self.post, "/update_weights_from_distributed", {**body, **spec})
                for _, t in named:
                    dist.broadcast(t.contiguous(), src=0, group=self.group)
                done.result()

    def _timed(self, path: str, body: dict) -> float:
        start = time.perf_counter()
        self.post(path, body)
        return time.perf_counter() - start

    def _join(self) -> None:
        port = self.args.group_port
        backend = "nccl" if self.trainer.device.type == "cuda" else "gloo"
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(
                self.post,
                "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 1 + self.args.tp_size,
                    "group_name": "rl_loop",
                    "backend": backend,
                },
            )
            self.group = init_weight_group(backend, "127.0.0.1", port, 0, 1 + self.args.tp_size, "rl_loop")
            joined.result()

    def run(self) -> list[dict]:
        rows = []
        paths = self.args.paths
        for step in range(self.args.steps):
            path = paths[step % len(paths)]
            t0 = time.perf_counter()
            samples = self.rollout()
            t1 = time.perf_counter()
            release = resume = 0.0
            if self.args.release_memory:  # colocated: the trainer gets the engine's GPU memory
                release = self._timed("/release_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]})
            train = self.trainer.train_subset(samples, self.args.train_samples, self.args.micro_batch)
            if self.args.release_memory:
                resume = self._timed("/resume_memory_occupation", {"tags": ["weights"]})
            t2 = time.perf_counter()
            train_s = t2 - t1 - release - resume
            paused = self.post("/pause_generation", {"mode": "in_place"})
            t3 = time.perf_counter()
            self.push(path, f"step-{step + 1}")
            t4 = time.perf_counter()
            if self.args.release_memory:  # the KV pool back, graphs captured again
                resume += self._timed("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
            t4b = time.perf_counter()
            self.post("/continue_generation", {})
            t5 = time.perf_counter()
            sync = (t3 - t2) + (t4 - t3) + (t5 - t4b)
            rows.append(
                {
                    "step": step + 1,
                    "path": path,
                    "samples": len(samples),
                    "output_tokens": sum(len(c) for _, c, _ in samples),
                    "mean_reward": sum(toy_reward(c, self.vocab) for _, c, _ in samples) / len(samples),
                    "rollout_s": t1 - t0,
                    "train_s": train_s,
                    "loss": train,
                    "release_s": release,
                    "resume_s": resume,
                    "pause_s": t3 - t2,
                    "update_s": t4 - t3,
                    "continue_s": t5 - t4b,
                    "sync_s": sync,
                    "sync_share_of_rollout": sync / (t1 - t0),
                    "paused_requests": paused["num_paused_requests"],
                }
            )
            r = rows[-1]
            print(
                f"step {r['step']} [{path}] rollout {r['rollout_s']:.2f} s ({r['output_tokens'] / r['rollout_s']:.0f} "
                f"tok/s), train {r['train_s']:.2f} s, sync {sync:.3f} s (pause {r['pause_s']:.3f}, update "
                f"{r['update_s']:.3f}, continue {r['continue_s']:.3f}) = {100 * r['sync_share_of_rollout']:.1f}% "
                f"of rollout; release {release:.2f} s, resume {resume:.2f} s; reward {r['mean_reward']:.3f}",
                flush=True,
            )
        return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8, help="completions per prompt (n)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS, help="update paths, in turn")
    ap.add_argument(
        "--release-memory",
        action="store_true",
        help="release the engine's GPU memory while the trainer trains (colocated), resume after",
    )
    ap.add_argument("--train-samples", type=int, default=64, help="samples of a step the trainer learns from")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--group-port", type=int, default=31900)
    ap.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.5,
        help="the engine's share of GPU memory: the trainer shares the GPU (the server's own default "
        "leaves it too little for its first step)",
    )
    ap.add_argument("--server-args", default="", help="more flags for the server, one string")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and "distributed" in args.paths and torch.cuda.device_count() <= args.tp_size:
        ap.error(
            f"--paths distributed: the trainer's rank needs a GPU the engine's {args.tp_size} do not use "
            f"({torch.cuda.device_count()} visible; NCCL cannot put two ranks of one group on one GPU): "
            "use --paths tensor disk"
        )
    flags = ["--enable-weight-update-from-tensor", "--tp-size", str(args.tp_size), *args.server_args.split()]
    if device.type == "cpu":
        flags += ["--device", "cpu"]
    else:
        if "--mem-fraction-static" not in flags:
            flags += ["--mem-fraction-static", str(args.mem_fraction_static)]
        if "distributed" in args.paths and "--base-gpu-id" not in flags:
            flags += ["--base-gpu-id", "1"]  # the trainer's rank keeps GPU 0 to itself
    proc, url = start_server(args.model, args.port, flags, args.load_format)
    try:
        trainer = Trainer(args.model, args.load_format, device, args.lr, args.seed)
        vocab = trainer.model.config.vocab_size
        rows = Loop(args, url, trainer, vocab).run()
    finally:
        proc.terminate()
        proc.wait(30)
    summary = {
        "args": vars(args),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return rows


if __name__ == "__main__":
    main()
