"""GPU weight-sync benchmark: ``python -m bench.weightsync_gpu [--cases 1.7b,8b] [--repeats 3]``.

Needs no vLLM and no Ray (it runs on the lent GPU machines; ``scripts/gpu_check.sh``): a Redis
server for the store's index (``redis-server`` on the PATH) and a CUDA device. Per case, a
synthetic Qwen3-shaped bf16 state dict (names and shapes of Qwen3-1.7B, tied embeddings, or
Qwen3-8B, from ``transformers``' config; random values) is held on the GPU by one trainer rank,
and in the same run it measures:

- the floor: pinned device-to-host and host-to-device bandwidth (1 GiB copies between device
  memory and page-locked host memory, best of 3 each way), as seconds for the model's bytes
  (``floor_s``: one way down plus one way up);
- push (``WeightPusher.push``: a whole push from the GPU state dict into /dev/shm, DMA into the
  registered shard file, checksums on the GPU, committed): the first one into a new file, and the
  median of ``--repeats`` in steady state (over recycled files, after the warm-up versions that
  register each of them once);
- update, as the vLLM worker's update method does it (``weightsync.reader.read_box`` into
  preallocated CUDA tensors through mapped, registered shard files kept across versions, then
  ``ChunkSource.finish``): the whole model (TP=1) and one TP=2 rank's share (vLLM's layouts as
  plain data, ``weightsync.layout.plan_pieces``), verified and not, steady-state medians; the
  bytes each copies from the host; every read is checked against the trainer's tensors;
- the baseline a user would write: ``safetensors`` ``save_file`` of the state dict into /dev/shm,
  then ``load_file(device="cuda")``;
- ratios: (push + verified update) over the floor, the baseline over it, and forge/torchstore's
  published 48.8 s for the 8B shape over it.

``--device cpu --cases tiny`` runs the same code paths without CUDA (plain copies into the mapped
files; the tests use it). Prints a table and writes ``bench/results/weightsync_gpu.json``
(``--out``): a list with one object per case.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "weightsync_gpu.json"
# (hidden, layers, intermediate, vocab, heads, kv_heads, head_dim, tied embeddings)
CASES = {
    "tiny": (64, 2, 192, 512, 4, 2, 16, True),
    "1.7b": (2048, 28, 6144, 151936, 16, 8, 128, True),
    "8b": (4096, 36, 12288, 151936, 32, 8, 128, False),
}
FORGE_8B_S = 48.8  # forge/torchstore, Qwen3-8B shape, push 5.1 s + update 43.7 s (forge#728)
WARMUP_VERSIONS = 3  # a file per version until retired ones come back: each registered once
COPY_BYTES = 2**30


def state_dict_shapes(case: str) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the Qwen3 model of ``case`` (tied: no ``lm_head``)."""
    from transformers import Qwen3ForCausalLM

    from bench.weightsync import qwen3_config

    *shape, tied = CASES[case]
    config = qwen3_config(tuple(shape), torch.bfloat16)
    config.tie_word_embeddings = tied
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if tied:
        shapes.pop("lm_head.weight", None)
    return shapes


def random_state_dict(shapes: dict[str, tuple[int, ...]], device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return {
        k: torch.randn(s, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16) for k, s in shapes.items()
    }


def tp_pieces(case: str, rank: int, tp: int) -> list:
    """What TP rank ``rank`` of ``tp`` vLLM workers reads of the model of ``case``: its fused
    parameters' pieces (vLLM's layouts, as plain data)."""
    from weightsync.layout import Layout, plan_pieces

    hidden, layers, inter, vocab, heads, kv, head_dim, tied = CASES[case]
    per = {"tp_rank": rank, "tp_size": tp}
    rows = vocab // tp
    vocab_layout = Layout("vocab", vocab_start=rank * rows, vocab_end=(rank + 1) * rows, **per)
    pieces = plan_pieces("model.embed_tokens.weight", (rows, hidden), vocab_layout)
    if not tied:
        pieces += plan_pieces("lm_head.weight", (rows, hidden), vocab_layout)
    q, k = heads // tp * head_dim, max(1, kv // tp) * head_dim
    for i in range(layers):
        p = f"model.layers.{i}."
        qkv = Layout("qkv", q_size=q, k_size=k, v_size=k, kv_rank=rank * min(tp, kv) // tp, **per)
        pieces += plan_pieces(p + "self_attn.qkv_proj.weight", (q + 2 * k, hidden), qkv)
        pieces += plan_pieces(
            p + "self_attn.o_proj.weight", (hidden, heads * head_dim // tp), Layout("row", dim=1, **per)
        )
        merged = Layout("merged", output_sizes=(inter, inter), **per)
        pieces += plan_pieces(p + "mlp.gate_up_proj.weight", (2 * inter // tp, hidden), merged)
        pieces += plan_pieces(p + "mlp.down_proj.weight", (hidden, inter // tp), Layout("row", dim=1, **per))
        for norm, n in [("self_attn.q_norm.weight", head_dim), ("self_attn.k_norm.weight", head_dim)]:
            pieces += plan_pieces(p + norm, (n,), Layout("replicated"))
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            pieces += plan_pieces(p + norm, (hidden,), Layout("replicated"))
    pieces += plan_pieces("model.norm.weight", (hidden,), Layout("replicated"))
    return pieces


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_floor(device: torch.device) -> tuple[float, float]:
    """(device-to-host, host-to-device) bytes per second between device memory and pinned host
    memory (best of 3 copies of ``COPY_BYTES``); on the CPU, a copy into a warm buffer both ways."""
    pinned = device.type == "cuda"
    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.ones(COPY_BYTES, dtype=torch.uint8, device=device)
    host.copy_(dev)
    speeds = []
    for dst, src in ((host, dev), (dev, host)):
        best = float("inf")
        for _ in range(3):
            _sync(device)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=pinned)
            _sync(device)
            best = min(best, time.perf_counter() - t)
        speeds.append(COPY_BYTES / best)
    return speeds[0], speeds[1]


class Worker:
    """A policy worker's side without vLLM: its live tensors on the device and the mapped shard
    files it keeps across versions, updated from the store like the update method does."""

    def __init__(self, pieces: list, device: torch.device) -> None:
        from weightsync.host_memory import MappedFiles

        self.pieces = pieces
        self.live = {
            name: torch.empty(shape, dtype=torch.bfloat16, device=device) for name, shape in _fused(pieces).items()
        }
        self.mappings = MappedFiles(register=device.type == "cuda")
        self.device = device

    def update(self, store, version: int, verify: bool) -> tuple[float, int]:
        """(seconds, bytes copied from the host) of reading every piece of ``version``."""
        from weightsync.reader import ChunkSource, read_box

        _sync(self.device)
        start = time.perf_counter()
        index = store.index(version)
        source = ChunkSource(store.url, version, verify, mappings=self.mappings, mapped_reads=True)
        nbytes = 0
        try:
            for piece in self.pieces:
                dst = self.live[_param_of(piece)][tuple(slice(lo, hi) for lo, hi in piece.dst)]
                nbytes += read_box(piece.hf_name, index[piece.hf_name], piece.src, dst, source)
            source.finish()
        finally:
            source.close()
        _sync(self.device)
        return time.perf_counter() - start, nbytes

    def check(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Every piece holds the trainer's values, bit for bit."""
        for piece in self.pieces:
            got = self.live[_param_of(piece)][tuple(slice(lo, hi) for lo, hi in piece.dst)]
            want = state_dict[piece.hf_name][tuple(slice(lo, hi) for lo, hi in piece.src)]
            if not torch.equal(got, want):
                raise AssertionError(f"update read wrong values for {piece.hf_name} box {piece.src}")

    def close(self) -> None:
        self.mappings.close()


def _param_of(piece) -> str:
    """The fused vLLM parameter a piece fills (the table's names: qkv_proj, gate_up_proj)."""
    from weightsync.layout import STACKED_PARAMS

    module, _, leaf = piece.hf_name.rpartition(".")
    stem, _, name = module.rpartition(".")
    for fused, hf, _ in STACKED_PARAMS:
        if name == hf:
            return f"{stem}.{fused}.{leaf}"
    return piece.hf_name


def _fused(pieces: list) -> dict[str, list[int]]:
    """Each fused parameter's shape: the end of the pieces' destination boxes, per dimension."""
    shapes: dict[str, list[int]] = {}
    for piece in pieces:
        end = [hi for _, hi in piece.dst]
        name = _param_of(piece)
        shapes[name] = end if name not in shapes else list(map(max, shapes[name], end))
    return shapes


def baseline(state_dict: dict[str, torch.Tensor], root: Path, device: torch.device) -> tuple[float, float]:
    """(save, load) seconds of ``safetensors``: save_file into shared memory, load_file onto the device."""
    from safetensors.torch import load_file, save_file

    path = root / "baseline.safetensors"
    _sync(device)
    t = time.perf_counter()
    save_file(state_dict, str(path))
    saved = time.perf_counter()
    loaded = load_file(str(path), device=str(device))
    _sync(device)
    done = time.perf_counter()
    ok = all(torch.equal(loaded[k], v) for k, v in state_dict.items())
    del loaded
    path.unlink()
    if not ok:
        raise AssertionError("the safetensors baseline read back other values")
    return saved - t, done - saved


def run_case(case: str, device: torch.device, repeats: int, redis_url: str, shm_root: Path) -> dict:
    from weightsync.config import WeightSyncConfig
    from weightsync.push import WeightPusher
    from weightsync.store import WeightStore

    shapes = state_dict_shapes(case)
    sd = random_state_dict(shapes, device)
    model_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"{case}: {len(sd)} tensors, {model_bytes / 2**30:.2f} GiB bf16 on {device}", flush=True)
    d2h, h2d = copy_floor(device)
    floor_s = model_bytes / d2h + model_bytes / h2d
    save_s, load_s = baseline(sd, shm_root, device)
    print(
        f"  floor {floor_s:.3f} s (D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s); "
        f"safetensors save {save_s:.2f} s + load {load_s:.2f} s",
        flush=True,
    )
    store = WeightStore(redis_url, f"gpu-bench-{case}-{uuid.uuid4().hex[:6]}")
    sync = WeightSyncConfig(
        "shm",
        str(shm_root),
        keep_last=1,
        checksums=True,
        verify=True,
        delta=False,
        delta_max_live=2.0,
        delta_elements=False,
    )
    pusher = WeightPusher(store, sync, dtype="bfloat16", mapped_writes=True)
    tp1 = Worker(tp_pieces(case, 0, 1), device)
    tp2 = Worker(tp_pieces(case, 0, 2), device)
    pushes, first = [], {}
    updates: dict[str, list[float]] = {"tp1": [], "tp1_unverified": [], "tp2": [], "tp2_unverified": []}
    read, last = {}, {}
    try:
        for version in range(1, WARMUP_VERSIONS + repeats + 1):
            _sync(device)
            stats = pusher.push(sd, version)
            steady = version > WARMUP_VERSIONS
            if version == 1:
                first["push_s"] = stats["push_s"]
            elif steady:
                pushes.append(stats["push_s"])
            for name, worker in (("tp1", tp1), ("tp2", tp2)):
                for verify in (True, False):
                    seconds, nbytes = worker.update(store, version, verify)
                    key = name if verify else name + "_unverified"
                    if version == 1:
                        first[key] = seconds
                    elif steady:
                        updates[key].append(seconds)
                    read[key] = nbytes
                    last[key] = seconds
            print(
                f"  v{version}: push {stats['push_s']:.3f} s (over a spare: {stats['wrote_over_spare']}), "
                f"update TP1 {last['tp1']:.3f} s ({last['tp1_unverified']:.3f} s unverified), "
                f"TP2 rank {last['tp2']:.3f} s",
                flush=True,
            )
        tp1.check(sd)
        tp2.check(sd)
    finally:
        tp1.close()
        tp2.close()
        pusher.remove_all()
        store.close()
    push_s = statistics.median(pushes)
    update_s = statistics.median(updates["tp1"])
    ours = push_s + update_s
    return {
        "case": case,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model_bytes": model_bytes,
        "tensors": len(sd),
        "d2h_bytes_per_s": d2h,
        "h2d_bytes_per_s": h2d,
        "floor_s": floor_s,
        "push_s": push_s,
        "update_s": update_s,
        "update_unverified_s": statistics.median(updates["tp1_unverified"]),
        "update_tp2_s": statistics.median(updates["tp2"]),
        "update_tp2_unverified_s": statistics.median(updates["tp2_unverified"]),
        "first_push_s": first["push_s"],
        "first_update_s": first["tp1"],
        "first_update_tp2_s": first["tp2"],
        "bytes_read_tp1": read["tp1"],
        "bytes_read_tp2": read["tp2"],
        "bytes_read_tp2_unverified": read["tp2_unverified"],
        "baseline_save_s": save_s,
        "baseline_load_s": load_s,
        "baseline_s": save_s + load_s,
        "sync_over_floor": ours / floor_s,
        "baseline_over_sync": (save_s + load_s) / ours,
        "forge_over_sync": FORGE_8B_S / ours if case == "8b" else None,
        "repeats": repeats,
        "torch": torch.__version__,
    }


def print_table(rows: list[dict]) -> None:
    header = [
        "case",
        "GiB",
        "floor s",
        "push s",
        "upd s",
        "upd nv s",
        "tp2 s",
        "tp2 nv s",
        "1st push s",
        "1st upd s",
        "tp2 read",
        "base s",
        "x floor",
        "base x",
        "forge x",
    ]
    lines = [header]
    for r in rows:
        lines.append(
            [
                r["case"],
                f"{r['model_bytes'] / 2**30:.2f}",
                f"{r['floor_s']:.3f}",
                f"{r['push_s']:.3f}",
                f"{r['update_s']:.3f}",
                f"{r['update_unverified_s']:.3f}",
                f"{r['update_tp2_s']:.3f}",
                f"{r['update_tp2_unverified_s']:.3f}",
                f"{r['first_push_s']:.3f}",
                f"{r['first_update_s']:.3f}",
                f"{r['bytes_read_tp2'] / r['model_bytes']:.2f}",
                f"{r['baseline_s']:.2f}",
                f"{r['sync_over_floor']:.1f}",
                f"{r['baseline_over_sync']:.1f}",
                "" if r["forge_over_sync"] is None else f"{r['forge_over_sync']:.1f}",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))
    print(
        "x floor: (push + verified TP=1 update) / floor (target <= 3); base x: safetensors save + load over it "
        "(target >= 10); forge x: 48.8 s over it (8b, target >= 25); tp2 read: bytes a TP=2 rank copies / model"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1.7b,8b", help=f"comma-separated: {', '.join(CASES)}")
    parser.add_argument("--repeats", type=int, default=3, help="steady-state versions timed (median)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to run the same code paths without a GPU")
    parser.add_argument("--shm-root", default="/dev/shm", help="where the shard files go")
    parser.add_argument("--out", default=str(RESULTS), help="the JSON results file")
    args = parser.parse_args()
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose from {list(CASES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; --device cpu runs the same code paths on the CPU")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main() -> None:
    from weightsync.redis_server import LocalRedis

    args = parse_args()
    device = torch.device(args.device)
    root = Path(tempfile.mkdtemp(prefix="ws-gpu-bench-", dir=args.shm_root))
    rows = []
    try:
        with LocalRedis() as redis:
            for case in args.cases.split(","):
                rows.append(run_case(case, device, args.repeats, redis.url, root))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
