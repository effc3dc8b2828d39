"""The compile worker's queue (scheduler/compile_queue.py): grammars in submission order, each once; one nobody waits
for is never compiled if still queued, and given up if under way only when another grammar is wanted."""

from __future__ import annotations

import threading

from scheduler.compile_queue import CompileQueue

A, B, C = ("regex", "a+"), ("regex", "b+"), ("choice", '["c"]')


def queue_of(*keys) -> CompileQueue:
    jobs = CompileQueue()
    for key in keys:
        jobs.submit(key)
    return jobs


def test_grammars_are_taken_in_submission_order_each_once():
    jobs = queue_of(A, B, A)
    assert len(jobs) == 2
    assert jobs.take() == A and jobs.under_way == A
    jobs.submit(A)  # asked for again while under way: that compile serves it
    jobs.done()
    assert jobs.take() == B and len(jobs) == 0


def test_a_queued_grammar_withdrawn_is_never_taken():
    jobs = queue_of(A, B, C)
    jobs.withdraw(B)
    assert [jobs.take(), jobs.take()] == [A, C]
    assert len(jobs) == 0


def test_a_compile_nobody_waits_for_is_given_up_once_another_grammar_is_wanted():
    jobs = queue_of(A)
    assert jobs.take() == A
    jobs.withdraw(A)
    assert not jobs.abandon(), "nothing else is wanted: it goes on, for the cache"
    jobs.submit(B)
    assert jobs.abandon() and jobs.under_way is None
    assert jobs.take() == B


def test_a_compile_still_wanted_is_not_given_up():
    jobs = queue_of(A, B)
    assert jobs.take() == A
    assert not jobs.abandon()


def test_a_compile_withdrawn_then_asked_for_again_goes_on_and_is_not_queued_twice():
    jobs = queue_of(A)
    assert jobs.take() == A
    jobs.withdraw(A)
    jobs.submit(A)  # a retry of the request that gave up
    jobs.submit(B)
    assert not jobs.abandon(), "wanted again"
    assert len(jobs) == 1


def test_a_grammar_asked_for_once_its_compile_is_done_is_queued_again():
    jobs = queue_of(A)
    assert jobs.take() == A
    jobs.done()
    jobs.submit(A)  # (its outcome already taken: the cache is not this queue's)
    assert len(jobs) == 1 and jobs.take() == A


def test_close_releases_the_compile_thread_waiting_for_a_grammar():
    jobs = CompileQueue()
    taken: list = []
    taker = threading.Thread(target=lambda: taken.append(jobs.take()))
    taker.start()
    jobs.close()
    taker.join(timeout=30)
    assert not taker.is_alive() and taken == [None]
