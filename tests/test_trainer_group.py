"""The FSDP2 trainer group (gloo, real Ray actors): data parallelism, checkpoints, errors."""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import pytest
import torch

from actors.rank_groups import TrainerGroup
from algos.episodes import Episode
from algos.shared_prefix import length_buckets
from checkpointing.folders import CheckpointError
from tests.configs import default_policy_loss, trainer_group
from weightsync.store import WeightStore

OPTIONS = {"lr": 3e-3, "max_grad_norm": 1.0}  # trainer settings; the default policy loss


def episodes(n: int, seed: int) -> list[Episode]:
    """Synthetic rollouts over the tiny model's 15-token vocabulary (ragged lengths)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(2, 15) for _ in range(rng.randint(3, 7))]
        completion = [rng.randrange(1, 15) for _ in range(rng.randint(1, 5))]
        logprobs = [-rng.random() * 3 for _ in completion]
        out.append(Episode(prompt, completion, logprobs, 0.0, 0, advantages=[rng.uniform(-1, 1)] * len(completion)))
    return out


@pytest.fixture
def make_group(ray_session, redis_url, tiny_model_path, shm_root):
    groups = []

    def make(ranks: int, run: str, model_path: str | None = None, **kwargs) -> TrainerGroup:
        sync = {"shm_root": shm_root}  # reserved shard files go there
        group = trainer_group(ranks, model_path or tiny_model_path, redis_url, run, sync=sync, **{**OPTIONS, **kwargs})
        groups.append(group)
        return group.start()

    yield make
    for group in groups:
        for actor in group.ranks:
            ray_session.kill(actor)


def _assert_same_weights(a: dict, b: dict, atol: float = 1e-5, adam_lr: float | None = None) -> None:
    """Every weight within ``atol``. With ``adam_lr``, for runs whose float sums differ (one rank
    against two): Adam divides by sqrt(v), so where a gradient is ~0 summation-order noise can
    move a weight by up to about lr. Then at most 1 in 10,000 of a tensor's elements (at least
    one) may differ by more than ``atol``, and none by more than ``adam_lr`` (or ``atol``)."""
    assert a.keys() == b.keys()
    for key in a:
        diff = (a[key] - b[key]).abs()
        stray = (diff > atol).sum().item()
        detail = (key, diff.max().item(), stray, diff.numel())
        if adam_lr is None:
            assert stray == 0, detail
        else:
            assert diff.max().item() <= max(adam_lr, atol) and stray <= max(1, diff.numel() // 10_000), detail


def test_two_ranks_train_like_one(make_group, tiny_model_path, redis_url):
    # One CPU rank in float32 trains the plain model (FSDPRank.wrapped_by_fsdp); two use FSDP2.
    one = make_group(1, "tg-one")
    two = make_group(2, "tg-two", micro_batch_size=2)  # 2 ranks x 3 uneven micro-batches of 5..6 episodes
    start = one.full_state_dict()
    for step in range(3):
        batch = episodes(11, seed=step)
        m1, m2 = one.train_step(batch), two.train_step(batch)
        for key in ("loss", "kl", "clip_frac", "entropy", "logprob_diff_mean", "logprob_diff_max", "grad_norm", "lr"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), (step, key)
    w1, w2 = one.full_state_dict(), two.full_state_dict()
    # 5e-5 is 1.7% of one step (lr 3e-3); the weights move by far more (below).
    _assert_same_weights(w1, w2, atol=5e-5, adam_lr=OPTIONS["lr"])
    moved = max((w1[k] - start[k]).abs().max().item() for k in w1)
    assert moved > 1e-3  # the steps really trained (so equal weights mean something)
    # Each rank reserved shard files at start (keep_last=2: two kept versions, the one a policy
    # still leases, the one being written): the first pushes write over those, later ones over
    # retired versions' files; none into fresh shared memory.
    store = WeightStore(redis_url, "tg-two")
    for version in range(1, 7):
        assert two.push_weights(version)["ranks_wrote_over_spare"] == 2, version
        store.lease(version, "policy-0")
    store.close()


@pytest.mark.timeout(300)  # a rank waiting for another's gather would wait for gloo's 30 minutes
def test_two_ranks_train_like_one_whatever_passes_their_completions_need(make_group):
    """FSDP2 ranks gather the parameters in every forward pass, so they must all make the same
    ones: here rank 0's half of the batch needs one completion pass and rank 1's two (shared
    prefix, ``completion_passes=3``), then rank 1 has no episode at all (its empty pass). Neither
    step may hang, and both train as one rank does."""
    loss = dataclasses.replace(default_policy_loss(), completion_passes=3)
    one = make_group(1, "tg-passes-one", loss=loss)
    two = make_group(2, "tg-passes-two", loss=loss)
    rng = random.Random(5)

    def episode(completion_len: int) -> Episode:
        prompt = [rng.randrange(2, 15) for _ in range(rng.randint(3, 7))]
        completion = [rng.randrange(1, 15) for _ in range(completion_len)]
        logprobs = [-rng.random() * 3 for _ in completion]
        return Episode(prompt, completion, logprobs, 0.0, 0, advantages=[rng.uniform(-1, 1)] * completion_len)

    uniform = [episode(3) for _ in range(12)]  # rank 0's share: one pass
    mixed = [episode(2 if i % 2 else 40) for i in range(12)]  # rank 1's: a pass for each length
    widths = [[len(e.completion_ids) - 1 for e in share] for share in (uniform, mixed)]
    assert [len(length_buckets(w, 3)) for w in widths] == [1, 2]
    for batch in (uniform + mixed, [episode(30)]):
        m1, m2 = one.train_step(batch), two.train_step(batch)
        for key in ("loss", "clip_frac", "entropy", "grad_norm"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    _assert_same_weights(one.full_state_dict(), two.full_state_dict(), atol=5e-5, adam_lr=OPTIONS["lr"])


def test_an_update_with_a_non_finite_loss_is_skipped(make_group):
    group = make_group(1, "tg-nan", lr_schedule="linear")  # over 1 step: a second step's LR would be 0
    before = group.full_state_dict()
    bad = episodes(6, seed=0)
    bad[2].advantages = [float("nan")] * len(bad[2].advantages)
    metrics = group.train_step(bad)
    assert metrics["update_skipped"] == 1 and not torch.isfinite(torch.tensor(metrics["loss"]))
    after = group.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no weight moved, none is NaN
    good = group.train_step(episodes(6, seed=1))
    assert good["update_skipped"] == 0 and good["lr"] == metrics["lr"]  # the LR schedule did not move
    moved = group.full_state_dict()
    assert all(torch.isfinite(v).all() for v in moved.values()) and any(
        not torch.equal(before[k], moved[k]) for k in before
    )  # Adam's state held no NaN either: the next good step trains


def test_checkpoint_resume_is_equivalent(make_group, tmp_path):
    first = make_group(2, "tg-ckpt-a")
    (tmp_path / "earlier").mkdir()
    first.save_checkpoint(str(tmp_path / "earlier"))  # so that the next save reuses cached DCP plans
    first.train_step(episodes(8, seed=0))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    first.save_checkpoint(str(ckpt), async_save=True)
    first.wait_for_checkpoint()
    after = [first.train_step(episodes(8, seed=s)) for s in (1, 2)]
    weights_after = first.full_state_dict()

    resumed = make_group(2, "tg-ckpt-b")
    resumed.load_checkpoint(str(ckpt))
    again = [resumed.train_step(episodes(8, seed=s)) for s in (1, 2)]
    for a, b in zip(after, again, strict=True):
        for key in ("loss", "grad_norm", "lr", "logprob_diff_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
    _assert_same_weights(weights_after, resumed.full_state_dict(), atol=1e-6)

    # A checkpoint that lost Adam's moments or the step count would change these updates: Adam's
    # first step moves every weight by ~lr whatever the gradient. The 2-rank shards also load
    # into a 1-rank group (DCP reshards) and continue identically.
    single = make_group(1, "tg-ckpt-c")
    single.load_checkpoint(str(ckpt))
    for s, a in zip((1, 2), after, strict=True):
        assert single.train_step(episodes(8, seed=s))["loss"] == pytest.approx(a["loss"], rel=1e-5)
    _assert_same_weights(weights_after, single.full_state_dict(), atol=5e-5, adam_lr=OPTIONS["lr"])


def test_bad_checkpoints_are_clear_errors(make_group, tmp_path, tiny_model_path):
    group = make_group(1, "tg-bad")
    good = tmp_path / "good"
    good.mkdir()
    group.save_checkpoint(str(good))

    # Corrupt: one shard file truncated.
    corrupt = tmp_path / "corrupt"
    shutil.copytree(good, corrupt)
    shard = next(corrupt.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="unreadable shards|could not be read"):
        group.load_checkpoint(str(corrupt))

    # Partial: the trainer's own state file is missing.
    partial = tmp_path / "partial"
    shutil.copytree(good, partial)
    (partial / "trainer_state.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        group.load_checkpoint(str(partial))

    # Another model's checkpoint: a model with a different hidden size.
    other_dir = _other_shape_model(tmp_path, tiny_model_path)
    other = make_group(1, "tg-other", model_path=str(other_dir))
    other_ckpt = tmp_path / "other"
    other_ckpt.mkdir()
    other.save_checkpoint(str(other_ckpt))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        group.load_checkpoint(str(other_ckpt))

    # None of that touched the good checkpoint, which still loads.
    group.load_checkpoint(str(good))


def _other_shape_model(tmp_path: Path, tiny_model_path: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_path)
    config.hidden_size = 64
    out = tmp_path / "other-model"
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for f in Path(tiny_model_path).glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


SEQUENCES = [[5, 6, 2, 7, 8, 14, 9, 1], [9, 9, 2, 12, 14, 7, 1], [3, 3, 12, 4, 14, 4, 8, 1]]


@pytest.mark.slow
def test_hf_export_by_two_ranks_loads_in_transformers_and_vllm(
    make_group, ray_session, redis_url, tmp_path, tiny_model_path
):
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.modeling import sequence_token_logprobs
    from actors.policy import Policy
    from tests.configs import policy_config

    group = make_group(2, "tg-export")
    group.train_step(episodes(12, seed=0))  # the export must hold trained weights, not the source's
    as_episodes = [Episode(ids[:1], ids[1:], [0.0] * (len(ids) - 1), 0.0, 0) for ids in SEQUENCES]
    trainer_logprobs = group.logprobs(as_episodes)

    out = tmp_path / "export"
    group.export_hf(str(out), max_shard_bytes=1 << 20)  # ~3 MiB of weights -> several files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) >= 2 and all((out / f).is_file() for f in files)
    assert set(out.glob("*.safetensors")) == {out / f for f in files}  # no stray per-rank shards

    model = AutoModelForCausalLM.from_pretrained(out)
    assert set(index["weight_map"]) == {k for k in model.state_dict() if k != "lm_head.weight"}  # tied head
    AutoTokenizer.from_pretrained(out)
    for ids, expected in zip(SEQUENCES, trainer_logprobs, strict=True):
        batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        with torch.no_grad():
            got = sequence_token_logprobs(model, batch)[0, 1:]
        torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=1e-5)

    policy = Policy.remote(str(out), redis_url, "tg-export-vllm", policy_config(), replica="export-check")
    try:
        served = ray_session.get(policy.prompt_logprobs.remote(SEQUENCES))
    finally:
        ray_session.get(policy.close.remote())
        ray_session.kill(policy)
    for row, expected in zip(served, trainer_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(row[1:]), torch.tensor(expected), rtol=0, atol=1e-4)
    # The source model gives other logprobs: the matches above are the trained weights'.
    source = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    batch = {"input_ids": torch.tensor([SEQUENCES[0]]), "attention_mask": torch.ones(1, len(SEQUENCES[0]))}
    with torch.no_grad():
        before = sequence_token_logprobs(source, batch)[0, 1:]
    assert (before - torch.tensor(trainer_logprobs[0])).abs().max().item() > 1e-3
