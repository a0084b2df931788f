import numpy as np
import pytest

from inferprof.demo.device import HostDevice
from inferprof.demo.model import Outputs, collate


def test_to_device_copies_into_the_preallocated_buffers():
    dev = HostDevice(max_batch_size=4, max_tokens=8)
    batch = collate([[1, 2, 3], [4]])
    on_dev = dev.to_device(batch)
    assert on_dev.nbytes == batch.ids.nbytes + batch.mask.nbytes
    assert np.shares_memory(on_dev.ids, dev._ids)  # the buffer allocated at start-up
    batch.ids[0, 0] = 99  # a real copy: the host batch can change afterwards
    assert on_dev.ids[0, 0] == 1
    np.testing.assert_array_equal(on_dev.mask, batch.mask)


def test_to_host_returns_independent_arrays():
    out = Outputs(logits=np.ones((2, 3), np.float32), token_scores=np.zeros((2, 4), np.float32))
    host, nbytes = HostDevice.to_host(out)
    out.logits[:] = 5
    assert host.logits.max() == 1 and nbytes == 2 * 3 * 4 + 2 * 4 * 4


def test_batches_larger_than_the_buffers_are_refused():
    dev = HostDevice(max_batch_size=2, max_tokens=4)
    with pytest.raises(ValueError, match="exceeds"):
        dev.to_device(collate([[1], [2], [3]]))
    with pytest.raises(ValueError, match="exceeds"):
        dev.to_device(collate([[1, 2, 3, 4, 5]]))
    with pytest.raises(ValueError):
        HostDevice(0, 4)
