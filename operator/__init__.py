"""rljob.operator: kopf handlers -> one reconcile service -> one module of Kubernetes I/O."""
