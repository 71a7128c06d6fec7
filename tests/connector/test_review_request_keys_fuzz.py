"""Review: a request's block keys, input by input (connector/request_keys.py), with real vLLM ``Request``s,
the connector's own functions and ``UcmDbScheduler`` over a real store in ``tmp_path``.

Invariants checked (docs/connector.md, "How it works" and "Identity: what a key names"):
    * Model-based, seeded: over requests drawn from small alphabets of token ids, ``cache_salt``, LoRA adapters
      (by content; an alias of the same files), the engine's LoRA inputs, multimodal items (length 0, two in a
      block in either order, one spanning blocks), pure prompt embeddings and decode tokens, block ``j``'s key
      is equal for two requests exactly when its KV inputs are: the root (adapter content with the engine's
      LoRA inputs, salt), the tokens up to the block's end, every item starting in a block up to ``j`` (whole),
      the embedding rows up to it. Each chain is grown in a random pattern of calls, as the scheduler does.
    * A change to one KV input moves every key from the first block whose KV it changes and none before (a
      shared text prefix still hits); sampling, structured outputs, pooling, priority, request ids, transfer
      params, ``mm_hash`` beside the same identifier, an adapter's name, path and (fresh) id move none.
    * Keys do not depend on the engine computing them (TP size, a restarted process) for content identifiers;
      a counter-identifier engine keeps the text prefix. The real lookup hits exactly where the KV is equal.
    * Adapter loads, rewrites, reused ids, in-place loads and evictions in any order never key a request by
      files other than those vLLM computes with (else ``unsettled``); a fresh id is keyed by its files.
The review's finding, its repro below: a mixed-mode prompt (token ids interleaved with embeddings) was
hashed from ``prompt_token_ids`` (placeholder ids) or ``all_token_ids`` (0 there), whichever the first call
reached (one prompt, two chains: lost hits); it is hashed from ``all_token_ids`` now, as vLLM's own block hash.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.pooling_params import PoolingParams  # noqa: E402
from vllm.sampling_params import StructuredOutputsParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from ucm_db.connector import fingerprints, identity_guards  # noqa: E402
from ucm_db.connector.identity import KVShape, grid, namespace, reader_spans  # noqa: E402
from ucm_db.connector.request_keys import chain_keys, request_block_extras, request_extras  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.scheduler.request_state import RequestState  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.keys.units import UnitKeys  # noqa: E402

SEEDS = (5, 19, 31, 47)
BS = 16
PROMPT = 6 * BS + 5  # a drawn prompt: six full blocks and a partial one
IDS = ("a1" * 16, "b2" * 16)  # content-hash identifiers
TARGETED = '{"target_modules":["o_proj"]}'  # an engine's lora_engine_inputs


def shape(tp_size: int = 1, counters: bool = False) -> KVShape:
    return KVShape(model="review-request-keys", kv_dtype="bfloat16", block_size=BS, use_mla=False, layout="cpu-test",
                   tp_size=tp_size, pp_size=1, kv_heads=2, layers=2, counter_mm_ids=counters)


NS = namespace(shape())


@dataclass(frozen=True)
class Item:  # a multimodal item: identifier and placeholder range
    identity: str
    offset: int
    length: int


@dataclass(frozen=True)
class Spec:
    """What a drawn request is made of; ``content``: a label of its adapter's files (the model's digest)."""

    tokens: tuple[int, ...] | None
    embeds: torch.Tensor | None = None
    salt: str | None = None
    adapter: tuple[str, int, str] | None = None  # (name, int id, path)
    content: str | None = None
    items: tuple[Item, ...] = ()
    outputs: tuple[int, ...] = ()
    lora_engine: str = ""

    def prompt_len(self) -> int:
        return len(self.tokens) if self.tokens is not None else len(self.embeds) if self.embeds is not None else 0


@pytest.fixture(autouse=True)
def fresh_fingerprints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private fingerprint cache and this process's adapter history, fresh per test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for name, empty in (("_memo", {}), ("_warned", set()), ("_adapters", {}), ("_adapter_ids", {}),
                        ("_resettled", set()), ("_named", {}), ("_renamed", set())):
        monkeypatch.setattr(fingerprints, name, empty)


def write_adapter(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, data in (("adapter_config.json", b'{"r": 8, "lora_alpha": 16}'), ("adapter_model.safetensors", weights)):
        (path / f".{name}.tmp").write_bytes(data)
        os.replace(path / f".{name}.tmp", path / name)  # a new inode: what a trainer's save gives
    return path


def adapters(tmp_path: Path) -> list[tuple[tuple[str, int, str], str]]:
    """(LoRA request fields, content label): adapter A, its files copied under another name, path and id, B."""
    first, alias, other = tmp_path / "a", tmp_path / "alias", tmp_path / "b"
    if not first.exists():  # written once per test: a rewrite would be a retrained adapter to vLLM
        shutil.copytree(write_adapter(first, b"A" * 300), alias)
        write_adapter(other, b"B" * 300)
    return [(("ad", 1, str(first)), "A"), (("alias", 2, str(alias)), "A"), (("b", 3, str(other)), "B")]


def make_request(spec: Spec, req_id: str = "r", mm_hash: str | None = None, **kwargs: Any) -> Request:
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=i.identity, mm_hash=mm_hash,
                                      mm_position=PlaceholderRange(i.offset, i.length)) for i in spec.items]
    sampling = kwargs.pop("sampling", SamplingParams(max_tokens=64))
    made = Request(req_id, None if spec.tokens is None else list(spec.tokens), sampling, kwargs.pop("pooling", None),
                   prompt_embeds=spec.embeds, mm_features=features or None, cache_salt=spec.salt,
                   lora_request=None if spec.adapter is None else LoRARequest(*spec.adapter), **kwargs)
    made.append_output_token_ids(list(spec.outputs))
    return made


def keys_of(request: Request, lora_engine: str = "", counters: bool = False,
            steps: tuple[int, ...] = ()) -> list[bytes]:
    """Every full block's key, the chain grown through ``steps`` (block counts) as the scheduler grows it."""
    blocks = request.num_tokens // BS
    state = RequestState(request, request_extras(request, lora_engine), request_block_extras(request, BS, counters))
    for count in (*steps, blocks):
        chain_keys(NS, BS, state, min(count, blocks))
    return list(state.keys[:blocks])


def spec_keys(spec: Spec, steps: tuple[int, ...] = ()) -> list[bytes]:
    return keys_of(make_request(spec), spec.lora_engine, steps=steps)


def kv_prefix(spec: Spec, block: int) -> tuple[Any, ...]:
    """The model: what the KV of blocks ``0..block`` depends on."""
    end = (block + 1) * BS
    tokens = (list(spec.tokens) if spec.tokens is not None else [0] * spec.prompt_len()) + list(spec.outputs)
    root = (None if spec.adapter is None else (spec.content, spec.lora_engine), spec.salt)
    items = tuple(sorted((i.identity, i.offset, i.length) for i in spec.items if i.offset // BS <= block))
    rows = None if spec.embeds is None else (str(spec.embeds.dtype), spec.embeds[:end].numpy().tobytes())
    return root, tuple(tokens[:end]), items, rows


def draw_items(rng: random.Random, prompt: int) -> tuple[Item, ...]:
    """0-2 non-overlapping items, sorted by offset (as vLLM sorts them), inside the prompt."""
    offsets, lengths = (2 * BS + 3, 2 * BS + 9, 3 * BS, 3 * BS + 5), (0, 4, BS + 2)
    items: list[Item] = []
    for _ in range(rng.randrange(3)):
        item = Item(rng.choice(IDS), rng.choice(offsets), rng.choice(lengths))
        span = range(item.offset, item.offset + max(item.length, 1))
        apart = all(o.offset + max(o.length, 1) <= span.start or span.stop <= o.offset for o in items)
        if span.stop <= prompt and apart:
            items.append(item)
    return tuple(sorted(items, key=lambda i: i.offset))


def draw_specs(rng: random.Random, tmp_path: Path, count: int) -> list[Spec]:
    base = tuple(rng.randrange(1, 500) for _ in range(PROMPT))
    flipped = list(base)
    flipped[rng.randrange(PROMPT)] += 1
    token_kinds = (base, tuple(flipped), base[:PROMPT - BS])
    rows = torch.randn(PROMPT, 4, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    other_row = rows.clone()
    other_row[rng.randrange(PROMPT)] += 1.0
    embed_kinds = (rows, other_row, rows.half(), rows[:PROMPT - 3])
    loras = [(None, None), (None, None), *adapters(tmp_path)]
    specs: list[Spec] = []
    for _ in range(count):
        lora, content = rng.choice(loras)
        common: dict[str, Any] = {"salt": rng.choice((None, None, "t1", "t2")), "adapter": lora, "content": content,
                  "outputs": rng.choice(((), (7,) * BS, (8,) * BS)), "lora_engine": rng.choice(("", TARGETED))}
        if rng.random() < 0.25:
            specs.append(Spec(None, embeds=rng.choice(embed_kinds), **common))
        else:
            tokens = rng.choice(token_kinds)
            specs.append(Spec(tokens, items=draw_items(rng, len(tokens)), **common))
    return specs


@pytest.mark.parametrize("seed", SEEDS)
def test_keys_are_equal_exactly_where_the_kv_is(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    by_key: dict[bytes, tuple[Any, ...]] = {}
    by_prefix: dict[tuple[Any, ...], bytes] = {}
    shared = 0  # blocks whose KV an earlier request's block had: a hit's keys
    for spec in draw_specs(rng, tmp_path, 40):
        blocks = (spec.prompt_len() + len(spec.outputs)) // BS
        steps = tuple(sorted(rng.sample(range(1, blocks + 1), rng.randrange(4))))
        keys = spec_keys(spec, steps)
        assert len(keys) == blocks
        for block, key in enumerate(keys):
            prefix = kv_prefix(spec, block)
            assert by_key.setdefault(key, prefix) == prefix, f"block {block}: KV-different requests share a key"
            shared += prefix in by_prefix
            assert by_prefix.setdefault(prefix, key) == key, f"block {block}: KV-equal requests differ ({steps})"
    assert shared > 20 and len(by_key) > 60  # both directions were exercised


def base_spec(tmp_path: Path, rng: random.Random) -> Spec:
    (lora, content), *_ = adapters(tmp_path)
    tokens = tuple(rng.randrange(1, 500) for _ in range(PROMPT))
    items = (Item(IDS[0], 2 * BS + 3, 4), Item(IDS[1], 2 * BS + 9, BS + 2))
    return Spec(tokens, salt="t1", adapter=lora, content=content, items=items, outputs=(9,) * BS)


def mutations(spec: Spec, rng: random.Random, tmp_path: Path) -> dict[str, tuple[Spec, int]]:
    """A change to one KV input, and the first block whose KV it changes."""
    first, second = spec.items
    position = rng.randrange(PROMPT)
    tokens = list(spec.tokens or ())
    tokens[position] += 1
    zero = rng.randrange(4 * BS, PROMPT)
    return {
        "a token": (replace(spec, tokens=tuple(tokens)), position // BS),
        "cache_salt": (replace(spec, salt="t2"), 0),
        "no cache_salt": (replace(spec, salt=None), 0),
        "another adapter's files": (replace(spec, adapter=("ad2", 9, str(write_adapter(tmp_path / "o", b"C" * 9)))), 0),
        "how the engine applies adapters": (replace(spec, lora_engine=TARGETED), 0),
        "no adapter": (replace(spec, adapter=None), 0),
        "an item's identity": (replace(spec, items=(replace(first, identity="c3" * 16), second)), first.offset // BS),
        "a tower adapter's identifier": (replace(spec, items=(replace(first, identity="ad:" + IDS[0]), second)), 2),
        "an item one token later": (replace(spec, items=(replace(first, offset=first.offset + 1), second)), 2),
        "an item longer": (replace(spec, items=(replace(first, length=5), second)), 2),
        "two items in one block swapped": (replace(spec, items=(replace(first, identity=IDS[1]),
                                                                replace(second, identity=IDS[0]))), 2),
        "a spanning item's identity": (replace(spec, items=(first, replace(second, identity="d4" * 16))), 2),
        "a zero-length item": (replace(spec, items=(first, second, Item("e5" * 16, zero, 0))), zero // BS),
        "a decode token": (replace(spec, outputs=(1,) + (9,) * (BS - 1)), PROMPT // BS),
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_a_kv_input_moves_every_key_from_the_first_block_it_changes(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    spec = base_spec(tmp_path, rng)
    base = spec_keys(spec)
    for name, (changed, first) in mutations(spec, rng, tmp_path).items():
        keys = spec_keys(changed, tuple(sorted(rng.sample(range(1, len(base)), 2))))
        assert keys[:first] == base[:first], f"{name}: a block before {first} moved"
        assert not set(keys[first:]) & set(base), f"{name}: a key from block {first} on is still the base's"


@pytest.mark.parametrize("seed", SEEDS)
def test_prompt_embedding_rows_dtype_and_the_mixed_mask_move_keys_from_their_block(seed: int) -> None:
    rng = random.Random(seed)
    rows = torch.randn(PROMPT, 4, generator=torch.Generator().manual_seed(seed))
    row = rng.randrange(PROMPT)
    changed = rows.clone()
    changed[row, rng.randrange(4)] += 0.5
    def pure(embeds: torch.Tensor) -> list[bytes]:  # a prompt of embeddings, then decode tokens
        return keys_of(make_request(Spec(None, embeds=embeds, outputs=(3,) * BS)))

    plain, moved, half = pure(rows), pure(changed), pure(rows.half())
    assert pure(rows.clone()) == plain
    assert moved[:row // BS] == plain[:row // BS] and not set(moved[row // BS:]) & set(plain)
    assert not set(half) & set(plain) and not set(pure(rows.half().view(torch.bfloat16))) & set(half)  # same bytes
    # Mixed mode, keyed within the prompt (the path the scheduler's lookups and prefill saves take):
    mask = [rng.random() < 0.5 for _ in range(PROMPT)]
    flip = rng.randrange(PROMPT)
    other = [not m if i == flip else m for i, m in enumerate(mask)]
    ids = [rng.randrange(1, 500) if i != flip else 999 for i in range(PROMPT)]  # at flip: a real 999 or a slot

    def mixed(rows_mask: list[bool]) -> list[bytes]:
        tokens = [t if m else 999 for t, m in zip(ids, rows_mask)]
        return keys_of(Request("m", tokens, SamplingParams(max_tokens=1), None, prompt_embeds=rows,
                               prompt_is_token_ids=rows_mask))

    once, again = mixed(mask), mixed(other)  # only which rows are token ids differs
    assert once[:flip // BS] == again[:flip // BS] and not set(again[flip // BS:]) & set(once)


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_what_leaves_the_kv_alone_leaves_every_key(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    spec = base_spec(tmp_path, rng)
    base = keys_of(make_request(spec))
    alias = adapters(tmp_path)[1][0]
    variants: dict[str, Request] = {
        "another request id": make_request(spec, "other-id"),
        "sampling": make_request(spec, sampling=SamplingParams(temperature=0.3, top_p=0.5, seed=7, max_tokens=3,
                                                               logprobs=2, stop=["x"])),
        "structured outputs": make_request(spec, sampling=SamplingParams(
            max_tokens=8, structured_outputs=StructuredOutputsParams(json={"type": "object"}))),
        "transfer params": make_request(spec, sampling=SamplingParams(max_tokens=8, extra_args={
            "kv_transfer_params": {"ucm_db": {"save": False}}})),
        "pooling": make_request(spec, sampling=None, pooling=PoolingParams()),
        "priority, arrival, client": make_request(spec, priority=3, arrival_time=1.0, client_index=2),
        "mm_hash beside the identifier": make_request(spec, mm_hash="processor-hash"),
        "the adapter's files under another name, path and id": make_request(replace(spec, adapter=alias)),
    }
    for name, request in variants.items():
        assert keys_of(request) == base, name


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_keys_are_the_same_whichever_engine_computes_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          seed: int) -> None:
    spec = base_spec(tmp_path, random.Random(seed))
    computed: list[list[bytes]] = []
    for index, tp in enumerate((1, 2, 2)):
        if index == 2:  # a restarted process: its own adapter history and nonce
            for name in ("_memo", "_adapters", "_adapter_ids", "_named"):
                monkeypatch.setattr(fingerprints, name, {})
            monkeypatch.setattr(identity_guards, "PROCESS_NONCE", "another-process")
        settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / f"store{index}")})
        sched = UcmDbScheduler(settings, shape(tp_size=tp))
        computed.append(sched.keys_for(make_request(spec, f"r{index}"), (PROMPT + BS) // BS))
        sched.shutdown()
    assert computed[0] == computed[1] == computed[2] == keys_of(make_request(spec))
    counters = keys_of(make_request(spec), counters=True)  # a counter engine: each item made unique to the process
    assert counters[:2] == computed[0][:2] and not set(counters[2:]) & set(computed[0])


def put_units(sched: UcmDbScheduler, keys: list[bytes]) -> None:
    """A payload for every unit of ``keys``: what all ranks of an engine save."""
    for span in reader_spans(shape()):
        sched.store.put(NS, list(UnitKeys(keys, grid(shape()), span)), [b"kv"] * len(keys), parent=None)


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_the_real_lookup_hits_where_the_kv_is_equal_and_nowhere_else(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    spec = replace(base_spec(tmp_path, rng), outputs=())
    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")}), shape())
    put_units(sched, sched.keys_for(make_request(spec, "stored"), PROMPT // BS))
    whole = (PROMPT - 1) // BS * BS
    first, second = spec.items
    cases = {
        "KV-equal": (make_request(spec, "same", sampling=SamplingParams(max_tokens=2, temperature=0.9)), whole),
        "the adapter's alias": (make_request(replace(spec, adapter=adapters(tmp_path)[1][0]), "alias"), whole),
        "another image": (make_request(replace(spec, items=(first, replace(second, identity="f6")))), 2 * BS),
        "another salt": (make_request(replace(spec, salt="t9"), "salt"), 0),
        "no adapter": (make_request(replace(spec, adapter=None), "plain"), 0),
    }
    hits = {name: sched.get_num_new_matched_tokens(request, 0)[0] for name, (request, _) in cases.items()}
    sched.shutdown()
    assert hits == {name: hit for name, (_, hit) in cases.items()}


def test_a_mixed_mode_prompt_has_one_chain_however_far_its_first_lookup_reaches(tmp_path: Path) -> None:
    rows = torch.randn(PROMPT, 4, generator=torch.Generator().manual_seed(1))
    mask = [i % 3 != 0 for i in range(PROMPT)]
    tokens = [5 + i if m else 999 for i, m in enumerate(mask)]  # 999: the renderer's placeholder id

    def mixed(req_id: str) -> Request:
        return Request(req_id, list(tokens), SamplingParams(max_tokens=64), None, prompt_embeds=rows,
                       prompt_is_token_ids=list(mask))

    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")}), shape())
    try:
        put_units(sched, sched.keys_for(mixed("first"), PROMPT // BS))  # looked up and saved as a new request is
        again = mixed("again")  # the same prompt with decode tokens, keyed anew (a preempted request after a reset)
        again.append_output_token_ids([7] * 2 * BS)
        assert sched.get_num_new_matched_tokens(again, 0)[0] == PROMPT // BS * BS
    finally:
        sched.shutdown()


@pytest.mark.parametrize("seed", SEEDS)
def test_an_adapter_is_keyed_by_the_files_vllm_computes_with_or_unsettled(tmp_path: Path, seed: int) -> None:
    """vLLM's worker: an id not loaded (never, or evicted) or sent ``load_inplace`` loads the path's files now."""
    rng = random.Random(seed)
    versions = [b"%d" % v * (200 + 37 * v) for v in range(3)]
    digests = [fingerprints.fingerprint(write_adapter(tmp_path / f"v{v}", w), adapter=True).digest
               for v, w in enumerate(versions)]
    paths = [tmp_path / "p0", tmp_path / "p1"]
    current = {path: rng.randrange(3) for path in paths}
    loaded, keyed_ids, settled = dict[int, int](), set[int](), 0  # vLLM's loaded versions by id; ids keyed
    for path, version in current.items():
        write_adapter(path, versions[version])
    for step in range(24):
        path, roll = rng.choice(paths), rng.random()
        if roll < 0.25:
            current[path] = rng.randrange(3)
            write_adapter(path, versions[current[path]])
            continue
        if roll < 0.35 and loaded:
            del loaded[rng.choice(sorted(loaded))]  # vLLM's LRU evicts it: the next request reloads the files
            continue
        lora_id, inplace = rng.choice((1, 2, 3, 10 + step)), rng.random() < 0.2
        if lora_id not in loaded or inplace:
            loaded[lora_id] = current[path]
        lora = LoRARequest(rng.choice(("a", "b")), lora_id, str(path), load_inplace=inplace)
        key = request_extras(Request(f"q{step}", [1], SamplingParams(max_tokens=1), None, lora_request=lora))["lora"]
        assert key == "blake3:" + digests[loaded[lora_id]] or key.startswith("unsettled:"), f"step {step}: {key}"
        if lora_id not in keyed_ids or inplace:
            assert key == "blake3:" + digests[current[path]], f"step {step}: a fresh id or in-place load unsettled"
        keyed_ids.add(lora_id)
        settled += key.startswith("blake3:")
    assert settled >= 3
