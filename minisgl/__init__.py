"""minisgl: a compact LLM serving runtime built around a radix-tree prefix cache."""

__version__ = "0.1.0"
