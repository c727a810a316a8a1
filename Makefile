# The README's two commands. Each sets up what it needs first (idempotent), then runs.
#   make run [ARGS="steps=20 run_name=x"]   GRPO on the embedded tiny model
#   make test                               the test suite
.PHONY: setup run test

setup:
	@bash scripts/setup.sh

run: setup
	.venv/bin/python -m apps.grpo $(ARGS)

test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q $(ARGS)
