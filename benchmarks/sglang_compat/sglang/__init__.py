"""Stand-in for the ``sglang`` package when SGLang's own benchmark scripts run against our server
(``benchmarks/sglang_multiturn.py``): only what those scripts import, without SGLang's GPU stack."""
