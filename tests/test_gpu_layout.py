"""GPU plans (``apps.grpo.gpu_layout``), without GPUs, and the example 8-GPU configs' plans."""

from collections import Counter
from pathlib import Path

import pytest
import yaml

from apps.grpo.gpu_layout import GpuPlan, PlacementConfig, plan_gpus, render_plan
from validation.config import ConfigError, check_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def gpus_used(plan: GpuPlan) -> Counter:
    """(node, GPU) -> how many actors use it."""
    return Counter((a.node, g) for a in plan.actors for g in a.gpus)


def assert_replicas_on_one_node(plan: GpuPlan, tp: int) -> None:
    for replica in plan.role("policy"):
        assert replica.node is not None and len(set(replica.gpus)) == tp
        assert max(replica.gpus) < plan.gpus_per_node[replica.node]


def test_separate_on_one_8_gpu_node_gives_each_actor_gpus_of_its_own():
    plan = plan_gpus([8], trainer_ranks=4, replicas=2, tp=2)
    assert gpus_used(plan) == Counter({(0, g): 1 for g in range(8)})  # disjoint, covering 0..7
    assert [a.gpus for a in plan.role("trainer")] == [(0,), (1,), (2,), (3,)]
    assert [a.gpus for a in plan.role("policy")] == [(4, 5), (6, 7)]
    assert {a.fraction for a in plan.actors} == {1.0}
    assert plan.role("critic") == plan.role("reference") == ()


def test_colocated_policy_runs_on_the_first_trainer_ranks_gpus_sharing_their_memory():
    plan = plan_gpus([8], trainer_ranks=6, replicas=2, tp=2, layout="colocated", policy_fraction=0.4)
    trainer = plan.role("trainer")
    assert [a.gpus for a in trainer] == [(g,) for g in range(6)]
    assert [a.gpus for a in plan.role("policy")] == [(0, 1), (2, 3)]  # replica r on ranks 2r, 2r+1
    assert [a.fraction for a in plan.role("policy")] == [0.4, 0.4]
    assert [a.fraction for a in trainer] == [0.6] * 4 + [1.0] * 2  # ranks 4, 5 share nothing
    for gpu in range(8):
        assert sum(a.fraction for a in plan.on_gpu(0, gpu)) <= 1.0 + 1e-12
    assert max(gpus_used(plan).values()) == 2
    assert {g for _, g in gpus_used(plan)} == set(range(6))  # the policy needs no GPUs of its own


def test_colocated_needs_as_many_trainer_ranks_as_policy_gpus():
    with pytest.raises(ConfigError, match=r"policy\.replicas=3 x policy\.tp=2.*trainer\.ranks=4.*placement\.layout"):
        plan_gpus([8], trainer_ranks=4, replicas=3, tp=2, layout="colocated")


def test_ppo_critic_ranks_and_the_reference_get_gpus_of_their_own_in_both_layouts():
    plan = plan_gpus([8], trainer_ranks=1, replicas=2, tp=2, critic_ranks=2, reference=True)
    assert gpus_used(plan) == Counter({(0, g): 1 for g in range(8)})
    assert [a.gpus for a in plan.role("critic")] == [(5,), (6,)]
    assert plan.actor("reference", 0).gpus == (7,) and plan.actor("reference", 0).fraction == 1.0

    shared = plan_gpus([8], trainer_ranks=4, replicas=2, tp=2, critic_ranks=2, reference=True, layout="colocated")
    own = shared.role("critic") + shared.role("reference")
    assert [a.gpus for a in own] == [(4,), (5,), (6,)]
    assert all(a.fraction == 1.0 and len(shared.on_gpu(0, a.gpus[0])) == 1 for a in own)

    with pytest.raises(
        ConfigError, match=r"trainer\.ranks=2, algo\.critic\.ranks=2 and a reference model.*need 9 GPUs"
    ):
        plan_gpus([8], trainer_ranks=2, replicas=2, tp=2, critic_ranks=2, reference=True)


def test_two_4_gpu_nodes_without_one_node_never_split_a_replica():
    plan = plan_gpus([4, 4], trainer_ranks=2, replicas=3, tp=2)
    assert_replicas_on_one_node(plan, 2)
    assert set(gpus_used(plan).values()) == {1} and len(gpus_used(plan)) == 8
    # Replicas first: trainer ranks first would leave one GPU free on each node for the last replica.
    odd = plan_gpus([3, 3], trainer_ranks=2, replicas=2, tp=2)
    assert_replicas_on_one_node(odd, 2)
    assert sorted(a.node for a in odd.role("policy")) == [0, 1]


def test_one_node_puts_policy_and_trainer_on_the_largest_node_and_names_the_keys_when_it_cannot():
    plan = plan_gpus([4, 8, 8], trainer_ranks=4, replicas=2, tp=2, critic_ranks=1, one_node=True)
    assert plan.weight_sync_node == 1  # the most GPUs; the first of the two
    assert {a.node for a in plan.role("trainer") + plan.role("policy")} == {1}
    assert plan_gpus([4, 8], trainer_ranks=2, replicas=1, tp=2, one_node=True, pinned_node=0).weight_sync_node == 0

    with pytest.raises(ConfigError) as e:  # 10 GPUs in all exist, but not on one node
        plan_gpus([8, 2], trainer_ranks=4, replicas=3, tp=2, one_node=True)
    message = str(e.value)
    for words in ("policy.replicas=3", "policy.tp=2", "trainer.ranks=4", "need 10 GPUs", "placement.layout=separate"):
        assert words in message
    assert "weightsync.data_plane=shm" in message and "has 8" in message and "node 1: 2" in message
    assert plan_gpus([8, 2], trainer_ranks=4, replicas=3, tp=2).uses_gpus  # fits without one_node


def test_tp3_replicas_on_4_gpu_nodes_take_one_node_each():
    plan = plan_gpus([4, 4, 4], trainer_ranks=3, replicas=3, tp=3)
    assert_replicas_on_one_node(plan, 3)
    assert sorted(a.node for a in plan.role("policy")) == [0, 1, 2]
    assert len(gpus_used(plan)) == 12 and set(gpus_used(plan).values()) == {1}
    with pytest.raises(ConfigError, match=r"policy\.replicas=3 x policy\.tp=3.*room for 2"):
        plan_gpus([4, 4, 2], trainer_ranks=1, replicas=3, tp=3)  # 10 GPUs, but 2 + 2 + 0 replicas' worth
    with pytest.raises(ConfigError, match=r"policy\.tp=3.*largest node has 2"):
        plan_gpus([2, 2], trainer_ranks=1, replicas=1, tp=3)


def test_no_gpus_is_a_cpu_plan():
    for cluster in ([], [0, 0]):
        plan = plan_gpus(cluster, trainer_ranks=2, replicas=2, tp=2, critic_ranks=1, one_node=True)
        assert not plan.uses_gpus
        assert [a.name for a in plan.actors] == ["trainer0", "trainer1", "policy0", "policy1", "critic0"]
        assert all(a.node is None and a.gpus == () and a.fraction == 0.0 for a in plan.actors)
        assert render_plan(plan) == "no GPUs: trainer0 trainer1 policy0 policy1 critic0 run on CPUs"


def test_the_table_has_a_line_per_node():
    plan = plan_gpus([0, 8], trainer_ranks=4, replicas=2, tp=2, layout="colocated", one_node=True)
    lines = render_plan(plan).splitlines()
    assert lines[0] == "node 0 (0 GPUs): -"
    assert lines[1].startswith("node 1 (8 GPUs) [policy and trainer node]: GPU0 trainer0(0.6)+policy0.tp0(0.4), ")
    assert "GPU3 trainer3(0.6)+policy1.tp1(0.4), GPU4 free" in lines[1]
    separate = render_plan(plan_gpus([8], trainer_ranks=4, replicas=2, tp=2))
    assert separate == "node 0 (8 GPUs): " + ", ".join(
        [f"GPU{g} trainer{g}" for g in range(4)] + [f"GPU{4 + g} policy{g // 2}.tp{g % 2}" for g in range(4)]
    )


def test_placement_config_rules():
    check_config(PlacementConfig("colocated", 0.4))
    with pytest.raises(ConfigError, match="layout='shared'"):
        check_config(PlacementConfig("shared", 0.4), "placement")
    with pytest.raises(ConfigError, match="placement.policy_fraction=1.0"):
        check_config(PlacementConfig("separate", 1.0), "placement")


@pytest.mark.parametrize("name", ["qwen3-1.7b-8gpu", "qwen3-8b-8gpu"])
def test_example_configs_fill_one_8_gpu_node(name):
    cfg = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    assert cfg["defaults"][0] == "grpo" and cfg["defaults"][-1] == "_self_" and cfg["model"]["path"] == "???"
    trainer_ranks, replicas, tp = cfg["trainer"]["ranks"], cfg["policy"]["replicas"], cfg["policy"]["tp"]
    plan = plan_gpus(
        [8],
        trainer_ranks=trainer_ranks,
        replicas=replicas,
        tp=tp,
        layout=cfg["placement"]["layout"],
        one_node=True,  # the default data plane, shm
    )
    assert gpus_used(plan) == Counter({(0, g): 1 for g in range(8)})  # every GPU, none twice
    assert [a.gpus for a in plan.role("trainer")] == [(0,), (1,), (2,), (3,)]
    assert [a.gpus for a in plan.role("policy")] == [(4, 5), (6, 7)]
    assert_replicas_on_one_node(plan, tp)
    assert cfg["policy"]["max_tokens"] < cfg["policy"]["max_model_len"]
