"""The watchdog's verdicts (common/control.py: Liveness) and the loop progress they read
(common/loop_progress.py): a process is given up on when it stops answering, or when it answers but its loop's
turns stand still while it has work waiting; an idle loop, a busy one and a long step that ends are not stuck.
(Through the real server: tests/test_fault_injection.py.)"""

from __future__ import annotations

import threading

from common.control import Liveness, Stuck
from common.loop_progress import LoopProgress

PING_TIMEOUT_S = 10.0
ITERATION_TIMEOUT_S = 60.0


def liveness() -> Liveness:
    return Liveness(["scheduler"], PING_TIMEOUT_S, ITERATION_TIMEOUT_S, now=0.0)


def answer_every_second(book: Liveness, progress: LoopProgress, start: float, end: float) -> None:
    for now in range(int(start), int(end) + 1):
        book.answered("scheduler", progress.report(), float(now))


def test_turns_that_stand_still_with_work_waiting_are_stuck_after_the_iteration_timeout():
    book, progress = liveness(), LoopProgress()  # outside its idle wait: a turn in progress, work waiting
    answer_every_second(book, progress, 0, 60)
    assert book.stuck(60.0) == []
    answer_every_second(book, progress, 61, 61)
    assert book.stuck(61.0) == [Stuck("scheduler", silent=False, seconds=61.0)]


def test_turns_that_keep_moving_are_never_stuck():
    book, progress = liveness(), LoopProgress()
    for now in range(0, 300):
        progress.advance()
        book.answered("scheduler", progress.report(), float(now))
    assert book.stuck(300.0) == []


def test_a_loop_waiting_for_input_is_never_stuck():
    book, progress = liveness(), LoopProgress()
    entered, release = threading.Event(), threading.Event()
    waiting = threading.Thread(target=progress.idle_wait, args=(lambda _: entered.set() or release.wait(), 0))
    waiting.start()
    try:
        assert entered.wait(5)
        answer_every_second(book, progress, 0, 300)  # the same turn all along, but no work waiting
        assert progress.report()["work_waiting"] is False
        assert book.stuck(300.0) == []
    finally:
        release.set()
        waiting.join()


def test_a_process_that_stops_answering_is_stuck_as_silent():
    book, progress = liveness(), LoopProgress()
    answer_every_second(book, progress, 0, 5)
    assert book.stuck(15.0) == []
    assert book.stuck(15.5) == [Stuck("scheduler", silent=True, seconds=10.5)]


def test_a_process_that_reports_no_turns_is_judged_by_its_silence_alone():
    book = liveness()
    for now in range(0, 300):
        book.answered("scheduler", {}, float(now))
    assert book.stuck(300.0) == []


def test_zero_turns_a_check_off():
    book = Liveness(["scheduler"], 0.0, 0.0, now=0.0)
    book.answered("scheduler", LoopProgress().report(), 1.0)
    assert book.stuck(1000.0) == []


def test_a_forgotten_role_is_no_longer_judged():
    book = liveness()
    book.forget("scheduler")
    book.answered("scheduler", {}, 1.0)  # a late answer from it changes nothing
    assert book.stuck(1000.0) == []


def test_each_wait_for_input_ends_a_turn_and_only_the_time_outside_it_is_work():
    progress = LoopProgress()
    assert progress.report() == {"turns": 0, "work_waiting": True}  # not waiting yet: busy starting
    seen = progress.idle_wait(lambda timeout_ms: progress.report(), 100)
    assert seen == {"turns": 1, "work_waiting": False}
    assert progress.report() == {"turns": 1, "work_waiting": True}


def test_polling_around_a_step_in_flight_is_not_progress_but_finishing_it_is():
    in_flight = [1]
    progress = LoopProgress(holds_work=lambda: bool(in_flight))
    for _ in range(1000):  # the GPU worker polls for its next plan while the device runs a step
        assert progress.idle_wait(lambda timeout_ms: progress.report(), 0)["work_waiting"] is True
    assert progress.turns == 0
    in_flight.clear()
    progress.advance()  # the step finished
    assert progress.turns == 1
