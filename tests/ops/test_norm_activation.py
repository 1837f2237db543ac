"""rms_norm, add_rms_norm and the gated activations (silu_and_mul, gelu_tanh_and_mul) of every
backend (conftest.py) against float64 references, and against the eager compositions the model
used before (HF's arithmetic): equal bits in float32 up to the sum's order, the eager form's
roundings in bfloat16/float16.

test_rms_norm and test_gated_activation run covering arrays (tests/covering.py) of the backend,
op, dtype and shape: every pair of values meets in some case, so each backend (the simulator
included) runs every op, dtype and shape at least once, and each shape every dtype.
"""

import covering
import pytest
import torch
import torch.nn.functional as F

from fastllm import ops
from fastllm.ops import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative to the float64 result: float32 sums, and one rounding of each low-precision step.
TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def eager_rms_norm(x, weight, eps):
    """HF's LlamaRMSNorm.forward, what the op replaces."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


# The gated activations: op name -> (the eager activation of the gate half (HF's ACT2FN), the
# float32 error its result may carry per unit of |gate|). gelu's 1 + tanh(u) cancels where
# tanh(u) nears -1 (gate below about -3): float32 tanh implementations an ulp apart there
# (Sleef on the CPU, CUDA's and the C library's tanhf) give gelus up to 2^-24 |gate| apart, a
# difference the product multiplies by |up| and a rounding to 16 bits cannot hide.
GATED = {"silu_and_mul": (F.silu, 0.0),
         "gelu_tanh_and_mul": (lambda gate: F.gelu(gate, approximate="tanh"), 2.0 ** -23)}


def assert_close_to(got, ref64, dtype):
    torch.testing.assert_close(got.cpu().double(), ref64, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.cuda_sim
@covering.grid(dtype=DTYPES, shape=[(1, 576), (7, 64), (3, 4, 128), (5, 17), (1, 1), (0, 32)])
def test_rms_norm(backend, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=backend.device) * 3
    weight = torch.randn(shape[-1], dtype=dtype, device=backend.device)
    got = backend.ops.rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    assert_close_to(got, reference.rms_norm(x.cpu(), weight.cpu(), 1e-6), dtype)
    eager = eager_rms_norm(x, weight, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(got, eager, atol=1e-6, rtol=1e-6)
    elif got.numel():  # one low-precision ulp at most: only the float32 sum's order differs
        assert ((got.double() - eager.double()).abs() <= eager.double().abs() * 2 ** -7 + 1e-6).all()


@pytest.mark.cuda_sim
def test_rms_norm_strided_heads(backend):
    """q/k norms run on [tokens, heads, head_dim] views of a fused projection, no copy."""
    fused = torch.randn(5, 3 * 64 + 32, device=backend.device)
    q = fused[:, :192].view(5, 3, 64)
    weight = torch.randn(64, device=backend.device)
    got = backend.ops.rms_norm(q, weight, 1e-5)
    assert_close_to(got, reference.rms_norm(q.cpu(), weight.cpu(), 1e-5), torch.float32)


@pytest.mark.cuda_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden", [(1, 576), (9, 100), (0, 16)])
def test_add_rms_norm(backend, dtype, rows, hidden):
    x = torch.randn(rows, hidden, dtype=dtype, device=backend.device)
    residual = torch.randn(rows, hidden, dtype=dtype, device=backend.device) * 4
    weight = torch.randn(hidden, dtype=dtype, device=backend.device)
    normed64, total64 = reference.add_rms_norm(x.cpu(), residual.cpu(), weight.cpu(), 1e-5)
    eager_total = residual + x
    eager = eager_rms_norm(eager_total, weight, 1e-5)
    assert backend.ops.add_rms_norm(x, residual, weight, 1e-5) is None
    assert torch.equal(residual, eager_total), "the residual add must round as the eager add"
    assert_close_to(residual, total64, dtype)
    if dtype == torch.float32:
        assert_close_to(x, normed64, dtype)
    elif x.numel():
        assert ((x.double() - eager.double()).abs() <= eager.double().abs() * 2 ** -7 + 1e-6).all()


@pytest.mark.cuda_sim
@covering.grid(op=list(GATED), dtype=DTYPES, shape=[(1, 1536), (6, 40), (3, 1), (0, 8)])
def test_gated_activation(backend, op, dtype, shape):
    rows, d = shape
    x = torch.randn(rows, 2 * d, dtype=dtype, device=backend.device) * 4
    got = getattr(backend.ops, op)(x)
    assert got.shape == (rows, d) and got.dtype == dtype
    assert_close_to(got, getattr(reference, op)(x.cpu()), dtype)
    gate, up = x.split(d, dim=-1)
    activation, cancellation = GATED[op]
    eager = activation(gate) * up
    # Where the activation cancels (see GATED): its float32 error times |up|.
    slack = cancellation * (gate.double() * up.double()).abs()
    error = (got.double() - eager.double()).abs()
    if dtype == torch.float32:
        assert (error <= eager.double().abs() * 1e-6 + 1e-6 + slack).all()
    elif got.numel():  # one 16-bit rounding
        assert (error <= eager.double().abs() * 2 ** -7 + 1e-6 + slack).all()


@pytest.mark.cuda_sim
@pytest.mark.parametrize("op", GATED)
def test_gated_activation_strided_rows(backend, op):
    x = torch.randn(4, 70, device=backend.device)[:, :64]  # rows 70 apart
    assert_close_to(getattr(backend.ops, op)(x), getattr(reference, op)(x.cpu()), torch.float32)


def test_gelu_tanh_reference_is_torchs_gelu():
    """The float64 twin is PyTorch's tanh approximation, not the exact (erf) gelu."""
    x = torch.randn(5, 64, dtype=torch.float64) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(reference.gelu_tanh_and_mul(x),
                               F.gelu(gate, approximate="tanh") * up, atol=1e-12, rtol=1e-12)
    assert not torch.allclose(reference.gelu_tanh_and_mul(x), F.gelu(gate) * up, atol=1e-6)


@pytest.mark.cuda_sim
def test_a_row_does_not_depend_on_the_others(backend):
    o, device = backend.ops, backend.device
    x = torch.randn(8, 576, dtype=torch.bfloat16, device=device)
    weight = torch.randn(576, dtype=torch.bfloat16, device=device)
    batch = o.rms_norm(x, weight, 1e-6)
    assert all(torch.equal(o.rms_norm(x[i:i + 1], weight, 1e-6)[0], batch[i]) for i in range(8))
    residual = torch.randn(8, 576, dtype=torch.bfloat16, device=device)
    xb, rb = x.clone(), residual.clone()
    o.add_rms_norm(xb, rb, weight, 1e-6)
    for i in range(8):
        xi, ri = x[i:i + 1].clone(), residual[i:i + 1].clone()
        o.add_rms_norm(xi, ri, weight, 1e-6)
        assert torch.equal(xi[0], xb[i]) and torch.equal(ri[0], rb[i])


@pytest.mark.cpu_inputs
def test_bad_inputs(backend):
    o = backend.ops
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match="weight has 7 elements"):
        o.rms_norm(x, torch.randn(7), 1e-5)
    with pytest.raises(TypeError, match="weight has dtype torch.float16"):
        o.rms_norm(x, w.half(), 1e-5)
    with pytest.raises(TypeError, match="x must be torch.float32"):
        o.rms_norm(x.double(), w.double(), 1e-5)
    with pytest.raises(ValueError, match="eps must be finite"):
        o.rms_norm(x, w, float("nan"))
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        o.rms_norm(torch.randn(8, 4).t(), torch.randn(8), 1e-5)
    with pytest.raises(ValueError, match="must not share memory"):
        o.add_rms_norm(x, x, w, 1e-5)
    with pytest.raises(ValueError, match="must not share memory"):
        o.add_rms_norm(x[:, None].expand(4, 1, 8)[:, 0], x, w, 1e-5)
    with pytest.raises(ValueError, match="residual has shape"):
        o.add_rms_norm(x, torch.randn(3, 8), w, 1e-5)
    with pytest.raises(ValueError, match="must be even"):
        o.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match=r"x must be \[rows, 2 \* d\]"):
        o.silu_and_mul(torch.randn(8))


@pytest.mark.parametrize("op, args", [
    ("rms_norm", lambda: (torch.randn(3, 16), torch.randn(16), 1e-6)),
    ("add_rms_norm", lambda: (torch.randn(3, 16), torch.randn(3, 16), torch.randn(16), 1e-6)),
    ("silu_and_mul", lambda: (torch.randn(3, 16),)),
    ("gelu_tanh_and_mul", lambda: (torch.randn(3, 16),)),
    ("gelu_tanh_and_mul", lambda: (torch.randn(3, 24, dtype=torch.bfloat16)[:, :16],)),
])
def test_opcheck(op, args):
    torch.library.opcheck(getattr(torch.ops.fastllm, op).default, args())
