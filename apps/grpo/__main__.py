"""``python -m apps.grpo [key=value ...]``: a GRPO or PPO run (``algo=...``) on a task
(``task=...``) with Hydra configs from ``configs/``.

Set-up order matters: every check on user input (config values, model.path and its config.json,
the task's data, the reward function, redis.url, the output folder) runs before anything is
written or started, so bad input leaves nothing behind. Ray starts (or is joined) before the room
for the weights is checked and the output folder is written: whether the run uses GPUs, and so
the policy's dtype, is the Ray cluster's answer. A run that fails before its first step removes
the output folder it made, so that the same command can simply be run again.
"""

from __future__ import annotations

import logging
import math
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path

import hydra
from omegaconf import OmegaConf
from rich.console import Console

from apps.grpo import interrupts
from apps.grpo.config import ConfigError, RunConfig, check_override_keys, load_config, register
from apps.grpo.inputs import load_task, resolve_model_path
from apps.grpo.trackers import logger_names, open_trackers

register()
log = logging.getLogger("apps.grpo")


def check_data_plane_room(
    cfg: RunConfig, model_path: str, sync_dtype: str, redis_url: str, shm_here: bool = True
) -> None:
    """Stop before any actor starts if the data plane cannot hold the weight versions the run
    keeps (the model's tensors at the sync dtype, ``keep_last + 1`` times): free space in
    ``weightsync.shm_root`` on this host when the policy runs here (``shm_here``; the trainer
    ranks check again, on their node, from their exact shards when they start), or a capped
    Redis's ``maxmemory`` less what it already uses."""
    from safetensors import safe_open

    from weightsync.push import DTYPES
    from weightsync.redis_space import check_redis_room, redis_memory
    from weightsync.shm_space import check_shm_room, free_bytes, shard_file_bytes

    memory = redis_memory(redis_url) if cfg.weightsync.data_plane == "redis" else None
    if cfg.weightsync.data_plane == "redis" and memory is None:
        return  # no limit to check against
    numel = tensors = 0
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors file is not iterable)
                numel += math.prod(f.get_slice(key).get_shape())
                tensors += 1
    ranks, keep_last, delta = cfg.trainer.ranks, cfg.weightsync.keep_last, cfg.weightsync.delta
    file_bytes = shard_file_bytes(-(-numel // ranks), DTYPES[sync_dtype], tensors)
    if memory is not None:
        check_redis_room(redis_url, *memory, ranks, file_bytes, keep_last, delta)
        return
    if not shm_here:
        return
    root = cfg.weightsync.shm_root
    check_shm_room(root, free_bytes(root), ranks, file_bytes, keep_last, delta)


def resume_step(out_dir: Path, cfg) -> int:
    """The step a run starts at: 0, or for ``resume=true`` the newest checkpoint's next step."""
    from apps.grpo.checkpoints import LoopState
    from checkpointing.folders import newest_checkpoint

    return LoopState.load(newest_checkpoint(out_dir / "checkpoints")[1]).step if cfg.resume else 0


def check_output_dir(cfg) -> Path:
    """The run's output folder; for ``resume=true`` it must hold a complete checkpoint."""
    from checkpointing.folders import CheckpointError, newest_checkpoint

    out = Path(cfg.output_dir) / cfg.run_name
    if cfg.resume:
        if cfg.overwrite:
            raise ConfigError("resume=true continues outputs/<run_name>; overwrite=true would delete it: pass one")
        if not out.is_dir():
            raise ConfigError(f"resume=true: there is no run folder {out}; pass the run_name of the run to continue")
        try:
            newest_checkpoint(out / "checkpoints")
        except CheckpointError as e:
            raise ConfigError(f"resume=true: {e}") from e
    elif out.exists() and not cfg.overwrite:
        raise ConfigError(
            f"output folder {out} already exists; choose another run_name=..., pass overwrite=true to replace it, "
            "or resume=true to continue it from its newest checkpoint"
        )
    return out


def check_store_of_earlier_run(cfg, redis_url: str, console: Console) -> None:
    """A shared Redis (``redis.url``) keeps what a run of this name that did not finish (killed,
    crashed) left there: its weight versions, leases and, with the Redis data plane, the weights.
    A new run's versions would be retired behind those at once (a resumed run's number is lower
    still), so they are removed first, with ``overwrite=true`` or ``resume=true``. Otherwise they
    may be a run of this name that is live on another machine: an error, and nothing changes."""
    from weightsync.store import WeightStore

    store = WeightStore(redis_url, cfg.run_name)
    try:
        stale = store.run_keys()
        if not stale:
            return
        if not (cfg.overwrite or cfg.resume):
            raise ConfigError(
                f"Redis {redis_url} already holds weight versions of run {cfg.run_name!r}, left by an earlier run "
                "of this name that did not finish, or used by one running now: choose another run_name=..., or "
                "pass overwrite=true (or resume=true) to remove them"
            )
        keys, held = store.clear_run(stale)
        console.print(f"removed {keys} Redis keys ({held / 2**20:.1f} MiB) that an earlier run {cfg.run_name!r} left")
    finally:
        store.close()


def prepare_output_dir(cfg, out: Path) -> None:
    if out.exists() and cfg.overwrite:
        shutil.rmtree(out)  # replace: no metrics or checkpoints of the old run may survive
    out.mkdir(parents=True, exist_ok=True)


def write_config(cfg, out: Path, resolved: dict, console) -> None:
    """``config.yaml`` holds the run's resolved config; a resume keeps it and says what changed."""
    path = out / "config.yaml"
    if cfg.resume and path.exists():
        before = OmegaConf.to_container(OmegaConf.load(path))
        changed = sorted(_changed_keys(before, resolved) - {"resume", "steps", "overwrite"})
        if changed:
            console.print(f"[yellow]warning:[/] resuming with changed config keys: {changed}")
        (out / f"config.resume-{len(list(out.glob('config.resume-*.yaml'))) + 1}.yaml").write_text(
            OmegaConf.to_yaml(resolved)
        )
        return
    path.write_text(OmegaConf.to_yaml(resolved))


def _changed_keys(a: dict, b: dict, prefix: str = "") -> set[str]:
    out = set()
    for key in set(a) | set(b):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out |= _changed_keys(x, y, f"{prefix}{key}.")
        elif x != y:
            out.add(f"{prefix}{key}")
    return out


def run(hydra_cfg, console: Console) -> dict:
    import ray
    from transformers import AutoTokenizer

    from algos.base import algorithm_class
    from apps.grpo.checkpoints import resume_from_checkpoint
    from apps.grpo.loop import train
    from apps.grpo.node_cleanup import remove_run_files
    from apps.grpo.placement import cluster_gpu_count, plan_placement
    from apps.grpo.run_lock import RunLock, RunLocked, lock_path
    from apps.grpo.start import engine_files_record, start_actors
    from weightsync.push import run_dir
    from weightsync.redis_server import LocalRedis, check_redis

    cfg = load_config(hydra_cfg)
    model_path = resolve_model_path(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    task = load_task(cfg, tokenizer)
    algorithm = algorithm_class(cfg.algo.name)(cfg.algo, cfg.policy.max_tokens)
    console.print(f"task: {task.summary()}")

    with ExitStack() as stack:
        if cfg.redis.url:
            check_redis(cfg.redis.url)
            redis_url = cfg.redis.url
        else:
            redis_url = stack.enter_context(LocalRedis()).url
        shm_dir = run_dir(cfg.weightsync.shm_root, cfg.run_name)
        engine_record = engine_files_record(cfg)
        out_dir = check_output_dir(cfg)
        try:
            stack.enter_context(RunLock(lock_path(cfg.weightsync.shm_root, cfg.run_name)))
        except RunLocked as e:
            raise ConfigError(
                f"run {cfg.run_name!r} is running on this host already (launcher {e}); choose another run_name=..."
            ) from None
        except OSError as e:
            raise ConfigError(f"weightsync.shm_root: cannot make the run's lock file there ({e})") from e
        if cfg.redis.url:
            check_store_of_earlier_run(cfg, redis_url, console)
        if shm_dir.exists() and (not cfg.redis.url or cfg.overwrite or cfg.resume):
            # A run of this name killed without cleanup (SIGKILL, OOM, power): not alive (the lock),
            # and no store can reference its files: a private Redis died with it, a shared one's
            # keys of this run were just removed. Otherwise they may belong to a run on another host.
            leftover = remove_run_files(shm_dir, engine_record)  # with its engine's queues, if it died starting
            console.print(f"removed {leftover / 2**20:.1f} MiB of shared memory left by an earlier run ({shm_dir})")
        # Removed from here, not by the actors, so that it happens even if they died: after
        # ray.shutdown (registered later, so it runs first), the engine's shared-memory queues
        # (left when the policy is ended before its engine finished starting), then the weights,
        # and a shared Redis's keys of the run (it outlives the run; they must not).
        stack.callback(shutil.rmtree, shm_dir, ignore_errors=True)
        stack.callback(_remove_engine_files, engine_record, console)
        if cfg.redis.url:
            stack.callback(_remove_store_keys, redis_url, cfg.run_name, console)
        ray.init(address=cfg.ray.address, include_dashboard=False, log_to_driver=cfg.ray.log_to_driver)
        # A scheduler's SIGTERM unwinds the run like Ctrl-C: actors, Ray, the private Redis and the
        # shared-memory weights are cleaned up; metrics.jsonl keeps every finished step. (Set after
        # ray.init, which installs a handler of its own that aborts the process.)
        interrupts.install()
        stack.callback(ray.shutdown)
        # GPUs or not is the cluster's answer, not this host's: a cluster's head node, where the
        # launcher usually runs, often has no GPU while its workers do.
        use_cuda = cluster_gpu_count() > 0
        policy_dtype = cfg.policy.engine_dtype(use_cuda)
        critic_ranks = cfg.algo.critic.ranks if algorithm.uses_critic else 0
        placement = plan_placement(cfg, use_cuda, algorithm.uses_reference, critic_ranks)
        for notice in placement.notices:
            console.print(notice)
        # Weights in shared memory live on the policy's node: its /dev/shm is checked there, by
        # the trainer ranks as they start, when that is not this host (a GPU-less head node's
        # small /dev/shm says nothing about it).
        check_data_plane_room(cfg, model_path, policy_dtype, redis_url, shm_here=placement.on_launchers_host)
        prepare_output_dir(cfg, out_dir)
        if not cfg.resume:  # a run that fails before its first step leaves no folder behind
            stack.callback(_remove_if_no_step_finished, out_dir)
        resolved = OmegaConf.to_container(hydra_cfg, resolve=True)
        resolved["model"]["path"] = model_path
        resolved["policy"]["dtype"] = policy_dtype
        write_config(cfg, out_dir, resolved, console)
        console.print(f"run {cfg.run_name}: model {model_path}, outputs in {out_dir}, {'GPUs' if use_cuda else 'CPU'}")
        if cfg.redis.url and (cfg.overwrite or cfg.resume):
            _clean_other_nodes([], shm_dir, engine_record, console)  # what a killed run left there
        # Before ray.shutdown (after the policy's close): the run's shared memory on other nodes.
        writers: list = []
        stack.callback(_clean_other_nodes, writers, shm_dir, engine_record, console)
        trackers = open_trackers(
            logger_names(cfg.logger), out_dir, cfg.run_name, cfg.wandb, resolved, resume_step(out_dir, cfg), console
        )
        stack.callback(trackers.close)
        console.print("starting actors (the vLLM engine takes a minute on CPU)...")
        actors = start_actors(
            cfg, algorithm, task.scorer, model_path, redis_url, policy_dtype, use_cuda, placement, writers
        )
        stack.callback(actors.policy.close)
        state = resume_from_checkpoint(actors, out_dir, console) if cfg.resume else None
        result = train(cfg, algorithm, task, actors, out_dir, console, resume=state, trackers=trackers)
        result["hf_dir"] = actors.trainer.export_hf(str((out_dir / "hf").resolve()))
    _write_report(out_dir, console)
    return result


def _write_report(out_dir: Path, console: Console) -> None:
    from apps.report.report import write_report

    try:
        png, md = write_report(out_dir)
    except Exception as e:  # noqa: BLE001 (the trained model matters more; `python -m apps.report` can retry)
        console.print(f"[yellow]warning:[/] could not write the run's report ({type(e).__name__}: {e})")
        return
    console.print(f"report: {png} and {md}")


def _remove_if_no_step_finished(out_dir: Path) -> None:
    """Remove a new run's output folder if it holds no finished step (the run failed or was
    stopped before its first step ended): nothing in it is worth keeping, and it would make the
    same command fail with 'already exists'."""
    metrics = out_dir / "metrics.jsonl"
    if not (metrics.exists() and metrics.read_text().strip()):
        shutil.rmtree(out_dir, ignore_errors=True)


def _remove_engine_files(record: Path, console) -> None:
    from actors.engine_shm import remove_recorded

    freed = remove_recorded(record)
    if freed:
        console.print(f"removed {freed / 2**20:.1f} MiB of shared memory the stopped vLLM engine left in /dev/shm")


def _clean_other_nodes(writers: list, shm_dir: Path, record: Path, console: Console) -> None:
    from apps.grpo.node_cleanup import clean_other_nodes

    try:
        freed = clean_other_nodes(writers, shm_dir, record)
    except Exception as e:  # noqa: BLE001 (the run's own outcome matters more; say what is left)
        console.print(f"[yellow]warning:[/] could not remove the run's shared memory on other Ray nodes: {e}")
        return
    for node, n in freed.items():
        if n:
            console.print(f"removed {n / 2**20:.1f} MiB of the run's shared memory on Ray node {node[:12]}...")


def _remove_store_keys(redis_url: str, run: str, console: Console) -> None:
    from redis import RedisError

    from weightsync.store import WeightStore

    try:
        store = WeightStore(redis_url, run)
        try:
            keys, held = store.clear_run()
        finally:
            store.close()
    except RedisError as e:  # the run's own outcome matters more; say what is left behind
        console.print(f"[yellow]warning:[/] could not remove run {run!r}'s keys (ws:{run}:*) from {redis_url}: {e}")
        return
    if held >= 2**20:
        console.print(f"removed the run's {held / 2**20:.1f} MiB of weights from Redis ({keys} keys)")


@hydra.main(config_path="../../configs", config_name="grpo", version_base=None)
def main(cfg) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    console = Console(soft_wrap=True)
    from apps.grpo.loop import TrainingStopped
    from apps.grpo.start import ActorStartError
    from checkpointing.folders import CheckpointError
    from weightsync.redis_server import RedisUnavailable
    from weightsync.redis_space import NotEnoughRedisMemory
    from weightsync.shm_space import NotEnoughSharedMemory

    try:
        result = run(cfg, console)
    except (
        ConfigError,
        ActorStartError,
        TrainingStopped,
        RedisUnavailable,
        CheckpointError,
        NotEnoughSharedMemory,
        NotEnoughRedisMemory,
    ) as e:
        cause = getattr(e, "cause", None) or e  # an actor's error arrives wrapped with its traceback
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {cause}", markup=True, highlight=False)
        sys.exit(2)
    except KeyboardInterrupt:
        out = f"{cfg.output_dir}/{cfg.run_name}"
        Console(stderr=True, soft_wrap=True).print(f"interrupted; the finished steps' metrics are in {out}")
        sys.exit(130)
    gain = result["eval_accuracy_final"] - result["eval_accuracy_start"]
    console.print(
        f"eval accuracy: {result['eval_accuracy_start']:.3f} at step 0 -> {result['eval_accuracy_final']:.3f} "
        f"after {cfg.steps} steps ({gain * 100:+.1f} points)"
    )
    console.print(f"final model: {result['hf_dir']}")


if __name__ == "__main__":
    try:
        check_override_keys(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    main()
