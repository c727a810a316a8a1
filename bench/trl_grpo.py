"""TRL's ``GRPOTrainer`` on one of our tasks, with settings that match a ``python -m apps.grpo``
run: run by ``bench.e2e`` in a process of its own (``python -m bench.trl_grpo SETTINGS.json``).

It trains on the same prompts in the same order as our run (the task's ``train_batches`` with
the run's seed, one batch of ``prompts_per_step`` prompts x ``group_size`` completions per
optimizer step, no shuffling), scores completions with the task's own scorer (``finished``: the
completion ends on EOS, as vLLM reports it for ours), saves the final model, and writes each
step's wall time (``steps.json`` in the output folder).

Generation is TRL's plain ``transformers`` ``generate`` (``use_vllm=False``): its fastest mode
that works on CPU here. Needs the ``bench`` extra: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def train_trl(settings: dict) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from apps.grpo.config import compose_config
    from tasks.base import Problem, task_class

    out = Path(settings["output_dir"])
    cfg = compose_config(*settings["overrides"])
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(settings["threads"])
    tokenizer = AutoTokenizer.from_pretrained(settings["model_path"])
    task = task_class(cfg.task.name)(cfg.task, cfg.seed, tokenizer)
    batches = task.train_batches(cfg.prompts_per_step)
    problems = [p for _ in range(cfg.steps) for p in next(batches)]
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    eos = tokenizer.eos_token_id

    def reward(prompts, completions, completion_ids, answer, **_) -> list[float]:
        return [
            task.scorer.score(Problem(p, a), text, bool(ids) and ids[-1] == eos)
            for p, text, ids, a in zip(prompts, completions, completion_ids, answer, strict=True)
        ]

    n = cfg.algo.group_size
    args = GRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=cfg.steps,
        per_device_train_batch_size=cfg.prompts_per_step * n,  # one optimizer step per generated batch
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=n,
        max_completion_length=cfg.policy.max_tokens,
        temperature=cfg.policy.temperature,
        learning_rate=cfg.trainer.lr,
        lr_scheduler_type="constant",
        weight_decay=cfg.trainer.weight_decay,
        max_grad_norm=cfg.trainer.max_grad_norm,
        beta=cfg.algo.kl_coef,
        epsilon=cfg.algo.clip_eps,
        loss_type=settings["loss_type"],
        scale_rewards="group" if cfg.algo.advantage_std_norm else "none",
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        seed=cfg.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    step_s: list[float] = []
    lengths: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            step_s.append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    model = AutoModelForCausalLM.from_pretrained(settings["model_path"], dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    trainer.save_model(str(out / "hf"))
    tokenizer.save_pretrained(out / "hf")
    summary = {"step_s": step_s, "train_s": train_s, "completion_len_mean": sum(lengths) / len(lengths)}
    (out / "steps.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    train_trl(json.loads(Path(sys.argv[1]).read_text()))
