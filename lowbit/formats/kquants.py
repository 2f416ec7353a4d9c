"""Quantizers for ggml's K-quant block types (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), in plain PyTorch.

``lowbit.formats.ggml`` reads these types (``ggml.dequantize``, bit-identical with
``gguf.quants.dequantize``) but the ``gguf`` package cannot write them; ``quantize``
here writes the raw bytes exactly as ggml lays them out, so ggml, llama.cpp,
``gguf.quants.dequantize`` and ``ggml.dequantize`` all read them back.

Layout
------
A row is cut into super-blocks of 256 values.  A super-block holds ``n_sub``
sub-blocks of ``sub`` values; each sub-block has a small integer scale ``sc`` (and,
for the types with a min, an integer ``m``), and the super-block has one float16
``d`` (and float16 ``dmin``) that turns those integers into floats::

    with a min:     x = d * sc * q - dmin * m      q in [0, 2^bits - 1], sc, m >= 0
    symmetric:      x = d * sc * q                 q in [-2^(bits-1), 2^(bits-1) - 1]

    type  bytes  sub-blocks     code q          sub-scale sc (and min m)      fields, in byte order
    Q2_K    84   16 x 16 values  2 bits, 0..3    4 bits each, 0..15            scales(16) qs(64) d dmin
    Q3_K   110   16 x 16 values  3 bits, -4..3   6 bits signed, -32..31        hmask(32) qs(64) scales(12) d
    Q4_K   144    8 x 32 values  4 bits, 0..15   6 bits each, 0..63            d dmin scales(12) qs(128)
    Q5_K   176    8 x 32 values  5 bits, 0..31   6 bits each, 0..63            d dmin scales(12) qh(32) qs(128)
    Q6_K   210   16 x 16 values  6 bits, -32..31 int8, -128..127               ql(128) qh(64) scales(16) d

Packing: Q4_K/Q5_K keep their eight 6-bit scales and eight 6-bit mins in 12 bytes
(bytes 0-3: scales 0-3 in the low 6 bits, bytes 4-7: mins 0-3 likewise, bytes 8-11:
the low nibbles of scale j+4 and min j+4; the top two bits of scale/min j+4 sit in
bits 6-7 of byte j / j+4).  Nibble-packed codes pair sub-block 2i (low nibble) with
sub-block 2i+1 (high nibble), 32 bytes per pair; Q5_K's ``qh`` byte l has in bit b
the fifth bit of value l of sub-block b.  Q2_K/Q3_K pack 2-bit codes four to a byte
(128 values per 32 bytes: value l + 32k in bits 2k); Q3_K's ``hmask`` byte l holds in
bit b the third bit of value 32b + l, its 6-bit scales (stored + 32) are split into low
nibbles (bytes 0-7, scale j and j+8) and high 2-bit pairs (bytes 8-11, scale j in byte
8 + j % 4 at bit 2 * (j // 4)).  Q6_K stores codes + 32 as low nibbles ``ql`` (value
l + 64 shares byte l with value l; 128 values per 64 bytes) and high 2-bit pairs
``qh`` (value l + 32k in bits 2k of byte l, 32 bytes per 128 values), and its scales
as plain int8.  ``ggml.dequantize`` is the executable statement of all of this.

Search
------
All arithmetic is float32, vectorized over every sub-block of the tensor (the
tensor is walked in chunks of super-blocks only so the temporaries stay in cache).
The error minimized is ``sum w * (x - xhat)^2`` with ``w`` the per-column
``importance`` (llama.cpp's imatrix idea: with ``w`` the mean squared input activation,
that sum is the expected squared output error for uncorrelated inputs), or ``w = 1``
without it.  llama.cpp's own default weights grow with ``|x|``; on the bundled model's
210 linear weights (``benchmarks/kquant_error.py``) each gave this search a higher plain
relative RMS error than ``w = 1``, as it must, ``w = 1`` being the plain squared error::

    weights                        Q4_K     Q5_K     Q6_K
    1 (the default)                0.07322  0.03630  0.01812
    rms(sub-block) + |x|           0.07380  0.03649  0.01821   llama.cpp's Q4_K/Q5_K
    sqrt(2 mean(x^2) + x^2)        0.07351  0.03638  0.01818   its imatrix path, w = 1
    x^2                            0.07741  0.03792  0.01861   its Q6_K

1. Sub-block fit.  With a min: the grid starts at ``lo = min(x, 0)`` and spans
   ``max(x) - lo``; for a few candidate level counts ``nmax + r`` (r = 0, +-0.4,
   +-0.8, then the best of those +-0.1 and +-0.2) the codes are rounded on that grid
   and the scale and min refitted to those codes by weighted least squares (the min
   clamped to <= 0, as ggml stores ``-dmin * m`` with ``m >= 0``); the candidate with
   the least weighted error wins (a sub-block whose codes all coincide keeps the plain
   min/max grid).  Symmetric: the same with the grid ``x / max`` times ``-(nmax + r)``,
   nmax = 2^(bits-1) (the value of largest magnitude takes the longer, negative end of
   the code range) and a least-squares scale.  Every candidate's error comes in closed
   form from ``sum w q``, ``sum w q^2``, ``sum w x q`` (no extra pass over the values).
2. Super-block scales.  ``d = max(scale) / sc_max`` (``dmin`` likewise from the mins),
   rounded *up* to float16 so the largest sub-scale still fits; ``sc = round(scale / d)``.
   Symmetric types map the sub-scale of largest magnitude to the negative end (-128
   or -32).
3. Neighbours.  The rounded sub-scale (and sub-min) is the grid point nearest the
   continuous optimum, not always the best once the codes move with it: each sub-block
   also tries ``m +- 1`` and ``sc +- 1`` (symmetric types: ``sc +- 1``), re-rounding its
   codes for each, and keeps whichever gives the least weighted error.
4. Codes.  Finally every value gets the nearest code under its sub-block's *quantized*
   scale and min: ``q = clamp(round((x + dmin * m) / (d * sc)))``.

So each value is within half a code step ``d * sc / 2`` of its reconstruction unless
it lies outside its sub-block's grid, where it goes to the nearest end
(``tests/test_kquants.py`` checks exactly this).  A block of zeros gives zeros, and so
does a block below float16's resolution (``|x| < ~1e-8``: its sub-scales round to 0);
values beyond what a float16 ``d`` can reach (``KQuant.limit``: 6.2e7 for Q4_K) are
clipped to it, so the bytes are always finite.

Example::

    >>> import torch
    >>> from lowbit.formats import ggml, kquants
    >>> x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    >>> raw = kquants.quantize(x, "Q4_K")
    >>> raw.shape, raw.dtype
    (torch.Size([4, 288]), torch.uint8)
    >>> err = (ggml.dequantize(raw, "Q4_K", x.shape) - x).norm() / x.norm()
    >>> bool(err < 0.09)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _validate
from .ggml import QK_K, _inverse, _u8, block_type

# Candidate level counts ``nmax + r`` of the sub-block search (step 1 of the module
# docstring), then the offsets tried around the best of those.
SEARCH_STEPS = (-0.8, -0.4, 0.4, 0.8)
REFINE_STEPS = (-0.2, 0.2, -0.1, 0.1)
# Sub-blocks per chunk of the walk over the tensor (2 MiB per float32 buffer for Q4_K):
# the fastest of 4096, 16384 and 32768 on 2 cores (by about 1.25x) - large enough to
# amortize each torch call over the per-sub-block arithmetic, small enough to stay in cache.
CHUNK = 16384


@dataclass(frozen=True)
class KQuant:
    """One K-quant type's rules: ``sub`` values per sub-block, codes q in [qmin, qmax]
    (stored as q - qmin), integer sub-scales in [smin, smax] (and sub-mins in [0, smax]
    when ``has_min``), and the (sub-scale, sub-min) offsets tried around the rounded
    ones (step 3 of the module docstring)."""

    name: str
    sub: int
    qmin: int
    qmax: int
    smin: int
    smax: int
    has_min: bool
    neighbors: tuple[tuple[int, int], ...]

    @property
    def n_sub(self) -> int:
        return QK_K // self.sub

    @property
    def limit(self) -> float:
        """The largest magnitude the type can store: 65504 (float16's largest) * sub-scale * code."""
        return 65504.0 * max(-self.smin, self.smax) * max(-self.qmin, self.qmax)


_AFFINE_NEIGHBORS = ((0, 1), (0, -1), (1, 0), (-1, 0))
_SYMMETRIC_NEIGHBORS = ((1, 0), (-1, 0))

TYPES: dict[str, KQuant] = {t.name: t for t in (
    KQuant("Q2_K", 16, 0, 3, 0, 15, True, _AFFINE_NEIGHBORS),
    KQuant("Q3_K", 16, -4, 3, -32, 31, False, _SYMMETRIC_NEIGHBORS),
    KQuant("Q4_K", 32, 0, 15, 0, 63, True, _AFFINE_NEIGHBORS),
    KQuant("Q5_K", 32, 0, 31, 0, 63, True, _AFFINE_NEIGHBORS),
    KQuant("Q6_K", 16, -32, 31, -128, 127, False, _SYMMETRIC_NEIGHBORS),
)}


def quantize(x: torch.Tensor, name: str, *, importance: torch.Tensor | None = None) -> torch.Tensor:
    """The raw ggml bytes (uint8 [..., K // 256 * type_size]) of float ``x`` [..., K]
    stored as the K-quant type ``name`` (one of ``TYPES``: Q2_K, Q3_K, Q4_K, Q5_K,
    Q6_K); ``ggml.dequantize(raw, name, x.shape)`` reads them back.

    ``K`` must be a multiple of 256 and ``x`` finite.  ``importance`` (float [K], >= 0,
    e.g. the mean squared input activation of each column) weights each column's
    squared error in the search; None weights all values alike, which minimizes the
    plain squared error.  The search is described in the module docstring.

    Example::

        >>> import torch
        >>> from lowbit.formats import ggml
        >>> x = torch.linspace(-1, 1, 256)
        >>> raw = quantize(x, "Q6_K")
        >>> err = (ggml.dequantize(raw, "Q6_K", x.shape) - x).abs().max()
        >>> raw.shape, bool(err <= 1 / 64)   # half of the code step 1/32 of a sub-block reaching 1
        (torch.Size([210]), True)
    """
    t = _check(x, name, importance)
    rows = x.detach().to(torch.float32).reshape(-1, x.shape[-1])
    k = rows.shape[1]
    blocks = rows.reshape(-1, t.n_sub, t.sub)
    w = None
    if importance is not None:  # scaled to at most 1 (the search is scale-free) so no sum overflows
        w = importance.detach().to(torch.float32).reshape(k // QK_K, t.n_sub, t.sub)
        w = w * _inverse(w.amax()) if w.numel() else w
    out = torch.empty(blocks.shape[0], block_type(t.name).type_size, dtype=torch.uint8, device=x.device)
    per_row = k // QK_K
    chunk = max(1, CHUNK // t.n_sub)  # super-blocks
    scratch = torch.empty(5, min(chunk, blocks.shape[0]), t.n_sub, t.sub, device=x.device)
    for start in range(0, blocks.shape[0], chunk):
        n = min(chunk, blocks.shape[0] - start)
        # Nothing beyond the type's largest magnitude (float16 d at 65504) can be stored;
        # clipping first also keeps every square and sum of the search finite in float32.
        xb = torch.clamp(blocks[start:start + n], -t.limit, t.limit, out=scratch[4, :n])
        wb = None if w is None else w[torch.arange(start, start + n, device=x.device) % per_row]
        out[start:start + n] = _PACKERS[t.name](*_quantize_blocks(xb, wb, t, tuple(scratch[:4, :n])))
    return out.reshape(*x.shape[:-1], per_row * block_type(t.name).type_size)


def from_parts(name: str, scale: torch.Tensor, low: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The raw blocks [n, type_size] of K-quant ``name`` whose values are exactly
    ``scale * q - low``: the inverse of reading a block into its sub-block parts
    (``ggml.as_qtensor``), so a K-quant loaded into lowbit is written back as it was.

    ``scale`` and ``low`` (None for Q3_K / Q6_K) are float32 [n, n_sub], ``q`` the codes
    [n, n_sub, sub] in ggml's formula (signed for Q3_K / Q6_K).  None when they are not a
    K-quant's: a code out of the type's range, or a super-block whose scales (or mins)
    are not one float16 ``d`` times integer sub-scales in range, as ggml's products
    ``d * sc`` (float32) must reproduce them bit for bit.  Where several ``d`` work, the
    one the quantizers pick is tried first (the sub-scale of largest magnitude at the
    end of its range), so their bytes come back unchanged.

    Example::

        >>> import torch, lowbit
        >>> from lowbit.formats import ggml
        >>> raw = quantize(torch.randn(2, 256), "Q4_K")
        >>> qt = ggml.as_qtensor(raw, "Q4_K", [2, 256])
        >>> q = lowbit.ops.unpack_bits(qt.codes, 4, signed=False).reshape(2, 8, 32)
        >>> torch.equal(from_parts("Q4_K", qt.scale.reshape(2, 8), -qt.zero_point.reshape(2, 8), q), raw)
        True
    """
    t = TYPES[str(name).upper()]
    n = q.shape[0]
    if (low is None) == t.has_min or q.shape[1:] != (t.n_sub, t.sub):
        raise ValueError(f"{t.name} takes {'a min' if t.has_min else 'no min'} and codes [n, {t.n_sub}, {t.sub}], "
                         f"got {'no' if low is None else 'a'} min and codes {list(q.shape)}")
    q = q.to(torch.int32)
    if bool(((q < t.qmin) | (q > t.qmax)).any()):
        return None
    d, sc = _integer_grid(scale.to(torch.float32).reshape(n, t.n_sub), t.smin, t.smax)
    dmin, m = (torch.zeros(n), torch.zeros(n, t.n_sub)) if low is None else \
        _integer_grid(low.to(torch.float32).reshape(n, t.n_sub), 0, t.smax)
    if d is None or dmin is None:
        return None
    return _PACKERS[t.name](d, dmin, sc.to(torch.int32), m.to(torch.int32), q - t.qmin)


def _integer_grid(v: torch.Tensor, smin: int, smax: int):
    """(d [n] float16-exact, k [n, j] integers in [smin, smax]) with ``d * k`` equal to
    ``v`` bit for bit in float32 for every row, or (None, None) when some row has none."""
    top = torch.gather(v, -1, v.abs().argmax(-1, keepdim=True))[:, 0]
    d, k = top * 0.0, torch.zeros_like(v)  # an all-zero row: d = 0 (with its zeros' sign), k = 0
    left = (top != 0).nonzero()[:, 0]
    # the quantizers' choice first: the largest magnitude at the longer end of the range;
    # nearly every row is settled by the first candidate, so only the rest go on
    ends = [(-smin, -1.0), (smax, 1.0)] if smin < 0 else [(smax, 1.0)]
    for c in range(max(-smin, smax), 0, -1):
        for end, sign in ends:
            if c > end or not left.numel():
                continue
            t, x = top[left], v[left]
            cand = (t.abs() / c).to(torch.float16).to(torch.float32) * torch.where(t < 0, -sign, sign)
            kk = torch.round(x / cand[:, None]) + 0.0  # + 0.0: an integer has no -0
            y = kk * cand[:, None]  # ggml's d * sc, compared bit for bit (a zero's sign too)
            ok = (cand != 0) & ((y == x) & (y.signbit() == x.signbit()) & (kk >= smin) & (kk <= smax)).all(-1)
            d[left[ok]], k[left[ok]] = cand[ok], kk[ok]
            left = left[~ok]
    return (d, k) if not left.numel() else (None, None)


def _check(x, name, importance) -> KQuant:
    t = TYPES.get(str(name).upper())
    if t is None:
        raise ValueError(f"name must be a K-quant type, one of {list(TYPES)}, got {name!r}")
    _validate.tensor("x", x, dtypes=_validate.FLOAT_DTYPES, min_ndim=1)
    if x.shape[-1] % QK_K:
        raise ValueError(f"x's last dim (K) must be a multiple of {QK_K} for {t.name}, got shape {tuple(x.shape)}")
    _validate.finite("x", x)
    if importance is not None:
        _validate.tensor("importance", importance, dtypes=_validate.FLOAT_DTYPES)
        _validate.same_device("x", x, importance=importance)
        _validate.shape("importance", importance, (x.shape[-1],), "one weight per column of x")
        _validate.finite("importance", importance)
        if _validate.has_values(importance) and bool((importance < 0).any()):
            raise ValueError(f"importance must be >= 0 (a weight per column), got min {importance.min().item()}")
    return t


# -- the search (module docstring, steps 1-4) ---------------------------------------------
# Candidates are evaluated one after another for the passes over the values, each writing
# its per-sub-block sums into row c of a [c, n, n_sub] tensor; the per-sub-block
# arithmetic and the choice then run once over all of them.  Every pass over the values
# writes into the four [n, n_sub, sub] buffers ``buf`` that the caller allocates once:
# a fresh allocation of that size page-faults and costs more than the arithmetic.
def _quantize_blocks(x: torch.Tensor, w: torch.Tensor | None, t: KQuant, buf):
    """x, w [n, n_sub, sub] -> (d [n], dmin [n], sc [n, n_sub], m [n, n_sub], q [n, n_sub, sub]):
    the float16-exact super-block scales, the integer sub-scales and sub-mins and the stored
    (unsigned) codes, all float32.  q is one of the buffers ``buf``."""
    wx = None if w is None else torch.mul(w, x, out=buf[3])
    sums = _sums(x, w, wx, buf[0])
    if t.has_min:
        scale, mn = _fit_affine(x, w, wx, t.qmax, sums, buf[:3])
        d, sc = _unsigned_grid(scale, t.smax)
        dmin, m = _unsigned_grid(mn, t.smax)
    else:
        scale = _fit_symmetric(x, w, wx, t.qmin, t.qmax, sums, buf[:3])
        d, sc = _signed_grid(scale, t.smin, t.smax)
        dmin, m = torch.zeros_like(d), torch.zeros_like(sc)
    # step 3: the rounded (sc, m) and its neighbours, codes re-rounded for each
    offsets = torch.tensor(((0, 0),) + t.neighbors, dtype=x.dtype, device=x.device)[:, :, None, None]
    sc_c = (sc + offsets[:, 0]).clamp_(t.smin, t.smax)  # [c, n, n_sub]
    m_c = (m + offsets[:, 1]).clamp_(0, t.smax)
    sq, mq = d * sc_c, dmin * m_c
    err = torch.stack([_code_error(_round_codes(x, sq[c], mq[c], t, buf), w, sq[c]) for c in range(len(offsets))])
    sw, swx, swxx = sums  # a zero scale reconstructs -mq everywhere
    err = torch.where(sq == 0, swxx + 2 * mq * swx + mq * mq * sw, err)
    pick = _argmin0(err)
    sc, m = sc_c.gather(0, pick)[0], m_c.gather(0, pick)[0]
    _, q = _round_codes(x, d * sc, dmin * m, t, buf)  # step 4
    return d[..., 0], dmin[..., 0], sc, m, q.sub_(t.qmin)


def _argmin0(err: torch.Tensor) -> torch.Tensor:
    """Index [1, ...] of the least value along dim 0 (``torch.min``: argmin over dim 0 is 10x slower)."""
    return err.min(0, keepdim=True).indices


def _rowsum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as a matrix-vector product (on the CPU 1.4x faster than
    ``t.sum(-1)`` over 32 values, 1.8x over 16)."""
    return t @ torch.ones(t.shape[-1], dtype=t.dtype, device=t.device)


def _sums(x, w, wx, tmp):
    """Per sub-block: sum w, sum w x, sum w x^2 (w None: all weights 1)."""
    if w is None:
        sw = torch.full(x.shape[:-1], float(x.shape[-1]), device=x.device)
        return sw, _rowsum(x), _rowsum(torch.mul(x, x, out=tmp))
    return _rowsum(w), _rowsum(wx), _rowsum(torch.mul(wx, x, out=tmp))


def _round_codes(x, sq, mq, t: KQuant, buf):
    """The nearest codes q in [qmin, qmax] for x ~ sq * q - mq (sq, mq [n, n_sub]): returns
    (y, q) = ((x + mq) / sq, clamp(round(y))) in buf[0] and buf[1]."""
    y, q = buf[0], buf[1]
    torch.add(x, mq[..., None], out=y).mul_(_inverse(sq)[..., None])
    torch.round(y, out=q).clamp_(t.qmin, t.qmax)
    return y, q


def _code_error(yq, w, sq):
    """sum w (sq q - mq - x)^2 = sq^2 sum w (q - y)^2 per sub-block (where sq != 0); overwrites y."""
    y, q = yq
    r = y.sub_(q).square_()
    return sq * sq * _rowsum(r if w is None else r.mul_(w))


def _search(evaluate, nmax: int, like: torch.Tensor):
    """Step 1's driver: ``evaluate(levels)`` maps level counts (a list of floats or [n, n_sub]
    tensors) to (error, *fit), each [len(levels), n, n_sub], the error inf where a candidate
    has no fit; try nmax + r for r = 0 and ``SEARCH_STEPS``, then the best r plus each of
    ``REFINE_STEPS``; return (error, *fit) of the least error, each [n, n_sub]."""
    steps = (0.0, *SEARCH_STEPS)
    first = evaluate([nmax + r for r in steps])
    pick = _argmin0(first[0])
    best_r = torch.tensor(steps, device=like.device)[pick[0]]
    more = evaluate([nmax + best_r + dr for dr in REFINE_STEPS])
    both = [torch.cat([a.gather(0, pick), b]) for a, b in zip(first, more)]
    pick = _argmin0(both[0])
    return [v.gather(0, pick)[0] for v in both]


def _fit_affine(x, w, wx, nmax: int, sums, buf):
    """Weighted least-squares scale >= 0 and min >= 0 of each sub-block, x ~ scale * q - min,
    q in [0, nmax] (step 1).  Returns two [n, n_sub] tensors."""
    sw, swx, swxx = sums
    xn, q, tmp = buf
    lo = x.amin(-1).clamp(max=0)
    span = x.amax(-1) - lo
    torch.sub(x, lo[..., None], out=xn).mul_(_inverse(span)[..., None])  # in [0, 1]

    def code_sums(levels):
        if isinstance(levels, float):
            torch.mul(xn, levels, out=q).round_()
            if levels >= nmax + 0.5:  # else no code passes nmax
                q.clamp_(max=nmax)
        else:
            torch.mul(xn, levels[..., None], out=q).round_().clamp_(max=nmax)
        if w is None:
            return _rowsum(q), _rowsum(torch.mul(q, q, out=tmp)), _rowsum(torch.mul(q, x, out=tmp))
        wq = torch.mul(q, w, out=tmp)
        return _rowsum(wq), _rowsum(wq.mul_(q)), _rowsum(torch.mul(q, wx, out=tmp))

    def evaluate(levels):
        sl, sl2, sxl = (torch.stack(v) for v in zip(*map(code_sums, levels)))
        det = sw * sl2 - sl * sl
        s = (sw * sxl - swx * sl) / det
        m = (sl2 * swx - sl * sxl) / det
        refit = m > 0  # ggml's min is -dmin * m with m >= 0: there, refit the scale alone
        m = m.clamp_(max=0)
        s = torch.where(refit, sxl / sl2, s)
        err = swxx - s * sxl - m * swx  # sum w (s q + m - x)^2 at the least-squares (s, m)
        # All codes alike: no fit (det = sum over pairs w_i w_j (q_i - q_j)^2; below 1e-5 of
        # sw * sl2 it is float32 rounding of the sums, not a fit)
        return err.masked_fill_(det <= 1e-5 * sw * sl2, float("inf")), s, m

    err, scale, m = _search(evaluate, nmax, lo)
    plain = err == float("inf")  # no candidate had a fit: the min/max grid
    return torch.where(plain, span / nmax, scale), -torch.where(plain, lo, m)


def _fit_symmetric(x, w, wx, qmin: int, qmax: int, sums, buf):
    """Weighted least-squares scale (signed) of each sub-block, x ~ scale * q, q in
    [qmin, qmax], the value of largest magnitude near qmin (step 1).  Returns [n, n_sub]."""
    swxx = sums[2]
    xn, q, tmp = buf
    hi, lo = x.amax(-1), x.amin(-1)
    top = torch.where(hi >= -lo, hi, lo)  # the value of largest magnitude
    torch.mul(x, _inverse(-top)[..., None], out=xn)  # in [-1, 1], the largest magnitude at -1
    wx = x if w is None else wx

    def code_sums(levels):
        torch.mul(xn, levels if isinstance(levels, float) else levels[..., None], out=q)
        q.round_().clamp_(qmin, qmax)
        qq = torch.mul(q, q, out=tmp)
        sl2 = _rowsum(qq if w is None else qq.mul_(w))
        return sl2, _rowsum(torch.mul(wx, q, out=tmp))

    def evaluate(levels):
        sl2, sxl = (torch.stack(v) for v in zip(*map(code_sums, levels)))
        s = sxl / sl2
        err = swxx - sxl * s  # sum w (s q - x)^2 at the least-squares s
        return err.masked_fill_(sl2 <= 0, float("inf")), s  # no nonzero code: no fit

    err, scale = _search(evaluate, -qmin, top)
    return torch.where(err == float("inf"), top / qmin, scale)  # no fit anywhere: the max grid


def _float16_up(v: torch.Tensor) -> torch.Tensor:
    """The smallest float16 >= v (v >= 0), at most 65504, as float32."""
    h = v.clamp(max=65504).to(torch.float16)
    h = torch.where(h.to(torch.float32) < v, torch.nextafter(h, torch.full_like(h, 65504)), h)
    return h.to(torch.float32)


def _unsigned_grid(v: torch.Tensor, smax: int):
    """Non-negative sub-scales v [n, n_sub] as d [n, 1] (float16-exact) times integers in [0, smax]."""
    d = _float16_up(v.amax(-1, keepdim=True) / smax)
    return d, torch.round(v * _inverse(d)).clamp_(0, smax)


def _signed_grid(v: torch.Tensor, smin: int, smax: int):
    """Signed sub-scales v [n, n_sub] as d [n, 1] (float16-exact) times integers in [smin, smax],
    the largest magnitude at smin (the longer end)."""
    top = torch.gather(v, -1, v.abs().argmax(-1, keepdim=True))
    d = _float16_up(top.abs() / -smin) * torch.where(top < 0, 1.0, -1.0) + 0.0  # + 0.0: no -0.0
    return d, torch.round(v * _inverse(d)).clamp_(smin, smax)


# -- byte layouts (module docstring, "Layout") ------------------------------------------------
def _bits_at(v: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    """OR over ``dim`` of v << (width * index) (uint8): pack small fields into one byte."""
    out = v.select(dim, 0).clone()
    for i in range(1, v.shape[dim]):
        out |= v.select(dim, i) << (width * i)
    return out


def _pack_scale_min_k4(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and eight 6-bit mins [n, 8] (uint8) -> the 12 bytes ``ggml._k_scale_min`` reads."""
    return torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                      (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], dim=1)


def _pack_2bit(q: torch.Tensor) -> torch.Tensor:
    """Codes [n, 256] -> [n, 64] bytes: value 128h + 32k + l in bits 2k of byte 32h + l (low 2 bits)."""
    return _bits_at((q & 3).reshape(-1, 2, 4, 32), 2, 2).reshape(-1, 64)


def _pack_q2_k(d, dmin, sc, m, q):
    n = q.shape[0]
    q = q.to(torch.uint8)
    return torch.cat([sc.to(torch.uint8) | (m.to(torch.uint8) << 4), _pack_2bit(q.reshape(n, 256)),
                      _u8(d), _u8(dmin)], dim=1)


def _pack_q3_k(d, dmin, sc, m, q):
    n = q.shape[0]
    q = q.to(torch.uint8).reshape(n, 256)
    hmask = _bits_at((q >> 2).reshape(n, 8, 32), 1, 1)
    s = (sc + 32).to(torch.uint8)
    scales = torch.cat([(s[:, :8] & 0x0F) | ((s[:, 8:] & 0x0F) << 4), _bits_at((s >> 4).reshape(n, 4, 4), 1, 2)], dim=1)
    return torch.cat([hmask, _pack_2bit(q), scales, _u8(d)], dim=1)


def _pack_q4_k(d, dmin, sc, m, q):
    n = q.shape[0]
    q = q.to(torch.uint8)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)
    return torch.cat([_u8(d), _u8(dmin), _pack_scale_min_k4(sc.to(torch.uint8), m.to(torch.uint8)), qs], dim=1)


def _pack_q5_k(d, dmin, sc, m, q):
    n = q.shape[0]
    q = q.to(torch.uint8)
    qh = _bits_at(q >> 4, 1, 1)
    lo = q & 0x0F
    qs = (lo[:, 0::2] | (lo[:, 1::2] << 4)).reshape(n, 128)
    return torch.cat([_u8(d), _u8(dmin), _pack_scale_min_k4(sc.to(torch.uint8), m.to(torch.uint8)), qh, qs], dim=1)


def _pack_q6_k(d, dmin, sc, m, q):
    n = q.shape[0]
    v = q.to(torch.uint8).reshape(n, 2, 4, 32)  # value 128h + 32k + l
    ql = ((v[:, :, 0:2] & 0x0F) | ((v[:, :, 2:4] & 0x0F) << 4)).reshape(n, 128)
    qh = _bits_at(v >> 4, 2, 2).reshape(n, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), _u8(d)], dim=1)


_PACKERS = {"Q2_K": _pack_q2_k, "Q3_K": _pack_q3_k, "Q4_K": _pack_q4_k, "Q5_K": _pack_q5_k, "Q6_K": _pack_q6_k}
