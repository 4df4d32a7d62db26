"""rljob.trainer: the RL trainer entrypoint (JAX/MaxText through tunix, LoRA through qwix)."""
