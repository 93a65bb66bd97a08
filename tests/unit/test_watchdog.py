"""The lost-host watchdog (hvtrain/watchdog.py) on loopback: a listener that answers with its
token, a port nobody answers on, and a stranger that answers with the wrong token."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from hvtrain.config import load_config
from hvtrain.watchdog import Listener, Place, Watchdog, knock


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: connections are refused


def watch(places, timeout_s=1.0, stall_s=0.5):
    said: list[str] = []
    done = threading.Event()

    def lost(message: str) -> None:
        said.append(message)
        done.set()

    dog = Watchdog(places, "me", timeout_s, lost, stall_s=stall_s)
    return dog, said, done


def test_knock_needs_the_listeners_own_token():
    listener = Listener()
    try:
        assert knock(Place("a", ("127.0.0.1",), listener.port, listener.token))
        assert not knock(Place("a", ("127.0.0.1",), listener.port, "0" * 16))  # someone else's door
        assert not knock(Place("a", ("127.0.0.1",), closed_port(), listener.token))
    finally:
        listener.close()


def test_a_silent_host_is_lost_and_named_with_its_ranks(monkeypatch):
    monkeypatch.setattr("hvtrain.watchdog.PROBE_EVERY_S", 0.2)
    listener = Listener()
    try:
        places = [Place("me", ("127.0.0.1",), 1, "x"), Place("me"),
                  Place("alive", ("127.0.0.1",), listener.port, listener.token), Place("alive"),
                  Place("gone", ("127.0.0.1",), closed_port(), "t"), Place("gone")]
        dog, said, done = watch(places)
        dog.start()
        t0 = time.monotonic()
        assert done.wait(10), "the silent host was never declared lost"
        assert 1.0 <= time.monotonic() - t0 < 5
        assert said[0].startswith("lost host gone (127.0.0.1; ranks 4-5): no answer for 1 s"), said
        assert "alive" not in said[0]
    finally:
        listener.close()


def test_progress_keeps_the_watchdog_quiet(monkeypatch):
    """While steps go on, nobody is knocked on: a host that never answers is not lost."""
    monkeypatch.setattr("hvtrain.watchdog.PROBE_EVERY_S", 0.1)
    dog, said, done = watch([Place("me"), Place("gone", ("127.0.0.1",), closed_port(), "t")])
    dog.start()
    end = time.monotonic() + 2.5
    while time.monotonic() < end:
        dog.beat()
        time.sleep(0.05)
    assert not said
    assert done.wait(5), "stalled after the beats stopped, yet the silent host was not found"  # then it is
    dog.stop()


def test_peer_timeout_is_checked():
    with pytest.raises(Exception, match=r"train.peer_timeout_s: expected seconds >= 0"):
        load_config({"name": "t", "data": {"dataset": "sklearn:digits"}, "model": {"layers": [{"type": "dense", "units": 10}]},
                     "train": {"peer_timeout_s": -1}})
