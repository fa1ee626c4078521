"""Vectorisable elementary functions for the Numba kernels: exp, erf, Φ, tanh, σ.

PyPI's Numba has no vector math library: ``math.exp``, ``math.erf`` and ``math.tanh`` are scalar
libm calls, and a loop that calls them is neither inlined nor vectorised (a batch_norm + silu
forward, (128, 64, 32, 32) float32, 2 threads, AMD Zen 3: 88 ms against 6.9 ms with identity).
The functions here are polynomials and selects only — no libm call, no branch — so that LLVM
inlines them into a loop and vectorises it (eight float32 or four float64 lanes per AVX2
vector).  Each is one name with one implementation per dtype (a Numba ``@overload``): float32
arguments are computed in float32, float64 arguments in float64.  From Python they are the
``math`` functions.  Compiled once per dtype into each caller; they are small enough for LLVM to
inline (the callers are the row functions of :mod:`.activations`, :mod:`.rnn` and :mod:`.loss`).

Approximations (all polynomials fitted for this module: weighted least squares on Chebyshev
nodes solved in 40-digit arithmetic (mpmath), reweighted towards equal ripple; the "fit" error
is the polynomial's own, with its coefficients rounded to the dtype; "measured" is the whole
function evaluated in the dtype against mpmath, tests/kernel_packages/cpu/test_vmath.py):

* :func:`exp` — x = k ln 2 + r, |r| <= ln 2 / 2 (Cody–Waite: ln 2 in two parts), e^r by a
  polynomial of degree 6 (float32, fit 9.6e-8) or 11 (float64, fit 1.8e-16), 2^k put into the
  exponent bits.  0 below −87 (float32) / −708 (float64), ∞ above 88 / 709, NaN for NaN.
  Measured max error: 1.6 ulp (float32), 2 ulp (float64).
* :func:`erf` — |x| < 0.6: x·P(x²), P of degree 4 (fit 5.9e-8) / 9 (2.5e-17).  Beyond:
  erf = 1 − erfc(|x|) with erfc(a) = e^(−a²)·G(t)/(a + k), t = (a − k)/(a + k) ∈ (−1, 1),
  G of degree 10 in t (k = 2, fit 2.5e-8) / 22 (k = 2.5, fit 1.1e-16), which covers the whole
  tail [0.6, ∞).  e^(−a²) takes a² as an exact two-term sum (fma), so the rounding of a² (up to
  100 ulp of the result at a = 10) does not reach the result.
* :func:`ndtr` — Φ(z) = ½ erfc(−z/√2), the standard normal CDF, with the same two pieces;
  accurate on both tails (Φ(−8) is computed, not 1 + erf(−5.66) = 0 as libm's cancellation
  gives), and with e^(−z²/2) from z itself, for gelu and its derivative.
* :func:`tanh` — |x| < 0.55: x + x³·Q(x²), Q of degree 4 (fit 6.0e-8, ×1/10 in the result) /
  9 (8.8e-16, ×1/10); beyond: (1 − e)/(1 + e), e = e^(−2|x|) ∈ (0, 1/3].  ±∞ -> ±1.
* :func:`sigmoid` — 1 / (1 + e^(−x)): relative error of exp plus two roundings; σ(−∞) = 0,
  σ(∞) = 1.

Measured max errors in ulp of the exact value (whole functions, dense grids over the range,
both tails, against mpmath; tests/kernel_packages/cpu/test_vmath.py holds them):

==========  =======  =======
function    float32  float64
==========  =======  =======
exp         1.6      2.0
erf         2.5      3.0
ndtr (Φ)    4.9      5.0      (float32: z in (−0.85, −0.5), where ½ + u·P cancels to ~0.2)
tanh        1.5      2.0
sigmoid     2.4      3.0
==========  =======  =======
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import binding as _llvm
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

# --------------------------------------------------------------------------- building blocks


@intrinsic
def _pow2(typingctx, k):
    """2**k for an integer-valued float ``k`` in the normal exponent range, from its exponent bits."""
    if k == types.float32:
        ity, fty, bias, shift = ir.IntType(32), ir.FloatType(), 127, 23
    elif k == types.float64:
        ity, fty, bias, shift = ir.IntType(64), ir.DoubleType(), 1023, 52
    else:
        return None

    def codegen(context, builder, sig, args):
        # Through int32 even for float64: AVX2 converts packed doubles to int32, not to int64.
        i = builder.fptosi(args[0], ir.IntType(32))
        if ity.width == 64:
            i = builder.sext(i, ity)
        i = builder.shl(builder.add(i, ir.Constant(ity, bias)), ir.Constant(ity, shift))
        return builder.bitcast(i, fty)

    return k(k), codegen


def _has_fma() -> bool:
    """Whether the CPU fuses a·b + c in one instruction (x86 FMA3, AArch64): else llvm.fma is a libm call."""
    try:
        features = _llvm.get_host_cpu_features()
    except RuntimeError:
        return False
    return bool(features.get("fma") or features.get("neon") or features.get("fp-armv8"))


#: Whether :func:`_square_lo` uses the fused multiply-add (else Dekker's exact product).
HAS_FMA = _has_fma()


@intrinsic
def _fma(typingctx, a, b, c):
    """a·b + c with one rounding (llvm.fma; a vector instruction where the CPU has FMA)."""
    if not (a == b == c and a in (types.float32, types.float64)):
        return None

    def codegen(context, builder, sig, args):
        return builder.fma(*args)

    return a(a, a, a), codegen


def _square_lo(a, s):
    """a·a − s exactly, where s = fl(a·a): the low part of the square (Python fallback)."""
    return float(np.float64(a) * np.float64(a) - s)


@overload(_square_lo)
def _square_lo_impl(a, s):
    if HAS_FMA:
        return lambda a, s: _fma(a, a, -s)
    # Dekker: split a into halves whose products are exact.
    split = np.float32(4097.0) if a == types.float32 else 134217729.0

    def dekker(a, s):
        c = a * split
        hi = c - (c - a)
        lo = a - hi
        return ((hi * hi - s) + (hi * lo + hi * lo)) + lo * lo

    return dekker


def poly(x, c):
    """c[0] + c[1]·x + … + c[n−1]·x^(n−1) (Python fallback; compiled: Estrin's scheme, unrolled)."""
    p = 0.0
    for ck in reversed(c):
        p = p * x + ck
    return p


@overload(poly)
def _poly_impl(x, c):
    """Estrin's scheme written out for the tuple's length: pairs c[2i] + c[2i+1]·x, then pairs of
    those with x², x⁴, …: the same operation count as Horner's rule with a dependency chain of
    log2(n) steps instead of n (the long tail polynomials would otherwise bound the loops by latency)."""
    if not isinstance(c, types.UniTuple):
        return None
    n = c.count
    lines = ["def impl(x, c):", "    x0 = x"]
    terms = [f"c[{k}]" for k in range(n)]
    level = 0
    while len(terms) > 1:
        nxt = []
        for i in range(0, len(terms), 2):
            nxt.append(f"({terms[i + 1]} * x{level} + {terms[i]})" if i + 1 < len(terms) else terms[i])
        terms = nxt
        if len(terms) > 1:
            lines.append(f"    x{level + 1} = x{level} * x{level}")
        level += 1
        # Name the partial sums so that the generated expression stays flat.
        for j, t in enumerate(terms):
            lines.append(f"    t{level}_{j} = {t}")
        terms = [f"t{level}_{j}" for j in range(len(terms))]
    lines.append(f"    return {terms[0]}")
    namespace: dict = {}
    exec("\n".join(lines), namespace)  # generated from integers only
    return namespace["impl"]


# --------------------------------------------------------------------------- coefficients

_F = np.float32

# e**r on |r| <= ln2/2, weighted by 1/e**r (fitted for kernels_cpu/rnn.py, which used them first).
_EXP32 = tuple(_F(c) for c in (
    1.0, 1.0, 0.4999999403953552, 0.16666419804096222, 0.04166772589087486, 0.008374805562198162,
    0.0013859259197488427,
))
_EXP64 = (
    1.0, 1.0, 0.5000000000000013, 0.16666666666666052, 0.041666666666515556, 0.008333333333613325,
    0.0013888888946891889, 0.00019841269330044532, 2.4801490113593883e-05, 2.7557707726637763e-06,
    2.763121237710946e-07, 2.4968604288080825e-08,
)

#: erf(x)/x = P(x²) on |x| <= ERF_SMALL.
ERF_SMALL = 0.6
_ERF32 = tuple(_F(c) for c in (
    1.128379157901808, -0.3761251259640697, 0.11280991550878629, -0.026646978624180598, 0.004512347304305443,
))
_ERF64 = (
    1.1283791670955126, -0.37612638903183704, 0.11283791670950462, -0.02686617064348004, 0.005223977595700337,
    -0.0008548323940838356, 0.0001205513803113613, -1.4917993543779525e-05, 1.62792430509368e-06,
    -1.3911612111321406e-07,
)
# erfc(a)·e^(a²)·(a + k) = G(t), t = (a − k)/(a + k), on a in [ERF_SMALL, ∞) (G(1) = 1/√π).
_K32, _K64 = 2.0, 2.5
_TAIL32 = tuple(_F(c) for c in (
    1.0215827020900088, -0.6871606490858778, 0.2794724130560083, -0.03644377193938776, -0.021515296691466207,
    0.006498370610918667, 0.003107159006038414, -0.0009293053586254141, -0.0006479520544920526,
    0.00019131357097773786, 3.460247862890042e-05,
))
_TAIL64 = (
    1.054031820305718, -0.8046518494391492, 0.45391411664809855, -0.17125114524599436, 0.02836155013179705,
    0.008393044300308976, -0.004818785516649458, -0.000439208226546504, 0.0007026936074721996,
    5.830739907495928e-05, -0.00011260362718697696, -1.9529974997883914e-05, 1.8236792544791703e-05,
    6.74826694094227e-06, -2.303264949620139e-06, -1.960620113271459e-06, -7.080112588310591e-08,
    4.780446294953942e-07, 2.112645973992592e-07, -1.4062099548221713e-07, -7.307131951197564e-08,
    5.644171577775632e-08, -9.246113559439975e-09,
)
# Beyond these |x| erfc is 0 in the dtype (and below exp's range): the tail is evaluated at most here,
# so that x = ±∞ gives no ∞·0.
_ERF_MAX32, _ERF_MAX64 = 10.0, 27.0

#: (tanh(x) − x)/x³ = Q(x²) on |x| < TANH_SMALL (where tanh x < 1/2).
TANH_SMALL = 0.55
_TANH32 = tuple(_F(c) for c in (
    -0.33333332008517796, 0.13333113785396752, -0.05390943806544774, 0.021309437247278924, -0.006610307806459918,
))
_TANH64 = (
    -0.3333333333333331, 0.13333333333315653, -0.05396825394890423, 0.021869487712535003, -0.00886321766617923,
    0.0035919044408958965, -0.001454118198603385, 0.0005817729463128755, -0.00021454311034211154,
    5.3907072364779456e-05,
)

_SQRT_HALF = math.sqrt(0.5)


def _dtype_of(x):
    """(numpy scalar type, suffix) for a Numba float type, or None."""
    if x == types.float32:
        return _F, 32
    if x == types.float64:
        return float, 64
    return None


# --------------------------------------------------------------------------- exp


def exp(x):
    """e**x; compiled: the vectorisable exponential of the module docstring."""
    return math.exp(x)


@overload(exp)
def _exp_impl(x):
    dt = _dtype_of(x)
    if dt is None:
        return None
    f, bits = dt
    if bits == 32:
        lo, hi, ln2_hi, ln2_lo, c = f(-87.0), f(88.0), f(0.693359375), f(-2.12194440e-4), _EXP32
    else:
        lo, hi, ln2_hi, ln2_lo, c = -708.0, 709.0, 6.93147180369123816490e-01, 1.90821492927058770002e-10, _EXP64
    zero, inf, half, log2e = f(0.0), f(math.inf), f(0.5), f(1.4426950408889634)

    def exp_impl(x):
        xc = lo if x < lo else x  # NaN stays NaN through both selects
        xc = hi if xc > hi else xc
        k = np.floor(xc * log2e + half)
        k = k if k == k else zero  # NaN: keeps the conversion in _pow2 defined; the polynomial stays NaN
        r = (xc - k * ln2_hi) - k * ln2_lo
        e = poly(r, c) * _pow2(k)
        e = zero if x < lo else e
        return inf if x > hi else e

    return exp_impl


# --------------------------------------------------------------------------- erf, Φ


def erf(x):
    """erf(x); compiled: the vectorisable erf of the module docstring."""
    return math.erf(x)


def ndtr(z):
    """Φ(z) = ½ erfc(−z/√2), the standard normal CDF (gelu(z) = z·Φ(z))."""
    return 0.5 * math.erfc(-z * _SQRT_HALF)


def ndtr_and_density(z):
    """(Φ(z), e^(−z²/2)): gelu'(z) = Φ(z) + z·e^(−z²/2)/√(2π) from one exponential."""
    return ndtr(z), math.exp(-0.5 * z * z)


def _erfc_tail(a, e):
    """erfc(a) for a >= ERF_SMALL given e = e^(−a²) (compiled only)."""
    raise NotImplementedError


@overload(_erfc_tail)
def _erfc_tail_impl(a, e):
    dt = _dtype_of(a)
    if dt is None:
        return None
    f, bits = dt
    k, c = (f(_K32), _TAIL32) if bits == 32 else (_K64, _TAIL64)
    one = f(1.0)

    def tail(a, e):
        q = one / (a + k)
        return e * poly((a - k) * q, c) * q

    return tail


@overload(erf, inline="always")
def _erf_impl(x):
    dt = _dtype_of(x)
    if dt is None:
        return None
    f, bits = dt
    amax, c = (f(_ERF_MAX32), _ERF32) if bits == 32 else (_ERF_MAX64, _ERF64)
    one, small = f(1.0), f(ERF_SMALL)

    def erf_impl(x):
        a = abs(x)
        ac = amax if a > amax else a  # NaN stays NaN; ±∞ -> amax (erfc 0, no ∞·0)
        s = ac * ac
        e = exp(-s) * (one - _square_lo(ac, s))  # e^(−a²) with a² = s + lo exactly
        big = one - _erfc_tail(ac, e)
        big = -big if x < 0 else big
        return x * poly(s, c) if a < small else big

    return erf_impl


@overload(ndtr_and_density, inline="always")
def _ndtr_and_density_impl(z):
    dt = _dtype_of(z)
    if dt is None:
        return None
    f, bits = dt
    zmax, c = (f(_ERF_MAX32 / _SQRT_HALF), _ERF32) if bits == 32 else (_ERF_MAX64 / _SQRT_HALF, _ERF64)
    c = tuple(f(0.5 * ck) for ck in c)  # Φ(z) = ½ + (z/√2)·½P(z²/2) near 0
    one, half, small, sqrt_half = f(1.0), f(0.5), f(ERF_SMALL), f(_SQRT_HALF)

    def parts(z):
        a = abs(z)
        ac = zmax if a > zmax else a
        s = ac * ac
        e = exp(-half * s) * (one - half * _square_lo(ac, s))  # e^(−z²/2), z² taken exactly
        u = ac * sqrt_half
        tail = half * _erfc_tail(u, e)  # Φ(−|z|) = ½ erfc(|z|/√2)
        big = tail if z < 0 else one - tail
        v = z * sqrt_half
        return (half + v * poly(v * v, c) if u < small else big), e

    return parts


@overload(ndtr, inline="always")
def _ndtr_impl(z):
    if _dtype_of(z) is None:
        return None
    return lambda z: ndtr_and_density(z)[0]


# --------------------------------------------------------------------------- tanh, σ


def tanh(x):
    """tanh(x); compiled: the vectorisable tanh of the module docstring."""
    return math.tanh(x)


@overload(tanh, inline="always")
def _tanh_impl(x):
    dt = _dtype_of(x)
    if dt is None:
        return None
    f, bits = dt
    c = _TANH32 if bits == 32 else _TANH64
    one, two, small = f(1.0), f(2.0), f(TANH_SMALL)

    def tanh_impl(x):
        a = abs(x)
        s = a * a
        e = exp(-two * a)  # in (0, 1/3] on the large branch: no cancellation in 1 − e
        big = (one - e) / (one + e)
        big = -big if x < 0 else big
        near0 = x + x * s * poly(s, c)
        near0 = x if a == 0 else near0  # tanh(−0) = −0 (the sum would give +0)
        return near0 if a < small else big

    return tanh_impl


def sigmoid(x):
    """σ(x) = 1 / (1 + e^(−x)); compiled: vectorisable, σ(−∞) = 0, σ(∞) = 1."""
    return 1.0 / (1.0 + math.exp(-x)) if x > -709.0 else 0.0


@overload(sigmoid)
def _sigmoid_impl(x):
    dt = _dtype_of(x)
    if dt is None:
        return None
    one = dt[0](1.0)
    return lambda x: one / (one + exp(-x))
