"""rljob.local: the scaffolding of local runs, which no pod runs: the GCS emulator (fake-gcs-server), `make
rl-cpu` (localrun) and `make tinker-cpu` (tinker_cpu). They start the pods' entrypoints as local processes;
the trainer and sampler packages never import this one (import-linter, pyproject.toml)."""
