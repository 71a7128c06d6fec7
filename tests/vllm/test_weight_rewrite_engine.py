"""A checkpoint written in place while a real engine starts stops the start
(the identity audit's ``load_then_hash_race.py``, finding 1).

vLLM 0.32 makes the KV connector after it loaded the weights, so ucm-db
hashes the files after vLLM read them. Before the fix, an engine whose
files were rewritten right after vLLM read them (a trainer saving in place
while the server restarts) stored the old weights' KV under the new
files' namespace, and a later engine on the new files was served it
(wrong tokens, reproduced by the audit). Now ucm-db's vLLM plugin records
the files' stat before the load, and the connector refuses to start where
they moved.

One engine in a new process (its engine core and worker in it:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which patches vLLM's
``DefaultModelLoader.load_weights`` to write another checkpoint over the
model right after vLLM read it; ucm-db's plugin runs from its entry point,
as in any vLLM process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from identity_helpers import build_llama

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

HERE = Path(__file__).resolve().parent

JOB = """
import json, sys
from pathlib import Path
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["helpers"])
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

original = DefaultModelLoader.load_weights

def load_then_rewrite(self, model, model_config):
    out = original(self, model, model_config)
    if spec["rewrite"]:
        from identity_helpers import build_llama
        build_llama(Path(spec["model"]), seed=2)  # a trainer saves another checkpoint in place
        print("REWROTE the checkpoint after vLLM read it", flush=True)
    return out

DefaultModelLoader.load_weights = load_then_rewrite
from vllm import LLM
try:
    LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", block_size=32, max_model_len=512,
        max_num_seqs=4, enable_prefix_caching=False, seed=0, enforce_eager=True,
        kv_transfer_config={"kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector",
                            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                            "kv_connector_extra_config": {"path": spec["store"]}})
except Exception as exc:
    print("START FAILED:", type(exc).__name__, exc, flush=True)
    sys.exit(3)
print("STARTED", flush=True)
"""


def _start(tmp_path: Path, rewrite: bool) -> tuple[int, str]:
    model = build_llama(tmp_path / "model", seed=1)
    spec = {"model": str(model), "store": str(tmp_path / "store"), "rewrite": rewrite, "helpers": str(HERE)}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_HOST_IP": "127.0.0.1", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop("VLLM_PLUGINS", None)  # every plugin, ucm-db's among them, as in a plain deployment
    done = subprocess.run([sys.executable, "-c", JOB, json.dumps(spec)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=800)
    return done.returncode, done.stdout + done.stderr


def test_a_checkpoint_rewritten_while_the_engine_loads_it_stops_the_start(tmp_path: Path) -> None:
    rc, log = _start(tmp_path, rewrite=True)
    assert "REWROTE" in log, log[-3000:]
    assert rc == 3 and "changed after vLLM began loading" in log, log[-3000:]
    lines = log.splitlines()
    loaded = next(i for i, line in enumerate(lines) if "Loading weights took" in line)
    refused = next(i for i, line in enumerate(lines) if "ucm-db connector cannot start" in line)
    assert loaded < refused  # vLLM makes the connector after the load: the snapshot had to come from the plugin
