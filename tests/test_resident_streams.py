"""Resident mode's CUDA stream bookkeeping on the CPU: torch's CUDA streams, events and
device calls stood in for, so that what each decode asks of the host is counted."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from entropykit._cuda import nvrtc  # noqa: E402
from entropykit.torch import _cuda  # noqa: E402


class _Stream:
    def __init__(self, handle: int, log: list) -> None:
        self.cuda_stream, self.log = handle, log

    def wait_event(self, event: object) -> None:
        self.log.append(("wait", self.cuda_stream, event.name))


@pytest.fixture
def fake_cuda(monkeypatch):
    """Stand-ins for torch.cuda's streams (side streams get handles 100, 101, ...),
    events, current stream (handle ``state["current"]``) and device (``state["device"]``),
    counting current-stream lookups and device contexts entered."""
    log: list = []
    state = {"current": 7, "device": 0, "lookups": 0, "contexts": 0, "sides": 100}

    def side(device=None) -> _Stream:
        state["sides"] += 1
        return _Stream(state["sides"] - 1, log)

    class Event:
        made = 0

        def __init__(self) -> None:
            self.name = f"e{Event.made}"
            Event.made += 1

        def record(self, stream: _Stream) -> None:
            log.append(("record", self.name, stream.cuda_stream))

    def current_stream(device=None) -> _Stream:
        state["lookups"] += 1
        return _Stream(state["current"], log)

    @contextlib.contextmanager
    def device(d):
        state["contexts"] += 1
        was, state["device"] = state["device"], torch.device(d).index
        yield
        state["device"] = was

    monkeypatch.setattr(torch.cuda, "Stream", side)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream",
                        lambda index: state["current"], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: state["device"], raising=False)
    monkeypatch.setattr(nvrtc, "view", lambda handle: ("view", handle))
    return log, state


class _Decoder:
    def __init__(self, log: list) -> None:
        self.log = log

    def run(self, rows=None, stream=None) -> None:
        self.log.append(("run", stream))


def test_decodes_go_to_streams_by_handle(fake_cuda) -> None:
    """A prefetch records the compute stream's event, the side stream (taken in turn)
    waits for it, the decode runs on the side stream's view and records its own event,
    which a join makes the compute stream wait for; a decode now runs on the compute
    stream's view. Torch's current stream is looked up once while its handle stays the
    same (again when it changes: a graph capture's stream), and no device context is
    entered per decode while the device is current (one is where it is not)."""
    log, state = fake_cuda
    streams = _cuda.CudaStreams(torch.device("cuda", 0), units=4, sides=2)
    made = state["contexts"]
    d = _Decoder(log)
    log.clear()
    streams.prefetch(1, d)
    streams.prefetch(2, d)
    streams.join(1)
    streams.now(d)
    free1, free2 = streams.free[1].name, streams.free[2].name
    ready1, ready2 = streams.ready[1].name, streams.ready[2].name
    assert log == [
        ("record", free1, 7), ("wait", 100, free1), ("run", ("view", 100)),
        ("record", ready1, 100),
        ("record", free2, 7), ("wait", 101, free2), ("run", ("view", 101)),
        ("record", ready2, 101),
        ("wait", 7, ready1), ("run", ("view", 7))]
    assert state["lookups"] == 1 and state["contexts"] == made + 1  # the first lookup's
    for _ in range(5):
        streams.prefetch(3, d)
        streams.join(3)
    assert state["lookups"] == 1 and state["contexts"] == made + 1
    state["current"] = 9  # another stream made current (a capture)
    log.clear()
    streams.now(d)
    assert log == [("run", ("view", 9))] and state["lookups"] == 2
    state["device"] = 1  # the device is not current: one context a call
    before = state["contexts"]
    streams.join(3)
    streams.now(d)
    assert state["contexts"] == before + 1
