"""The dense KV layout (inference/dense.py): the benchmark's bare-loop cache and the tests' plain one."""

import torch

from burstrl.inference.dense import DecodeBatch, SessionKV

LAYERS, KVH, D = 2, 2, 4
CPU = torch.device("cpu")


def _kv(length: int, capacity: int = 4) -> SessionKV:
    kv = SessionKV(LAYERS, KVH, D, torch.float32, CPU, capacity=capacity)
    kv.reserve(length)
    for i in range(LAYERS):
        kv.k[i][:, :length] = torch.randn(KVH, length, D)
        kv.v[i][:, :length] = torch.randn(KVH, length, D)
    kv.length = length
    return kv


# ---- SessionKV ----

def test_session_kv_reserve_grows_and_keeps_prefix():
    kv = _kv(3, capacity=4)
    k = [t[:, :3].clone() for t in kv.k]
    v = [t[:, :3].clone() for t in kv.v]
    kv.reserve(4)
    assert kv.capacity == 4  # fits: no growth
    kv.reserve(5)
    assert kv.capacity == 8  # doubles
    kv.reserve(100)
    assert kv.capacity == 100  # jumps straight to what is needed
    assert kv.length == 3
    for i in range(LAYERS):
        assert kv.k[i].shape == (KVH, 100, D)
        assert torch.equal(kv.k[i][:, :3], k[i]) and torch.equal(kv.v[i][:, :3], v[i])


def test_session_kv_truncate():
    kv = _kv(5)
    kv.truncate(8)
    assert kv.length == 5
    kv.truncate(2)
    assert kv.length == 2


# ---- DecodeBatch ----

def _batch() -> DecodeBatch:
    return DecodeBatch(LAYERS, KVH, D, torch.float32, CPU, scale=1.0)


def _assert_row(batch: DecodeBatch, row: int, kv: SessionKV) -> None:
    n = kv.length
    assert int(batch.lens[row]) == n
    for i in range(LAYERS):
        assert torch.equal(batch.k[i][row, :, :n], kv.k[i][:, :n])
        assert torch.equal(batch.v[i][row, :, :n], kv.v[i][:, :n])


def test_decode_batch_add_copies_rows():
    batch = _batch()
    kvs = [_kv(n) for n in (3, 7, 1)]
    for r, kv in enumerate(kvs):
        assert batch.add(kv) == r
    assert batch.size == 3 and batch.lens.tolist() == [3, 7, 1]
    for r, kv in enumerate(kvs):
        _assert_row(batch, r, kv)


def test_decode_batch_grows_rows_and_length():
    batch = _batch()
    kvs = [_kv(n) for n in range(1, 12)]  # more than 8 rows
    kvs.append(_kv(300))  # longer than the initial 256
    for kv in kvs:
        batch.add(kv)
    assert batch.size == len(kvs)
    for r, kv in enumerate(kvs):
        _assert_row(batch, r, kv)


def test_decode_batch_remove_moves_last_row_and_copies_out():
    batch = _batch()
    kvs = [_kv(n) for n in (3, 7, 5, 2)]
    for kv in kvs:
        batch.add(kv)
    out = SessionKV(LAYERS, KVH, D, torch.float32, CPU, capacity=1)
    batch.remove(1, out)
    assert out.length == 7
    for i in range(LAYERS):
        assert torch.equal(out.k[i][:, :7], kvs[1].k[i][:, :7])
        assert torch.equal(out.v[i][:, :7], kvs[1].v[i][:, :7])
    assert batch.size == 3 and batch.lens.tolist() == [3, 2, 5]
    _assert_row(batch, 0, kvs[0])
    _assert_row(batch, 1, kvs[3])
    _assert_row(batch, 2, kvs[2])
    # removing the last row moves nothing
    batch.remove(2, None)
    assert batch.lens.tolist() == [3, 2]
    _assert_row(batch, 0, kvs[0])
    _assert_row(batch, 1, kvs[3])
    batch.remove(0, None)
    batch.remove(0, None)
    assert batch.size == 0
    batch.add(kvs[2])
    _assert_row(batch, 0, kvs[2])


def test_decode_batch_remove_into_same_kv_after_steps():
    batch = _batch()
    a, b = _kv(4), _kv(6)
    a_k = a.k[0][:, :4].clone()
    batch.add(a)
    batch.add(b)
    q = torch.randn(2, 2 * KVH, 1, D)
    steps = []
    for _ in range(3):
        batch.prepare()
        k, v = torch.randn(2, KVH, 1, D), torch.randn(2, KVH, 1, D)
        for layer in range(LAYERS):
            batch.attend(layer, q, k, v)
        batch.advance()
        steps.append((k, v))
    assert batch.lens.tolist() == [7, 9]
    batch.remove(0, a)
    assert a.length == 7
    assert torch.equal(a.k[0][:, :4], a_k)
    for s, (k, v) in enumerate(steps):
        assert torch.equal(a.k[1][:, 4 + s], k[0, :, 0])
        assert torch.equal(a.v[1][:, 4 + s], v[0, :, 0])
    assert batch.lens.tolist() == [9]
    assert torch.equal(batch.k[0][0, :, 6 + 2], steps[2][0][1, :, 0])


def test_decode_batch_attend_matches_per_row_attention():
    batch = _batch()
    kvs = [_kv(n) for n in (2, 5, 9)]
    for kv in kvs:
        batch.add(kv)
    batch.prepare()
    H = 2 * KVH
    q = torch.randn(3, H, 1, D)
    k, v = torch.randn(3, KVH, 1, D), torch.randn(3, KVH, 1, D)
    out = batch.attend(0, q, k, v)
    for r, kv in enumerate(kvs):
        keys = torch.cat([kv.k[0][:, :kv.length], k[r]], dim=1).repeat_interleave(2, dim=0)
        values = torch.cat([kv.v[0][:, :kv.length], v[r]], dim=1).repeat_interleave(2, dim=0)
        w = torch.softmax(q[r] @ keys.transpose(-1, -2), dim=-1)
        assert torch.allclose(out[r], w @ values, atol=1e-5)
