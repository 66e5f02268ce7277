"""Exact polynomials in batch (B) and sequence length (S) from measured points.

Every per-layer quantity of a training step is a polynomial in the
micro-batch size b (degree 1) and sequence length s (degree <= 2: attention
scores are s x s). Capture measures each quantity at b in {2, 3} and three
sequence lengths, solves for the exact rational coefficients, and checks the
polynomial at one more point (b=4, a fourth s). b=1 is not measured: PyTorch
takes different paths for a batch of one (views instead of copies in
matmul), which would make b=1 the odd point out. A quantity that does not fit
(a model whose cost is not polynomial, e.g. routing that rounds) fails loudly
rather than extrapolating wrong numbers.
"""
from __future__ import annotations

from fractions import Fraction

import sympy

from autopar.errors import CaptureError
from cost_models.workload import B, S


def _quadratic(xs, ys) -> list[Fraction]:
    """Coefficients [c0, c1, c2] of the parabola through three points (Newton form)."""
    (x1, x2, x3), (y1, y2, y3) = [Fraction(x) for x in xs], [Fraction(y) for y in ys]
    d1 = (y2 - y1) / (x2 - x1)
    d2 = ((y3 - y2) / (x3 - x2) - d1) / (x3 - x1)
    # y = y1 + d1 (x - x1) + d2 (x - x1)(x - x2)
    c2 = d2
    c1 = d1 - d2 * (x1 + x2)
    c0 = y1 - d1 * x1 + d2 * x1 * x2
    return [c0, c1, c2]


class PointGrid:
    """The (batch, seq) points capture measures at, and the check point."""

    def __init__(self, seq: int | None, local: bool = False):
        self.batches = (2, 3)
        self.local = local and seq is not None
        if seq is None:
            self.seqs = None
            self.points = [(2, None), (3, None)]
            self.check = (4, None)
        else:
            self.seqs = local_points(seq) if local else sequence_points(seq)
            self.points = [(b, s) for b in self.batches for s in self.seqs]
            self.check = (4, self.seqs[3] if local else check_seq(seq, self.seqs))
            self.seqs = self.seqs[:3]

    @classmethod
    def fallbacks(cls, seq: int | None) -> list:
        """The grids to try in order: wide (s, s/2, s/4); local (s, s-8, s-16),
        for costs that are polynomial only piecewise (a sliding window that
        switches a mask on past its width); batch only, at s."""
        if seq is None:
            return [cls(None)]
        grids = [cls(seq)]
        if seq >= 8 * LOCAL_STEP:
            grids.append(cls(seq, local=True))
        return grids + [cls(None)]

    @property
    def all_points(self):
        return self.points + [self.check]


def sequence_points(seq: int) -> tuple:
    """Three distinct sequence lengths <= seq, as round as possible (MoE routing
    divides tokens by the expert count, so multiples of 4 keep counts exact)."""
    if seq % 4 == 0 and seq >= 8:
        return (seq, seq // 2, seq // 4)
    if seq >= 3:
        return (seq, seq - 1, seq - 2)
    raise CaptureError(f"sequence length {seq} is too short to fit costs in s",
                       hint="use example inputs with a sequence length of at least 8")


LOCAL_STEP = 8  # a multiple of 4 and of common expert counts: balanced routing stays exact


def local_points(seq: int) -> tuple:
    """Three lengths just below seq and the check length, LOCAL_STEP apart."""
    return tuple(seq - i * LOCAL_STEP for i in range(4))


def check_seq(seq: int, seqs: tuple) -> int:
    if seq % 4 == 0 and seq >= 8:
        return 3 * seq // 4
    return seq - 3 if seq - 3 > 0 and seq - 3 not in seqs else seq


def fit(values: dict, grid: PointGrid, what: str):
    """sympy polynomial through values[(b, s)], verified at grid.check."""
    b1, b2 = grid.batches
    if grid.seqs is None:
        g1, g2 = [Fraction(values[(b1, None)])], [Fraction(values[(b2, None)])]
    else:
        g1 = _quadratic(grid.seqs, [values[(b1, s)] for s in grid.seqs])
        g2 = _quadratic(grid.seqs, [values[(b2, s)] for s in grid.seqs])
    coeffs = {}
    for j in range(len(g1)):  # value = g1 + (b - b1) * (g2 - g1) / (b2 - b1)
        slope = (g2[j] - g1[j]) / (b2 - b1)
        coeffs[(0, j)] = g1[j] - slope * b1
        coeffs[(1, j)] = slope
    b, s = grid.check
    predicted = sum(c * b ** i * (s ** j if j else 1) for (i, j), c in coeffs.items())
    measured = Fraction(values[grid.check])
    if abs(predicted - measured) > Fraction(1, 10 ** 6) * max(1, abs(measured)):
        raise CaptureError(
            f"{what} is not a polynomial in batch (linear) and sequence length (quadratic): "
            f"fitted {float(predicted):.6g} but measured {float(measured):.6g} at batch={b}, seq={s}",
            hint="the model's cost depends on the input size in a way capture cannot extrapolate; "
                 "capture at the sequence length you will train with and pass seq_dim=None")
    expr = sympy.Integer(0)
    for (i, j), c in coeffs.items():
        if c:
            expr += sympy.Rational(c.numerator, c.denominator) * B ** i * S ** j
    return expr
