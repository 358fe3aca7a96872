"""What the tests share that is not a fixture: tiny-model builders (models), the tiny tasks and texts (tasks),
shared checks (checks) and the repository's paths (paths). Imported as ``tests.support.<module>``."""
