from setuptools import find_packages, setup

setup(
    name="minisgl",
    version="0.1.0",
    description="A compact, fast LLM serving runtime built around a radix-tree prefix cache.",
    python_requires=">=3.10",
    packages=find_packages(include=["minisgl", "minisgl.*"]),
    # the JIT kernels' CUDA sources, compiled on first use: a non-editable install needs them
    package_data={"minisgl.kernels": ["csrc/*.cu", "configs/*.json"]},
    # torch is deliberately not pinned to a CUDA build: install the torch you need first.
    install_requires=[
        "torch>=2.4",
        "numpy",
        "safetensors",
        "huggingface_hub",
        "transformers>=4.45",
        "tokenizers",
        "tqdm",
        "msgspec",
        "pyzmq",
        "starlette",
        "uvicorn",
        "prometheus-client",
        "setproctitle",  # process titles: minisgl::api, minisgl::scheduler, ...
        "regex",  # partial matching: tool calls read as they stream
        "gguf",
    ],
    extras_require={
        # triton: the cascade's kernels (torch's CUDA wheels bring it too).
        "cuda": ["flashinfer-python>=0.6", "apache-tvm-ffi>=0.1.15", "ninja", "triton>=3.4", "xgrammar>=0.1.25"],
        # structured output (json_schema, regex, ebnf, forced tool calls): xgrammar ships CPU wheels,
        # but on Linux x86-64 it requires triton (about 1 GB), so a plain CPU install goes without.
        "grammar": ["xgrammar>=0.1.25"],
        # accelerate: transformers reading GGUF; triton: its interpreter runs the cascade kernels on CPU.
        # smg: SGLang's router, run in front of two servers by tests/test_router.py.
        # openai-agents: the Agents SDK's agent loop against /v1/responses (tests/test_responses.py).
        "test": ["pytest", "hypothesis", "httpx", "openai", "openai-agents", "accelerate", "jsonschema", "xgrammar>=0.1.25",
                 "smg; platform_system == 'Linux' and platform_machine == 'x86_64'",
                 "triton>=3.4; platform_system == 'Linux' and platform_machine == 'x86_64'"],
        "bench": ["httpx", "matplotlib"],
        # --dp-size: SGLang's cache-aware router in front of the replicas.
        "router": ["smg; platform_system == 'Linux' and platform_machine == 'x86_64'"],
    },
)
