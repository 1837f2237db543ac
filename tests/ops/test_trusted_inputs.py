"""fastllm.ops.trusted_inputs: a per-thread flag, restored on exit; CPU ops check anyway."""

from __future__ import annotations

import threading

import pytest
import torch

from fastllm import _C, ops


def test_the_flag_is_set_inside_and_restored_after_an_exception():
    assert not _C.trusted_inputs()
    with pytest.raises(RuntimeError, match="inside"):
        with ops.trusted_inputs():
            assert _C.trusted_inputs()
            with ops.trusted_inputs():  # nested: still trusted after the inner block
                pass
            assert _C.trusted_inputs()
            raise RuntimeError("inside")
    assert not _C.trusted_inputs()


def test_the_flag_belongs_to_one_thread():
    seen = []
    with ops.trusted_inputs():
        worker = threading.Thread(target=lambda: seen.append(_C.trusted_inputs()))
        worker.start()
        worker.join()
    assert seen == [False]


def test_cpu_ops_still_check_values_inside():
    k_cache = torch.zeros(2, 4, 1, 8)
    key = torch.randn(1, 1, 8)
    with ops.trusted_inputs(), pytest.raises(ValueError, match=r"slot_mapping\[0\]=8 is past"):
        ops.reshape_and_cache(key, key, k_cache, k_cache.clone(), torch.tensor([8]))
