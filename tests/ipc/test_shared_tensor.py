from __future__ import annotations

import os
import signal

import msgspec
import pytest
import torch

import ipc
from tests.ipc import children
from tests.ipc.children import Note, pattern


def test_tensor_crosses_processes_bit_exact(ctx, endpoint, prefix, procs):
    ch = ipc.Channel(endpoint, bind=True)
    p = ctx.Process(target=children.echo, args=(endpoint, os.getpid()))
    p.start()
    procs.append(p)
    ch.set_peer(p.pid)
    shape = (512, 513)  # not a multiple of anything convenient
    with ipc.SharedTensor.create(shape, torch.float32, prefix) as st:
        st.tensor.copy_(pattern(shape, 7))
        ch.put(Note(7, prefix, st.handle), timeout=10)
        reply = ch.get(timeout=30)
        assert reply.text == "True:True"  # the child read our bytes, and reused its mapping
        theirs = ipc.open_handle(reply.handle)
        assert torch.equal(theirs, pattern(shape, 8))
        ipc.close_handle(reply.handle)
        ch.put(Note(-1), timeout=10)
    p.join(30)
    assert p.exitcode == 0
    ch.close()


def test_open_same_handle_reuses_mapping(prefix):
    with ipc.SharedTensor.create((1000,), torch.int32, prefix) as st:
        a = ipc.open_handle(st.handle)
        b = ipc.open_handle(ipc.TensorHandle.from_dict(st.handle.to_dict()))
        assert a is b
        a[3] = 42
        assert st.tensor[3].item() == 42  # zero-copy view of the same bytes
        ipc.close_handle(st.handle)
        c = ipc.open_handle(st.handle)
        assert c is not a and c[3].item() == 42  # the mapping was forgotten, then made again
        ipc.close_handle(st.handle)


def test_handle_and_message_size_constant(prefix):
    fixed = set()
    for nbytes in (1 << 10, 1 << 20, 16 << 20, 64 << 20):
        with ipc.SharedTensor.create((nbytes // 4,), torch.float32, prefix) as st:
            h = st.handle
            # Only the name and the sizes' encodings (msgpack: 1 to 9 bytes by magnitude)
            # may differ between tensors.
            sizes = (h.name, h.shape[0], h.nbytes)
            varying = sum(len(msgspec.msgpack.encode(v)) for v in sizes)
            fixed.add(len(ipc.encode(Note(1, "x", h))) - varying)
    assert len(fixed) == 1


def test_handle_rejects_bad_input():
    with pytest.raises(ValueError):
        ipc.TensorHandle.from_dict({"kind": "pickle", "name": "x", "dtype": "float32", "shape": []})
    with pytest.raises(ValueError):
        ipc.TensorHandle.from_dict({"kind": "shm", "name": "x", "dtype": "object", "shape": [1]})


def _spawn_holder(ctx, endpoint, prefix, procs, handlers: bool):
    ch = ipc.Channel(endpoint, bind=True)
    p = ctx.Process(target=children.hold, args=(endpoint, os.getpid(), prefix, handlers))
    p.start()
    procs.append(p)
    ch.set_peer(p.pid)
    assert ch.get(timeout=30).seq == 3
    assert len(ipc.list_segments(prefix)) == 3
    return ch, p


def test_no_segments_after_normal_exit(ctx, endpoint, prefix, procs):
    ch, p = _spawn_holder(ctx, endpoint, prefix, procs, handlers=False)
    ch.put(Note(0), timeout=10)
    p.join(30)
    assert p.exitcode == 0
    assert ipc.list_segments(prefix) == []


def test_no_segments_after_sigterm(ctx, endpoint, prefix, procs):
    ch, p = _spawn_holder(ctx, endpoint, prefix, procs, handlers=True)
    p.terminate()
    p.join(30)
    assert p.exitcode == -signal.SIGTERM
    assert ipc.list_segments(prefix) == []


def test_owner_sweeps_after_sigkill(ctx, endpoint, prefix, procs):
    ch, p = _spawn_holder(ctx, endpoint, prefix, procs, handlers=True)
    p.kill()
    p.join(30)
    left = ipc.list_segments(prefix)
    assert len(left) == 3  # SIGKILL leaves them behind
    removed = ipc.sweep_stale(prefix.split("_")[0])
    assert set(left) <= set(removed)
    assert ipc.list_segments(prefix) == []


def test_sweep_keeps_live_owners(prefix):
    with ipc.SharedTensor.create((8,), torch.uint8, prefix):
        ipc.sweep_stale(prefix.split("_")[0])
        assert len(ipc.list_segments(prefix)) == 1


def test_segments_are_private(prefix):
    with ipc.SharedTensor.create((8,), torch.uint8, prefix) as st:
        mode = os.stat("/dev/shm" + st.handle.name).st_mode & 0o777
        assert mode == 0o600


def test_shm_event_across_processes(ctx, prefix, procs):
    with ipc.SharedTensor.create((2,), torch.int64, prefix) as st:
        first = ipc.ShmEvent(st.tensor[0:1])
        second = ipc.ShmEvent(st.tensor[1:2])
        p = ctx.Process(target=children.event_setter, args=(st.handle, 5, 0.2))
        p.start()
        procs.append(p)
        assert not first.query(5)
        first.wait(5, timeout=30)
        assert first.value() == 5 and second.value() == 0
        with pytest.raises(ipc.EventTimeout):
            second.wait(1, timeout=0.05)
        p.join(30)


def _faults_writing_each_page(t: torch.Tensor) -> int:
    """Minor page faults this thread takes writing one byte of every 4 KiB page of `t`."""
    import resource

    flat = t.view(torch.uint8).view(-1)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    flat[::4096].fill_(1)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


@pytest.mark.parametrize("populate", [False, True])
def test_a_populated_tensor_takes_no_page_faults_on_first_write(prefix, populate):
    pages = 8192  # 32 MiB
    with ipc.SharedTensor.create((pages * 4096,), torch.uint8, prefix, populate=populate) as st:
        assert int(st.tensor[:: 1 << 20].sum()) == 0  # zeroed either way
        faults = _faults_writing_each_page(st.tensor)
    if populate:
        assert faults < pages // 100
    else:  # pages come at first touch: the cost `populate` moves to the creation
        assert faults > pages // 2


def test_a_segment_the_shared_memory_fs_cannot_hold_fails_at_creation(prefix):
    fs = os.statvfs("/dev/shm")
    too_big = 2 * fs.f_blocks * fs.f_frsize  # over the whole file system: refused at once
    with pytest.raises(OSError, match="cannot reserve .* bytes of shared memory"):
        ipc.SharedTensor.create((too_big,), torch.uint8, prefix, populate=True)
    assert ipc.list_segments(prefix) == []
