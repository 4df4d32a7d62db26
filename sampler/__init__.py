"""rljob.sampler: the sampler entrypoint (vLLM on TPU; a JAX backend on CPU)."""
