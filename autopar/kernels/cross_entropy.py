"""Cross-entropy over a large vocabulary, and the chunked linear + cross-entropy.

`cross_entropy(logits, targets)`: one kernel streams each row of logits in
blocks with an online log-sum-exp (a 128k vocabulary never has to fit in
registers) and saves only the per-row lse; backward recomputes the softmax
from logits + lse and writes d(logits) directly. Eager saves the full
log-softmax tensor (another N x V) and reads it back.

`linear_cross_entropy(hidden, weight, targets)`: the output head and the
loss together, over chunks of rows. For each chunk it computes the chunk's
logits (a GEMM), and one kernel turns them *in place* into d(logits) while
computing the loss; two more GEMMs accumulate d(hidden) and d(weight).
Full N x V logits never exist: peak extra memory is one chunk of logits
instead of logits + log-softmax + their gradient (3 x N x V in eager; for
Llama-3 at 8k tokens that is 3 x 8192 x 128256 x 2 bytes = 6.3 GB).
Backward only scales the stored gradients by the incoming scalar.

Semantics follow F.cross_entropy(..., ignore_index=-100, reduction='mean'|'sum'):
targets equal to ignore_index contribute nothing, the mean divides by the
number of non-ignored targets (0/0 = nan when all are ignored, as torch).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.kernels._runtime import HAVE_TRITON, new_empty, next_pow2, rows_of, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _ce_fwd_kernel(LOGITS, TARGETS, LOSS, LSE, DLOGITS, V, ignore_index, grad_scale,
                       WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = LOGITS + row * V
        t = tl.load(TARGETS + row).to(tl.int64)
        # pass 1: online max / sum-exp over the row, block by block
        m = float("-inf")
        s = 0.0
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        ignored = t == ignore_index
        t_safe = tl.where(ignored, 0, t)
        x_t = tl.load(base + t_safe).to(tl.float32)
        tl.store(LOSS + row, tl.where(ignored, 0.0, lse - x_t))
        tl.store(LSE + row, lse)
        if WRITE_GRAD:
            # pass 2: d(loss)/d(logits) = (softmax - onehot) * grad_scale, written
            # over the logits (DLOGITS may alias LOGITS: each element is read
            # before it is written, by the same program).
            g = tl.where(ignored, 0.0, grad_scale)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
                d = (tl.exp(x - lse) - tl.where(cols == t, 1.0, 0.0)) * g
                tl.store(DLOGITS + row * V + cols, d.to(DLOGITS.dtype.element_ty), mask=cols < V)

    @triton.jit
    def _ce_bwd_kernel(LOGITS, TARGETS, LSE, DLOSS, DLOGITS, V, ignore_index,
                       PER_ROW_GRAD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        t = tl.load(TARGETS + row).to(tl.int64)
        lse = tl.load(LSE + row)
        if PER_ROW_GRAD:
            g = tl.load(DLOSS + row).to(tl.float32)
        else:
            g = tl.load(DLOSS).to(tl.float32)
        g = tl.where(t == ignore_index, 0.0, g)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(LOGITS + row * V + cols, mask=cols < V, other=0.0).to(tl.float32)
            d = (tl.exp(x - lse) - tl.where(cols == t, 1.0, 0.0)) * g
            tl.store(DLOGITS + row * V + cols, d.to(DLOGITS.dtype.element_ty), mask=cols < V)


def _block(v: int) -> int:
    return min(next_pow2(v), 4096)


def _check_targets(logits_shape, targets, name):
    from autopar.errors import AutoparError

    if tuple(targets.shape) != tuple(logits_shape[:-1]):
        raise AutoparError(f"{name}: targets shape {tuple(targets.shape)} must equal the logits' leading shape {tuple(logits_shape[:-1])}")
    if targets.is_floating_point():
        raise AutoparError(f"{name}: targets must be integer class indices, got {targets.dtype}")


def _check_range(targets, vocab, ignore_index, name):
    # The kernel would read out of bounds for a bad class index. On CPU the
    # check is cheap; on a GPU it would cost a host sync per step, so there an
    # asynchronous device assert fires instead.
    ok = ((targets >= 0) & (targets < vocab)) | (targets == ignore_index)
    if targets.device.type == "cpu":
        if not bool(ok.all()):
            from autopar.errors import AutoparError

            bad = targets[~ok][:5].tolist()
            raise AutoparError(f"{name}: targets must be in [0, {vocab}) or ignore_index={ignore_index}; got {bad}")
    else:
        torch._assert_async(ok.all(), f"{name}: a target is outside [0, {vocab}) and not ignore_index")


def _reduce(loss_rows, targets, ignore_index, reduction, dtype):
    if reduction == "none":
        return loss_rows.view(targets.shape).to(dtype)
    total = loss_rows.sum()
    if reduction == "sum":
        return total.to(dtype)
    return (total / (targets != ignore_index).sum()).to(dtype)


def _ce_forward(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (loss per row, log-sum-exp per row), fp32; the reduction is the caller's."""
    _check_range(targets, logits.shape[-1], ignore_index, "cross_entropy")  # in the op: real tensors
    x2 = rows_of(logits)
    t = targets.contiguous().view(-1)
    n, v = x2.shape
    loss = new_empty((n,), torch.float32, x2.device)
    lse = new_empty((n,), torch.float32, x2.device)
    _ce_fwd_kernel[(n,)](x2, t, loss, lse, x2, v, ignore_index, 0.0, WRITE_GRAD=False, BLOCK=_block(v))
    return loss, lse


def _ce_backward(dloss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                 ignore_index: int) -> torch.Tensor:
    x2 = rows_of(logits)
    t = targets.contiguous().view(-1)
    n, v = x2.shape
    dx = new_empty((n, v), x2.dtype, x2.device)
    _ce_bwd_kernel[(n,)](x2, t, lse, dloss.float().contiguous().view(-1), dx, v, ignore_index,
                         PER_ROW_GRAD=True, BLOCK=_block(v))
    return dx.view(logits.shape)


# torch.library ops: compiled code calls them as opaque ops (fake versions for tracing)
_ce_op = torch.library.custom_op("autopar::cross_entropy", _ce_forward, mutates_args=())
_ce_op.register_fake(lambda logits, targets, ignore_index: (
    logits.new_empty((logits.numel() // logits.shape[-1],), dtype=torch.float32),
    logits.new_empty((logits.numel() // logits.shape[-1],), dtype=torch.float32)))
_ce_backward_op = torch.library.custom_op("autopar::cross_entropy_backward", _ce_backward, mutates_args=())
_ce_backward_op.register_fake(lambda dloss, logits, targets, lse, ignore_index: torch.empty_like(logits))


def _ce_setup(ctx, inputs, output):
    logits, targets, ignore_index = inputs
    ctx.save_for_backward(logits, targets, output[1])
    ctx.ignore_index = ignore_index


def _ce_grad(ctx, dloss, _dlse):
    logits, targets, lse = ctx.saved_tensors
    return _ce_backward_op(dloss, logits, targets, lse, ctx.ignore_index), None, None


_ce_op.register_autograd(_ce_grad, setup_context=_ce_setup)


def cross_entropy_reference(logits, targets, ignore_index: int = -100, reduction: str = "mean"):
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index,
                           reduction=reduction).view(targets.shape if reduction == "none" else ())


def cross_entropy(logits, targets, ignore_index: int = -100, reduction: str = "mean"):
    """F.cross_entropy over the last dim of `logits` (..., V) with `targets` (...)."""
    _check_targets(logits.shape, targets, "cross_entropy")
    if reduction not in ("mean", "sum", "none"):
        from autopar.errors import AutoparError

        raise AutoparError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not use_triton(logits, targets):
        return cross_entropy_reference(logits, targets, ignore_index, reduction)
    loss, _ = _ce_op(logits, targets, int(ignore_index))
    return _reduce(loss, targets, ignore_index, reduction, logits.dtype)


def _lce_forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, mean: bool,
                 chunk_rows: int, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (the reduced loss, fp32 scalar; d(loss)/d(hidden); d(loss)/d(weight), fp32), the
    gradients made chunk by chunk while the loss is (empty when not needed)."""
    _check_range(targets, weight.shape[0], ignore_index, "linear_cross_entropy")  # in the op: real tensors
    h2 = rows_of(hidden)
    t = targets.contiguous().view(-1)
    n, _ = h2.shape
    v = weight.shape[0]
    n_valid = int((t != ignore_index).sum())
    grad_scale = 1.0 / n_valid if (mean and n_valid > 0) else 1.0
    loss = new_empty((n,), torch.float32, h2.device)
    lse = new_empty((n,), torch.float32, h2.device)
    dh = new_empty(h2.shape if need_grad else (0,), hidden.dtype, h2.device)
    dw = torch.zeros(weight.shape if need_grad else (0,), dtype=torch.float32, device=h2.device)
    for start in range(0, n, chunk_rows):
        end = min(n, start + chunk_rows)
        logits = h2[start:end] @ weight.t()  # (rows, V): the only logits in memory
        _ce_fwd_kernel[(end - start,)](
            logits, t[start:end], loss[start:], lse[start:], logits, v, ignore_index, grad_scale,
            WRITE_GRAD=need_grad, BLOCK=_block(v))
        if need_grad:  # logits now hold d(loss)/d(logits) for this chunk
            dh[start:end] = logits @ weight
            dw += (logits.t() @ h2[start:end]).float()  # fp32-accumulated GEMM, summed in fp32
    total = loss.sum()
    if mean:  # n_valid = 0: nan, as F.cross_entropy
        total = total / n_valid if n_valid > 0 else total / 0.0
    return total, dh.view(hidden.shape) if need_grad else dh, dw


def _lce_fake(hidden, weight, targets, ignore_index, mean, chunk_rows, need_grad):
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape if need_grad else (0,)),
            hidden.new_empty(weight.shape if need_grad else (0,), dtype=torch.float32))


# a torch.library op: compiled code calls it as one opaque op; its backward only scales
# the gradients the forward made (plain torch ops, traced)
_lce_op = torch.library.custom_op("autopar::linear_cross_entropy", _lce_forward, mutates_args=())
_lce_op.register_fake(_lce_fake)


def _lce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])
    ctx.w_dtype = inputs[1].dtype


def _lce_grad(ctx, dloss, _ddh, _ddw):
    dh, dw = ctx.saved_tensors
    g = dloss.float()
    return (dh.float() * g).to(dh.dtype), (dw * g).to(ctx.w_dtype), None, None, None, None, None


_lce_op.register_autograd(_lce_grad, setup_context=_lce_setup)


def linear_cross_entropy_reference(hidden, weight, targets, ignore_index: int = -100, reduction: str = "mean",
                                   chunk_rows: int = 4096):
    logits = F.linear(hidden, weight)
    return cross_entropy_reference(logits, targets, ignore_index, reduction)


def linear_cross_entropy(hidden, weight, targets, ignore_index: int = -100, reduction: str = "mean",
                         chunk_rows: int = 4096):
    """cross_entropy(hidden @ weight.T, targets) without materialising the full logits.

    `hidden` (..., H), `weight` (V, H) (the output head / tied embedding),
    `targets` (...). `chunk_rows` bounds the logits held at once (chunk_rows x V).
    """
    from autopar.errors import AutoparError

    _check_targets(hidden.shape, targets, "linear_cross_entropy")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise AutoparError(f"linear_cross_entropy: weight shape {tuple(weight.shape)} must be (vocab, {hidden.shape[-1]})")
    if reduction not in ("mean", "sum"):
        raise AutoparError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_rows < 1:
        raise AutoparError(f"linear_cross_entropy: chunk_rows must be >= 1, got {chunk_rows}")
    if not use_triton(hidden, weight, targets):
        return linear_cross_entropy_reference(hidden, weight, targets, ignore_index, reduction)
    loss, _, _ = _lce_op(hidden, weight, targets, int(ignore_index), reduction == "mean", int(chunk_rows),
                         hidden.requires_grad or weight.requires_grad)
    return loss.to(hidden.dtype)


def make_cross_entropy_inputs(seed: int, shape=None, dtype=torch.float32):
    shape = tuple(shape or (3, 5, 1000))  # (..., vocab)
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=g) * 3).to(dtype)
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    targets.view(-1)[:: 4] = -100  # some ignored positions, as padding produces
    return (logits, targets)


def make_linear_cross_entropy_inputs(seed: int, shape=None, dtype=torch.float32):
    # shape = (..., hidden, vocab): leading dims of the tokens, then H and V.
    shape = tuple(shape or (3, 5, 64, 1000))
    *lead, hid, vocab = shape
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, hid, generator=g).to(dtype)
    weight = (torch.randn(vocab, hid, generator=g) / hid**0.5).to(dtype)
    targets = torch.randint(0, vocab, tuple(lead), generator=g)
    targets.view(-1)[1::5] = -100
    return (hidden, weight, targets)
