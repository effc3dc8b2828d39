"""The one rule of heartbeats between nodes (common/heartbeat.py): a peer not heard for longer than the timeout is
lost; a timeout of 0 never loses one for silence."""

from __future__ import annotations

from common.heartbeat import PeerSilence


def test_a_peer_is_lost_once_silent_for_longer_than_the_timeout():
    silence = PeerSilence(timeout_s=5.0, heard_at=100.0)
    assert not silence.lost(105.0)
    assert silence.lost(105.5) and silence.silent_s(105.5) == 5.5


def test_hearing_a_peer_starts_its_silence_again():
    silence = PeerSilence(timeout_s=5.0, heard_at=100.0)
    silence.hear(104.0)
    assert not silence.lost(108.0)


def test_a_timeout_of_0_never_loses_a_peer_for_silence():
    assert not PeerSilence(timeout_s=0.0, heard_at=0.0).lost(1e9)
