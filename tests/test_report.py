"""The run report (``apps/report``): a run folder's metrics summed up in report.md and drawn in
report.png, and the command's errors for folders that are not runs."""

from __future__ import annotations

import json
import statistics

import pytest

from apps.report.__main__ import main
from apps.report.report import load_run, median_phases, write_report


def make_run(folder, steps: int = 6, final: bool = True, ppo: bool = False):
    """A run folder as the launcher writes it: eval every 3 steps, a reference model."""
    folder.mkdir()
    rows = []
    for s in range(steps):
        row = {
            "step": s,
            "reward_mean": 0.1 * s,
            "accuracy_sampled": 0.1 * s,
            "reward_errors": s % 2,
            "kl": 0.01 * s,
            "entropy": 0.5,
            "logprob_diff_mean": 1e-7,
            "logprob_diff_max": 1e-5,
            "grad_norm": 1.0,
            "clip_frac": 0.0,
            "skipped_updates": 1,
            "gen_s": 0.4 + 0.01 * s,
            "reward_s": 0.02,
            "reference_s": 0.1,
            "train_s": 0.3,
            "weight_sync_s": 0.05,
            "step_s": 1.0 + 0.01 * s,
            "completions_per_s": 100.0 + s,
        }
        if s % 3 == 0:
            row["eval_accuracy"] = 0.3 + 0.01 * s
            if s:
                row["eval_s"] = 2.0
                row["step_s"] += 2.0
        if ppo:
            row.update(value_loss=0.1, explained_variance=0.2, critic_s=0.2)
        rows.append(row)
    lines = [json.dumps(r) for r in rows]
    if final:
        lines.append(json.dumps({"step": steps, "final": True, "eval_accuracy": 0.5, "policy_version": steps}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "config.yaml").write_text(
        "steps: 10\nprompts_per_step: 8\nalgo:\n  name: grpo\n  group_size: 4\ntask:\n  name: arithmetic\n"
        "trainer:\n  lr: 0.001\n  ranks: 2\npolicy:\n  tp: 1\nmodel:\n  path: /m\n"
    )
    return rows


@pytest.mark.parametrize("ppo", [False, True])
def test_report_files_say_what_the_metrics_say(tmp_path, ppo):
    import matplotlib.image

    rows = make_run(tmp_path / "r", ppo=ppo)
    png, md = write_report(tmp_path / "r")
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 500 and image.shape[1] > 1000 and image[..., :3].std() > 0.05  # drawn, not blank
    text = md.read_text()
    assert "algorithm: grpo; task: arithmetic; model: /m" in text
    assert "6 of 10 steps; 8 prompts x 4 samples per step" in text and "trainer ranks 2" in text
    assert "held-out accuracy: 0.300 at step 0 -> 0.500 at step 6 (final, +20.0 points)" in text
    assert "reward errors: 3; skipped updates: 1" in text
    gen = statistics.median(r["gen_s"] for r in rows)
    assert f"| generate | {gen:.3f} |" in text and "| eval (eval steps) | 2.000 |" in text
    values = 0.2 if ppo else 0.1  # reference and critic run side by side: the longer of the two
    assert f"| reference / critic values | {values:.3f} |" in text
    assert f"| **step** | **{statistics.median(r['step_s'] for r in rows):.3f}** |" in text


def test_phases_add_up_to_the_step(tmp_path):
    rows = make_run(tmp_path / "r")
    medians = median_phases(load_run(tmp_path / "r"))
    eval_free = [r for r in rows if "eval_s" not in r]
    other = statistics.median(
        r["step_s"] - r["gen_s"] - r["reward_s"] - r["reference_s"] - r["train_s"] - r["weight_sync_s"]
        for r in eval_free
    )
    assert medians["other"] == pytest.approx(other)


def test_a_run_still_going_and_a_cut_last_line(tmp_path):
    make_run(tmp_path / "r", final=False)
    with open(tmp_path / "r" / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')  # killed while writing
    run = load_run(tmp_path / "r")
    assert run.final is None and len(run.rows) == 6
    assert "(last so far, +3.0 points)" in write_report(tmp_path / "r")[1].read_text()


def test_the_command_names_what_is_not_a_run(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    make_run(tmp_path / "good")
    assert main([str(tmp_path / "nope"), str(tmp_path / "empty"), str(tmp_path / "good")]) == 2
    out, err = capsys.readouterr()
    assert "nope is not a run folder (no such folder)" in err
    assert "empty is not a run folder (it has no metrics.jsonl)" in err
    assert f"report: {tmp_path / 'good' / 'report.png'}" in out
