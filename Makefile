.PHONY: setup demo test lint bench

setup:
	bash scripts/setup.sh

# The main job: a cache-mediated prefill -> decode demo on embedded defaults.
demo: setup
	.venv/bin/python -m tiered_cache.tools.demo

# Lint, type-check, check the layering contracts (pyproject.toml), then every test (unit, fault, property, e2e with real vLLM).
test: setup
	.venv/bin/ruff check .
	.venv/bin/mypy
	.venv/bin/lint-imports
	.venv/bin/pytest -q -ra

lint: setup
	.venv/bin/ruff check .
	.venv/bin/mypy
	.venv/bin/lint-imports

bench: setup
	.venv/bin/python bench/tiers.py --quick --json
