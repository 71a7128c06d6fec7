"""Fixtures of the vLLM end-to-end tests; the helpers live in ``e2e_helpers``."""

from e2e_helpers import tiny_models  # noqa: F401 - re-exported fixture
