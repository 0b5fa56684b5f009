"""Bad input raises a TypeError / ValueError naming the op and the argument, on every path."""

import pytest
import torch


def f32(*shape, device="cpu"):
    return torch.zeros(shape, device=device)


# (id, op name, arguments builder(device) -> (args, kwargs), exception, message pattern)
CASES = [
    ("flatten-overlap", "flatten", lambda d: (([f32(12, device=d), f32(4, device=d)], [0, 10], f32(20, device=d)), {}),
     ValueError, r"flatten: offsets\[1\]=10 overlaps tensors\[0\] which covers \[0, 12\)"),
    ("flatten-overlap-unsorted", "flatten",
     lambda d: (([f32(30, device=d), f32(4, device=d), f32(5, device=d)], [100, 0, 120], f32(140, device=d)), {}),
     ValueError, r"flatten: offsets\[2\]=120 overlaps tensors\[0\] which covers \[100, 130\)"),
    ("flatten-negative-offset", "flatten", lambda d: (([f32(2, device=d)], [-1], f32(4, device=d)), {}),
     ValueError, r"flatten: offsets\[0\]=-1 is negative"),
    ("flatten-past-end", "flatten", lambda d: (([f32(3, device=d)], [2], f32(4, device=d)), {}),
     ValueError, r"flatten: offsets\[0\]=2 with tensors\[0\] of 3 elements ends at 5, past out.numel\(\)=4"),
    ("flatten-int-tensor", "flatten", lambda d: (([f32(1, device=d), torch.zeros(2, dtype=torch.int64, device=d)], [0, 1], f32(4, device=d)), {}),
     TypeError, r"flatten: tensors\[1\] has non-floating dtype torch.int64"),
    ("flatten-complex-tensor", "flatten", lambda d: (([torch.zeros(2, dtype=torch.complex64, device=d)], [0], f32(4, device=d)), {}),
     TypeError, r"flatten: tensors\[0\] has non-floating dtype torch.complex64; only .* float32, bfloat16, float16 and float64"),
    ("flatten-int-out", "flatten", lambda d: (([f32(2, device=d)], [0], torch.zeros(4, dtype=torch.int32, device=d)), {}),
     TypeError, r"flatten: out has non-floating dtype torch.int32"),
    ("flatten-2d-out", "flatten", lambda d: (([f32(2, device=d)], [0], f32(2, 2, device=d)), {}),
     ValueError, r"flatten: out must be 1-D, got shape \(2, 2\)"),
    ("flatten-strided-out", "flatten", lambda d: (([f32(2, device=d)], [0], f32(8, device=d)[::2]), {}),
     ValueError, r"flatten: out must be contiguous"),
    ("flatten-other-device", "flatten", lambda d: (([f32(2, device="meta")], [0], f32(4, device=d)), {}),
     ValueError, r"flatten: tensors\[0\] is on meta but out is on"),
    ("flatten-too-few-offsets", "flatten", lambda d: (([f32(2, device=d), f32(2, device=d)], [0], f32(4, device=d)), {}),
     ValueError, r"flatten: got 2 tensors but 1 offsets"),
    ("flatten-too-few-numels", "flatten", lambda d: (([f32(2, device=d), None], [0, 2], f32(4, device=d)), {"numels": [2]}),
     ValueError, r"flatten: got 2 tensors but 1 numels"),
    ("flatten-wrong-numel", "flatten", lambda d: (([f32(2, device=d)], [0], f32(4, device=d)), {"numels": [3]}),
     ValueError, r"flatten: numels\[0\]=3 but tensors\[0\] has 2 elements"),
    ("flatten-negative-numel", "flatten", lambda d: (([None], [0], f32(4, device=d)), {"numels": [-2]}),
     ValueError, r"flatten: numels\[0\]=-2 is negative"),
    ("flatten-none-past-end", "flatten", lambda d: (([None], [1], f32(4, device=d)), {"numels": [4]}),
     ValueError, r"flatten: offsets\[0\]=1 with tensors\[0\] of 4 elements ends at 5"),
    # An offset near 2^63 must not wrap around in the range check (start + size overflows int64).
    ("flatten-offset-near-int64-max", "flatten", lambda d: (([f32(2, device=d)], [2**63 - 1], f32(4, device=d)), {}),
     ValueError, r"flatten: offsets\[0\]=9223372036854775807 with tensors\[0\] of 2 elements .* past out.numel\(\)=4"),
    ("flatten-offset-beyond-int64", "flatten", lambda d: (([f32(2, device=d)], [2**64], f32(4, device=d)), {}),
     ValueError, r"flatten: offsets\[0\]=18446744073709551616 with tensors\[0\] of 2 elements .* past out.numel\(\)=4"),
    ("flatten-scale-infinite-in-fp32", "flatten", lambda d: (([f32(2, device=d)], [1], f32(4, device=d)), {"scale": 1e39}),
     ValueError, r"flatten: scale must be finite in float32 .* got 1e\+39"),
    ("flatten-not-a-tensor", "flatten", lambda d: (([[1.0, 2.0]], [0], f32(4, device=d)), {}),
     TypeError, r"flatten: tensors\[0\] must be a torch.Tensor, got list"),
    ("flatten-float-offset", "flatten", lambda d: (([f32(2, device=d)], [1.5], f32(4, device=d)), {}),
     TypeError, r"flatten: offsets\[0\] must be an int, got float"),
    ("flatten-nan-scale", "flatten", lambda d: (([f32(2, device=d)], [0], f32(4, device=d)), {"scale": float("nan")}),
     ValueError, r"flatten: scale must be finite"),
    ("flatten-string-scale", "flatten", lambda d: (([f32(2, device=d)], [0], f32(4, device=d)), {"scale": "2"}),
     TypeError, r"flatten: scale must be a Python float, got str"),
    ("flatten-out-not-a-tensor", "flatten", lambda d: (([f32(2, device=d)], [0], [0.0] * 4), {}),
     TypeError, r"flatten: out must be a torch.Tensor, got list"),
    ("flatten-partial-alias", "flatten", lambda d: (lambda out: (([out[1:3]], [2], out), {}))(f32(8, device=d)),
     ValueError, r"flatten: tensors\[0\] overlaps the memory of out without being exactly out\[2:4\]"),
    ("flatten-strided-alias", "flatten", lambda d: (lambda buf: (([buf[8:20].view(3, 4).t()], [0], buf[:12]), {}))(f32(24, device=d)),
     ValueError, r"flatten: tensors\[0\] overlaps the memory of out without being exactly out\[0:12\]"),
    ("unflatten-past-end", "unflatten", lambda d: ((f32(10, device=d), [0, 8], [f32(2, device=d), f32(3, device=d)]), {}),
     ValueError, r"unflatten: offsets\[1\]=8 with outs\[1\] of 3 elements ends at 11, past flat.numel\(\)=10"),
    ("unflatten-offset-near-int64-max", "unflatten", lambda d: ((f32(10, device=d), [2**63 - 1], [f32(2, device=d)]), {}),
     ValueError, r"unflatten: offsets\[0\]=9223372036854775807 with outs\[0\] of 2 elements .* past flat.numel\(\)=10"),
    ("unflatten-negative-offset", "unflatten", lambda d: ((f32(10, device=d), [-3], [f32(2, device=d)]), {}),
     ValueError, r"unflatten: offsets\[0\]=-3 is negative"),
    ("unflatten-int-out", "unflatten", lambda d: ((f32(10, device=d), [0], [torch.zeros(2, dtype=torch.int8, device=d)]), {}),
     TypeError, r"unflatten: outs\[0\] has non-floating dtype torch.int8"),
    ("unflatten-int-flat", "unflatten", lambda d: ((torch.zeros(4, dtype=torch.int64, device=d), [0], [f32(2, device=d)]), {}),
     TypeError, r"unflatten: flat has non-floating dtype torch.int64"),
    ("unflatten-strided-flat", "unflatten", lambda d: ((f32(8, device=d)[::2], [0], [f32(2, device=d)]), {}),
     ValueError, r"unflatten: flat must be contiguous"),
    ("unflatten-2d-flat", "unflatten", lambda d: ((f32(2, 4, device=d), [0], [f32(2, device=d)]), {}),
     ValueError, r"unflatten: flat must be 1-D"),
    ("unflatten-length-mismatch", "unflatten", lambda d: ((f32(8, device=d), [0, 2, 4], [f32(2, device=d)]), {}),
     ValueError, r"unflatten: got 1 outs but 3 offsets"),
    ("unflatten-other-device", "unflatten", lambda d: ((f32(8, device=d), [0], [f32(2, device="meta")]), {}),
     ValueError, r"unflatten: outs\[0\] is on meta but flat is on"),
    ("unflatten-partial-alias", "unflatten", lambda d: (lambda flat: ((flat, [0], [flat[1:3]]), {}))(f32(8, device=d)),
     ValueError, r"unflatten: outs\[0\] overlaps the memory of flat"),
    ("accumulate-numel-mismatch", "accumulate_grad_shard", lambda d: ((f32(4, 3, device=d), f32(10, device=d)), {}),
     ValueError, r"accumulate_grad_shard: src has 12 elements \(shape \(4, 3\)\) but dst has 10"),
    ("accumulate-int-src", "accumulate_grad_shard", lambda d: ((torch.zeros(3, dtype=torch.int32, device=d), f32(3, device=d)), {}),
     TypeError, r"accumulate_grad_shard: src has non-floating dtype torch.int32"),
    ("accumulate-int-dst", "accumulate_grad_shard", lambda d: ((f32(3, device=d), torch.zeros(3, dtype=torch.int32, device=d)), {}),
     TypeError, r"accumulate_grad_shard: dst has non-floating dtype torch.int32"),
    ("accumulate-other-device", "accumulate_grad_shard", lambda d: ((f32(3, device="meta"), f32(3, device=d)), {}),
     ValueError, r"accumulate_grad_shard: src is on meta but dst is on"),
    ("accumulate-partial-alias", "accumulate_grad_shard", lambda d: (lambda b: ((b[1:4], b[0:3]), {}))(f32(8, device=d)),
     ValueError, r"accumulate_grad_shard: src overlaps the memory of dst"),
    ("accumulate-scale-infinite-in-fp32", "accumulate_grad_shard", lambda d: ((f32(3, device=d), f32(3, device=d)), {"scale": -4e38}),
     ValueError, r"accumulate_grad_shard: scale must be finite in float32"),
    ("accumulate-inf-scale", "accumulate_grad_shard", lambda d: ((f32(3, device=d), f32(3, device=d)), {"scale": float("inf")}),
     ValueError, r"accumulate_grad_shard: scale must be finite"),
]


@pytest.mark.parametrize("op_name, build, error, pattern", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_raises_a_clear_error(ops, device, op_name, build, error, pattern):
    args, kwargs = build(device)
    with pytest.raises(error, match=pattern):
        getattr(ops, op_name)(*args, **kwargs)


def test_errors_leave_the_output_untouched(ops, device):
    out = torch.full((8,), 7.0, device=device)
    with pytest.raises(ValueError):
        ops.flatten([torch.ones(4, device=device), torch.ones(4, device=device)], [0, 3], out)
    assert torch.equal(out.cpu(), torch.full((8,), 7.0))


def test_ops_stay_outside_autograd(ops, device):
    """Inputs that require grad do not put the outputs on the autograd graph, on any path: the ops
    write buffers that the runtime hands to autograd itself (as the Triton path always did)."""
    x = torch.randn(5, device=device, requires_grad=True)
    out = ops.flatten([x], [1], f32(8, device=device), scale=2.0)
    assert not out.requires_grad and out.grad_fn is None
    dst = f32(5, device=device)
    ops.accumulate_grad_shard(x, dst, scale=0.5)
    assert not dst.requires_grad and dst.grad_fn is None
    assert torch.equal(dst.cpu(), (x.detach() * 0.5).cpu())
    y = f32(5, device=device)
    ops.unflatten(out, [1], [y])
    assert not y.requires_grad and torch.equal(y.cpu(), (x.detach() * 2).cpu())


def test_same_storage_without_overlap_is_fine(ops, device):
    """Inputs and outputs may live in one storage as long as their bytes do not overlap."""
    buf = torch.arange(80, dtype=torch.float32, device=device)
    ops.flatten([buf[60:70]], [2], buf[:50])
    assert torch.equal(buf[2:12].cpu(), torch.arange(60, 70, dtype=torch.float32))
    assert int(torch.count_nonzero(buf[:2])) == 0 and int(torch.count_nonzero(buf[12:50])) == 0
    ops.unflatten(buf[:10], [0], [buf[70:80]])
    assert torch.equal(buf[70:80].cpu(), buf[:10].cpu())
    ops.accumulate_grad_shard(buf[50:53], buf[53:56], accumulate=False)
    assert torch.equal(buf[53:56].cpu(), buf[50:53].cpu())
