"""PPO's critic group (FSDP2 over gloo, real Ray actors): its start from the policy's weights,
its values against a direct computation, data parallelism and checkpoint resume."""

from __future__ import annotations

import random

import pytest
import torch

from actors.modeling import ValueModel, load_causal_lm
from actors.rank_groups import CriticGroup
from algos.ppo import ValueLoss
from tests.configs import trainer_config
from tests.test_trainer_group import _assert_same_weights, episodes


def critic_episodes(n: int, seed: int):
    """The trainer tests' episodes with values (as a critic gave them) and returns to fit."""
    rng = random.Random(seed)
    out = episodes(n, seed)
    for e in out:
        e.values = [rng.uniform(-0.2, 0.2) for _ in e.completion_ids]
        e.returns = [rng.uniform(0, 1) for _ in e.completion_ids]
    return out


@pytest.fixture
def make_critic(ray_session, tiny_model_path):
    groups = []

    def make(ranks: int, **changes) -> CriticGroup:
        config = trainer_config(ranks=ranks, lr=3e-3, **changes)
        group = CriticGroup(config, tiny_model_path, loss=ValueLoss(clip=0.2), total_steps=10)
        groups.append(group)
        return group.start()

    yield make
    for group in groups:
        for actor in group.ranks:
            ray_session.kill(actor)


def _direct_values(weights: dict, tiny_model_path: str, batch) -> list[list[float]]:
    """A plain (unsharded) value model with ``weights``, one unpadded sequence at a time: the
    head's output at the position before each completion token."""
    from transformers import AutoModel

    model = ValueModel(AutoModel.from_pretrained(tiny_model_path))
    model.load_state_dict(weights)
    out = []
    for e in batch:
        ids = torch.tensor([e.prompt_ids + e.completion_ids])
        with torch.no_grad():
            v = model(ids)[0]
        out.append(v[len(e.prompt_ids) - 1 : -1].tolist())
    return out


def test_the_critic_starts_from_the_policy_and_its_values_match_a_direct_computation(make_critic, tiny_model_path):
    critic = make_critic(1)
    start = critic.full_state_dict()
    policy = load_causal_lm(tiny_model_path).state_dict()
    body = {k: v for k, v in start.items() if k.startswith("model.")}
    assert body.keys() == {k for k in policy if k.startswith("model.")}
    assert all(torch.equal(v, policy[k]) for k, v in body.items())
    assert not start["value_head.weight"].any() and not start["value_head.bias"].any()  # a fresh head: 0
    batch = critic_episodes(6, seed=1)
    assert all(v == 0.0 for row in critic.values(batch) for v in row)

    metrics = critic.train_step(critic_episodes(8, seed=2))
    assert metrics["loss"] > 0 and metrics["update_skipped"] == 0
    trained = critic.full_state_dict()
    assert trained["value_head.weight"].abs().sum() > 0
    got, want = critic.values(batch), _direct_values(trained, tiny_model_path, batch)
    assert [len(r) for r in got] == [len(e.completion_ids) for e in batch]
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_two_critic_ranks_train_like_one_and_resume_from_a_checkpoint(make_critic, tmp_path):
    one, two = make_critic(1), make_critic(2, micro_batch_size=2)
    for step in range(2):
        batch = critic_episodes(9, seed=step)
        m1, m2 = one.train_step(batch), two.train_step(batch)
        for key in ("loss", "value_clip_frac", "value_mean", "grad_norm", "lr"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), (step, key)
    _assert_same_weights(one.full_state_dict(), two.full_state_dict(), atol=5e-5, adam_lr=3e-3)

    ckpt = tmp_path / "critic"
    ckpt.mkdir()
    two.save_checkpoint(str(ckpt))
    after = [two.train_step(critic_episodes(9, seed=s)) for s in (5, 6)]
    resumed = make_critic(2, micro_batch_size=2)
    resumed.load_checkpoint(str(ckpt))
    again = [resumed.train_step(critic_episodes(9, seed=s)) for s in (5, 6)]
    for a, b in zip(after, again, strict=True):
        for key in ("loss", "grad_norm", "lr", "value_clip_frac"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
    _assert_same_weights(two.full_state_dict(), resumed.full_state_dict(), atol=1e-6)
