"""Trainer actor: the policy's ``transformers`` model in fp32 with AdamW; pushes weights to the store."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import ray
import torch

from actors.modeling import load_causal_lm
from algos.episodes import Episode
from algos.train import grpo_backward
from weightsync.push import WeightPusher
from weightsync.store import WeightStore


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(
        self,
        model_path: str,
        redis_url: str,
        run: str,
        lr: float = 1e-4,
        warmup_steps: int = 0,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        loss: dict | None = None,
        micro_batch_size: int | None = None,
        seed: int = 0,
        torch_threads: int = 1,
        shm_root: str = "/dev/shm",
        sync_dtype: str = "float32",
        keep_last: int = 2,
    ) -> None:
        torch.set_num_threads(torch_threads)
        torch.manual_seed(seed)
        self.model_path = model_path
        self.model = load_causal_lm(model_path)
        self.model.train()
        self.pad_id = self.model.config.pad_token_id or 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        # Linear warm-up: Adam's first steps move every weight by about lr whatever the gradient's
        # size, which on a noisy RL gradient can undo the warm start before the moments settle.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / (warmup_steps + 1))
        )
        self.max_grad_norm = max_grad_norm
        self.loss_options = loss or {}  # keyword arguments of algos.grpo.grpo_loss
        self.micro_batch_size = micro_batch_size
        self.pusher = WeightPusher(WeightStore(redis_url, run), shm_root, sync_dtype, keep_last)

    def train_step(self, episodes: list[Episode]) -> dict[str, float]:
        """One optimizer step on ``episodes`` (gradients accumulated over micro-batches)."""
        self.optimizer.zero_grad(set_to_none=True)
        metrics = grpo_backward(self.model, episodes, self.pad_id, self.loss_options, self.micro_batch_size)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        self.optimizer.step()
        self.scheduler.step()
        metrics["grad_norm"] = grad_norm.item()
        return metrics

    def push_weights(self, version: int) -> dict:
        """Write the current weights as ``version`` into the store and commit it."""
        return self.pusher.push(self.model.state_dict(), version)

    def save_hf(self, out_dir: str) -> str:
        """Save the model and the tokenizer files as a Hugging Face directory, atomically."""
        out = Path(out_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            self.model.save_pretrained(tmp, safe_serialization=True)
            for name in os.listdir(self.model_path):
                if name.startswith(("tokenizer", "special_tokens")):
                    shutil.copy(Path(self.model_path) / name, tmp / name)
            if out.exists():
                shutil.rmtree(out)
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return str(out)
