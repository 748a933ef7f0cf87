"""End-to-end tests with real vLLM servers (a package, so its conftest does not shadow
``tests/conftest.py`` as the top-level module ``conftest``)."""
