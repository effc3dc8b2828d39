"""The tokenizer worker's replica router: longest remembered prefix first, else least load, within a bound on
imbalance; bounded memory; every request's owner remembered until it ends."""

from __future__ import annotations

from tokenizer_worker.router import ReplicaRouter

BLOCK = 4


def prompt(prefix: int, blocks: int, tail: list[int] | None = None) -> list[int]:
    """`blocks` full blocks of a prefix family `prefix`, then `tail`."""
    return [prefix * 1000 + i for i in range(blocks * BLOCK)] + (tail or [])


def test_idle_replicas_are_chosen_by_index_then_least_load():
    router = ReplicaRouter(3, BLOCK)
    assert [router.route(rid, [rid, rid + 1]) for rid in range(4)] == [0, 1, 2, 0]
    assert router.in_flight == [2, 1, 1]


def test_a_request_goes_where_its_longest_prefix_was_routed_even_when_that_replica_is_busier():
    router = ReplicaRouter(2, BLOCK)
    assert router.route(1, prompt(7, 4, [1])) == 0
    assert router.route(2, prompt(9, 1)) == 1  # no shared prefix: the idle replica
    assert router.route(3, prompt(5, 3)) == 0  # loads 1 and 1: index
    # Replica 0 is now a request ahead, yet it holds the prefix.
    assert router.route(4, prompt(7, 4, [2, 3])) == 0
    assert router.route(5, prompt(9, 1, [4])) == 1


def test_the_longer_match_wins():
    router = ReplicaRouter(2, BLOCK, max_imbalance=100)
    router.route(1, prompt(7, 1))  # replica 0 knows block 1 of family 7
    router.route(2, prompt(7, 3))  # replica 0 again (prefix), now it knows 3 blocks
    router.release(1), router.release(2)
    router.route(3, prompt(8, 1))  # replica 0 (idle tie) ...
    assert router.route(4, prompt(8, 2)) == 0  # ... and keeps family 8
    assert router.route(5, prompt(7, 3)) == 0


def test_a_partial_block_is_not_a_prefix():
    router = ReplicaRouter(2, BLOCK)
    router.route(1, [1, 2, 3])
    assert router.route(2, [1, 2, 3]) == 1  # nothing cacheable was shared: least load


def test_a_popular_prefix_spreads_once_its_replica_is_too_far_ahead():
    router = ReplicaRouter(2, BLOCK, max_imbalance=2)
    shared = [router.route(rid, prompt(7, 8, [rid])) for rid in range(8)]
    assert shared[:3] == [0, 0, 0]  # 0, 1, 2 ahead: within the bound
    assert shared[3] == 1  # 3 ahead would exceed it; replica 1 learns the prefix
    assert abs(router.in_flight[0] - router.in_flight[1]) <= 2


def test_finished_requests_stop_counting_as_load():
    router = ReplicaRouter(2, BLOCK)
    assert router.route(1, [1]) == 0
    assert router.release(1) == 0
    assert router.route(2, [2]) == 0
    assert router.in_flight == [1, 0]


def test_an_abort_finds_the_replica_that_holds_the_request():
    router = ReplicaRouter(2, BLOCK)
    owners = {rid: router.route(rid, [rid]) for rid in range(6)}
    assert {router.owner(rid) for rid in owners} == {0, 1}
    for rid, replica in owners.items():
        assert router.owner(rid) == replica
        assert router.release(rid) == replica
        assert router.owner(rid) is None
    assert router.release(3) is None  # ended twice (an abort after its finish): nothing more to release
    assert router.in_flight == [0, 0]


def test_prefix_memory_is_bounded_and_forgets_the_least_recently_routed():
    router = ReplicaRouter(2, BLOCK, memory_blocks=8)
    for family in range(20):  # new families alternate between the replicas (least load)
        router.route(family, prompt(family, 4))
        assert max(router.remembered_blocks(0), router.remembered_blocks(1)) <= 8
    assert router.remembered_blocks(0) == router.remembered_blocks(1) == 8
    router = ReplicaRouter(2, BLOCK, memory_blocks=4)
    router.route(1, prompt(1, 4))
    router.route(2, prompt(2, 4))  # replica 1 (least load)
    router.release(1), router.release(2)
    router.route(3, prompt(3, 4))  # replica 0 forgets family 1 to remember family 3
    router.release(3)
    router.route(4, [0])  # load 0 ahead by one
    assert router.route(5, prompt(1, 4)) == 1  # family 1 is remembered nowhere now: least load


def test_a_single_replica_remembers_no_prefixes():
    router = ReplicaRouter(1, BLOCK)
    for rid in range(20):
        assert router.route(rid, prompt(rid % 3, 4, [rid])) == 0
    assert router.remembered_blocks(0) == 0
    assert router.in_flight == [20]
    for rid in range(20):
        router.release(rid)
    assert router.in_flight == [0]


def test_block_hashes_name_whole_prefixes():
    router = ReplicaRouter(1, BLOCK)
    a = router.block_hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = router.block_hashes([9, 9, 9, 9, 5, 6, 7, 8])
    assert len(a) == len(b) == 2
    assert a[1] != b[1]  # the same second block after a different first one is a different prefix
    assert router.block_hashes([1, 2, 3, 4, 5]) == a[:1]


def test_a_failed_replica_hands_back_its_requests_and_is_never_chosen_again():
    router = ReplicaRouter(3, BLOCK)
    assert [router.route(rid, prompt(7, 4, [rid])) for rid in range(6)] == [0, 0, 0, 0, 0, 0]  # the prefix's
    router.route(6, [1])  # replica 1: least load
    assert router.remove(0) == [0, 1, 2, 3, 4, 5]
    assert router.owner(0) is None and router.in_flight == [0, 1, 0]
    # Its prefix goes with it: new to the others, the family goes to the least loaded, which learns it.
    assert [router.route(rid, prompt(7, 4, [rid])) for rid in range(10, 14)] == [2, 2, 2, 2]
    assert router.release(10) == 2


def test_with_one_replica_left_every_request_goes_there():
    router = ReplicaRouter(2, BLOCK)
    router.remove(0)
    assert [router.route(rid, prompt(rid, 2)) for rid in range(4)] == [1, 1, 1, 1]


def test_a_cache_salt_heads_every_block_hash_as_it_heads_the_tries_keys():
    router = ReplicaRouter(1, BLOCK)
    ids = prompt(7, 3)
    plain, salted = router.block_hashes(ids), router.block_hashes(ids, "tenant-a")
    assert salted == router.block_hashes(ids, "tenant-a")
    assert not set(salted) & set(plain) and not set(salted) & set(router.block_hashes(ids, "tenant-b"))


def test_a_prompt_routed_under_one_salt_is_no_prefix_match_under_another():
    router = ReplicaRouter(2, BLOCK)
    assert router.route(1, prompt(7, 3), "a") == 0
    assert router.route(2, prompt(7, 3), "b") == 1, "nothing of salt b cached anywhere: least load"
    assert router.route(3, prompt(7, 3), "a") == 0, "salt a's prefix is remembered on replica 0"


def test_a_replica_that_has_not_joined_is_not_chosen_until_it_joins():
    router = ReplicaRouter(2, BLOCK, serving=[0])  # replica 1: a headless node's, not joined yet
    assert [router.route(rid, prompt(rid, 2)) for rid in range(3)] == [0, 0, 0]
    router.add(1)
    assert router.route(3, prompt(3, 2)) == 1  # the least loaded, now that it serves


def test_a_replica_back_from_a_lost_node_is_routed_to_with_an_empty_memory():
    router = ReplicaRouter(2, BLOCK)
    assert [router.route(rid, prompt(7, 4, [rid])) for rid in (0, 1)] == [0, 0]
    router.route(2, [1])  # replica 1
    router.remove(1)
    router.add(1)
    router.release(0)
    router.release(1)
    # Replica 0 still remembers the family; replica 1, back, remembers nothing and holds nothing.
    assert router.remembered_blocks(1) == 0 and router.in_flight == [0, 0]
    assert router.route(3, prompt(7, 4, [3])) == 0
