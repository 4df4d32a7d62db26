"""rljob.cli: the `rljob` command line."""
