"""The compute tables: GEMMs on an (m, n, k) grid per dtype (and unaligned
shapes), memory-bound ops by name forward and backward, the optimizer step,
and scaled_dot_product_attention."""
from __future__ import annotations

import statistics

import torch

from autopar.calibrate.host_overhead import _dispatched
from autopar.calibrate.timing import Timer, _copies, _cycling, _rotating, _work_rate, _work_seconds
from autopar.precision import DTYPES


def measure_gemm(timer: Timer, device: torch.device, dtype: str, g: dict, overhead: float, progress) -> dict:
    ms, nks = g["gemm_m"], g["gemm_nk"]
    dt = DTYPES[dtype]
    rates = []
    with torch.no_grad():
        for i, m in enumerate(ms):
            for n in nks:
                for k in nks:
                    ops = _rotating(lambda: (torch.randn(m, k, device=device, dtype=dt),
                                             torch.randn(k, n, device=device, dtype=dt)),
                                    (m * k + k * n) * dt.itemsize, device)
                    rates.append(_work_rate(2 * m * n * k, timer, _cycling(torch.mm, ops), overhead))
            progress(f"GEMM {dtype}: m = {m} done ({i + 1}/{len(ms)})")
    return {"m": ms, "n": nks, "k": nks, "flops_per_s": rates}



# Memory-bound ops timed by name (a captured op `mlp:gelu` is priced by the `gelu` table),
# with the class each stands for when an op has no table of its own. Ops with
# transcendental maths (gelu's erf, exp in softmax) are compute-bound on a CPU core,
# so one "elementwise" rate would not do.
OP_TABLES = {"add": "elementwise", "mul": None, "gelu": None, "gelu_tanh": None, "silu": None, "exp": None,
             "native_layer_norm": "norm", "_softmax": "softmax", "_log_softmax": None, "copy": "copy",
             "embedding": "embedding"}



def measure_ops(timer: Timer, device: torch.device, g: dict, overhead: float, progress) -> dict:
    """bytes/s per op (and per op class), by bytes moved per call (reads + writes).
    Rows are a hidden size wide (256), the softmax family a vocabulary or a
    sequence wide (2048): a row's reduction is part of their cost."""
    f = torch.nn.functional
    calls = {
        "add": (lambda x, y, i: x + y, 3, 256), "mul": (lambda x, y, i: x * y, 3, 256),
        "gelu": (lambda x, y, i: f.gelu(x), 2, 256),
        "gelu_tanh": (lambda x, y, i: f.gelu(x, approximate="tanh"), 2, 256),
        "silu": (lambda x, y, i: f.silu(x), 2, 256), "exp": (lambda x, y, i: torch.exp(x), 2, 256),
        "native_layer_norm": (lambda x, y, i: f.layer_norm(x, (x.shape[-1],)), 2, 256),
        "_softmax": (lambda x, y, i: torch.softmax(x, -1), 2, 2048),
        "_log_softmax": (lambda x, y, i: torch.log_softmax(x, -1), 2, 2048),
        "copy": (lambda x, y, i: x.clone(), 2, 256), "embedding": (lambda x, y, i: f.embedding(i, x), 2, 256),
    }
    out = {}
    with torch.no_grad():
        for name, (fn, factor, width) in calls.items():
            sizes, rates = [], []
            for numel in g["elements"]:
                rows = max(1, numel // width)

                def make():
                    x = torch.randn(rows, width, device=device)
                    return x, torch.randn_like(x), torch.randint(0, rows, (rows,), device=device)
                ops = _rotating(make, 3 * rows * width * 4, device)
                nbytes = factor * rows * width * 4
                sizes.append(float(nbytes))
                keep = _copies(rows * width * 4, device)  # the results: one row block each
                rates.append(_work_rate(nbytes, timer, _cycling(fn, ops, keep=keep), overhead))
            out[name] = {"bytes": sizes, "bytes_per_s": rates}
            if OP_TABLES[name]:
                out[OP_TABLES[name]] = out[name]
    for name, (fn, _, width) in calls.items():
        if name in BACKWARD_TABLES:
            out[name + ".bwd"] = _measure_op_backward(timer, device, fn, width, g["elements"])
            if OP_TABLES[name]:
                out[OP_TABLES[name] + ".bwd"] = out[name + ".bwd"]
    progress(f"memory-bound ops: {', '.join(calls)} done (forward; backward of {', '.join(BACKWARD_TABLES)})")
    return out



# Ops whose backward is a kernel of its own with another speed per byte than the forward
# (gelu's backward evaluates the derivative, not the function: on one CPU core tanh-GELU's
# backward moved 3 tensors in the time its forward moved 2). add and copy pass the gradient on.
BACKWARD_TABLES = ("mul", "gelu", "gelu_tanh", "silu", "exp", "native_layer_norm", "_softmax", "_log_softmax",
                   "embedding")



def _bytes_moved(fn) -> int:
    """Bytes fn's aten ops read and write, counted as capture counts an op's bytes
    (every tensor argument and output of an op that moves data; views move none), so
    a table's bytes per call and a captured op's bytes mean the same thing."""
    from torch.utils._pytree import tree_flatten

    from autopar.capture import ops as opinfo

    def weigh(func, args, kwargs, out):
        if opinfo.moves_no_data(func):
            return 0
        return sum(opinfo.tensor_bytes(t) for t in tree_flatten((args, kwargs, out))[0]
                   if isinstance(t, torch.Tensor))
    return _dispatched(fn, weigh)



def _measure_op_backward(timer: Timer, device: torch.device, fn, width: int, elements: list) -> dict:
    """bytes/s of an op's backward, by the bytes its backward kernels move per call. As in
    a step: the saved tensors were written a whole forward ago (rotating, cold), the
    incoming gradient was just written by the op after it in backward (one buffer,
    reused: as warm as the caches keep it), the gradient it makes lands in a buffer
    freed long before (kept results)."""
    sizes, rates = [], []
    # autograd.grad's own fixed cost (the engine starting, once per call: a step pays it
    # once, not per op) is taken out with the one-row call's time; the host time of each
    # backward op is charged per op by the cost model, as for forward ops
    one = torch.randn(1, width, device=device, requires_grad=True)
    one_out = fn(one, torch.randn(1, width, device=device), torch.zeros(1, dtype=torch.long, device=device))
    one_grad = torch.randn_like(one_out)
    fixed = timer(lambda: torch.autograd.grad(one_out, one, one_grad, retain_graph=True))
    for numel in elements:
        rows = max(1, numel // width)

        def make():
            x = torch.randn(rows, width, device=device)
            return x, torch.randn_like(x), torch.randint(0, rows, (rows,), device=device)
        sets = _rotating(make, 3 * rows * width * 4, device)
        graphs = [(fn(x.requires_grad_(), y, i), x) for x, y, i in sets]
        grad = torch.randn_like(graphs[0][0])

        def backward(out, x):
            return torch.autograd.grad(out, x, grad, retain_graph=True)
        nbytes = _bytes_moved(lambda: backward(*graphs[0]))
        keep = _copies(rows * width * 4, device)
        sizes.append(float(nbytes))
        rates.append(_work_rate(nbytes, timer, _cycling(backward, graphs, keep=keep), fixed))
        del graphs, sets
    return {"bytes": sizes, "bytes_per_s": rates}



def measure_optimizer(timer: Timer, device: torch.device, progress, mesh=None) -> dict:
    """Seconds of optimizer.step() for torch's default implementation on this device
    (CPU: a loop over tensors; CUDA: foreach), as a + b x tensors + c x elements,
    each constant from the points it dominates. With a mesh, also over DTensor
    parameters sharded on it (what FSDP2 and tensor parallelism hand the
    optimizer: every per-tensor op goes through DTensor's dispatch)."""
    from torch.distributed.tensor import DTensor, Shard

    world = mesh.size() if mesh is not None else 1
    # the large total (64 MiB per fp32 array on a CPU) is beyond the caches, as a real step's
    # state is: backward has evicted it by the time the optimizer runs
    large = 2**24 if device.type == "cpu" else 2**28

    def param(numel: int, sharded: bool):
        if not sharded:
            return torch.nn.Parameter(torch.randn(numel, device=device))
        local = torch.randn(max(1, numel // world), device=device)
        return torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))

    fits = {}
    for sharded in ((False, True) if mesh is not None else (False,)):
        for name, make in (("adam", lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
                           ("sgd", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9))):
            secs = {}
            for tensors in (4, 64):
                for total in (2**12, large):
                    params = [param(max(1, total // tensors), sharded) for _ in range(tensors)]
                    for p in params:
                        p.grad = torch.randn_like(p)
                    opt = make(params)
                    secs[tensors, total] = timer(opt.step)
                    del opt, params
            per_tensor = max(0.0, (secs[64, 2**12] - secs[4, 2**12]) / 60)
            per_step = max(0.0, secs[4, 2**12] - 4 * per_tensor)
            local = large / (world if sharded else 1)  # the elements this rank updates
            per_param = statistics.mean(max(1e-15, (secs[t, large] - per_step - t * per_tensor) / local)
                                        for t in (4, 64))
            fits[name + (":dtensor" if sharded else "")] = {"per_step_s": per_step, "per_tensor_s": per_tensor,
                                                             "per_param_s": per_param}
    progress("optimizer steps (AdamW, SGD; plain and DTensor parameters) done")
    return fits



def measure_attention(timer: Timer, device: torch.device, dtypes, g: dict, over: dict, progress) -> list:
    """SDPA per dtype: the kernel torch picks differs by dtype (flash for bf16/fp16 on
    a GPU, memory-efficient or math for fp32), and so does its speed, by 5x or more."""
    f = torch.nn.functional
    h, d = g["attn_heads"], g["attn_dim"]
    rows = []
    for dtype in dtypes:
        for causal in (True, False):
            fwd_rates, bwd_rates, flops = [], [], []
            for s in g["attn_seq"]:
                q, k, v = (torch.randn(1, h, s, d, device=device, dtype=DTYPES[dtype], requires_grad=True)
                           for _ in range(3))
                work = 4.0 * h * s * s * d  # counted unmasked, as the workload counts attention
                with torch.no_grad():
                    fwd_rates.append(_work_rate(work, timer, lambda: f.scaled_dot_product_attention(
                        q, k, v, is_causal=causal), over["no_grad"]))
                out = f.scaled_dot_product_attention(q, k, v, is_causal=causal)
                grad = torch.randn_like(out)
                bwd_rates.append(_work_rate(work, timer, lambda: torch.autograd.grad(
                    out, (q, k, v), grad, retain_graph=True), over["bwd"]))
                flops.append(work)
            # the sequence length of each point: the cost model prices a call of b x h
            # sequences at the rate measured at its length (measured.attention_time)
            seqs = [float(s) for s in g["attn_seq"]]
            rows += [{"dtype": dtype, "causal": causal, "direction": "fwd", "flops": flops,
                      "flops_per_s": fwd_rates, "seq": seqs},
                     {"dtype": dtype, "causal": causal, "direction": "bwd", "flops": flops,
                      "flops_per_s": bwd_rates, "seq": seqs}]
            progress(f"attention {dtype} ({'causal' if causal else 'full'}) done")
    return rows



def measure_gemm_unaligned(timer: Timer, device: torch.device, dtype: str, overhead: float) -> dict:
    """How much slower a GEMM runs when n or k is not a multiple of 16 bytes (GPT-2's
    vocabulary of 50257, say): the tensor-core kernels need aligned rows, and BLAS
    falls back to kernels that are several times slower on a GPU. Timed as pairs,
    aligned and one element short of aligned, at a few sizes; slowdown = mean of
    the n- and k-unaligned times over the aligned time."""
    dt = DTYPES[dtype]
    shapes = ([(2048, 2048, 2048), (8192, 8192, 4096), (8192, 50304, 768)] if device.type == "cuda"
              else [(256, 256, 256), (1024, 1024, 256)])
    flops, slowdown = [], []
    with torch.no_grad():
        for m, n, k in shapes:
            def timed(n_, k_):
                ops = _rotating(lambda: (torch.randn(m, k_, device=device, dtype=dt),
                                         torch.randn(k_, n_, device=device, dtype=dt)),
                                (m * k_ + k_ * n_) * dt.itemsize, device)
                return _work_seconds(timer, _cycling(torch.mm, ops), overhead)  # positive: a call is some work
            aligned = timed(n, k)
            flops.append(2.0 * m * n * k)
            slowdown.append(max(1.0, (timed(n - 1, k) + timed(n, k - 1)) / 2 / aligned))
    return {"flops": flops, "slowdown": slowdown}

