"""rljob.recipes: the pure core. RLJob spec -> resolved plan -> Kubernetes objects.

No I/O, no kopf, kubernetes or jax imports here (checked by import-linter). The CLI and the
operator call the same functions, so what `rljob render` prints is what the operator applies.
"""
