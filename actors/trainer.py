"""Trainer rank actor: one rank of the FSDP2 trainer group (see ``actors/trainer_group.py``).

Each rank holds the policy's ``transformers`` model sharded with ``fully_shard`` (per decoder
layer, then the root) over a torch.distributed process group (gloo on CPU, NCCL on GPU), an
AdamW optimizer over its shards and a LambdaLR schedule. A train step gets this rank's share of
the batch plus the whole batch's totals; FSDP2 averages the ranks' gradients, so each rank scales
its backward pass by the world size to make the sum the whole batch's gradient.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from actors.modeling import completion_logprobs, load_causal_lm
from algos.episodes import Episode
from algos.schedule import lr_multiplier
from algos.train import SUMMED_METRICS, BatchTotals, grpo_backward
from checkpointing import dcp_io
from checkpointing.folders import CheckpointError
from checkpointing.hf_export import export_hf
from weightsync.push import WeightPusher, without_aliases
from weightsync.store import WeightStore

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TRAINER_STATE = "trainer_state.json"  # optimizer hyper-parameters, LR schedule, written by rank 0


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.json"


@ray.remote(num_cpus=0)
class TrainerRank:
    def __init__(
        self,
        rank: int,
        world: int,
        model_path: str,
        redis_url: str,
        run: str,
        *,
        lr: float = 1e-4,
        lr_schedule: str = "constant",
        total_steps: int = 1,
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.0,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        loss: dict | None = None,
        param_dtype: str = "float32",
        reduce_dtype: str = "float32",
        seed: int = 0,
        torch_threads: int = 1,
        shm_root: str = "/dev/shm",
        sync_dtype: str = "float32",
        keep_last: int = 2,
        data_plane: str = "shm",
        checksums: bool = True,
        delta: bool = False,
        delta_max_live: float = 2.0,
        delta_elements: bool = False,
    ) -> None:
        torch.set_num_threads(torch_threads)
        torch.manual_seed(seed)
        self.rank, self.world = rank, world
        self.model_path = model_path
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.model = load_causal_lm(model_path)
        self.pad_id = self.model.config.pad_token_id or 0
        self.hparams = {
            "lr": lr,
            "lr_schedule": lr_schedule,
            "total_steps": total_steps,
            "warmup_steps": warmup_steps,
            "min_lr_ratio": min_lr_ratio,
            "weight_decay": weight_decay,
            "param_dtype": param_dtype,
            "reduce_dtype": reduce_dtype,
        }
        self.max_grad_norm = max_grad_norm
        self.loss_options = loss or {}  # keyword arguments of algos.grpo.grpo_loss
        self.pusher = WeightPusher(
            WeightStore(redis_url, run),
            shm_root,
            sync_dtype,
            keep_last,
            data_plane=data_plane,
            checksums=checksums,
            delta=delta,
            delta_max_live=delta_max_live,
            delta_elements=delta_elements,
        )
        self.pending_save = None

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
        policy = MixedPrecisionPolicy(
            param_dtype=DTYPES[self.hparams["param_dtype"]], reduce_dtype=DTYPES[self.hparams["reduce_dtype"]]
        )
        for layer in self.model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(self.model, mp_policy=policy)
        self.model.train()
        h = self.hparams
        # The shard files the first weight pushes write over, allocated while the policy starts.
        self.pusher.reserve(self._model_state_dict(offload=False))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=h["lr"], weight_decay=h["weight_decay"])
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_multiplier(step, h["total_steps"], h["warmup_steps"], h["lr_schedule"], h["min_lr_ratio"]),
        )

    def close(self) -> None:
        self.wait_for_checkpoint()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- training --------------------------------------------------------------------------------

    def train_step(self, episodes: list[Episode], totals: BatchTotals, num_micro_batches: int) -> dict[str, float]:
        """One optimizer step; ``episodes`` is this rank's share of a batch with ``totals``.

        Returns the whole batch's metrics (the same on every rank).
        """
        self.optimizer.zero_grad(set_to_none=True)
        local = grpo_backward(
            self.model,
            episodes,
            self.pad_id,
            self.loss_options,
            num_micro_batches=num_micro_batches,
            totals=totals,
            grad_scale=float(self.world),
        )
        summed = torch.tensor([local[k] for k in SUMMED_METRICS], dtype=torch.float64, device=self.device)
        top = torch.tensor([local["logprob_diff_max"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(summed)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        metrics = dict(zip(SUMMED_METRICS, summed.tolist()))
        metrics["logprob_diff_max"] = top.item()
        metrics["train_tokens"] = totals.tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        metrics["grad_norm"] = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        self.optimizer.step()
        self.scheduler.step()
        return metrics

    def logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        """Each episode's completion-token logprobs under the current weights (all ranks run it)."""
        return completion_logprobs(self.model, episodes, self.pad_id)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights gathered on every rank (for tests and small models)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # -- weights out -----------------------------------------------------------------------------

    def _model_state_dict(self, offload: bool = True) -> dict[str, torch.Tensor]:
        """This rank's shards of the weights (copied to the host on GPU unless ``offload=False``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        cpu_offload = offload and self.device is not None
        return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=cpu_offload))

    def push_weights(self, version: int) -> dict:
        """Write this rank's shard of the current weights as ``version``; rank 0 commits it."""
        return self.pusher.push(self._model_state_dict(), version)

    def remove_pushed(self) -> None:
        self.pusher.remove_all()

    def export_hf(self, out_dir: str, dtype: str | None = None, max_shard_bytes: int = 2 << 30) -> str:
        """Write a consolidated Hugging Face model directory together with the other ranks."""
        out = export_hf(
            self._model_state_dict(),
            out_dir,
            self.model.config,
            self.model_path,
            dtype=DTYPES[dtype] if dtype else None,
            max_shard_bytes=max_shard_bytes,
        )
        return str(out)

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

    def save_checkpoint(self, path: str, async_save: bool = False) -> None:
        """Write model, optimizer, LR schedule and RNG state under ``path`` (the caller renames it).

        With ``async_save`` this returns once the state is staged; ``wait_for_checkpoint`` blocks
        until the shards are written.
        """
        self.wait_for_checkpoint()
        tensors, optim_rest = self._training_state()
        folder = Path(path)
        if self.rank == 0:
            state = {"optimizer": optim_rest, "scheduler": self.scheduler.state_dict(), "hparams": self.hparams}
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
