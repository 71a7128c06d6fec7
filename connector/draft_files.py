"""What a stored draft's KV depends on beside what
:func:`~ucm_db.connector.drafts.draft_shape` names of it already (its
method, its model's files, dtype, quantization and load config): weights its
load format reads from outside those files, and the vocabularies a draft of
another vocabulary reads the target's tokens through.

Invariants:
    * A draft's weights are read from its fingerprinted files (a load
      format of ``identity_guards.FILE_LOAD_FORMATS``; ``dummy``, random
      weights keyed by the shards they were drawn for: ``drafts.draft_load_inputs``),
      or from elsewhere and keyed by content as a target's are
      (``weight_loads.weights_elsewhere``: a local tensorizer file, a local
      ``model_weights`` directory), or the start is refused with a
      ConfigError: a remote URI, another process or server (``modelexpress``,
      ``ipc_cache``), a loader ucm-db does not know (:func:`draft_weight_inputs`).
      The connector's ``model_id`` names the target's weights, not a
      draft's: it covers a draft only where the draft reads the target's own
      checkpoint (an MTP module streamed with it).
    * The load config is the one vLLM loads the draft with
      (``drafts.draft_load_config``).
    * With ``use_heterogeneous_vocab`` vLLM's draft reads the target's token
      ids mapped through both tokenizers' vocabularies
      (``v1/spec_decode/vocab_mapping.py``): the same target tokens give the
      draft other ids, so other KV, when either tokenizer changes. Both are
      keyed by their files' content (:func:`vocabulary_inputs`); a tokenizer
      ucm-db cannot find locally (vLLM found it: a cache ucm-db does not
      read) by its name, with a warning.
    * A file a draft reads that never reaches a stored block is not keyed:
      DFlash's ``mask_embedding.pt`` (``qwen3_dflash.py``) embeds its query
      slots, whose KV lies past the accepted tokens and is overwritten by
      the context KV (projected from the target's hidden states) before
      vLLM counts those positions computed. ``tests/connector/test_identity_extra_files.py``
      judges every such read in vLLM's model classes.
    * Nothing changes for a draft loaded from its files with one vocabulary:
      its namespace is as before.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ucm_db.connector.config_files import files_digest
from ucm_db.connector.identity_guards import FILE_LOAD_FORMATS
from ucm_db.connector.weight_files import load_format_of
from ucm_db.connector.weight_loads import weights_elsewhere

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it
#: Files a tokenizer is read from beside ``tokenizer*`` (Hugging Face, SentencePiece, tiktoken, Mistral's tekken).
TOKENIZER_FILES = frozenset({"vocab.json", "vocab.txt", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                             "spiece.model", "sentencepiece.bpe.model", "tekken.json"})


def draft_weight_inputs(vllm_config: Any, draft_model: Any, load_config: Any, model_id: str | None) -> dict[str, Any]:
    """The content of weights the draft's load format reads from outside
    its fingerprinted files (empty where it reads those), or a ConfigError
    (module invariants)."""
    fmt = load_format_of(load_config)
    if fmt in FILE_LOAD_FORMATS or fmt == "dummy":
        return {}
    if model_id is not None and _reads_targets_checkpoint(vllm_config.model_config, draft_model):
        return {}
    spec = vllm_config.speculative_config
    parallel = getattr(spec, "draft_parallel_config", None) or vllm_config.parallel_config
    return weights_elsewhere(vllm_config, fmt, draft_model, load_config, parallel, draft=True)


def _reads_targets_checkpoint(target: Any, draft: Any) -> bool:
    """Whether the draft's weights are the target's (vLLM's MTP draft: the target's ``model_weights`` or model)."""
    theirs = {str(getattr(target, "model_weights", "") or ""), str(target.model)} - {""}
    return str(getattr(draft, "model_weights", "") or draft.model) in theirs


def vocabulary_inputs(vllm_config: Any) -> dict[str, Any]:
    """Both tokenizers' files by content, where the draft reads the target's
    tokens through them (module invariants); empty otherwise."""
    spec = vllm_config.speculative_config
    if not getattr(spec, "use_heterogeneous_vocab", False):
        return {}
    target = getattr(spec, "target_model_config", None) or vllm_config.model_config
    return {"vocabularies": [_tokenizer_digest(str(target.tokenizer), "the target's tokenizer"),
                             _tokenizer_digest(str(spec.draft_model_config.model), "the draft's tokenizer")]}


def _tokenizer_digest(source: str, what: str) -> str:
    """The digest of the tokenizer files of a local directory or of a hub
    id's snapshot at ``main`` (vLLM reads both tokenizers without a
    revision) in the local cache."""
    from ucm_db.connector.fingerprints import hub_snapshot

    folder = Path(source).expanduser()
    if not folder.is_dir():
        found = hub_snapshot(source, None)
        if found is None:
            logger.warning("ucm-db: cannot find %s (%r) locally: it is keyed by its name, so a tokenizer updated under "
                           "it keeps the draft's namespace (with use_heterogeneous_vocab the draft's KV depends on both "
                           "vocabularies); serve the target and the draft from local directories", what, source)
            return "name:" + source
        folder = found[1]
    files = sorted((p.name, p) for p in folder.iterdir()
                   if (p.name.startswith("tokenizer") or p.name in TOKENIZER_FILES or p.suffix == ".tiktoken")
                   and p.is_file())
    return files_digest(files, b"ucm-db/tokenizer")
