"""Cache pools: one pytree holding paged KV, recurrent-state slots and conv-state slots."""

import jax.numpy as jnp
import numpy as np
import pytest

from kk_jax.cache.pages import OutOfPages, PageAllocator, SlotAllocator
from kk_jax.cache.pools import PagedSpec, SlotSpec, allocate_pools, bytes_per_page, bytes_per_slot, zero_slots
from kk_jax.parallel.mesh import make_mesh

# What GLM-5.3 needs: attention layers with paged KV, KDA layers with [H, K, V] fp32 state slots
# and a short-conv state of the last 3 inputs, plus a per-sequence pool tail.
MIXED = {
    "layers.0.k": PagedSpec((2, 8), jnp.bfloat16, ("kv_heads", None)),
    "layers.0.v": PagedSpec((2, 8), jnp.float8_e4m3fn, ("kv_heads", None)),
    "layers.1.state": SlotSpec((4, 8, 8), jnp.float32, ("heads", None, None)),
    "layers.1.conv": SlotSpec((3, 32), jnp.bfloat16, (None, "heads")),
    "layers.2.pool_tail": SlotSpec((3, 16), jnp.bfloat16, (None, None)),
}


@pytest.mark.parametrize("tp", [1, 2])
def test_mixed_pool_shapes_dtypes_shardings(tp):
    mesh = make_mesh(tp)
    pools = allocate_pools(MIXED, num_pages=5, page_size=4, num_slots=3, mesh=mesh)
    assert pools["layers.0.k"].shape == (5, 4, 2, 8) and pools["layers.0.k"].dtype == jnp.bfloat16
    assert pools["layers.0.v"].dtype == jnp.float8_e4m3fn
    assert pools["layers.1.state"].shape == (3, 4, 8, 8) and pools["layers.1.state"].dtype == jnp.float32
    assert pools["layers.1.conv"].shape == (3, 3, 32)
    # kv heads / state heads split across tp; the per-device shard holds 1/tp of them
    assert pools["layers.0.k"].addressable_shards[0].data.shape == (5, 4, 2 // tp, 8)
    assert pools["layers.1.state"].addressable_shards[0].data.shape == (3, 4 // tp, 8, 8)
    assert pools["layers.1.conv"].addressable_shards[0].data.shape == (3, 3, 32 // tp)
    assert all(float(jnp.abs(a.astype(jnp.float32)).sum()) == 0 for a in pools.values())
    assert bytes_per_page(MIXED, 4) == 4 * 2 * 8 * (2 + 1)
    assert bytes_per_slot(MIXED) == 4 * 8 * 8 * 4 + 3 * 32 * 2 + 3 * 16 * 2


def test_zero_slots_touches_only_given_slots_and_donates():
    mesh = make_mesh(1)
    pools = allocate_pools(MIXED, num_pages=3, page_size=4, num_slots=4, mesh=mesh)
    pools = {n: a + jnp.ones((), a.dtype) for n, a in pools.items()}
    before = pools["layers.1.state"]
    kv_before = np.asarray(pools["layers.0.k"].astype(jnp.float32))
    pools = zero_slots(pools, MIXED, jnp.array([2], jnp.int32))
    assert before.is_deleted()                                   # updated in place
    st = np.asarray(pools["layers.1.state"])
    assert (st[2] == 0).all() and (st[[0, 1, 3]] == 1).all()
    assert (np.asarray(pools["layers.2.pool_tail"].astype(jnp.float32))[2] == 0).all()
    np.testing.assert_array_equal(np.asarray(pools["layers.0.k"].astype(jnp.float32)), kv_before)


def test_page_allocator_reserves_page_zero_and_reuses():
    alloc = PageAllocator(5)
    pages = alloc.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and alloc.num_free == 0
    with pytest.raises(OutOfPages):
        alloc.allocate(1)
    alloc.free(pages[:2])
    assert alloc.num_free == 2
    with pytest.raises(ValueError):
        alloc.free([pages[0]])                                   # double free
    with pytest.raises(ValueError):
        PageAllocator(1)


def test_slot_allocator_marks_reused_slots_dirty():
    slots = SlotAllocator(3)
    a, b = slots.allocate(), slots.allocate()
    assert {a, b} == {1, 2} and slots.take_dirty() == [a, b] and slots.take_dirty() == []
    with pytest.raises(OutOfPages):
        slots.allocate()
    slots.free(a)
    again = slots.allocate()
    assert again == a and slots.take_dirty() == [a]              # reuse must be zeroed first


def test_stacked_entries_hold_every_layer_and_zero_a_slot_in_each():
    layout = {"layers.1.state": SlotSpec((2, 4), jnp.float32, ("heads", None), stack=3),
              "layers.1.latent": PagedSpec((8,), jnp.float32, (None,), stack=3)}
    pools = allocate_pools(layout, num_pages=5, page_size=4, num_slots=4, mesh=make_mesh(1))
    assert pools["layers.1.state"].shape == (12, 2, 4) and pools["layers.1.latent"].shape == (15, 4, 8)
    assert bytes_per_slot(layout) == 3 * 2 * 4 * 4 and bytes_per_page(layout, 4) == 3 * 4 * 8 * 4
    pools = {n: a + 1 for n, a in pools.items()}
    st = np.asarray(zero_slots(pools, layout, jnp.array([2], jnp.int32))["layers.1.state"]).reshape(3, 4, 2, 4)
    assert (st[:, 2] == 0).all() and (st[:, [0, 1, 3]] == 1).all()      # slot 2 of each stacked layer


def test_repeating_groups_finds_the_glm_trunk_run():
    from kk_jax.models.layers.scan import repeating_groups

    kinds = ["kda", "kda", "kda", "dsa"] * 11 + ["kda"]
    mlp = ["dense"] * 3 + ["moe"] * 42
    assert repeating_groups(list(zip(kinds, mlp))) == (3, 4, 10)        # layers 3-42: 9 bodies compiled, not 45
    assert repeating_groups(["a", "b", "c"]) is None
    assert repeating_groups(["a", "b", "b", "b"]) == (1, 1, 3)
