"""The memory-mapping budget (jspec/serve/memory_maps.py): counted from /proc, and a server whose programs would
pass vm.max_map_count refused with the ways out after compiling one program, instead of dying inside LLVM."""

import pytest

import jspec
from jspec.serve import memory_maps
from jspec.serve.slots import SlotEngine


def test_room_for_counts_this_process_against_the_limit(monkeypatch):
    used = memory_maps.maps_in_use()
    assert used is not None and used > 10 and memory_maps.max_map_count() > used
    # A limit whose 90% margin is 1,000 mappings above today's count, however many earlier tests in this process
    # left mapped.
    monkeypatch.setattr(memory_maps, "max_map_count", lambda: int((used + 1000) / 0.9))
    assert memory_maps.room_for(2, 100)
    assert not memory_maps.room_for(20, 100)
    assert memory_maps.room_for(10 ** 6, None)  # nothing measured: no verdict


# slow: a server whose programs would pass vm.max_map_count is refused after one compile; default tier:
# test_room_for_counts_this_process_against_the_limit
@pytest.mark.slow
def test_a_server_past_the_limit_is_refused_before_compiling_the_rest(monkeypatch):
    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter="ngram", max_batch_size=2,
                                              max_seq_len=64)
    slots = SlotEngine(engine, row_buckets=(2,))
    monkeypatch.setattr(memory_maps, "max_map_count", lambda: memory_maps.maps_in_use() + 500)
    with pytest.raises(ValueError, match=r"above this system's vm.max_map_count=\d+.*sysctl -w vm.max_map_count"):
        slots.warm_up()
    assert slots.num_compiled == 0 and not slots.ready
