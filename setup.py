from setuptools import find_packages, setup

setup(
    name="minisgl",
    version="0.1.0",
    description="A compact, fast LLM serving runtime built around a radix-tree prefix cache.",
    python_requires=">=3.10",
    packages=find_packages(include=["minisgl", "minisgl.*"]),
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
        "gguf",
    ],
    extras_require={
        "cuda": ["flashinfer-python>=0.6", "apache-tvm-ffi>=0.1.15", "ninja"],
        "test": ["pytest", "hypothesis", "httpx", "openai", "accelerate"],  # accelerate: transformers reading GGUF
        "bench": ["httpx", "matplotlib"],
    },
)
