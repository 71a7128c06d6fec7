"""docs/connector.md, "Identity": which files key a model and a LoRA adapter,
held on a model folder built here, with the document's words beside the
code (no engine: ``connector/weight_files.py``'s ``selected_files``, what
the fingerprint hashes).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")  # ucm_db.connector imports vLLM

ROOT = Path(__file__).resolve().parents[1]
CONNECTOR = " ".join((ROOT / "docs" / "connector.md").read_text(encoding="utf-8").split())

#: file -> keyed? as connector.md words the rule.
MODEL = {
    "model-00001-of-00002.safetensors": True,  # "the weights of the kind vLLM loads (`*.safetensors`, else `*.bin` ...)"
    "model.safetensors.index.json": True,  # "their index"
    "pytorch_model.bin": False,  # another kind beside safetensors
    "pytorch_model.bin.index.json": False,  # another kind's index
    "config.json": True,
    "preprocessor_config.json": True,  # "every other `*.json` but the tokenizer and generation files"
    "tokenizer.json": False, "tokenizer_config.json": False, "generation_config.json": False,
    "modeling_custom.py": True,  # "`*.py` (remote code)"
    "training_args.bin": False,
    "README.md": False,
    "transformer/diffusion.safetensors": True,  # "in each of its subfolders, one level down"
    "transformer/config.json": True,
    "checkpoint-500/model.safetensors": True,  # "A subfolder vLLM does not load ... is hashed once"
    "adapters/retrieval/adapter_config.json": True,  # "task adapters under `adapters/<task>/`"
    "adapters/retrieval/adapter_model.safetensors": True,
    "adapters/retrieval/adapter_model.bin": False,  # "the first of" them
    "original/consolidated.pth": False,  # "`original/` [is] left out"
    ".cache/model.safetensors": False,  # "hidden folders"
    "transformer/deeper/model.safetensors": False,  # one level down only
}

ADAPTER = {
    "adapter_config.json": True, "adapter_model.safetensors": False, "adapter_model.bin": True, "adapter_model.pt": False,
    "new_embeddings.safetensors": False, "checkpoint-10/adapter_model.bin": False, "README.md": False,
}


def _build(root: Path, files: dict[str, bool]) -> None:
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)


def test_the_files_that_key_a_model_and_an_adapter() -> None:
    import tempfile

    from ucm_db.connector.weight_files import selected_files, skipped_model_folders

    for said in ("(`*.safetensors`, else `*.bin`, else `*.pt`; `*.gguf`",
                 "their index, `config.json` and every other `*.json` but the tokenizer and generation files, and `*.py`",
                 "in the model's folder and in each of its subfolders, one level down",
                 "a model's task adapters under `adapters/<task>/`", "hidden folders and, under vLLM's default ignore patterns, "
                 "`original/` are left out", "`adapter_config.json` and the first of `adapter_model.safetensors`, "
                 "`adapter_model.bin`, `adapter_model.pt` that exists, nothing else in its directory"):
        assert said in CONNECTOR, said
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "model"
        _build(model, MODEL)
        keyed = set(selected_files(model, subfolders=True, skipped_folders=skipped_model_folders(None)))
        assert keyed == {name for name, wanted in MODEL.items() if wanted}
        adapter = Path(folder) / "adapter"
        _build(adapter, {name: True for name in ADAPTER if name != "adapter_model.safetensors"})
        assert set(selected_files(adapter, adapter=True)) == {name for name, wanted in ADAPTER.items() if wanted}
        # `--load-format pt`: "the `*.pt` files ... whatever lies beside them"
        pt = Path(folder) / "pt"
        _build(pt, {"model.safetensors": False, "weights.pt": True, "config.json": True})
        assert set(selected_files(pt, load_format="pt")) == {"weights.pt", "config.json"}
