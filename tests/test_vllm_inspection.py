"""tests/vllm_inspection.py: vLLM inspects a model class in this process,
with the answer of its own inspection, saved to its cache."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.model_executor.models import registry  # noqa: E402

from vllm_inspection import inspect_in_process  # noqa: E402


def test_a_model_class_is_inspected_in_place_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert inspect_in_process()
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))

    class NoNewInterpreter:
        """The registry's ``subprocess``: fails the test, stands in for no fault."""

        @staticmethod
        def run(*args: Any, **kwargs: Any) -> None:
            raise AssertionError(f"vLLM started a process to inspect a model: {args}")

    monkeypatch.setattr(registry, "subprocess", NoNewInterpreter)
    model = registry.ModelRegistry.models["Qwen3NextForCausalLM"]  # not imported by this test session before
    info = model.inspect_model_cls()
    assert info.is_hybrid and info.has_inner_state and not info.supports_multimodal
    cached = json.loads((tmp_path / "modelinfos" / "vllm-model_executor-models-qwen3_next-Qwen3NextForCausalLM.json").read_text())
    assert cached["modelinfo"] == json.loads(json.dumps(asdict(info)))
    assert model.inspect_model_cls().is_hybrid  # read back from the cache
