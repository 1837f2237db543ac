"""fastllm.ops.host_to_device: a StagingBuffer send gives back every tensor (any dtype, shape,
empty or 0-d) in one counted copy, also when its buffers grow and alternate; to_host reads mixed
dtypes back in one counted copy."""

from __future__ import annotations

import torch

from fastllm.ops.host_to_device import StagingBuffer, to_device, to_host, transfers


def host_groups(scale: int) -> tuple[dict, dict]:
    model = {"ids": torch.arange(3 * scale, dtype=torch.int64),
             "table": torch.arange(6 * scale, dtype=torch.int32).view(2 * scale, 3),
             "none": torch.empty(0, 4, dtype=torch.int32),
             "mask": torch.tensor([True, False] * scale)}
    sampling = {"floats": torch.rand(6, scale), "count": torch.tensor(7, dtype=torch.int64),
                "ids": torch.arange(scale, dtype=torch.int64) - 5}  # a name the other group has
    return model, sampling


def test_a_send_gives_back_every_tensor_in_one_copy(device):
    staging = StagingBuffer(device)
    for scale in (1, 3, 1, 500, 2):  # grows, shrinks, alternates its two host buffers
        groups = host_groups(scale)
        before = transfers.host_to_device
        staged = staging.send(*groups)
        assert transfers.host_to_device == before + 1
        for group, on_device in zip(groups, staged):
            assert list(on_device) == list(group)
            for name, tensor in group.items():
                got = on_device[name]
                assert got.device.type == torch.device(device).type
                assert got.dtype == tensor.dtype and got.shape == tensor.shape
                assert torch.equal(got.cpu(), tensor), name


def test_to_device_and_to_host(device):
    kept = to_device(torch.arange(5), device)
    StagingBuffer(device).send({"other": torch.zeros(5, dtype=torch.int64)})
    assert kept.tolist() == list(range(5))  # its own buffer: no later send touches it
    tensors = [torch.arange(4, device=device), torch.rand(3, 2, device=device),
               torch.tensor([True, False], device=device), torch.arange(3, dtype=torch.int32,
                                                                        device=device)]
    before = transfers.device_to_host
    back = to_host(*tensors)
    assert transfers.device_to_host == before + 1
    for tensor, host in zip(tensors, back):
        assert host.device.type == "cpu" and torch.equal(host, tensor.cpu())
