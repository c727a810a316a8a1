"""The engines' activity file and the trainer's thread count that follows it, layer by layer."""

from __future__ import annotations

import time

import torch

from actors.engine_activity import EngineActivity, IdleCoreThreads


def test_any_replica_busy_is_busy_and_a_restarted_replica_clears_its_byte(tmp_path):
    path = tmp_path / "run" / "engines-busy"
    reader = EngineActivity(path)
    assert not reader.any_busy()  # no replica has made the file yet
    first, second = EngineActivity(path, slot=0), EngineActivity(path, slot=1)
    assert not reader.any_busy()
    second.mark(True)
    assert reader.any_busy()
    first.mark(True)
    second.mark(False)
    assert reader.any_busy()
    first.mark(False)
    assert not reader.any_busy()
    second.mark(True)
    second.close()  # the replica dies while busy; Ray restarts it
    assert reader.any_busy()
    EngineActivity(path, slot=1)
    assert not reader.any_busy()


class _Recorder(torch.nn.Module):
    """A layer that records the torch threads its forward and its backward run with."""

    def __init__(self, log: list, name: str) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.log, self.name = log, name

    def forward(self, x):
        self.log.append((self.name, "forward", torch.get_num_threads()))
        return _RecordBackward.apply(self.linear(x), self.log, self.name)


class _RecordBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, name):
        ctx.log, ctx.name = log, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append((ctx.name, "backward", torch.get_num_threads()))
        return grad, None, None


def test_threads_follow_the_engines_at_each_layer_forward_and_backward(tmp_path):
    path = tmp_path / "engines-busy"
    engine = EngineActivity(path, slot=0)
    log: list = []
    layers = [_Recorder(log, "a"), _Recorder(log, "b")]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        IdleCoreThreads(layers, EngineActivity(path), base=1, extra=2, settle_s=0.0)

        engine.mark(True)
        x = torch.randn(2, 4, requires_grad=True)
        h = layers[0](x)
        engine.mark(False)  # the engine empties between the two layers' forwards
        out = layers[1](h).sum()
        engine.mark(True)  # and works again before the backward pass
        out.backward()
        assert log == [
            ("a", "forward", 1),
            ("b", "forward", 3),
            ("b", "backward", 1),
            ("a", "backward", 1),
        ]

        log.clear()
        engine.mark(False)
        layers[1](layers[0](x)).sum().backward()
        assert [threads for *_, threads in log] == [3, 3, 3, 3]
    finally:
        torch.set_num_threads(before)


def test_threads_are_lent_only_once_the_engines_stay_idle(tmp_path):
    path = tmp_path / "engines-busy"
    engine = EngineActivity(path, slot=0)
    layers = [torch.nn.Identity()]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        IdleCoreThreads(layers, EngineActivity(path), base=1, extra=1, settle_s=0.2)
        x = torch.zeros(1)
        layers[0](x)  # idle from now
        assert torch.get_num_threads() == 1
        time.sleep(0.25)
        layers[0](x)
        assert torch.get_num_threads() == 2
        engine.mark(True)
        layers[0](x)
        assert torch.get_num_threads() == 1
        engine.mark(False)
        layers[0](x)  # idle again, but not for long enough
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
