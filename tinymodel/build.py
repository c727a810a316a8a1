"""Build the embedded default model: no downloads, ever.

A character-level tokenizer trained locally on the arithmetic task's alphabet, a small
Qwen3-architecture ``transformers`` model, and a short supervised warm start on the task's train
split that leaves it clearly imperfect (so GRPO has room to improve): it stops once greedy decoding
gets ``warm_start_target_accuracy`` of a fixed sample of the train split right. A fixed step count
would not do: the accuracy climbs steeply in that range, and the same steps on CPUs with other
vector units (other float rounding in the GEMMs) left it at far apart accuracies. The result is a normal
Hugging Face directory (config.json, model.safetensors, tokenizer files) that both
``transformers`` and vLLM load.

The directory is cached under ``cache_dir/<recipe hash>``: it is rebuilt only when the recipe
(this file's ``RECIPE_VERSION`` or any field of ``TinyModelRecipe``) changes. It is written to a
temporary name and renamed when complete, so an interrupted build never looks finished.

Run ``python -m tinymodel.build`` to build it by hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks.arithmetic import ALPHABET, ArithmeticConfig, split
from tasks.base import Problem, TaskConfig, shuffled_batches

log = logging.getLogger(__name__)

# Bump when the build code changes in a way the recipe fields do not capture.
RECIPE_VERSION = 2

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
DEFAULT_CACHE_DIR = Path(__file__).resolve().parent.parent / ".cache" / "tiny-model"


@dataclass(frozen=True)
class TinyModelRecipe:
    """Everything that determines the built directory's contents."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2  # divisible by TP=2, so the model splits for TP=2 without replication
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 64
    # Supervised warm start on the task's train split (same operand range and seed as the task),
    # until greedy decoding gets warm_start_target_accuracy of warm_start_probe_size train problems
    # right (checked every warm_start_check_every steps), or for warm_start_max_steps at most.
    warm_start_target_accuracy: float = 0.3
    warm_start_max_steps: int = 2000
    warm_start_check_every: int = 10
    warm_start_probe_size: int = 500
    warm_start_batch: int = 128
    warm_start_lr: float = 3e-3
    task_low: int = 0
    task_high: int = 99
    task_ops: tuple[str, ...] = ("+", "-")
    task_eval_size: int = 500
    seed: int = 0

    def digest(self) -> str:
        payload = json.dumps({"version": RECIPE_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    @staticmethod
    def for_task(task: TaskConfig, seed: int) -> TinyModelRecipe:
        """The recipe for a run of ``task``: the warm start must see only the run's train split,
        so an arithmetic task's settings and the run's seed build (and cache) a model of their
        own. Any other task gets the model warm-started on the default arithmetic task."""
        if isinstance(task, ArithmeticConfig):
            ops = tuple(task.ops)
            return TinyModelRecipe(
                task_low=task.low, task_high=task.high, task_ops=ops, task_eval_size=task.eval_size, seed=seed
            )
        return TinyModelRecipe(seed=seed)

    def split(self) -> tuple[list[Problem], list[Problem]]:
        """The arithmetic task's (train, held-out) problems this model is warm-started on."""
        return split(self.task_low, self.task_high, self.task_ops, self.task_eval_size, self.seed)


def build_tokenizer():
    """A character-level tokenizer, trained with ``tokenizers`` on the task alphabet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD_TOKEN, EOS_TOKEN]
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    # vocab_size = alphabet + specials: the trainer learns the characters and no merges, so every
    # digit is its own token (multi-digit tokens would make carrying much harder to learn).
    trainer = trainers.BpeTrainer(
        vocab_size=len(ALPHABET) + len(specials), special_tokens=specials, initial_alphabet=list(ALPHABET)
    )
    tokenizer.train_from_iterator([ALPHABET], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=64,
        padding_side="left",
    )


def build_model(recipe: TinyModelRecipe, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(recipe.seed)
    return Qwen3ForCausalLM(config)


def sft_batch(tokenizer, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + answer + EOS`` ids, attention mask, and labels (-100 off the answer)."""
    rows, label_rows = [], []
    for p in problems:
        prompt_ids = tokenizer.encode(p.prompt)
        answer_ids = tokenizer.encode(p.answer) + [tokenizer.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        label_rows.append([-100] * len(prompt_ids) + answer_ids)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, lr) in enumerate(zip(rows, label_rows)):
        ids[i, : len(r)] = torch.tensor(r)
        labels[i, : len(lr)] = torch.tensor(lr)
        mask[i, : len(r)] = 1
    return ids, mask, labels


def warm_start(model, tokenizer, recipe: TinyModelRecipe) -> tuple[int, float]:
    """Supervised steps until the probe's greedy accuracy reaches the target (or the step cap).
    Returns (steps taken, the probe's last accuracy)."""
    train = recipe.split()[0]
    probe = random.Random(recipe.seed).sample(train, min(recipe.warm_start_probe_size, len(train)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.warm_start_lr, weight_decay=0.0)
    batches = shuffled_batches(train, recipe.warm_start_batch, recipe.seed)
    probe_accuracy, step = 0.0, 0
    while step < recipe.warm_start_max_steps:
        model.train()
        ids, mask, labels = sft_batch(tokenizer, next(batches))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % recipe.warm_start_check_every == 0 or step == recipe.warm_start_max_steps:
            model.eval()
            probe_accuracy = greedy_accuracy(model, tokenizer, probe)
            if step % 50 == 0:
                log.info("warm start step %d: loss %.4f, train-probe accuracy %.3f", step, loss.item(), probe_accuracy)
            if probe_accuracy >= recipe.warm_start_target_accuracy:
                break
    model.eval()
    if probe_accuracy < recipe.warm_start_target_accuracy:
        log.warning(
            "the warm start stopped at its cap of %d steps with train-probe accuracy %.3f, short of the target %.3f",
            step,
            probe_accuracy,
            recipe.warm_start_target_accuracy,
        )
    return step, probe_accuracy


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[Problem], max_new_tokens: int = 5) -> float:
    """Exact-match accuracy of greedy decoding with plain ``transformers``."""
    tokenizer.padding_side = "left"
    enc = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True)
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    correct = 0
    for p, row in zip(problems, out[:, enc["input_ids"].shape[1] :].tolist()):
        finished = tokenizer.eos_token_id in row
        text = tokenizer.decode(row[: row.index(tokenizer.eos_token_id)] if finished else row)
        correct += finished and text == p.answer
    return correct / len(problems)


def build(recipe: TinyModelRecipe, out_dir: Path) -> dict:
    """Build the model directory at ``out_dir`` (which must not exist). Returns the build report."""
    start = time.perf_counter()
    tokenizer = build_tokenizer()
    model = build_model(recipe, tokenizer)
    steps, probe_accuracy = warm_start(model, tokenizer, recipe)
    accuracy = greedy_accuracy(model, tokenizer, recipe.split()[1])
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    report = {
        "recipe": dataclasses.asdict(recipe),
        "recipe_version": RECIPE_VERSION,
        "digest": recipe.digest(),
        "params": sum(p.numel() for p in model.parameters()),
        "warm_start_steps": steps,
        "warm_start_train_probe_accuracy": probe_accuracy,
        "warm_start_eval_accuracy": accuracy,
        "build_s": round(time.perf_counter() - start, 1),
    }
    (out_dir / "tiny_model_recipe.json").write_text(json.dumps(report, indent=2))
    return report


def ensure_tiny_model(recipe: TinyModelRecipe | None = None, cache_dir: str | Path | None = None) -> Path:
    """Return the cached model directory for ``recipe``, building it first if it is missing."""
    recipe = recipe or TinyModelRecipe()
    cache_dir = Path(cache_dir or os.environ.get("TINY_MODEL_CACHE", DEFAULT_CACHE_DIR))
    final = cache_dir / recipe.digest()
    if (final / "tiny_model_recipe.json").is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("building the tiny model (recipe %s) into %s", recipe.digest(), final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{recipe.digest()}.", dir=cache_dir))
    try:
        report = build(recipe, tmp / "model")
        try:
            os.rename(tmp / "model", final)
        except OSError:
            # Another process finished the same build first: theirs is as good as ours.
            if not (final / "tiny_model_recipe.json").is_file():
                raise
        log.info(
            "tiny model built in %.1f s: %d params, warm-start eval accuracy %.3f",
            report["build_s"],
            report["params"],
            report["warm_start_eval_accuracy"],
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(ensure_tiny_model())
