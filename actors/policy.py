"""Policy actor: a vLLM engine that samples rollouts and takes weight updates in place."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import ray

from actors import vllm_cpu_async_scheduling, vllm_cpu_waits
from actors.config import IN_FLIGHT_MODES, PolicyConfig
from actors.engine_activity import EngineActivity
from actors.engine_errors import engine_start_error, is_engine_start_failure, log_sizes, own_logs
from actors.engine_shm import EngineFileRecord, private_ipc_dir, remove_ipc_dir, remove_recorded
from actors.modeling import check_model_dir
from weightsync.store import WeightStore

if TYPE_CHECKING:
    from vllm import RequestOutput, TokensPrompt

EXTENSION = "actors.policy_worker.PolicyWorkerExtension"
ABORT_AGAIN_S = 0.05  # an update that aborts requests in flight aborts the ones left this often


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
    seconds: float = 0.0  # spent in the engine(s), from admitting the requests to the last sample
    resampled: int = 0  # prompts an update aborted and the next version sampled again (policy.in_flight)

    @property
    def version(self) -> int:
        """The oldest version among the prompts' (all equal when one engine sampled them)."""
        return min(self.versions)


@ray.remote(num_cpus=0)
class Policy:
    """A vLLM engine (``AsyncLLM``: continuous batching) behind a Ray actor.

    Calls run concurrently: every prompt of every ``generate`` call is its own request, and the
    engine batches whatever is in flight. Weight updates reach the engine between requests: an
    update stops admitting new requests, lets the ones in flight finish on the version that
    started them (``in_flight="finish"``) or aborts them and samples them again once the new
    version is loaded (``"resample"``), loads the version, and admits again. Each prompt's samples
    carry the version that produced them.

    Ray does not promise that an async actor's calls start in the order they were made, so a
    caller that needs that order (a batch asked for before an update is sampled by the version
    before it) numbers its calls: ``seq`` 0, 1, 2, ... per process of this actor (``status``
    says how many were admitted); a numbered call waits for every lower number to be admitted.
    """

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
        engine_activity: str | None = None,
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
        trainer rank, ``placement.layout=colocated``); None: vLLM's default. ``engine_activity``:
        the file where this replica (byte ``cpu_share[0]``) marks when its engine works, for the
        trainer ranks on this host (``actors.engine_activity``); None: not marked."""
        check_model_dir(model_path)  # here, on this actor's host (see actors.modeling)
        self.config = config
        self.verify = verify
        other_workers: set[int] = set()  # CPUs other replicas' workers on this host are bound to
        if config.omp_threads_bind:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = config.omp_threads_bind
        else:
            other_workers = _bind_tp_workers_on_cpu(config.tp, *cpu_share)
        if _on_cpu():
            os.environ[vllm_cpu_waits.ENV] = "1"  # the engine's processes inherit it
            os.environ[vllm_cpu_async_scheduling.ENV] = "1" if config.async_scheduling else "0"
        # The engine's ZeroMQ sockets go to a folder of its own, removed when it stops (vLLM
        # leaves them in the temp folder otherwise; see actors.engine_shm).
        self.ipc_dir = private_ipc_dir()
        os.environ["VLLM_RPC_BASE_PATH"] = str(self.ipc_dir)
        if engine_files_record:
            remove_recorded(engine_files_record)  # what a killed earlier process of this replica left
        self.engine_files = EngineFileRecord(engine_files_record, ipc_dir=self.ipc_dir) if engine_files_record else None
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        logs_before = log_sizes(own_logs())
        try:
            self.engine = AsyncLLM.from_engine_args(
                AsyncEngineArgs(
                    model=model_path,
                    tensor_parallel_size=config.tp,
                    dtype=config.dtype,
                    max_model_len=config.max_model_len,
                    kv_cache_memory_bytes=config.kv_cache_mib * 2**20,
                    max_num_seqs=config.max_num_seqs,
                    max_num_batched_tokens=config.max_num_batched_tokens,
                    enforce_eager=config.enforce_eager,
                    # None: vLLM decides (on where its executor supports it); False: off.
                    async_scheduling=None if config.async_scheduling else False,
                    seed=seed,
                    worker_extension_cls=EXTENSION,
                    disable_log_stats=True,
                    **({} if gpu_memory_fraction is None else {"gpu_memory_utilization": gpu_memory_fraction}),
                )
            )
        except BaseException as e:
            remove_ipc_dir(self.ipc_dir)  # the start failed: nothing will use these sockets
            # vLLM says only "Engine core initialization failed. See root cause above": name it.
            reason = engine_start_error(logs_before) if is_engine_start_failure(e) else None
            if reason is not None:
                raise reason from e
            raise
        if self.engine_files is not None:
            self.engine_files.started()
        if _on_cpu():
            _keep_engine_processes_off_worker_cpus(other_workers)
        self.redis_url = redis_url
        self.run = run
        self.replica = replica
        self.version = 0
        self._invalid: str | None = None  # why the weights cannot be used, after a failed update
        # Dense buffers for the weights vLLM-cpu repacks, allocated by the first call (the
        # engine's RPCs need the actor's event loop) rather than in the first weight update (see
        # WeightSyncExtension.prepare_weight_updates).
        self.prepared_bytes_per_worker: list[int] | None = None
        self._prepare_lock = asyncio.Lock()
        self._admitted = 0  # numbered calls admitted so far
        self._updating = False  # an update is waiting for the engine to empty, or loading
        self._in_engine: dict[str, bool] = {}  # request id -> whether an update may abort it
        self._state = asyncio.Condition()  # guards the three above
        self._requests = 0  # request ids handed out
        self.resampled = 0  # prompts aborted by an update and sampled again
        self._aborted: list[str] = []  # their request ids, whose logprobs the worker may keep
        self.activity = EngineActivity(engine_activity, slot=cpu_share[0]) if engine_activity else None

    # -- admission: numbered calls in order, nothing in the engine across an update --------------

    async def _ready(self) -> None:
        if self.prepared_bytes_per_worker is None:
            async with self._prepare_lock:
                if self.prepared_bytes_per_worker is None:
                    await self.engine.collective_rpc("capture_sampled_logprobs")
                    self.prepared_bytes_per_worker = await self.engine.collective_rpc("prepare_weight_updates")

    async def _turn(self, seq: int | None) -> None:
        """Wait (holding ``_state``) until every call numbered below ``seq`` was admitted."""
        if seq is None:
            return
        if seq < self._admitted:
            raise RuntimeError(f"policy {self.replica!r}: call number {seq} came after number {self._admitted - 1}")
        await self._state.wait_for(lambda: self._admitted == seq)

    def _next_turn(self, seq: int | None) -> None:
        if seq is not None:
            self._admitted = seq + 1
            self._state.notify_all()

    async def _take_turn(self, seq: int | None) -> None:
        """(Holding ``_state``.) Wait for ``seq``'s turn and for a pending update to finish, then
        hand the turn to the next numbered call."""
        await self._turn(seq)
        await self._state.wait_for(lambda: not self._updating)
        self._next_turn(seq)

    def _request_id(self) -> str:
        self._requests += 1
        return f"{self.replica}-{self._requests}"

    async def _admit(self, prompts: int, seq: int | None = None, resample: bool = False) -> tuple[list[str], int]:
        """Admit ``prompts`` requests once no update is pending (in ``seq``'s turn): their ids and
        the version that will sample them (no update can start while they are in the engine).
        ``resample``: an update with ``in_flight="resample"`` may abort them."""
        await self._ready()
        async with self._state:
            await self._take_turn(seq)
            self._check_weights()
            ids = [self._request_id() for _ in range(prompts)]
            self._in_engine.update(dict.fromkeys(ids, resample))
            self._mark_activity()
            return ids, self.version

    async def _leave(self, request_id: str) -> None:
        async with self._state:
            self._in_engine.pop(request_id, None)
            self._mark_activity()
            self._state.notify_all()

    async def _final(self, request_id: str, prompt, params) -> RequestOutput:
        """The request's final output (the engine batches it with everything else in flight)."""
        final = None
        try:
            async for out in self.engine.generate(prompt, params, request_id):
                final = out
        finally:
            await self._leave(request_id)
        return final

    def _mark_activity(self) -> None:
        """(Holding ``_state``.) Busy while requests are in the engine or an update is pending."""
        if self.activity is not None:
            self.activity.mark(bool(self._in_engine) or self._updating)

    def _check_weights(self) -> None:
        if self._invalid is not None:
            raise PolicyWeightsInvalid(self._invalid)

    # -- sampling ------------------------------------------------------------------------------

    async def generate(self, prompts: list[str], n: int, seed: int | None = None, seq: int | None = None) -> Generation:
        """``n`` samples per prompt (at ``policy.temperature``, at most ``policy.max_tokens``
        each) and the policy version that produced each prompt's.

        Log-probabilities are those of the sampling distribution: with ``temperature=1`` and no
        top-k/top-p they are the model's own, which the trainer recomputes.

        The actor tokenizes the prompts and decodes the samples itself, each in one batched call
        of the engine's tokenizer, rather than vLLM per request and (decoding) per token as it
        goes: the engine's front end shares its process, and its per-step work is what a batch
        of short completions costs most of.
        """
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        tokenizer = self.engine.get_tokenizer()
        prompt_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]  # as vLLM's renderer does
        ids, version = await self._admit(len(prompts), seq, resample=True)
        start = time.perf_counter()  # admitted: the wait for an earlier update is not the engine's
        # vLLM seeds a prompt's n samples seed, seed+1, ...: give each prompt its own range so that
        # different prompts do not share random streams.
        params = [
            SamplingParams(
                n=n,
                temperature=self.config.temperature,
                max_tokens=self.config.max_tokens,
                logprobs=0,  # the sampled token's alone, kept by the worker (see _take_logprobs)
                detokenize=False,
                seed=None if seed is None else seed + i * n,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            for i in range(len(prompts))
        ]
        outputs = await asyncio.gather(
            *(
                self._sample(rid, version, TokensPrompt(prompt_token_ids=p), sp)
                for rid, p, sp in zip(ids, prompt_ids, params, strict=True)
            )
        )
        logprobs = await self._take_logprobs([out for out, _ in outputs], n)
        completions = [c for out, _ in outputs for c in out.outputs]
        # vLLM's own detokenizer defaults: special tokens (EOS) skipped.
        texts = iter(tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True))
        samples = [
            [
                Sample(list(c.token_ids), lps, next(texts), c.finish_reason == "stop")
                for c, lps in zip(out.outputs, group_logprobs, strict=True)
            ]
            for (out, _), group_logprobs in zip(outputs, logprobs, strict=True)
        ]
        return Generation(
            [list(p) for p in prompt_ids],
            samples,
            [v for _, v in outputs],
            time.perf_counter() - start,
            sum(v != version for _, v in outputs),
        )

    async def _sample(self, request_id: str, version: int, prompt: TokensPrompt, params) -> tuple[RequestOutput, int]:
        """One prompt's samples and the version that produced them: sampled again, whole, by the
        next version when an update aborted them (``in_flight="resample"``)."""
        while True:
            out = await self._final(request_id, prompt, params)
            if len(out.outputs) == params.n and all(c.finish_reason in ("stop", "length") for c in out.outputs):
                return out, version
            self.resampled += 1
            self._aborted.append(request_id)
            (request_id,), version = await self._admit(1, resample=True)

    async def _take_logprobs(self, outputs: list[RequestOutput], n: int) -> list[list[list[float]]]:
        """Each sample's logprobs, from the worker that sampled it (``actors.sampled_logprobs``:
        vLLM's own path costs the engine's front end more than the rest of a short sample)."""
        aborted, self._aborted = self._aborted, []
        ids = [out.request_id for out in outputs]
        taken = (await self.engine.collective_rpc("take_sampled_logprobs", args=(ids, n, aborted)))[0]
        logprobs = []
        for out, kept in zip(outputs, taken, strict=True):
            row = []
            for c in out.outputs:
                pair = kept[c.index] if c.index < n else None
                # With async scheduling the worker samples one step past a stop token before the
                # scheduler sees it: the engine drops that token, and so does this.
                length = len(c.token_ids)
                if pair is None or pair[0][:length] != list(c.token_ids):
                    raise RuntimeError(
                        f"policy {self.replica!r}: the engine's worker kept no logprobs, or logprobs of other tokens, "
                        f"for sample {c.index} of request {out.request_id!r}"
                    )
                row.append(pair[1][:length])
            logprobs.append(row)
        return logprobs

    async def greedy(
        self, prompts: list[str], max_tokens: int | None = None, seq: int | None = None
    ) -> list[Completion]:
        """Greedy completion of each prompt (at most ``max_tokens``, default ``policy.max_tokens``)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens or self.config.max_tokens, output_kind=RequestOutputKind.FINAL_ONLY
        )
        ids, _ = await self._admit(len(prompts), seq)
        outputs = await asyncio.gather(*(self._final(rid, p, params) for rid, p in zip(ids, prompts, strict=True)))
        return [
            Completion(o.outputs[0].text, o.outputs[0].finish_reason == "stop", len(o.outputs[0].token_ids))
            for o in outputs
        ]

    async def prompt_logprobs(self, token_ids: list[list[int]]) -> list[list[float | None]]:
        """Log-probability of each given token under the live weights (None for the first)."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=1, prompt_logprobs=0, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY
        )
        ids, _ = await self._admit(len(token_ids))
        outputs = await asyncio.gather(
            *(self._final(rid, TokensPrompt(prompt_token_ids=t), params) for rid, t in zip(ids, token_ids, strict=True))
        )
        return [
            [None if step is None else step[tok].logprob for tok, step in zip(t, o.prompt_logprobs)]
            for t, o in zip(token_ids, outputs)
        ]

    async def status(self) -> dict:
        """This replica's name, loaded version and numbered calls admitted (answers once its
        engine has started)."""
        await self._ready()
        return {
            "replica": self.replica,
            "version": self.version,
            "pid": os.getpid(),
            "calls": self._admitted,
            "in_engine": len(self._in_engine),
            "resampled": self.resampled,
        }

    async def kept_sampled_logprobs(self) -> list[int]:
        """Per worker, the requests whose sampled logprobs it keeps that no call has taken (0
        once every sampling call has returned)."""
        await self._ready()
        return await self.engine.collective_rpc("kept_sampled_logprobs")

    # -- weight updates --------------------------------------------------------------------------

    async def update_weights(self, version: int, in_flight: str = "finish", seq: int | None = None) -> dict:
        """Load ``version`` from the store into every worker, in place, between requests: the
        requests in the engine finish first (``in_flight="finish"``) or are aborted and sampled
        again after it (``"resample"``); requests made meanwhile wait for it.

        The replica leases the version before reading it, so the trainer cannot retire it midway.
        If the update fails once workers have started copying (a checksum mismatch, a lost
        shard), some slices hold the new version and some the old: the policy then raises
        ``PolicyWeightsInvalid`` on every sampling call until an update succeeds.
        """
        if in_flight not in IN_FLIGHT_MODES:
            raise ValueError(f"in_flight={in_flight!r}: expected one of {list(IN_FLIGHT_MODES)}")
        await self._ready()
        async with self._state:
            await self._take_turn(seq)  # an earlier update first
            self._updating = True
            self._mark_activity()
        try:
            waited = time.perf_counter()
            # An admitted request reaches vLLM's front end a moment later: an abort misses one that
            # has not yet, so resample aborts the requests left until none is.
            again_s = ABORT_AGAIN_S if in_flight == "resample" else None
            while True:
                abortable = [rid for rid, resample in self._in_engine.items() if resample]
                if in_flight == "resample" and abortable:
                    await self.engine.abort(abortable)
                async with self._state:
                    try:
                        await asyncio.wait_for(self._state.wait_for(lambda: not self._in_engine), again_s)
                        break
                    except TimeoutError:
                        continue
            waited = time.perf_counter() - waited
            return await self._load(version) | {"in_flight_wait_s": waited}
        finally:
            async with self._state:
                self._updating = False
                self._mark_activity()
                self._state.notify_all()

    async def _load(self, version: int) -> dict:
        store = WeightStore(self.redis_url, self.run)
        try:
            store.lease(version, self.replica)
        finally:
            store.close()
        try:
            stats = await self.engine.collective_rpc(
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
        await self.engine.reset_prefix_cache()
        self.version = version
        return {
            "version": version,
            "update_s": max(s["update_s"] for s in stats),
            # Of it (the slowest worker's each): reading and copying the weights, then vLLM's
            # repacking of the layers that changed (on CPU, the packed form its GEMMs use).
            "update_copy_s": max(s["copy_s"] for s in stats),
            "update_repack_s": max(s["repack_s"] for s in stats),
            "bytes_read_per_worker": [s["bytes_read"] for s in stats],
            # Slices delta sync did not read again: their stored pieces equal the loaded version's,
            # or differ only by element patches (then only the patches were read).
            "bytes_skipped_per_worker": [s["bytes_skipped"] for s in stats],
            # Dense buffers this update had to allocate (0: prepared at start).
            "dense_bytes_allocated_per_worker": [s["dense_bytes_allocated"] for s in stats],
        }

    async def close(self) -> None:
        """Stop the vLLM engine (its processes and shared-memory queues) before Ray ends the actor."""
        self.engine.shutdown()
        if self.engine_files is not None:
            self.engine_files.remove()  # what the shutdown left, if anything
        remove_ipc_dir(self.ipc_dir)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _bind_tp_workers_on_cpu(tp: int, replica: int, replicas: int) -> set[int]:
    """On vLLM-cpu, give each TP worker its own share of this machine's cores where vLLM's
    ``auto`` binding would refuse (fewer NUMA nodes than workers) or would bind several replicas'
    workers to the same cores (see ``actors.cpu_binding``). A ``VLLM_CPU_OMP_THREADS_BIND`` set
    by the user other than ``auto`` is left alone. Returns the CPUs the other replicas' workers
    on this host are bound to (none where vLLM or the user binds)."""
    if tp * replicas <= 1 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto" or not _on_cpu():
        return set()
    import vllm.utils.cpu_resource_utils as cpus

    from actors.cpu_binding import tp_thread_binding

    allowed, numa_nodes = cpus.get_allowed_cpu_list(), cpus.get_visible_memory_node()

    def binding(r: int) -> str | None:
        return tp_thread_binding(tp, allowed, numa_nodes, r, replicas)

    own = binding(replica)
    if own is None:
        return set()
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = own
    return {cpu for r in range(replicas) if r != replica for cpu in cpus.parse_id_list(binding(r).replace("|", ","))}


def _keep_engine_processes_off_worker_cpus(other_workers: set[int]) -> None:
    """Bind this process and the engine's processes other than its TP workers (the engine core)
    to the CPUs no worker is bound to (``actors.cpu_binding.engine_process_cpus``), where there
    are any. Called once the engine has started (its workers' threads bound)."""
    import psutil

    from actors.cpu_binding import engine_process_cpus

    me = psutil.Process()
    processes = [me, *me.children(recursive=True)]
    is_worker = {p.pid: p.name().startswith("VLLM::Worker") for p in processes}
    worker_threads = [t.id for p in processes if is_worker[p.pid] for t in p.threads()]
    free = engine_process_cpus(os.sched_getaffinity(0), [_affinity(t) for t in worker_threads], other_workers)
    if free is None:
        return
    for p in processes:
        if not is_worker[p.pid]:
            for t in p.threads():
                with contextlib.suppress(ProcessLookupError):  # a thread that has ended since
                    os.sched_setaffinity(t.id, free)


def _affinity(thread_id: int) -> set[int]:
    try:
        return os.sched_getaffinity(thread_id)
    except ProcessLookupError:  # ended since: bound nowhere
        return set()
