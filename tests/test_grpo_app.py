"""The `python -m apps.grpo` entry point: config errors, bad input, and a short real GRPO run."""

import contextlib
import json
import math
import os
import re
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from actors.engine_shm import IPC_PREFIX
from apps.grpo.config import ConfigError, check_override_keys, load_config, register
from tests.tracker_files import history, tensorboard_scalars

REPO = Path(__file__).resolve().parent.parent
REQUIRED = {
    "step",
    "reward_mean",
    "loss",
    "kl",
    "policy_version",
    "logprob_diff_mean",
    "weight_sync_s",
    "step_s",
    "gen_tokens_per_s",
    "gen_s",
    "gen_engine_s",
    "staleness",
    "dropped_stale",
    "reward_s",
    "train_s",
    "push_s",
    "update_s",
    "completions_per_s",
    "train_tokens_per_s",
}


def _compose(*overrides):
    register()
    with initialize_config_dir(str(REPO / "configs"), version_base=None):
        return compose("grpo", overrides=list(overrides))


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _engine_sockets() -> set[Path]:
    """vLLM's ZeroMQ sockets (``<uuid4>``) and engine socket folders in the temp folder."""
    found = set()
    for path in Path(tempfile.gettempdir()).iterdir():
        with contextlib.suppress(OSError):
            if path.name.startswith(IPC_PREFIX) or (_UUID.fullmatch(path.name) and stat.S_ISSOCK(path.lstat().st_mode)):
                found.add(path)
    return found


def _run_app(*overrides, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "apps.grpo", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "NO_COLOR": "1"},
    )


def test_default_config_composes_and_validates():
    cfg = _compose()
    load_config(cfg)
    assert cfg.policy.tp == 1 and cfg.model.path is None and cfg.algo.group_size >= 2


def test_unknown_key_names_the_key():
    with pytest.raises(ConfigCompositionException, match="stepz"):
        _compose("stepz=3")
    with pytest.raises(ConfigCompositionException, match="tpp"):
        _compose("policy.tpp=2")


def test_wrong_type_names_the_key():
    with pytest.raises((ConfigCompositionException, ValidationError), match="steps"):
        _compose("steps=abc")


@pytest.mark.parametrize(
    "override, key",
    [
        ("policy.dtype=bf17", "policy.dtype"),
        ("steps=0", "steps"),
        ("algo.group_size=1", "algo.group_size"),
        ("algo.kl_coef=-1", "algo.kl_coef"),
        ("algo.reference_device=tpu", "algo.reference_device"),
        ("run_name=a/b", "run_name"),
        ("run_name=a:b", "run_name"),
        ("weightsync.data_plane=nfs", "weightsync.data_plane"),
        ("weightsync.checksums=false", "weightsync.verify"),
        ("trainer.lr_schedule=step", "trainer.lr_schedule"),
        ("trainer.ranks=0", "trainer.ranks"),
        ("trainer.completion_passes=0", "trainer.completion_passes"),
        ("policy.max_num_batched_tokens=100", "policy.max_num_batched_tokens"),
        ("weightsync.delta_max_live=0.5", "weightsync.delta_max_live"),
        ("weightsync.delta_elements=true", "weightsync.delta_elements"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(override, key):
    with pytest.raises(ConfigError, match=f"{key}=.*expected"):
        load_config(_compose(override))


def test_async_mode_needs_a_staleness_bound_and_the_versions_it_lags_kept():
    with pytest.raises(ConfigError, match="mode=.*expected one of"):
        load_config(_compose("mode=eager"))
    with pytest.raises(ConfigError, match=r"algo.max_staleness=0 is invalid: expected an integer >= 1 with mode=async"):
        load_config(_compose("mode=async"))
    with pytest.raises(
        ConfigError, match=r"weightsync.keep_last=2 is invalid: expected at least algo.max_staleness \(3\)"
    ):
        load_config(_compose("mode=async", "algo.max_staleness=3"))
    assert load_config(_compose("mode=async", "algo.max_staleness=1")).mode == "async"
    assert load_config(_compose("mode=async", "algo=ppo", "algo.max_staleness=2")).algo.max_staleness == 2


def test_a_colocated_layout_needs_replicas_of_one_gpu():
    with pytest.raises(
        ConfigError, match=r"placement.layout='colocated' is invalid: expected separate with policy.tp > 1"
    ):
        load_config(_compose("placement.layout=colocated", "policy.tp=2"))
    assert load_config(_compose("placement.layout=colocated")).placement.policy_fraction == 0.4


@pytest.mark.parametrize("name", ["qwen3-1.7b-8gpu", "qwen3-8b-8gpu"])
def test_the_example_gpu_node_configs_load_and_need_a_model_path(name, tmp_path):
    register()
    with initialize_config_dir(str(REPO / "configs"), version_base=None):
        cfg = load_config(compose(name, overrides=[f"model.path={tmp_path}", "task=dataset", "task.path=x.jsonl"]))
        assert (cfg.policy.replicas, cfg.policy.tp, cfg.trainer.ranks, cfg.placement.layout) == (2, 2, 4, "separate")
        with pytest.raises(ConfigError, match="model.path"):
            load_config(compose(name, overrides=["task=dataset", "task.path=x.jsonl"]))


def test_delta_sync_without_checksums_is_refused():
    cfg = _compose("weightsync.checksums=false", "weightsync.verify=false", "weightsync.delta=true")
    with pytest.raises(ConfigError, match="weightsync.delta=.*expected.*checksums"):
        load_config(cfg)
    load_config(_compose("weightsync.checksums=false", "weightsync.verify=false"))  # without delta: fine


@pytest.mark.parametrize(
    "override, message",
    [
        ("stepz=3", "unknown config key 'stepz'; allowed keys: ["),
        ("policy.tpp=2", "Did you mean 'policy.tp'?"),
        ("polcy.tp=2", "'polcy' is not a config group"),
    ],
)
def test_cli_unknown_key_names_it_and_what_is_allowed(tmp_path, override, message):
    proc = _run_app(override, f"output_dir={tmp_path}")
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not any(tmp_path.iterdir())


def test_override_check_passes_known_keys_and_hydra_syntax():
    check_override_keys(["steps=3", "policy.tp=2", "model=tiny", "+extra=1", "hydra.run.dir=x", "--cfg", "job"])


@pytest.mark.parametrize("kind", ["missing", "not_hf"])
def test_bad_model_path_is_a_clear_error_and_writes_nothing(tmp_path, kind):
    path = tmp_path / "nope" if kind == "missing" else tmp_path / "empty"
    if kind == "not_hf":
        path.mkdir()
        (path / "weights.bin").write_bytes(b"x")
    out = tmp_path / "outputs"
    proc = _run_app(f"model.path={path}", f"output_dir={out}", "run_name=r")
    assert proc.returncode == 2, proc.stderr
    assert f"model.path {str(path)!r}" in proc.stderr
    assert ("does not exist" if kind == "missing" else "no config.json") in proc.stderr
    assert not out.exists()


def test_unreachable_redis_is_a_clear_error_and_writes_nothing(tmp_path, tiny_model_path):
    out = tmp_path / "outputs"
    proc = _run_app("redis.url=redis://127.0.0.1:1", f"output_dir={out}", "run_name=r")
    assert proc.returncode == 2, proc.stderr
    assert "redis.url 'redis://127.0.0.1:1' is not reachable" in proc.stderr
    assert not out.exists()


def test_too_little_shared_memory_stops_the_run_before_any_actor_starts(tiny_model_path, monkeypatch, redis_url):
    from safetensors.torch import load_file

    from apps.grpo.__main__ import check_data_plane_room
    from weightsync.shm_space import HEADER_SLACK, NotEnoughSharedMemory

    weights = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    bf16_bytes = sum(t.numel() for t in weights.values()) * 2
    file_bytes = bf16_bytes + HEADER_SLACK + 512 * len(weights)  # one trainer rank
    cfg = _compose("weightsync.keep_last=2")
    monkeypatch.setattr("weightsync.shm_space.free_bytes", lambda path: 3 * file_bytes - 1)
    with pytest.raises(NotEnoughSharedMemory, match=r"keep_last=2.*--shm-size"):
        check_data_plane_room(cfg, tiny_model_path, "bfloat16", redis_url)
    monkeypatch.setattr("weightsync.shm_space.free_bytes", lambda path: 3 * file_bytes)
    check_data_plane_room(cfg, tiny_model_path, "bfloat16", redis_url)  # 2 kept versions + 1 being written fit
    monkeypatch.setattr("weightsync.shm_space.free_bytes", lambda path: 0)
    # The policy's node is another host: its /dev/shm is the trainer ranks' to check, not this one's.
    check_data_plane_room(cfg, tiny_model_path, "bfloat16", redis_url, shm_here=False)
    # No shared memory used, and a Redis without maxmemory has no limit to check.
    check_data_plane_room(_compose("weightsync.data_plane=redis"), tiny_model_path, "bfloat16", redis_url)


def test_a_capped_redis_too_small_for_the_kept_versions_stops_the_run_at_start(tmp_path, tiny_model_path):
    import redis
    from safetensors.torch import load_file

    from apps.grpo.__main__ import check_data_plane_room
    from weightsync.redis_server import LocalRedis
    from weightsync.redis_space import stored_bytes
    from weightsync.shm_space import HEADER_SLACK

    weights = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    shard = sum(t.numel() for t in weights.values()) * 4 + HEADER_SLACK + 512 * len(weights)  # float32, 1 rank
    with LocalRedis() as server:
        client = redis.Redis.from_url(server.url)
        used = client.info("memory")["used_memory"]
        client.config_set("maxmemory", used + 2 * stored_bytes(shard))  # 2 versions of 3 (keep_last=2)
        plane = ["weightsync.data_plane=redis", f"redis.url={server.url}"]
        proc = _run_app(f"output_dir={tmp_path}", "run_name=capped", *plane)
        assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "weight sync needs" in proc.stderr and "of Redis memory" in proc.stderr and "maxmemory" in proc.stderr
        assert not (tmp_path / "capped").exists()
        client.config_set("maxmemory", used + 4 * stored_bytes(shard))
        check_data_plane_room(_compose(*plane), tiny_model_path, "float32", server.url)  # room for 3
        client.close()


def test_an_actor_that_does_not_start_is_named_with_its_error(tmp_path, tiny_model_path):
    """More TP workers than this machine has cores: the policy refuses in its constructor; the
    launcher says which actor and why in one line (not Ray's 40-line traceback), exit 2, and
    leaves no output folder (a rerun of the same name is not blocked)."""
    tp = 4  # divides the tiny model's 4 heads, 2 KV heads and MLP: only the cores are short
    if len(os.sched_getaffinity(0)) >= tp:
        pytest.skip(f"this machine has {tp} cores or more")
    proc = _run_app(f"output_dir={tmp_path}", "run_name=tp", f"policy.tp={tp}")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, proc.stderr[-3000:]
    assert error[0].startswith(
        f"error: the policy did not start: ValueError: policy.tp={tp} needs a CPU core for each of its {tp} workers"
    )
    assert error[0].endswith("bind by hand with policy.omp_threads_bind (one CPU list per worker, e.g. '0|1').")
    assert "Traceback" not in proc.stderr
    assert "starting actors" in proc.stdout and not (tmp_path / "tp").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["policy.tp=3"], "policy.tp=3 does not divide the model's 4 attention heads; use a divisor of 4"),
        (["policy.max_model_len=128"], "policy.max_model_len=128 is more than the model's max_position_embeddings=64"),
        (["model.path={unknown}"], "is a ['GPT2LMHeadModel']; the weight update knows ["),
    ],
)
def test_what_the_models_config_rules_out_stops_the_run_before_any_actor(tmp_path, tiny_model_path, overrides, message):
    unknown = tmp_path / "gpt2"
    unknown.mkdir()
    for f in Path(tiny_model_path).iterdir():
        if f.is_file():
            (unknown / f.name).write_bytes(f.read_bytes())
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    out = tmp_path / "outputs"
    proc = _run_app(f"output_dir={out}", "run_name=r", *[o.format(unknown=unknown) for o in overrides])
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert message in proc.stderr
    assert "starting actors" not in proc.stdout and not out.exists()


def test_a_reference_model_on_a_gpu_the_cluster_lacks_stops_the_run_before_any_actor(tmp_path, tiny_model_path):
    proc = _run_app(f"output_dir={tmp_path}", "run_name=ref", "algo.kl_coef=0.1", "algo.reference_device=gpu")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "error: algo.reference_device=gpu: the Ray cluster has no GPU; use auto or cpu" in proc.stderr
    assert "eval accuracy" not in proc.stdout  # stopped at start


def test_existing_output_folder_is_not_overwritten(tmp_path, tiny_model_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text("keep\n")
    proc = _run_app(f"output_dir={tmp_path}", "run_name=r")
    assert proc.returncode == 2 and "overwrite=true" in proc.stderr
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == "keep\n"


@pytest.mark.slow
def test_short_grpo_run_end_to_end(tmp_path, tiny_model_path):
    """Three real steps (vLLM, Ray, Redis, DCP push, in-place update) with the KL term on."""
    shm = tmp_path / "shm"
    leftover = shm / "ws-short" / "v9" / "model-00001-of-00001.safetensors"  # from a killed run
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(bytes(3 * 2**20))
    sockets_before = _engine_sockets()
    proc = _run_app(
        "steps=3",
        "eval_every=2",
        "prompts_per_step=8",
        "algo.group_size=4",
        "algo.kl_coef=0.05",
        "trainer.lr=1e-3",
        f"output_dir={tmp_path}",
        "run_name=short",
        f"weightsync.shm_root={shm}",
        "logger=[tensorboard,wandb]",
        "wandb.mode=offline",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "short"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps, final = rows[:-1], rows[-1]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert set(r) >= REQUIRED, REQUIRED - set(r)
        assert r["logprob_diff_mean"] < 1e-3  # the policy serves exactly the trainer's weights
        assert r["policy_version"] == r["step"]  # each step's rollouts come from the previous update
        assert 0.0 <= r["reward_mean"] <= 1.0
        phases = [r[k] for k in ("eval_s", "gen_s", "reward_s", "reference_s", "train_s", "weight_sync_s") if k in r]
        assert all(p > 0 for p in phases) and sum(phases) <= r["step_s"]  # the phases run one after another
        assert r["completions_per_s"] == pytest.approx(8 * 4 / r["gen_engine_s"]) and "reference_s" in r
        assert r["gen_engine_s"] <= r["gen_s"] and r["staleness"] == 0 and r["dropped_stale"] == 0
        assert 0 < r["update_copy_s"] < r["update_s"] and 0 < r["update_repack_s"] < r["update_s"]  # one worker
    assert "eval_accuracy" in steps[0] and "eval_accuracy" in steps[2] and "eval_accuracy" not in steps[1]
    assert "eval_s" in steps[2] and "eval_s" not in steps[1]
    assert final["final"] is True and final["policy_version"] == 3 and 0.0 <= final["eval_accuracy"] <= 1.0
    assert steps[0]["kl"] < 1e-6 < steps[2]["kl"]  # policy == reference at first, then they part
    assert "eval accuracy:" in proc.stdout
    assert (out / "report.png").stat().st_size > 10_000 and "held-out accuracy" in (out / "report.md").read_text()
    assert f"report: {out / 'report.png'}" in proc.stdout
    assert f"removed 3.0 MiB of shared memory left by an earlier run ({shm / 'ws-short'})" in proc.stdout

    # TensorBoard and W&B (offline) got every step's numbers, the final eval included.
    board = tensorboard_scalars(out / "tensorboard")
    assert [v for _, v in board["reward_mean"]] == pytest.approx([r["reward_mean"] for r in steps])
    assert [s for s, _ in board["eval_accuracy"]] == [0, 2, 3] and board["eval_accuracy"][-1][1] == pytest.approx(
        final["eval_accuracy"]
    )
    (wandb_run,) = (out / "wandb").glob("offline-run-*")
    logged = history(wandb_run)
    assert [r["_step"] for r in logged] == [0, 1, 2, 3]
    assert [r["gen_s"] for r in logged[:3]] == pytest.approx([r["gen_s"] for r in steps])

    resolved = (out / "config.yaml").read_text()
    assert f"path: {tiny_model_path}" in resolved and "kl_coef: 0.05" in resolved

    # apps.eval on the export, with vLLM and the task's verdicts, gives the run's final accuracy.
    proc = subprocess.run(
        [sys.executable, "-m", "apps.eval", f"model.path={out / 'hf'}"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    correct = round(final["eval_accuracy"] * 500)
    assert f"held-out accuracy {final['eval_accuracy']:.3f} ({correct}/500 problems)" in proc.stdout

    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = AutoModelForCausalLM.from_pretrained(out / "hf")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    AutoTokenizer.from_pretrained(out / "hf")
    moved = [not torch.equal(a, b) for a, b in zip(trained.parameters(), initial.parameters())]
    assert all(moved)  # every tensor was trained and exported
    assert not any(shm.glob("ws-*"))  # shared memory cleaned up at exit
    assert _engine_sockets() <= sockets_before  # and the engine's sockets with their folder


@pytest.mark.slow
def test_async_run_trains_on_batches_sampled_while_earlier_steps_trained(tmp_path, tiny_model_path):
    """mode=async with max_staleness=2: steps 0-2 are requested up front (version 0), then each
    step asks for the batch two steps ahead, sampled by the version loaded just before it; the
    generation of later steps overlaps training, so the loop hardly waits for it."""
    settings = [
        "mode=async",
        "algo.max_staleness=2",
        "eval_every=3",
        "prompts_per_step=8",
        "algo.group_size=4",
        "trainer.lr=1e-4",
        f"output_dir={tmp_path}",
        "run_name=async",
        f"weightsync.shm_root={tmp_path / 'shm'}",
    ]
    proc = _run_app(*settings, "steps=6")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    steps, final = rows[:-1], rows[-1]
    assert [r["step"] for r in steps] == list(range(6))
    assert [r["policy_version"] for r in steps] == [0, 0, 0, 1, 2, 3]
    assert [r["staleness"] for r in steps] == [0, 1, 2, 2, 2, 2] and all(r["dropped_stale"] == 0 for r in steps)
    for r in steps:
        assert set(r) >= REQUIRED - {"update_s"}, REQUIRED - set(r)
        assert "update_wait_s" in r and r["logprob_diff_mean"] < 1.0
    assert steps[0]["logprob_diff_mean"] < 1e-3 < steps[-1]["logprob_diff_mean"]  # the lag shows
    assert any(r["gen_s"] < 0.5 * r["gen_engine_s"] for r in steps[3:])  # sampled while training
    assert final["final"] is True and final["policy_version"] == 6 and "eval_accuracy" in steps[3]
    assert not any((tmp_path / "shm").glob("ws-*"))

    # Resumed for two more steps: the policy loads the checkpoint's version and the batches are
    # requested again from the data cursor (the ones in flight at the end were never trained on).
    proc = _run_app(*settings, "steps=8", "resume=true")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows[:-1]] == list(range(8)) and rows[-1]["policy_version"] == 8
    assert [(r["policy_version"], r["staleness"]) for r in rows[6:8]] == [(6, 0), (6, 1)]


@pytest.mark.slow
def test_grpo_run_with_loss_variants(tmp_path, tiny_model_path):
    """KL as a reward penalty (k2), Dr. GRPO aggregation and advantages, clip-higher, truncated IS;
    weights through the Redis data plane with delta sync; async checkpoints."""
    proc = _run_app(
        "steps=2",
        "eval_every=0",
        "prompts_per_step=8",
        "algo.group_size=4",
        "algo.kl_coef=0.05",
        "algo.kl_mode=reward",
        "algo.kl_estimator=k2",
        "algo.loss_aggregation=seq_mean_token_sum_norm",
        "algo.advantage_std_norm=false",
        "algo.clip_eps_high=0.28",
        "algo.tis_cap=2.0",
        "checkpoint.every=1",
        "checkpoint.async_save=true",
        "weightsync.data_plane=redis",
        "weightsync.delta=true",
        f"output_dir={tmp_path}",
        "run_name=variants",
        f"weightsync.shm_root={tmp_path / 'shm'}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "variants" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows[:-1]] == [0, 1] and rows[-1]["final"] is True
    for r in rows[:-1]:
        assert r["kl"] == 0.0  # the KL went into the rewards, not the loss
        assert r["entropy"] > 0 and r["logprob_diff_mean"] < 1e-3  # vLLM samples with the trainer's weights
        assert r["push_bytes"] + r["push_bytes_reused"] > 0
    # Async saves were published (renamed from their .tmp folders) by the end of the run.
    assert sorted(p.name for p in (tmp_path / "variants" / "checkpoints").iterdir()) == ["step_1", "step_2"]


def _signal_app_when(ready, signum: int, *overrides: str, what: str) -> tuple[subprocess.CompletedProcess, object]:
    """Start the app, wait (5 min at most) until ``ready()`` returns something true, send it
    ``signum``; returns the finished process and what ``ready`` returned."""
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "apps.grpo", *overrides],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (seen := ready()):
            assert proc.poll() is None and time.monotonic() < deadline, f"the run ended or stalled before {what}"
            time.sleep(0.2)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), seen


@pytest.mark.slow
def test_sigterm_mid_run_cleans_up_and_keeps_finished_steps(tmp_path, tiny_model_path):
    import signal

    shm = tmp_path / "shm"
    metrics = tmp_path / "term" / "metrics.jsonl"
    proc, _ = _signal_app_when(
        lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2,
        signal.SIGTERM,
        "steps=500",
        "eval_every=0",
        "prompts_per_step=8",
        "algo.group_size=4",
        f"output_dir={tmp_path}",
        "run_name=term",
        f"weightsync.shm_root={shm}",
        what="step 2",
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "interrupted" in proc.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line is whole
    assert len(rows) >= 2 and not any(r.get("final") for r in rows)
    assert not any(shm.glob("ws-*"))


@pytest.mark.slow
def test_ctrl_c_while_the_engine_starts_leaves_no_shared_memory(tmp_path, tiny_model_path):
    """Ray ends the policy actor (SIGTERM, then SIGKILL within ~0.1 s) while vLLM is starting:
    its engine processes die without removing their /dev/shm queues, so the launcher removes
    those the policy recorded."""
    import signal

    shm = tmp_path / "shm"
    record = shm / "ws-startint" / "engine-files" / "policy-0.json"

    def engine_queues() -> list[Path]:  # once the engine has made its message queue: mid-start
        with contextlib.suppress(OSError, ValueError):
            return [Path(p) for p in json.loads(record.read_text()) if Path(p).name.startswith("psm_")]
        return []

    sockets_before = _engine_sockets()
    proc, queues = _signal_app_when(
        engine_queues,
        signal.SIGINT,
        f"output_dir={tmp_path}",
        "run_name=startint",
        f"weightsync.shm_root={shm}",
        what="its engine started",
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "interrupted" in proc.stderr
    assert not [q for q in queues if q.exists()], "the engine's shared-memory queues were left in /dev/shm"
    assert "MiB of shared memory the stopped vLLM engine left" in proc.stdout
    assert not any(shm.glob("ws-*"))
    assert _engine_sockets() <= sockets_before  # the recorded socket folder, removed by the launcher


@pytest.mark.parametrize(
    "setup, overrides, message",
    [
        ("none", ["resume=true"], "there is no run folder"),
        ("empty", ["resume=true"], "no complete checkpoint"),
        ("partial", ["resume=true"], "only unfinished ones"),
        ("empty", ["resume=true", "overwrite=true"], "pass one"),
    ],
)
def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, setup, overrides, message):
    run = tmp_path / "r"
    if setup != "none":
        (run / "checkpoints").mkdir(parents=True)
        (run / "metrics.jsonl").write_text("keep\n")
    if setup == "partial":
        (run / "checkpoints" / ".step_4.tmp").mkdir()
    proc = _run_app(f"output_dir={tmp_path}", "run_name=r", *overrides)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    if setup != "none":
        assert (run / "metrics.jsonl").read_text() == "keep\n"  # nothing of the old run is touched


TIMING_KEYS = {
    "step_s",
    "weight_sync_s",
    "push_s",
    "update_s",
    "update_copy_s",
    "update_repack_s",
    "gen_tokens_per_s",
    "completions_per_s",
    "train_tokens_per_s",
    "eval_s",
} | {f"{phase}_s" for phase in ("gen", "gen_engine", "reward", "reference", "critic", "train", "critic_train")}


@pytest.mark.slow
def test_a_second_launcher_of_a_live_run_is_refused_and_leaves_its_files_alone(tmp_path, tiny_model_path):
    """Another output_dir does not make it another run here: the same run name shares the
    shared-memory folder, which the second launcher would have taken for a killed run's."""
    from apps.grpo.run_lock import RunLock, lock_path

    shm = tmp_path / "shm"
    live = shm / "ws-live" / "v3" / "model-00001-of-00001.safetensors"
    live.parent.mkdir(parents=True)
    live.write_bytes(bytes(2**20))
    with RunLock(lock_path(shm, "live")):  # as the live run's launcher holds it
        proc = _run_app(f"output_dir={tmp_path / 'other'}", "run_name=live", f"weightsync.shm_root={shm}")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"run 'live' is running on this host already (launcher pid {os.getpid()})" in proc.stderr
    assert live.exists() and not (tmp_path / "other").exists()


def _store_keys(redis_url: str, run: str) -> list[bytes]:
    from weightsync.store import WeightStore

    store = WeightStore(redis_url, run)
    try:
        return store.run_keys()
    finally:
        store.close()


def _leave_versions_in_store(redis_url: str, run: str, versions: list[int]) -> None:
    """What a run killed after pushing ``versions`` leaves in a shared Redis."""
    from weightsync.store import Chunk, TensorEntry, WeightStore

    store = WeightStore(redis_url, run)
    entry = TensorEntry("float32", [2], [Chunk([0], [2], {"kind": "shm", "file": "/dev/shm/gone"})])
    for version in versions:
        store.put_part(version, 0, {"w": entry})
        store.commit(version, 1)
    store.lease(versions[-1], "policy-0")
    store.close()


def test_a_shared_redis_holding_a_runs_versions_is_not_silently_reused(tmp_path, tiny_model_path, redis_url):
    _leave_versions_in_store(redis_url, "taken", [5, 6])
    proc = _run_app(f"output_dir={tmp_path}", "run_name=taken", f"redis.url={redis_url}")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "already holds weight versions of run 'taken'" in proc.stderr and "overwrite=true" in proc.stderr
    assert not (tmp_path / "taken").exists() and len(_store_keys(redis_url, "taken")) > 0  # nothing changed


def test_two_rank_run_resumes_like_an_uninterrupted_run(tmp_path, tiny_model_path, redis_url):
    """trainer.ranks=2 with checkpoints; a copy cut back to its step-2 checkpoint, resumed, redoes
    steps 2-3 exactly as the uninterrupted run did (metrics, evals, policy versions, export).

    Through a shared Redis (``redis.url``): each run removes its keys at the end, and the resumed
    run first removes the versions 3 and 4 that the cut run left there when it was killed (kept,
    they would retire the resumed run's version 2 as soon as it is pushed)."""
    import shutil

    common = [
        "steps=4",
        "eval_every=2",
        "prompts_per_step=8",
        "algo.group_size=4",
        "trainer.ranks=2",
        "trainer.lr=1e-3",
        "trainer.lr_schedule=cosine",
        "checkpoint.every=1",
        "checkpoint.keep_last=3",
        f"output_dir={tmp_path}",
        f"weightsync.shm_root={tmp_path / 'shm'}",
        f"redis.url={redis_url}",
        "logger=tensorboard",
    ]
    proc = _run_app(*common, "run_name=full")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _store_keys(redis_url, "full") == []
    full = tmp_path / "full"
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == ["step_2", "step_3", "step_4"]  # keep_last
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["final"] and rows[-1]["policy_version"] == 4
    assert all(r["logprob_diff_mean"] < 1e-3 for r in rows[:-1])  # two ranks' shards reach vLLM
    assert rows[1]["lr"] > rows[3]["lr"] > 0  # the cosine schedule decays

    # The same run, as if it had crashed after step 2's checkpoint (and left a half-written one).
    cut = tmp_path / "cut"
    shutil.copytree(full, cut, ignore=shutil.ignore_patterns("step_3", "step_4", "hf"))
    (cut / "checkpoints" / ".step_3.tmp").mkdir()
    _leave_versions_in_store(redis_url, "cut", [3, 4])
    proc = _run_app(*common, "run_name=cut")  # an existing run is not silently restarted
    assert proc.returncode == 2 and "resume=true" in proc.stderr
    proc = _run_app(*common, "run_name=cut", "resume=true")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "checkpoints/step_2 (step 2" in proc.stdout
    assert "Redis keys" in proc.stdout and "that an earlier run 'cut' left" in proc.stdout
    assert _store_keys(redis_url, "cut") == []
    resumed = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [r["step"] for r in rows]
    for a, b in zip(rows, resumed, strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING_KEYS} == {
            k: v for k, v in b.items() if k not in TIMING_KEYS
        }
    assert not (cut / "checkpoints" / ".step_3.tmp").exists()  # the unfinished save was cleared
    # TensorBoard shows the redone steps once, with the resumed run's values.
    board = tensorboard_scalars(cut / "tensorboard")
    assert board["loss"] == [(r["step"], pytest.approx(r["loss"])) for r in resumed[:-1]]

    from safetensors.torch import load_file

    def weights(folder):
        return {k: v for f in sorted(folder.glob("model-*.safetensors")) for k, v in load_file(f).items()}

    a, b = weights(full / "hf"), weights(cut / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rows(out: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows[:-1], rows[-1]


def _finite_export(folder: Path) -> bool:
    from safetensors.torch import load_file

    return all(torch.isfinite(t).all() for f in folder.glob("model-*.safetensors") for t in load_file(f).values())


PPO_KEYS = {
    "value_loss",
    "value_clip_frac",
    "explained_variance",
    "advantage_mean",
    "advantage_std",
    "critic_grad_norm",
    "critic_lr",
    "critic_s",
    "critic_train_s",
    "reference_s",
}


@pytest.mark.slow
def test_short_ppo_run_with_two_trainer_and_two_critic_ranks(tmp_path, tiny_model_path):
    """PPO end to end: critic values, GAE, a KL reward penalty to the reference model, both
    models sharded over 2 ranks, the critic's state in the checkpoint; a copy cut back to its
    step-2 checkpoint and resumed redoes the last step exactly (critic included)."""
    import shutil

    common = [
        "algo=ppo",
        "steps=3",
        "eval_every=0",
        "prompts_per_step=8",
        "algo.samples_per_prompt=4",
        "algo.kl_coef=0.05",
        "trainer.ranks=2",
        "algo.critic.ranks=2",
        "checkpoint.every=2",
        f"output_dir={tmp_path}",
        f"weightsync.shm_root={tmp_path / 'shm'}",
    ]
    proc = _run_app(*common, "run_name=ppo")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "ppo"
    steps, final = _rows(out)
    assert [r["step"] for r in steps] == [0, 1, 2] and final["policy_version"] == 3
    for r in steps:
        assert set(r) >= REQUIRED | PPO_KEYS, (REQUIRED | PPO_KEYS) - set(r)
        assert r["logprob_diff_mean"] < 1e-3 and r["kl"] == 0.0  # the KL went into the rewards
        assert r["value_loss"] > 0 and r["critic_lr"] > 0 and r["update_skipped"] == 0
    assert steps[0]["value_mean"] == 0.0  # the fresh head: every value 0 before its first update
    assert steps[2]["value_mean"] != 0.0
    for step in ("step_2", "step_3"):
        critic = out / "checkpoints" / step / "critic"
        assert (critic / "trainer_state.json").is_file() and list(critic.glob("*.safetensors")), step

    cut = tmp_path / "cut"
    shutil.copytree(out, cut, ignore=shutil.ignore_patterns("step_3", "hf"))
    proc = _run_app(*common, "run_name=cut", "resume=true")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    resumed, resumed_final = _rows(cut)
    assert [r["step"] for r in resumed] == [0, 1, 2]
    for a, b in zip(steps, resumed, strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING_KEYS} == {
            k: v for k, v in b.items() if k not in TIMING_KEYS
        }
    assert resumed_final == final


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_run_on_a_dataset_file_with_the_math_reward(tmp_path, tiny_model_path, suffix):
    """``task=dataset``: problems from a file the test writes (arithmetic, so that the tiny
    model's tokenizer reads them), one bad row skipped, the math-answer reward."""
    import random

    rng = random.Random(0)
    records = [
        {"question": f"{a}+{b}=", "solution": str(a + b)}
        for a, b in ((rng.randrange(50), rng.randrange(50)) for _ in range(60))
    ]
    records.insert(7, {"question": "1+1=", "solution": None})
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    proc = _run_app(
        "task=dataset",
        f"task.path={path}",
        "task.prompt_key=question",
        "task.answer_key=solution",
        "task.heldout_size=20",
        "steps=2",
        "eval_every=0",
        "prompts_per_step=8",
        "algo.group_size=4",
        f"output_dir={tmp_path}",
        "run_name=data",
        f"weightsync.shm_root={tmp_path / 'shm'}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"dataset {path.name}: 40 train / 20 held-out problems (1 bad row skipped)" in proc.stdout
    steps, final = _rows(tmp_path / "data")
    assert len(steps) == 2 and final["final"]
    # The warm-started tiny model gets some of these sums right: the math reward sees them.
    assert max(r["reward_mean"] for r in steps) > 0 and 0 < final["eval_accuracy"] <= 1


@pytest.mark.slow
def test_a_reward_that_raises_hangs_or_returns_nan_is_counted_and_the_run_finishes(tmp_path, tiny_model_path):
    marker = tmp_path / "hung-once"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "apps.grpo",
            "task.reward_fn=tests.run_rewards:misbehaving",
            "task.reward_timeout_s=2",
            "task.reward_fallback=0.0",
            "steps=3",
            "eval_every=0",
            "prompts_per_step=8",
            "algo.group_size=4",
            f"output_dir={tmp_path}",
            "run_name=rewards",
            f"weightsync.shm_root={tmp_path / 'shm'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_COLOR": "1", "RLSYS_TEST_HANG_ONCE": str(marker)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert marker.exists()  # the reward did hang once (and was stopped)
    steps, _ = _rows(tmp_path / "rewards")
    assert sum(r["reward_errors"] for r in steps) >= 2  # at least the hang and one raise or NaN
    assert proc.stdout.count("a reward call failed") == 1  # the first error, said once
    assert "timed out after 2" in proc.stdout
    for r in steps:
        assert math.isfinite(r["reward_mean"]) and math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
    assert _finite_export(tmp_path / "rewards" / "hf")


def test_a_bad_reward_function_is_a_clear_error_before_anything_starts(tmp_path, tiny_model_path):
    out = tmp_path / "outputs"
    for path, message in [
        ("tests.run_rewards:nope", "module 'tests.run_rewards' has no attribute 'nope'"),
        ("tests.no_such_module:f", "cannot import module 'tests.no_such_module'"),
        ("tests.run_rewards", "expected null or an import path 'package.module:function'"),
    ]:
        proc = _run_app(f"task.reward_fn={path}", f"output_dir={out}", "run_name=r")
        assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert message in proc.stderr and "task.reward_fn" in proc.stderr, proc.stderr
        assert not out.exists()


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat_file.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


@pytest.mark.slow
def test_policy_replicas_killed_mid_run_come_back_with_the_newest_weights(tmp_path, tiny_model_path):
    """policy.replicas=2 samples each step's batch in two shares; after step 4 both replicas'
    processes are killed (SIGKILL). Ray restarts them, the run waits for one, which loads the
    newest version before it samples: every step's samples come from the weights the trainer
    holds (sync mode: logprob diff ~1e-7; a replica sampling with its start-up weights shows
    > 1e-3 by then), and the run finishes, leaving no engine files behind."""
    import signal
    import time

    psm_before = set(Path("/dev/shm").glob("psm_*"))
    metrics = tmp_path / "replicas" / "metrics.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apps.grpo",
            "policy.replicas=2",
            "steps=10",
            "eval_every=0",
            "prompts_per_step=8",
            "algo.group_size=4",
            "trainer.lr=1e-3",
            f"output_dir={tmp_path}",
            "run_name=replicas",
            f"weightsync.shm_root={tmp_path / 'shm'}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
    )
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 4"
            time.sleep(0.1)
        replicas = [pid for pid in _descendants(proc.pid) if _cmdline(pid).startswith("ray::Policy")]
        assert len(replicas) == 2, [_cmdline(pid) for pid in _descendants(proc.pid)]
        for pid in replicas:
            os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps, final = rows[:-1], rows[-1]
    assert [r["step"] for r in steps] == list(range(10)) and final["final"] is True
    assert steps[-1]["replica_failures"] == 2 and steps[0]["replica_failures"] == 0
    assert max(r["logprob_diff_mean"] for r in steps) < 1e-4
    assert max(r["gen_s"] for r in steps[4:]) > 5  # a step waited for a replica's engine to start again
    assert "is back after" in out and "died (ActorUnavailableError)" in out
    assert not any((tmp_path / "shm").glob("ws-*"))
    assert set(Path("/dev/shm").glob("psm_*")) <= psm_before  # the killed engines' queues too
