"""The torch side: what a worker process runs (model, layers, attention, kernels, KV pools,
sampler, distributed). Only worker processes and the offline API import it."""
