"""One rank of an FSDP2-sharded model trained with AdamW: what the policy's trainer ranks
(``actors/trainer.py``) and the critic's ranks (``actors/critic.py``) share. Not an actor itself.

Each rank holds the model sharded with ``fully_shard`` (per decoder layer, then the root) over a
torch.distributed process group (gloo on CPU, NCCL on GPU), an AdamW optimizer over its shards
and a LambdaLR schedule; a lone CPU rank in float32 holds the plain model
(``FSDPRank.wrapped_by_fsdp``). A train step gets this rank's share of the batch plus the whole
batch's totals and runs the algorithm's loss through ``algos.train.backward``; FSDP2 averages
the ranks' gradients, so each rank scales its backward pass by the world size to make the sum
the whole batch's gradient. An update whose loss or gradient norm is not finite is not applied.
"""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from algos.episodes import Episode
from algos.schedule import lr_multiplier
from algos.train import BatchTotals, Loss, backward, summed_metric_names
from algos.train_config import TrainerConfig
from checkpointing import dcp_io
from checkpointing.folders import CheckpointError
from weightsync.push import without_aliases

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TRAINER_STATE = "trainer_state.json"  # optimizer hyper-parameters, LR schedule, written by rank 0


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.json"


def keep_freed_memory() -> None:
    """Have glibc's malloc keep the memory a CPU train step frees for the next step.

    By default every allocation above 32 MiB (activations, FSDP2's gathered parameters and
    reduced gradients) is a fresh ``mmap``, returned at free: each step then faults in every
    page of them again, which on a CPU rank costs as much as a good part of the step's compute.
    With mmap off and no trimming the heap stays at the step's peak and is reused. Elsewhere
    than glibc this does nothing."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    mallopt(M_MMAP_MAX, 0)
    mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # an int: the largest threshold mallopt takes


class FSDPRank:
    def __init__(self, rank: int, world: int, config: TrainerConfig, loss: Loss, total_steps: int, seed: int) -> None:
        """Subclasses load ``self.model`` after this (seeded, on the CPU)."""
        torch.set_num_threads(config.torch_threads)
        torch.manual_seed(seed)
        self.rank, self.world = rank, world
        self.config = config
        self.loss = loss
        self.total_steps = total_steps
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if self.device is None:
            keep_freed_memory()
        self.model: torch.nn.Module
        self.pending_save = None

    @property
    def pad_id(self) -> int:
        return self.model.config.pad_token_id or 0

    # -- process group ---------------------------------------------------------------------------

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def rendezvous_address(self) -> str:
        """On rank 0: a ``tcp://host:port`` init address the group can meet at."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def join(self, init_method: str) -> None:
        """Form the process group with the other ranks, shard the model, create the optimizer."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        backend = "nccl" if self.device is not None else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world)
        # Checkpoint collectives get a gloo group of their own: async saves run them in a
        # background thread while training goes on in the default group.
        self.ckpt_group = dist.new_group(backend="gloo")
        if self.device is not None:
            self.model.to(self.device)
        c = self.config
        if self.wrapped_by_fsdp:
            policy = MixedPrecisionPolicy(param_dtype=DTYPES[c.param_dtype], reduce_dtype=DTYPES[c.reduce_dtype])
            for layer in self.model.model.layers:
                fully_shard(layer, mp_policy=policy)
            fully_shard(self.model, mp_policy=policy)
        self.model.train()
        self._sharded()
        # The fused kernel (one vectorized pass per parameter, on CPU as on GPU) instead of the
        # default per-parameter loop of separate ops, which makes a temporary per op.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr, weight_decay=c.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_multiplier(step, self.total_steps, c.warmup_steps, c.lr_schedule, c.min_lr_ratio),
        )

    @property
    def wrapped_by_fsdp(self) -> bool:
        """Whether the model is wrapped by FSDP2: not for a single CPU rank in float32, where a world
        of one would only add copies (its all-gathers and reduce-scatters) and DTensor dispatch to
        every step. The process group is formed all the same (checkpoints and pushes use it)."""
        c = self.config
        return self.world > 1 or self.device is not None or (c.param_dtype, c.reduce_dtype) != ("float32", "float32")

    def _sharded(self) -> None:
        """Called once the model is in place (wrapped by FSDP2 or not), before the optimizer exists."""

    def close(self) -> None:
        self.wait_for_checkpoint()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- training --------------------------------------------------------------------------------

    def train_step(self, episodes: list[Episode], totals: BatchTotals, num_micro_batches: int) -> dict[str, float]:
        """One optimizer step; ``episodes`` is this rank's share of a batch with ``totals``.

        Returns the whole batch's metrics (the same on every rank). ``update_skipped`` is 1 when
        the loss or the gradient norm was not finite: the gradients are dropped and neither the
        weights nor the optimizer's state nor the LR schedule move.
        """
        self.optimizer.zero_grad(set_to_none=True)
        local = backward(
            self.model,
            episodes,
            self.pad_id,
            self.loss,
            num_micro_batches=num_micro_batches,
            totals=totals,
            grad_scale=float(self.world),
        )
        summed_names, max_names = summed_metric_names(self.loss), self.loss.max_metric_names
        summed = torch.tensor([local[k] for k in summed_names], dtype=torch.float64, device=self.device)
        top = torch.tensor([local[k] for k in max_names] or [0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(summed)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        metrics = dict(zip(summed_names, summed.tolist()))
        metrics.update(zip(max_names, top.tolist()))
        metrics["train_tokens"] = totals.tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        metrics["grad_norm"] = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        # The loss and the norm are the whole batch's, the same on every rank: all skip together.
        skip = not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]))
        metrics["update_skipped"] = float(skip)
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.scheduler.step()
        return metrics

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights gathered on every rank (for tests and small models)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # -- checkpoints -----------------------------------------------------------------------------

    def _training_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors for DCP, JSON-able rest) of the model and optimizer."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(
            self.model, self.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )
        tensors = {f"model.{k}": v for k, v in model_sd.items()}
        rest = {}
        for k, v in optim_sd.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim.{k}"] = v
            else:
                rest[k] = list(v) if isinstance(v, tuple) else v
        return tensors, rest

    def _hparams(self) -> dict:
        c = self.config
        return {
            "lr": c.lr,
            "lr_schedule": c.lr_schedule,
            "total_steps": self.total_steps,
            "warmup_steps": c.warmup_steps,
            "min_lr_ratio": c.min_lr_ratio,
            "weight_decay": c.weight_decay,
            "param_dtype": c.param_dtype,
            "reduce_dtype": c.reduce_dtype,
        }

    def save_checkpoint(self, path: str, async_save: bool = False) -> None:
        """Write model, optimizer, LR schedule and RNG state under ``path`` (the caller renames it).

        With ``async_save`` this returns once the state is staged; ``wait_for_checkpoint`` blocks
        until the shards are written.
        """
        self.wait_for_checkpoint()
        tensors, optim_rest = self._training_state()
        folder = Path(path)
        if self.rank == 0:
            state = {"optimizer": optim_rest, "scheduler": self.scheduler.state_dict(), "hparams": self._hparams()}
            (folder / TRAINER_STATE).write_text(json.dumps(state))
        rng = {"cpu": torch.get_rng_state().tolist()}
        if self.device is not None:
            rng["cuda"] = torch.cuda.get_rng_state().tolist()
        (folder / _rng_file(self.rank)).write_text(json.dumps(rng))
        self.pending_save = dcp_io.save(
            without_aliases(tensors), folder, async_save=async_save, process_group=self.ckpt_group
        )

    def checkpoint_written(self) -> bool:
        """Whether no save is pending or the pending async save has finished (without blocking)."""
        return self.pending_save is None or self.pending_save.done()

    def wait_for_checkpoint(self) -> None:
        """Block until an async save has written its shards (re-raising its error)."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            pending.result()

    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimizer, LR schedule and RNG state from a complete checkpoint folder."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        folder = Path(path)
        try:
            state = json.loads((folder / TRAINER_STATE).read_text())
            rng = json.loads((folder / _rng_file(self.rank)).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {folder} is incomplete or corrupt: {e}") from e
        tensors, _ = self._training_state()
        stored = without_aliases(tensors)  # tied weights are stored once; loading fills both names
        self._check_shapes(folder, stored)
        try:
            dcp_io.load(stored, folder, process_group=self.ckpt_group)
        except Exception as e:
            raise CheckpointError(f"checkpoint {folder} could not be read (corrupt or partial?): {e}") from e
        model_sd = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
        optim_sd = {k.removeprefix("optim."): v for k, v in tensors.items() if k.startswith("optim.")}
        optim_sd.update(state["optimizer"])
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(torch.tensor(rng["cpu"], dtype=torch.uint8))
        if self.device is not None and "cuda" in rng:
            torch.cuda.set_rng_state(torch.tensor(rng["cuda"], dtype=torch.uint8))

    def _check_shapes(self, folder: Path, tensors: dict[str, torch.Tensor]) -> None:
        try:
            stored = dcp_io.stored_shapes(folder)
        except Exception as e:
            raise CheckpointError(f"checkpoint {folder} has unreadable shards (corrupt or partial?): {e}") from e
        missing = sorted(k for k in tensors if k not in stored)
        wrong = [
            (k, stored[k], list(v.shape)) for k, v in tensors.items() if k in stored and list(v.shape) != stored[k]
        ]
        if missing or wrong:
            detail = "; ".join(f"{k}: stored {s}, model {m}" for k, s, m in wrong[:3])
            raise CheckpointError(
                f"checkpoint {folder} does not fit this model: "
                + (f"{len(wrong)} tensors differ in shape ({detail}); " if wrong else "")
                + (f"{len(missing)} tensors are missing (e.g. {missing[:3]})" if missing else "")
                + "; was it written for another model.path?"
            )
