"""What the trainer, the sampler and the command line share below them: local ports, storage and HTTP.

It imports no JAX and no Kubernetes client, so the operator image and the CLI may use it; only
rljob.recipes (pure data and rules) lies below it. docs/architecture.md says where it sits.
"""
