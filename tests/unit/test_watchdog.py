"""The lost-host watchdog (hvtrain/watchdog.py) on loopback. A host "goes silent" the way a cut
link looks to TCP: its door stops accepting and its accept queue fills, so SYNs are dropped and
connects time out (no refusal, no reset)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from hvtrain.config.load import load_config
from hvtrain.errors import ConfigError
from hvtrain.runtime.watchdog import Listener, Place, Watchdog, distinct_addresses, knock


class Door:
    """A host's listener on loopback that can go silent."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.accepting, self.held = True, []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.accepting:
            try:
                self.sock.accept()[0].close()
            except OSError:
                pass

    def silence(self) -> None:
        self.accepting = False
        self.thread.join()
        for _ in range(4):  # fill the accept queue: later SYNs are dropped
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", self.port))
            self.held.append(c)
        time.sleep(0.2)

    def close(self) -> None:
        self.accepting = False
        for c in self.held:
            c.close()
        self.sock.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: connections are refused


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr("hvtrain.runtime.watchdog.PROBE_EVERY_S", 0.1)
    monkeypatch.setattr("hvtrain.runtime.watchdog.KNOCK_TIMEOUT_S", 0.3)


class Seen:
    def __init__(self) -> None:
        self.lines: list[tuple[str, bool]] = []
        self.ended = threading.Event()

    def report(self, message: str, failure: bool) -> None:
        self.lines.append((message, failure))

    def failures(self) -> list[str]:
        return [m for m, f in self.lines if f]


def watchdog(places, seen: Seen, timeout_s=1.0, grace_s=0.0) -> Watchdog:
    return Watchdog(places, "me", timeout_s, seen.report, seen.ended.set, stall_s=0.3, grace_s=grace_s)


def test_knock_alive_on_accept_or_refusal_silent_on_timeout(fast):
    """Defect (review): a refusal counted as silence, so a host whose ranks had ended normally
    (listener closed) was 'lost' while rank 0 still wrote the final or pre-emption checkpoint."""
    listener, door = Listener(), Door()
    try:
        assert knock(Place("a", ("127.0.0.1",), listener.port))
        assert knock(Place("a", ("127.0.0.1",), closed_port()))  # refused: the host is up
        door.silence()
        t0 = time.monotonic()
        assert not knock(Place("a", ("127.0.0.1",), door.port))
        assert time.monotonic() - t0 >= 0.25
    finally:
        listener.close()
        door.close()


def test_a_host_that_goes_silent_is_lost_and_named_with_its_ranks(fast):
    alive, gone = Door(), Door()
    seen = Seen()
    places = [Place("me", ("127.0.0.1",), 1), Place("me"), Place("alive", ("127.0.0.1",), alive.port),
              Place("alive"), Place("gone", ("127.0.0.1",), gone.port), Place("gone")]
    dog = watchdog(places, seen)
    # loopback stands for three hosts' addresses (shared addresses are dropped: put them back)
    dog.doors = {"alive": places[2], "gone": places[4]}
    try:
        dog.start()
        time.sleep(0.5)
        assert not seen.lines  # both answered at start
        t0 = time.monotonic()  # before: silence() itself takes 0.2 s, and knocks fail from its start
        gone.silence()
        assert seen.ended.wait(10), f"the silent host was never declared lost: {seen.lines}"
        assert 1.0 <= time.monotonic() - t0 < 5
        (said,) = seen.failures()
        assert said.startswith("lost host gone (127.0.0.1; ranks 4-5): no answer for 1 s"), said
        assert "alive" not in said
    finally:
        dog.stop()
        alive.close()
        gone.close()


def test_progress_keeps_the_watchdog_quiet_and_ranks_that_ended_are_not_lost(fast):
    gone = Door()
    seen = Seen()
    dog = watchdog([Place("me"), Place("gone", ("127.0.0.1",), gone.port)], seen)
    dog.doors = {"gone": Place("gone", ("127.0.0.1",), gone.port)}
    try:
        dog.start()
        gone.silence()
        end = time.monotonic() + 2.0
        while time.monotonic() < end:  # steps go on: nobody is knocked on
            dog.beat()
            time.sleep(0.05)
        assert not seen.lines
        assert seen.ended.wait(5)  # stalled after the beats stopped: then it is found
    finally:
        dog.stop()
        gone.close()
    refused = Seen()
    dog = watchdog([Place("me"), Place("done", ("127.0.0.1",), closed_port())], refused)
    dog.doors = {"done": Place("done", ("127.0.0.1",), closed_port())}
    try:
        dog.start()
        time.sleep(2.0)  # stalled throughout; the host refuses: up, its ranks ended
        assert not refused.lines and not refused.ended.is_set()
    finally:
        dog.stop()


def test_a_host_unreachable_at_start_is_not_watched_with_a_warning(fast):
    door = Door()
    door.silence()
    seen = Seen()
    dog = watchdog([Place("me"), Place("walled", ("127.0.0.1",), door.port)], seen)
    dog.doors = {"walled": Place("walled", ("127.0.0.1",), door.port)}
    try:
        dog.start()
        time.sleep(2.0)
        assert not seen.ended.is_set() and not seen.failures()
        (warning,) = [m for m, _ in seen.lines]
        assert "does not answer on port" in warning and "not watched" in warning, warning
    finally:
        dog.stop()
        door.close()


def test_training_that_resumes_within_the_grace_is_not_ended(fast):
    gone = Door()
    seen = Seen()
    dog = watchdog([Place("me"), Place("gone", ("127.0.0.1",), gone.port)], seen, grace_s=1.5)
    dog.doors = {"gone": Place("gone", ("127.0.0.1",), gone.port)}
    try:
        dog.start()
        time.sleep(0.3)
        gone.silence()
        deadline = time.monotonic() + 10
        while not seen.failures() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen.failures(), "never reported"
        dog.beat()  # training went on after all
        time.sleep(2.0)
        assert not seen.ended.is_set()
        assert any("training goes on" in m for m, _ in seen.lines), seen.lines
    finally:
        dog.stop()
        gone.close()


def test_addresses_several_hosts_claim_are_not_knocked_on():
    places = distinct_addresses([Place("a", ("10.0.0.1", "172.17.0.1"), 5), Place("b", ("10.0.0.2", "172.17.0.1"), 6)])
    assert [p.addresses for p in places] == [("10.0.0.1",), ("10.0.0.2",)]


@pytest.mark.parametrize("value", [-1, 0.1, 3.9])
def test_peer_timeout_is_checked(value):
    with pytest.raises(ConfigError, match=r"train.peer_timeout_s: expected 0 \(no lost-host watchdog\) or seconds >= 4"):
        load_config({"name": "t", "data": {"dataset": "sklearn:digits"},
                     "model": {"layers": [{"type": "dense", "units": 10}]}, "train": {"peer_timeout_s": value}})
