"""The command line: ``app`` (the typer app) in :mod:`.app`, one module per command, and :mod:`.errors` (domain errors become messages and exit codes)."""
