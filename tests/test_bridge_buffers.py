"""The fill's arenas: aligned buffers carved from one mapping, reused after
`reset`, and buffers of their own past its end."""

import numpy as np

from orbax_eqx._bridge.buffers import Arena


def _address(x: np.ndarray) -> int:
    return x.ctypes.data


def test_buffers_are_carved_aligned_and_do_not_overlap():
    arena = Arena(1 << 16)
    taken = [arena.take(n) for n in (100, 1, 64, 999)]
    assert [t.nbytes for t in taken] == [100, 1, 64, 999]
    assert all(_address(t) % 64 == 0 for t in taken)
    spans = sorted((_address(t), _address(t) + t.nbytes) for t in taken)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    for k, t in enumerate(taken):  # each writable, and none clobbers another
        t[:] = k
    assert [int(t[0]) for t in taken] == [0, 1, 2, 3]


def test_reset_reuses_the_same_memory():
    arena = Arena(1 << 16)
    first = arena.take(4096)
    arena.reset()
    again = arena.take(4096)
    assert _address(first) == _address(again)


def test_past_its_end_a_buffer_of_its_own():
    arena = Arena(1000)
    inside = arena.take(900)
    outside = arena.take(200)  # 900 rounded up to 960, + 200 > 1000
    assert outside.nbytes == 200 and _address(outside) % 64 == 0
    base = _address(inside)
    assert not base <= _address(outside) < base + 1000
    none = Arena(0)  # no arena: every buffer its own
    a, b = none.take(10), none.take(10)
    assert _address(a) != _address(b)
