"""The watch on a joined Ray cluster's GCS (optimizer/run/gcs_watch.py): lost once it has not
answered for its grace, never before; a GCS back within the grace costs nothing; dialled at most
once a second. The clock is injected; the dial is a real TCP connect on 127.0.0.1 (a real GCS
gone under a joined daemon is tests/test_faults_ray.py's)."""

from __future__ import annotations

import socket

from optimizer.run.gcs_watch import RECONNECT_ENV, GcsWatch, dial, grace_for


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watch(answers: list[bool], clock: _Clock, grace_s: float = 30.0) -> tuple[GcsWatch,
                                                                                list[str]]:
    dialled: list[str] = []

    def connect(host: str, port: int) -> bool:
        dialled.append(f"{host}:{port}")
        return answers.pop(0)

    return GcsWatch("10.0.0.5:6379", grace_s, clock=clock, connect=connect), dialled


def test_a_gcs_is_lost_only_once_it_has_not_answered_for_the_whole_grace() -> None:
    clock = _Clock()
    watch, dialled = _watch([True, False, False, False], clock)
    assert watch.lost() is None
    clock.now += 1.0
    assert watch.lost() is None, "the first refusal starts the grace"
    clock.now += 29.0
    assert watch.lost() is None, "29 s of silence is within a 30 s grace"
    clock.now += 1.0
    line = watch.lost()
    assert line is not None and "10.0.0.5:6379" in line and "30 s" in line, line
    assert dialled == ["10.0.0.5:6379"] * 4


def test_a_gcs_back_within_the_grace_starts_it_again() -> None:
    clock = _Clock()
    watch, _ = _watch([False, True, False, False, False], clock)
    assert watch.lost() is None
    clock.now += 20.0
    assert watch.lost() is None, "it answered again: a restarted GCS (Ray's fault tolerance)"
    clock.now += 20.0
    assert watch.lost() is None, "silent again for 0 s, not 40"
    clock.now += 29.0
    assert watch.lost() is None
    clock.now += 1.0
    assert watch.lost() is not None


def test_the_gcs_is_dialled_at_most_once_a_second_however_often_it_is_asked() -> None:
    clock = _Clock()
    watch, dialled = _watch([False, False], clock, grace_s=0.4)
    for _ in range(10):
        watch.lost()
        clock.now += 0.05
    assert len(dialled) == 1
    assert watch.lost() is not None, "the grace runs on the clock, not on the dials"
    clock.now += 0.6
    watch.lost()
    assert len(dialled) == 2


def test_the_grace_is_half_of_rays_reconnect_window() -> None:
    assert grace_for({}) == 30.0, "Ray's default window is 60 s"
    assert grace_for({RECONNECT_ENV: "8"}) == 4.0
    assert grace_for({RECONNECT_ENV: "1"}) == 1.0, "never under a second"
    assert grace_for({RECONNECT_ENV: "soon"}) == 30.0, "Ray's default for a value it refuses"


def test_dial_tells_a_listening_port_from_a_closed_one() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert dial("127.0.0.1", server.getsockname()[1])
    # bound but not listening: held by this test, so no other process can take the port
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        assert not dial("127.0.0.1", bound.getsockname()[1]), "nothing listens there"
