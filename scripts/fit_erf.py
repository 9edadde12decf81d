"""Fit the erf table of bert_engine/runtime/fused_layer.c (ERF_PIECES, behind its exact GELU) and print it with
its error.

erf on [0, 4) is cut into PIECES pieces of width 1; on each, a degree-DEGREE polynomial in u, the distance from
the piece's middle, is fitted by Chebyshev least squares in float64 (4,001 Chebyshev points a piece), then
rounded to float32. The error is measured the way the C code evaluates it: in float32, u = a - (piece + 0.5),
two Horner chains of FMAs (low: coefficients 0-4, high: 5-9) joined as low + u^5 high, against Python's
math.erf in float64 on 300,001 points of [0, 6] (past 4 the input is clamped below 4).

    python scripts/fit_erf.py            # the C table and the largest error
"""

from __future__ import annotations

import math

import numpy as np
from numpy.polynomial import chebyshev

PIECES, DEGREE = 4, 9
CLAMP = np.float32(3.9999998)


def fit() -> np.ndarray:
    """(DEGREE + 1, PIECES) float32: coefficient k of piece i at [k, i]."""
    half = 0.5
    nodes = np.cos(np.linspace(0.0, np.pi, 4001))
    columns = []
    for piece in range(PIECES):
        middle = piece + half
        values = np.array([math.erf(middle + half * t) for t in nodes])
        series = chebyshev.chebfit(nodes, values, DEGREE)
        columns.append(chebyshev.cheb2poly(series) / half ** np.arange(DEGREE + 1))
    return np.array(columns).T.astype(np.float32)


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a * b + c rounded once to float32, as the FMA instruction does (a float32 product is exact in float64)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def evaluate(table: np.ndarray, x: np.ndarray) -> np.ndarray:
    """erf(x) for x >= 0 (float32) as fused_layer.c's erf_ps computes it."""
    a = np.minimum(x.astype(np.float32), CLAMP)
    piece = a.astype(np.int32)  # truncation, as _mm256_cvttps_epi32
    u = (a - (piece.astype(np.float32) + np.float32(0.5))).astype(np.float32)
    low, high = table[4][piece], table[9][piece]
    for k in (3, 2, 1, 0):
        low = _fma(low, u, table[k][piece])
    for k in (8, 7, 6, 5):
        high = _fma(high, u, table[k][piece])
    u2 = (u * u).astype(np.float32)
    return _fma(high, ((u2 * u2).astype(np.float32) * u).astype(np.float32), low)


def largest_error(table: np.ndarray) -> tuple[float, float]:
    """The largest |erf_ps(x) - erf(x)| over [0, 6] and where it is."""
    x = np.linspace(0.0, 6.0, 300_001).astype(np.float32)
    truth = np.array([math.erf(float(v)) for v in x])
    error = np.abs(evaluate(table, x).astype(np.float64) - truth)
    return float(error.max()), float(x[error.argmax()])


def c_table(table: np.ndarray) -> str:
    rows = ("    {" + ", ".join(f"{float(v):.9e}f" for v in row) + "}," for row in table)
    return f"static const float ERF_PIECES[{DEGREE + 1}][{PIECES}] = {{\n" + "\n".join(rows) + "\n};"


def main() -> None:
    table = fit()
    error, where = largest_error(table)
    print(c_table(table))
    print(f"largest error {error:.2e} at {where:.5f}")


if __name__ == "__main__":
    main()
