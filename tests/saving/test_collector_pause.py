"""The union's prepare pauses Python's garbage collector and moves what it
made to the oldest generation on the way out (deeppart.saving.prepare._no_gc),
never releasing objects a process froze itself."""

from __future__ import annotations

import gc

from deeppart.saving.prepare import _no_gc


def test_what_the_pause_made_goes_to_the_oldest_generation() -> None:
    assert gc.get_freeze_count() == 0
    was_enabled = gc.isenabled()
    with _no_gc():
        assert not gc.isenabled()
        kept = [[i] for i in range(1000)]
    assert gc.isenabled() == was_enabled
    assert gc.get_freeze_count() == 0
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert id(kept) in oldest and all(id(x) in oldest for x in kept)
    young = {id(o) for o in gc.get_objects(generation=0)}
    assert id(kept) not in young


def test_a_process_frozen_objects_stay_frozen() -> None:
    gc.collect()
    frozen = [[i] for i in range(100)]
    gc.freeze()
    try:
        assert gc.get_freeze_count() > 0
        with _no_gc():
            made = [[i] for i in range(100)]
        # Not released by an unfreeze: still in no generation the collector
        # walks. (The count alone may drop: the pause's young collection can
        # free the last references to frozen objects, as a full suite's
        # garbage did once.)
        tracked = {id(o) for o in gc.get_objects()}
        assert id(frozen) not in tracked and not any(id(x) in tracked for x in frozen)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert frozen and made


def test_the_collector_is_enabled_again_after_an_error() -> None:
    assert gc.isenabled()
    try:
        with _no_gc():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_the_callers_young_garbage_is_collected_not_moved_out_of_reach() -> None:
    import weakref

    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    with _no_gc():
        kept = [[i] for i in range(1000)]
    assert gone() is None
    assert kept
