"""rljob.trainer: the RL trainer entrypoint (JAX/MaxText models, LoRA through qwix)."""
