"""Tests of the 2:4 masks (`prune_24`, `is_24`) and formats (`compress`,
`decompress`, `Sparse24`, `Mask24`) against independent numpy references.

The references here are written from the documented contract (the docstrings
of `jsparse24/_prune.py` and `jsparse24/_format.py`), not from the library's
code: a per-group sort for the plain rule, a brute force over the 90
transposable 4x4 patterns (enumerated here from scratch), and a hand-written
metadata packer.

Most calls go through module-level `jax.jit` wrappers with few distinct
shapes: op-by-op (eager) dispatch compiles every primitive for every new shape,
which would dominate the runtime. A few tests call the functions eagerly too.
"""

import functools
import itertools
import zlib

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jsparse24

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = [BF16, F16, F32]
DTYPE_IDS = ["bf16", "f16", "f32"]
UINT_OF = {1: np.uint8, 2: np.uint16, 4: np.uint32}

NAN = float("nan")
INF = float("inf")

HYP = hypothesis.settings(
    max_examples=60, deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow,
                           hypothesis.HealthCheck.data_too_large])
HYP_T = hypothesis.settings(HYP, max_examples=40)


def _seed(*parts) -> int:
  """A per-test seed, different for every parametrization (and reproducible)."""
  return zlib.crc32(repr(parts).encode())


@functools.partial(jax.jit, static_argnames=("axis", "transposable"))
def _prune(w, axis=-2, transposable=False):
  return jsparse24.prune_24(w, axis=axis, transposable=transposable)


@functools.partial(jax.jit, static_argnames=("transposed",))
def _round_trip(w, mask, transposed=False):
  """compress + everything read back from it, in one compiled call."""
  sp = jsparse24.compress(w, mask, transposed=transposed)
  out = dict(sp=sp, dense=jsparse24.decompress(sp), mask=sp.mask())
  if transposed:
    spt = sp.transpose()
    out.update(dense_t=jsparse24.decompress(spt), mask_t=spt.mask(),
               dense_tt=jsparse24.decompress(spt.transpose()))
  return out


_pack = jax.jit(jsparse24.Mask24.pack, static_argnames=("transposable",))
_unpack = jax.jit(lambda mk: mk.unpack())
_is_24 = jax.jit(jsparse24.is_24, static_argnames=("axis",))


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view(UINT_OF[a.dtype.itemsize])


def _assert_bitwise_equal(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype, (got.dtype, want.dtype)
  assert got.shape == want.shape, (got.shape, want.shape)
  bad = np.argwhere(_bits(got) != _bits(want))
  assert bad.size == 0, (
      f"{bad.shape[0]} element(s) differ bitwise, first at {tuple(bad[0])}:"
      f" got {got[tuple(bad[0])]!r}, want {want[tuple(bad[0])]!r}")


def _masked(w, m):
  """w * m with pruned entries +0.0 (also for NaN/inf/negative pruned ones)."""
  w = np.asarray(w)
  return np.where(m, w, np.zeros((), w.dtype))


# ---------------------------------------------------------------------------
# Independent references.
# ---------------------------------------------------------------------------


def ref_plain_mask(w, axis: int) -> np.ndarray:
  """Brute-force plain 2:4 mask: in every group, sort the 4 indices by
  (NaN first, then larger float64 |w| first, then lower index) and keep the
  first two. abs() maps -0.0 to 0.0 and -inf to inf, so those tie."""
  w64 = np.moveaxis(np.asarray(w).astype(np.float64), axis, -1)
  groups = w64.reshape(-1, 4)
  is_nan = np.isnan(groups)
  mag = np.where(is_nan, 0.0, np.abs(groups))
  index = np.broadcast_to(np.arange(4), groups.shape)
  order = np.lexsort((index, -mag, ~is_nan), axis=-1)
  keep = np.zeros(groups.shape, bool)
  np.put_along_axis(keep, order[:, :2], True, axis=-1)
  return np.moveaxis(keep.reshape(w64.shape), -1, axis)


def _all_transposable_patterns() -> np.ndarray:
  """All 4x4 0/1 matrices with every row and column sum 2, sorted in the
  documented order: lexicographic in the rows' kept index pairs."""
  every = (np.arange(1 << 16)[:, None] >> np.arange(16)) & 1
  every = every.astype(bool).reshape(-1, 4, 4)
  ok = (every.sum(1) == 2).all(1) & (every.sum(2) == 2).all(1)
  pats = list(every[ok])
  pats.sort(key=lambda m: tuple(tuple(np.flatnonzero(r)) for r in m))
  return np.stack(pats)


PATTERNS = _all_transposable_patterns()  # [90, 4, 4] bool
# Kept column indices of each row of each pattern: [90, 4, 2].
PATTERN_COLS = np.array([[np.flatnonzero(r) for r in p] for p in PATTERNS])
# The same as row-pair indices [90, 4] (pairs in lexicographic order).
_PAIRS = list(itertools.combinations(range(4), 2))
PATTERN_ROW_PAIRS = np.array([[_PAIRS.index(tuple(c)) for c in p] for p in PATTERN_COLS])


def _blocks(a) -> np.ndarray:
  """[..., R, C] -> [B, 4, 4], the 4x4 blocks of the last two axes."""
  a = np.asarray(a)
  *lead, r, c = a.shape
  b = a.reshape(*lead, r // 4, 4, c // 4, 4)
  return np.moveaxis(b, -3, -2).reshape(-1, 4, 4)


def _block_scores(blocks: np.ndarray):
  """blocks [B, 4, 4] -> per pattern [B, 90]: (number of kept non-finite,
  float64 sum of kept finite |v|, IEEE float32 sums: each row's pair added,
  then the rows added from the last up, row0 + (row1 + (row2 + row3)); as
  [B, 90, 3]: the sums of rows 0-3, 1-3 and 2-3), and the kept non-finite
  counts of rows 0-3, 1-3, 2-3 ([B, 90, 3])."""
  b = blocks.astype(np.float64)
  finite = np.isfinite(b)
  mag = np.where(finite, np.abs(b), 0.0)
  count = np.einsum("prc,brc->bp", PATTERNS.astype(np.int64), (~finite).astype(np.int64))
  s64 = np.einsum("prc,brc->bp", PATTERNS.astype(np.float64), mag)
  mag32 = mag.astype(np.float32)
  rows = np.arange(4)
  first = mag32[:, rows[None, :], PATTERN_COLS[:, :, 0]]  # [B, 90, 4]
  second = mag32[:, rows[None, :], PATTERN_COLS[:, :, 1]]
  row_sums = first + second
  s23 = row_sums[..., 2] + row_sums[..., 3]
  s13 = row_sums[..., 1] + s23
  s32 = np.stack([row_sums[..., 0] + s13, s13, s23], axis=-1)
  assert s32.dtype == np.float32
  bad = ((~finite)[:, rows[None, :], PATTERN_COLS[:, :, 0]].astype(np.int64)
         + (~finite)[:, rows[None, :], PATTERN_COLS[:, :, 1]])  # [B, 90, 4]
  counts = np.stack([bad.sum(-1), bad[..., 1:].sum(-1), bad[..., 2:].sum(-1)], axis=-1)
  return count, s64, s32, counts


def _rule_f32(s32: np.ndarray, counts: np.ndarray) -> int:
  """The pattern the documented rule picks from one block's float32 sums
  `[90, 3]` and non-finite counts `[90, 3]` (of rows 0-3, 1-3, 2-3): the
  first row 0 pair among the best patterns by (count, sum) of rows 0-3;
  among its patterns, the first row 1 pair of the best by rows 1-3; among
  those, the first rows 2-3 of the best by rows 2-3."""
  alive = np.ones(len(PATTERN_ROW_PAIRS), bool)
  for level, fixed in enumerate((1, 2, 4)):  # rows [:fixed] decided at this level
    cnt = np.where(alive, counts[:, level], -1)
    best = cnt == cnt.max()
    score = np.where(best, s32[:, level].astype(np.float64), -1.0)
    first = int(np.flatnonzero(best & (score == score.max()))[0])
    alive &= (PATTERN_ROW_PAIRS[:, :fixed] == PATTERN_ROW_PAIRS[first, :fixed]).all(1)
  (chosen,) = np.flatnonzero(alive)
  return int(chosen)


def check_transposable(w, mask, *, exact: str | None):
  """Checks that `mask` is an optimal transposable mask of `w`.

  Every block must be one of the 90 patterns, keep the most non-finite
  elements possible, and have a float64 finite score within 1e-6 (relative)
  of the best one.
  exact="int": the inputs are small integers (float32 sums are exact): the
    chosen pattern must be the first one (documented order) achieving the max.
  exact="f32": the chosen pattern must be the one the documented rule picks
    from the float32 sums in the documented order (`_rule_f32`).
  """
  wb, mb = _blocks(w), _blocks(mask)
  hits = (mb[:, None] == PATTERNS[None]).all((2, 3))  # [B, 90]
  assert (hits.sum(1) == 1).all(), (
      f"block(s) not among the 90 transposable patterns:"
      f" {mb[hits.sum(1) != 1][:2].astype(int)}")
  chosen = hits.argmax(1)
  count, s64, s32, counts = _block_scores(wb)
  for b in range(len(wb)):
    p, info = chosen[b], (b, wb[b], mb[b].astype(int))
    cand = count[b] == count[b].max()
    assert count[b, p] == count[b].max(), info
    best64 = s64[b][cand].max()
    assert s64[b, p] >= best64 - 1e-6 * abs(best64), (*info, s64[b, p], best64)
    if exact == "int":
      first = int(np.flatnonzero(cand & (s64[b] == best64))[0])
      assert p == first, (*info, PATTERNS[first].astype(int))
    elif exact == "f32":
      first = _rule_f32(s32[b], counts[b])
      assert p == first, (*info, PATTERNS[first].astype(int))


def ref_meta(mask) -> np.ndarray:
  """Hand-written metadata packer: [..., K, N] mask -> uint8 [..., N, ceil(K/8)]."""
  mask = np.asarray(mask)
  *lead, k, n = mask.shape
  groups = k // 4
  nbytes = (groups + 1) // 2
  out = np.zeros((*lead, n, nbytes), np.uint8)
  for idx in np.ndindex(*lead, n):
    column = mask[idx[:-1] + (slice(None), idx[-1])]
    codes = []
    for g in range(groups):
      i0, i1 = np.flatnonzero(column[4 * g:4 * g + 4])
      codes.append(int(i0) | (int(i1) << 2))
    if groups % 2:
      codes.append(0x4)
    for b in range(nbytes):
      out[idx + (b,)] = codes[2 * b] | (codes[2 * b + 1] << 4)
  return out


def ref_values(w, mask) -> np.ndarray:
  """Kept values of each column in K order: [..., K, N] -> [..., N, K/2]."""
  w, mask = np.asarray(w), np.asarray(mask)
  *lead, k, n = w.shape
  out = np.zeros((*lead, n, k // 2), w.dtype)
  for idx in np.ndindex(*lead, n):
    sel = idx[:-1] + (slice(None), idx[-1])
    out[idx] = w[sel][mask[sel]]
  return out


def random_24_mask(rng, shape, axis=-2) -> np.ndarray:
  """A uniformly random valid 2:4 mask (not derived from any weights)."""
  ax = axis % len(shape)
  moved = [d for i, d in enumerate(shape) if i != ax] + [shape[ax]]
  pairs = np.array(list(itertools.combinations(range(4), 2)))
  choice = rng.integers(0, 6, size=(*moved[:-1], moved[-1] // 4))
  m = np.zeros((*moved[:-1], moved[-1] // 4, 4), bool)
  np.put_along_axis(m, pairs[choice], True, axis=-1)
  return np.moveaxis(m.reshape(moved), -1, ax)


def random_transposable_mask(rng, shape) -> np.ndarray:
  *lead, r, c = shape
  blocks = PATTERNS[rng.integers(0, 90, size=(*lead, r // 4, c // 4))]
  return np.moveaxis(blocks, -2, -3).reshape(shape)


def test_reference_sanity():
  """The test's own enumeration and references, on hand-checked values."""
  assert len({p.tobytes() for p in PATTERNS}) == 90
  np.testing.assert_array_equal(PATTERNS[0], [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]])
  np.testing.assert_array_equal(PATTERNS[1], [[1, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1], [0, 0, 1, 1]])
  np.testing.assert_array_equal(PATTERNS[-1], [[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]])
  np.testing.assert_array_equal(
      ref_plain_mask(np.array([1.0, -3.0, NAN, -INF, 0.0, -0.0, 0.0, 0.0]), 0),
      [0, 0, 1, 1, 1, 1, 0, 0])
  rng = np.random.default_rng(0)
  assert ref_plain_mask(rng.standard_normal((3, 8, 5)), 1).reshape(3, 2, 4, 5).sum(2).tolist() \
      == np.full((3, 2, 5), 2).tolist()
  m = random_transposable_mask(rng, (2, 8, 12))
  assert (m.reshape(2, 2, 4, 12).sum(2) == 2).all() and (m.reshape(2, 8, 3, 4).sum(3) == 2).all()


# ---------------------------------------------------------------------------
# Strategies.
# ---------------------------------------------------------------------------

SPECIALS = [0.0, -0.0, NAN, -NAN, INF, -INF]
TIE_ELEMENTS = st.one_of(st.sampled_from(SPECIALS), st.integers(-3, 3).map(float))
ANY_ELEMENTS = st.one_of(
    st.sampled_from(SPECIALS), st.integers(-3, 3).map(float),
    st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True))
BIG = float(np.float32(1e30))  # keeps float32 block sums finite
NAN_PAYLOADS = np.array([0x7FC00001, 0xFFC00000, 0x7F800001, 0xFFFFFFFF],
                        np.uint32).view(np.float32)

# A few fixed (shape, axis) cases keep the number of compilations small.
PLAIN_CASES = [((16,), 0), ((8, 3), 0), ((3, 8), -1), ((2, 4, 3), 1), ((5, 12), 1)]
T_SHAPES = [(4, 4), (8, 12), (2, 8, 4)]


@st.composite
def plain_case(draw, elements):
  shape, axis = draw(st.sampled_from(PLAIN_CASES))
  return draw(hnp.arrays(np.float32, shape, elements=elements)), axis


# ---------------------------------------------------------------------------
# Plain masks.
# ---------------------------------------------------------------------------


def _check_plain(w, axis, got=None):
  if got is None:
    got = _prune(w, axis=axis)
  got = np.asarray(got)
  assert got.dtype == np.bool_ and got.shape == w.shape
  counts = np.moveaxis(got, axis, -1).reshape(-1, 4).sum(-1)
  assert (counts == 2).all(), counts
  want = ref_plain_mask(w, axis)
  bad = np.argwhere(got != want)
  assert bad.size == 0, (bad[:4], w, got.astype(int), want.astype(int))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@HYP
@hypothesis.given(case=plain_case(TIE_ELEMENTS))
def test_plain_mask_ties_and_specials(case, dtype):
  w, axis = case
  _check_plain(w.astype(dtype), axis)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@HYP
@hypothesis.given(case=plain_case(ANY_ELEMENTS))
def test_plain_mask_any_floats(case, dtype):
  w, axis = case
  _check_plain(w.astype(dtype), axis)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,axis", [((12, 5), 0), ((4, 3, 8), 0), ((4, 3, 8), -1), ((3, 20, 7), -2)])
def test_plain_mask_random_normal(shape, axis, dtype):
  rng = np.random.default_rng(_seed("plain", shape, axis, str(dtype)))
  w = rng.standard_normal(shape).astype(dtype)
  _check_plain(w, axis)
  assert bool(_is_24(_prune(w, axis=axis), axis=axis))


def test_plain_mask_eager_equals_jit():
  rng = np.random.default_rng(_seed("eager"))
  w = rng.integers(-2, 3, size=(12, 5)).astype(BF16)
  w[rng.random(w.shape) < 0.2] = NAN
  w[rng.random(w.shape) < 0.2] = -INF
  _check_plain(w, 0, jsparse24.prune_24(w))
  np.testing.assert_array_equal(np.asarray(jsparse24.prune_24(w)), np.asarray(_prune(w)))


HAND_CASES = [
    ([0.0, 0.0, 0.0, 0.0], [1, 1, 0, 0]),
    ([-0.0, 0.0, -0.0, 0.0], [1, 1, 0, 0]),
    ([0.0, -0.0, 1.0, -0.0], [1, 0, 1, 0]),
    ([2.0, 2.0, 2.0, 2.0], [1, 1, 0, 0]),
    ([-2.0, 2.0, -2.0, 2.0], [1, 1, 0, 0]),
    ([1.0, -3.0, 3.0, 2.0], [0, 1, 1, 0]),
    ([1.0, 2.0, -3.0, 3.0], [0, 0, 1, 1]),
    ([1.0, NAN, 5.0, 0.0], [0, 1, 1, 0]),
    ([INF, NAN, 5.0, 0.0], [1, 1, 0, 0]),
    ([5.0, -INF, INF, NAN], [0, 1, 0, 1]),
    ([NAN, NAN, NAN, NAN], [1, 1, 0, 0]),
    ([1.0, NAN, -NAN, NAN], [0, 1, 1, 0]),
    ([-INF, 1.0, INF, -INF], [1, 0, 1, 0]),
    ([INF, INF, INF, INF], [1, 1, 0, 0]),
    ([0.0, 0.0, 0.0, -INF], [1, 0, 0, 1]),
    ([0.0, 0.0, NAN, 0.0], [1, 0, 1, 0]),
    ([-65504.0, 65504.0, INF, 1.0], [1, 0, 1, 0]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_plain_mask_hand_cases(dtype):
  groups = np.array([g for g, _ in HAND_CASES], np.float32).astype(dtype)  # [C, 4]
  want = np.array([k for _, k in HAND_CASES], bool)
  np.testing.assert_array_equal(np.asarray(_prune(groups, axis=-1)), want)
  # The same groups along K of a [K, N] kernel (the default axis).
  np.testing.assert_array_equal(np.asarray(_prune(groups.T)), want.T)


def test_plain_mask_nan_payloads_tie():
  """NaNs of every sign and payload rank equal (ties to the lower index)."""
  w = np.stack([NAN_PAYLOADS[list(p)] for p in itertools.permutations(range(4))])
  np.testing.assert_array_equal(np.asarray(_prune(w, axis=-1)),
                                np.tile([True, True, False, False], (24, 1)))
  w = np.array([[1.0, NAN_PAYLOADS[2], 2.0, NAN_PAYLOADS[1]]], np.float32)
  np.testing.assert_array_equal(np.asarray(_prune(w, axis=-1)), [[0, 1, 0, 1]])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_plain_mask_subnormals(dtype):
  """Subnormal magnitudes are ranked like any other (no flush to zero)."""
  tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal)
  w = (np.array([[1, -3, 2, 0], [0, 0, 0, -1]], np.float64) * tiny).astype(dtype)
  np.testing.assert_array_equal(np.asarray(_prune(w, axis=-1)), [[0, 1, 1, 0], [1, 0, 0, 1]])


def test_plain_mask_under_vmap():
  rng = np.random.default_rng(_seed("vmap"))
  w = rng.integers(-2, 3, size=(3, 16, 6)).astype(np.float32)
  want = ref_plain_mask(w, -2)
  np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(jsparse24.prune_24))(w)), want)
  f = jax.vmap(lambda a: jsparse24.prune_24(a, axis=1), in_axes=2, out_axes=2)
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(w)), want)


# ---------------------------------------------------------------------------
# Transposable masks.
# ---------------------------------------------------------------------------


def _prune_t(w, axis=-2):
  return np.asarray(_prune(w, axis=axis, transposable=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@HYP_T
@hypothesis.given(w=st.sampled_from(T_SHAPES).flatmap(
    lambda s: hnp.arrays(np.float32, s, elements=TIE_ELEMENTS)))
def test_transposable_ties_and_specials(w, dtype):
  w = w.astype(dtype)
  check_transposable(w, _prune_t(w), exact="int")


@HYP_T
@hypothesis.given(w=st.sampled_from(T_SHAPES).flatmap(lambda s: hnp.arrays(
    np.float32, s, elements=st.one_of(
        st.sampled_from([0.0, -0.0, NAN, INF, -INF, 1.0]),
        st.floats(-BIG, BIG, width=32, allow_subnormal=False)))))
def test_transposable_any_floats(w):
  check_transposable(w, _prune_t(w), exact=None)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(8, 12), (2, 8, 4)])
def test_transposable_random_normal(shape, dtype):
  rng = np.random.default_rng(_seed("tnormal", shape, str(dtype)))
  w = rng.standard_normal(shape).astype(dtype)
  check_transposable(w, _prune_t(w), exact="f32")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_transposable_small_integers(dtype):
  rng = np.random.default_rng(_seed("tint", str(dtype)))
  w = rng.integers(-4, 5, size=(2, 3, 4, 8)).astype(dtype)
  check_transposable(w, _prune_t(w), exact="int")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_transposable_rounding_ties(dtype):
  """Small integers beside 2^24 and 2^25, which float32 sums drop: patterns
  tie only through rounding, and the documented order of the additions
  and the row-by-row tie rule decide (in some blocks that is not the first
  pattern of the largest float32 total)."""
  rng = np.random.default_rng(_seed("trounding", str(dtype)))
  big = np.array([0, 1, 2, 3, 2.0**24, 1.5 * 2.0**24, 2.0**25])
  with np.errstate(over="ignore"):  # float16: 2^24 and up round to inf, as XLA's cast does
    w = rng.choice(big, (8, 4 * 500)).astype(dtype)
  check_transposable(w, _prune_t(w), exact="f32")
  _, _, s32, counts = _block_scores(_blocks(w))
  naive = [int(np.argmax(s[:, 0])) for s in s32]
  rule = [_rule_f32(s, c) for s, c in zip(s32, counts)]
  assert sum(a != b for a, b in zip(naive, rule)) > 10


def test_transposable_axis_argument():
  """`axis` may name either of the last two axes: the mask is the same."""
  rng = np.random.default_rng(_seed("taxis"))
  w = rng.standard_normal((8, 12)).astype(np.float32)
  m = _prune_t(w)
  np.testing.assert_array_equal(_prune_t(w, axis=-1), m)
  np.testing.assert_array_equal(_prune_t(w, axis=0), m)
  assert (m.reshape(2, 4, 12).sum(1) == 2).all() and (m.reshape(8, 3, 4).sum(2) == 2).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_transposable_nonfinite_blocks(dtype):
  rng = np.random.default_rng(_seed("tnonfinite", str(dtype)))
  blocks = [
      np.full((4, 4), NAN), np.full((4, 4), INF), np.full((4, 4), -0.0),
      np.zeros((4, 4)), np.ones((4, 4)),
      np.diag([NAN, INF, -INF, NAN]),
      np.where(rng.random((4, 4)) < 0.5, NAN, rng.integers(-3, 4, (4, 4))),
      np.where(rng.random((4, 4)) < 0.3, -INF, rng.integers(-3, 4, (4, 4))),
  ]
  b = rng.integers(0, 4, (4, 4)).astype(np.float64)
  b[1] = NAN  # a whole row of NaN: only 2 of them can be kept
  blocks.append(b)
  b = rng.integers(0, 4, (4, 4)).astype(np.float64)
  b[:, 2] = [INF, NAN, -INF, NAN]  # a whole column non-finite
  blocks.append(b)
  w = np.concatenate(blocks, axis=1).astype(dtype)  # (4, 40)
  m = _prune_t(w)
  check_transposable(w, m, exact="int")
  kept_nonfinite = (~np.isfinite(w.astype(np.float64)) & m).reshape(4, 10, 4).sum((0, 2))
  assert kept_nonfinite.tolist()[:6] == [8, 8, 0, 0, 0, 4]
  assert kept_nonfinite[8] == 2 and kept_nonfinite[9] == 2
  np.testing.assert_array_equal(m[:, :4], PATTERNS[0])  # all-NaN block: a full tie


def test_transposable_hand_case():
  # The optimum keeps the big off-diagonal corners; pattern 0 (the diagonal
  # corners) only wins ties.
  w = np.array([[0, 0, 9, 8],
                [0, 0, 7, 9],
                [9, 6, 0, 0],
                [8, 9, 0, 0]], np.float32)
  np.testing.assert_array_equal(_prune_t(w), w > 0)
  np.testing.assert_array_equal(_prune_t(-w), w > 0)  # magnitudes, not signed values
  np.testing.assert_array_equal(_prune_t(np.zeros((4, 4), np.float32)), PATTERNS[0])


def test_transposable_subnormals_score_zero():
  # Documented rule: subnormal magnitudes count as 0 in the transposable
  # score on every platform (XLA:CPU flushes them in float32 arithmetic), so
  # an all-subnormal block is a tie and the first pattern wins; one normal
  # value among subnormals still decides.
  tiny = float(np.finfo(np.float32).smallest_subnormal)
  base = np.array([[0, 0, 9, 8],
                   [0, 0, 7, 9],
                   [9, 6, 0, 0],
                   [8, 9, 0, 0]], np.float64)
  w = (base * tiny).astype(np.float32)
  np.testing.assert_array_equal(_prune_t(w), PATTERNS[0])
  w_normal = w.copy()
  w_normal[0, 2] = 1.0
  got = _prune_t(w_normal)
  assert got[0, 2] and got.sum(0).tolist() == [2, 2, 2, 2] and got.sum(1).tolist() == [2, 2, 2, 2]


def test_transposable_under_vmap():
  rng = np.random.default_rng(_seed("tvmap"))
  w = rng.standard_normal((3, 8, 12)).astype(np.float32)
  f = jax.jit(jax.vmap(lambda a: jsparse24.prune_24(a, transposable=True)))
  np.testing.assert_array_equal(np.asarray(f(w)), _prune_t(w))


# ---------------------------------------------------------------------------
# prune_24 / is_24 errors.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.bool_])
def test_prune_non_float_raises(dtype):
  with pytest.raises(TypeError, match=r"prune_24: `w` must have a floating dtype"):
    jsparse24.prune_24(np.zeros((8, 4), dtype))
  with pytest.raises(TypeError, match=r"`w` must have a floating dtype"):
    jsparse24.prune_24(np.zeros((8, 4), dtype), transposable=True)


@pytest.mark.parametrize("shape,axis", [((6, 4), -2), ((8, 5), 1), ((3,), 0), ((4, 3, 8), 1)])
def test_prune_not_multiple_of_4_raises(shape, axis):
  shape_re = str(shape).replace("(", r"\(").replace(")", r"\)")
  with pytest.raises(ValueError, match=r"prune_24: `w\.shape\[\d\]` = \d+.*not a multiple of 4.*" + shape_re):
    jsparse24.prune_24(np.ones(shape, np.float32), axis=axis)


@pytest.mark.parametrize("shape", [(8, 6), (6, 8), (2, 8, 10), (4, 3)])
@pytest.mark.parametrize("axis", [-1, -2])
def test_prune_transposable_not_multiple_of_4_raises(shape, axis):
  with pytest.raises(ValueError, match=r"prune_24: `w\.shape\[\d\]` = \d+ \(transposable"):
    jsparse24.prune_24(np.ones(shape, np.float32), axis=axis, transposable=True)


def test_prune_transposable_bad_rank_or_axis_raises():
  with pytest.raises(ValueError, match=r"prune_24: transposable=True needs `w` with at least 2 axes"):
    jsparse24.prune_24(np.ones((8,), np.float32), axis=0, transposable=True)
  with pytest.raises(ValueError, match=r"`axis` must be one of them; got axis=0"):
    jsparse24.prune_24(np.ones((4, 8, 8), np.float32), axis=0, transposable=True)


@pytest.mark.parametrize("axis", [2, -3, 5, -100])
def test_prune_axis_out_of_range_raises(axis):
  with pytest.raises(ValueError, match=rf"prune_24: `axis={axis}` is out of range for `w` of rank 2"):
    jsparse24.prune_24(np.ones((8, 8), np.float32), axis=axis)
  with pytest.raises(ValueError, match=rf"`axis={axis}` is out of range"):
    jsparse24.prune_24(np.ones((8, 8), np.float32), axis=axis, transposable=True)
  with pytest.raises(ValueError, match=r"is_24: `axis=.*out of range for `mask`"):
    jsparse24.is_24(np.ones((8, 8), bool), axis=axis)


def test_prune_scalar_raises():
  with pytest.raises(ValueError, match=r"prune_24: `w` must have at least one axis"):
    jsparse24.prune_24(np.float32(1.0))
  with pytest.raises(ValueError, match=r"`w` must have at least one axis"):
    jsparse24.prune_24(jnp.float32(1.0), axis=0)


def test_is_24():
  rng = np.random.default_rng(_seed("is24"))
  m = random_24_mask(rng, (12, 5))
  assert bool(jsparse24.is_24(m))
  assert bool(jsparse24.is_24(m.T, axis=-1))
  assert not bool(jsparse24.is_24(np.ones((8, 8), bool), axis=-1))
  for keep in (0, 1, 3, 4):
    bad = m.copy()
    bad[4:8, 2] = np.arange(4) < keep
    assert not bool(jsparse24.is_24(bad))
  with pytest.raises(ValueError, match=r"is_24: `mask\.shape\[0\]` = 6"):
    jsparse24.is_24(np.ones((6, 4), bool))


# ---------------------------------------------------------------------------
# compress / decompress / Sparse24.
# ---------------------------------------------------------------------------


def _check_sparse(w, m, out, transposed=False):
  sp = out["sp"]
  *lead, k, n = w.shape
  assert isinstance(sp, jsparse24.Sparse24)
  assert sp.shape == w.shape and sp.dtype == w.dtype and sp.has_transpose == transposed
  assert sp.values.shape == (*lead, n, k // 2) and sp.values.dtype == w.dtype
  assert sp.meta.shape == (*lead, n, -(-k // 8)) and sp.meta.dtype == np.uint8
  _assert_bitwise_equal(out["dense"], _masked(w, m))
  _assert_bitwise_equal(sp.values, ref_values(w, m))
  np.testing.assert_array_equal(np.asarray(sp.meta), ref_meta(m))
  np.testing.assert_array_equal(np.asarray(out["mask"]), m)
  if (k // 4) % 2:  # the padding nibble is the valid code 0x4
    assert (np.asarray(sp.meta)[..., -1] >> 4 == 0x4).all()
  assert sp.nbytes == sp.values.size * w.dtype.itemsize + sp.meta.size
  if transposed:
    wt, mt = np.swapaxes(w, -1, -2), np.swapaxes(m, -1, -2)
    assert sp.values_t.shape == (*lead, k, n // 2)
    assert sp.meta_t.shape == (*lead, k, -(-n // 8))
    _assert_bitwise_equal(out["dense_t"], _masked(wt, mt))
    np.testing.assert_array_equal(np.asarray(out["mask_t"]), mt)
    _assert_bitwise_equal(out["dense_tt"], _masked(w, m))
    _assert_bitwise_equal(sp.values_t, ref_values(wt, mt))
    np.testing.assert_array_equal(np.asarray(sp.meta_t), ref_meta(mt))
    assert sp.transpose().shape == (*lead, n, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(4, 1), (12, 5), (16, 7), (2, 20, 3)])
def test_compress_round_trip(shape, dtype):
  rng = np.random.default_rng(_seed("rt", shape, str(dtype)))
  w = rng.standard_normal(shape).astype(dtype)
  for m in (random_24_mask(rng, shape), np.asarray(_prune(w))):
    _check_sparse(w, m, _round_trip(w, m))
    assert np.array_equal(np.asarray(_round_trip(w, m)["dense"]), w * m)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_compress_round_trip_specials(dtype):
  """NaN (any payload), inf, -0.0, negatives: kept bit for bit; pruned ones +0."""
  rng = np.random.default_rng(_seed("rtspecial", str(dtype)))
  pool = np.array([NAN, -NAN, INF, -INF, -0.0, 0.0, -1.5, 2.0], np.float32)
  w = rng.choice(pool, size=(12, 5))
  w[rng.random(w.shape) < 0.2] = rng.choice(NAN_PAYLOADS)
  w = w.astype(dtype)
  for m in (random_24_mask(rng, w.shape), np.asarray(_prune(w))):
    _check_sparse(w, m, _round_trip(w, m))


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("shape", [(4, 4), (2, 12, 8)])
def test_compress_transposed(shape, dtype):
  rng = np.random.default_rng(_seed("rtT", shape, str(dtype)))
  w = rng.standard_normal(shape).astype(dtype)
  for m in (random_transposable_mask(rng, shape), _prune_t(w)):
    _check_sparse(w, m, _round_trip(w, m, transposed=True), transposed=True)


def test_compress_transposed_eager():
  rng = np.random.default_rng(_seed("rtTeager"))
  w = rng.standard_normal((4, 4)).astype(BF16)
  m = random_transposable_mask(rng, w.shape)
  sp = jsparse24.compress(w, m, transposed=True)
  spt = sp.transpose()
  _check_sparse(w, m, dict(sp=sp, dense=jsparse24.decompress(sp), mask=sp.mask(),
                           dense_t=jsparse24.decompress(spt), mask_t=spt.mask(),
                           dense_tt=jsparse24.decompress(spt.transpose())), transposed=True)


def test_meta_hand_example():
  # K=12 (3 groups: odd, so a padding nibble), N=2.
  # column 0 keeps (0,2) (1,2) (2,3) in its groups; column 1 (0,3) (0,1) (1,3).
  w = np.array([[1, 10], [0, 0], [2, 0], [0, 20],
                [0, 30], [5, 40], [6, 0], [0, 0],
                [0, 0], [0, 50], [3, 0], [4, 60]], np.float32)
  m = np.array([[1, 1], [0, 0], [1, 0], [0, 1],
                [0, 1], [1, 1], [1, 0], [0, 0],
                [0, 0], [0, 1], [1, 0], [1, 1]], bool)
  sp = _round_trip(w, m)["sp"]
  # codes i0 | i1 << 2: (0,2)=0x8 (1,2)=0x9 (2,3)=0xE (0,3)=0xC (0,1)=0x4 (1,3)=0xD;
  # byte 0 = group 0 | group 1 << 4; byte 1 = group 2 | padding 0x4 << 4.
  np.testing.assert_array_equal(np.asarray(sp.meta), np.array([[0x98, 0x4E], [0x4C, 0x4D]], np.uint8))
  np.testing.assert_array_equal(np.asarray(sp.values), [[1, 2, 5, 6, 3, 4], [10, 20, 30, 40, 50, 60]])
  packed = _pack(m)
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda mk: mk.meta())(packed)), np.asarray(sp.meta))
  # K/4 odd: Mask24 packs the codes flat, row-major over [N, K/4], no per-column padding.
  np.testing.assert_array_equal(np.asarray(packed.packed), np.array([0x98, 0xCE, 0xD4], np.uint8))
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda meta: jsparse24.Mask24.from_meta(meta, (12, 2)))(sp.meta).packed),
                                np.asarray(packed.packed))
  # K=8: two groups, no padding.
  sp8 = _round_trip(w[:8, :1], m[:8, :1])["sp"]
  np.testing.assert_array_equal(np.asarray(sp8.meta), np.array([[0x98]], np.uint8))


def test_sparse24_nbytes_bf16():
  spec = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
  mspec = jax.ShapeDtypeStruct((4096, 4096), jnp.bool_)
  sp = jax.eval_shape(jsparse24.compress, spec, mspec)
  assert sp.values.shape == (4096, 2048) and sp.meta.shape == (4096, 512)
  assert sp.nbytes == 4096 * 2048 * 2 + 4096 * 512
  assert sp.nbytes <= 0.57 * (4096 * 4096 * 2)
  # A real (small) array: the property counts the real bytes.
  rng = np.random.default_rng(_seed("nbytes"))
  w = rng.standard_normal((64, 40)).astype(BF16)
  sp = _round_trip(w, random_24_mask(rng, w.shape))["sp"]
  assert sp.nbytes == sp.values.nbytes + sp.meta.nbytes
  assert sp.nbytes / w.nbytes == pytest.approx(0.5625)


def test_sparse24_pytree():
  rng = np.random.default_rng(_seed("pytree"))
  w = rng.standard_normal((8, 12)).astype(np.float32)
  m = random_transposable_mask(rng, w.shape)
  for transposed in (False, True):
    sp = _round_trip(w, m, transposed=transposed)["sp"]
    leaves = jax.tree.leaves(sp)
    assert len(leaves) == (4 if transposed else 2)
    sp2 = jax.jit(lambda s: s)(sp)
    assert isinstance(sp2, jsparse24.Sparse24) and sp2.shape == sp.shape
    assert sp2.has_transpose == transposed
    assert jax.tree.structure(sp2) == jax.tree.structure(sp)
    _assert_bitwise_equal(jax.jit(jsparse24.decompress)(sp2), _masked(w, m))
    sp3 = jax.tree.map(lambda a: np.asarray(a).copy(), sp)
    assert isinstance(sp3, jsparse24.Sparse24) and sp3.shape == sp.shape
    _assert_bitwise_equal(jax.jit(jsparse24.decompress)(sp3), _masked(w, m))
    for a, b in zip(jax.tree.leaves(sp3), leaves):
      _assert_bitwise_equal(a, b)


# ---------------------------------------------------------------------------
# compress errors.
# ---------------------------------------------------------------------------


def _good_mask(shape=(8, 4)):
  return random_24_mask(np.random.default_rng(_seed("good", shape)), shape)


# Kept along K but 4 or 0 of 4 along N: 2:4 only along K.
NON_TRANSPOSABLE = np.zeros((8, 8), bool)
NON_TRANSPOSABLE[[0, 1, 4, 5], :] = True


@pytest.mark.parametrize("keep", [0, 1, 3, 4])
def test_compress_bad_group_raises(keep):
  m = _good_mask()
  m[4:8, 1] = np.arange(4) < keep
  with pytest.raises(ValueError, match=rf"compress: `mask` is not 2:4 along axis 0.*keeping {keep}\)"):
    jsparse24.compress(np.ones((8, 4), np.float32), m)


def test_compress_errors():
  w = np.ones((8, 4), np.float32)
  with pytest.raises(ValueError, match=r"compress: `mask` has shape \(8, 8\), expected \(8, 4\)"):
    jsparse24.compress(w, np.ones((8, 8), bool))
  with pytest.raises(ValueError, match=r"compress: `mask` has shape \(4, 8\)"):
    jsparse24.compress(w, _good_mask((4, 8)))
  with pytest.raises(TypeError, match=r"compress: `mask` must be a bool array.*float32"):
    jsparse24.compress(w, _good_mask().astype(np.float32))
  with pytest.raises(TypeError, match=r"`mask` must be a bool array.*int32"):
    jsparse24.compress(w, _good_mask().astype(np.int32))
  with pytest.raises(TypeError, match=r"compress: `w` must have a floating dtype"):
    jsparse24.compress(w.astype(np.int32), _good_mask())
  with pytest.raises(ValueError, match=r"compress: `w\.shape\[0\]` = 6"):
    jsparse24.compress(np.ones((6, 4), np.float32), np.ones((6, 4), bool))
  with pytest.raises(ValueError, match=r"compress: `w` must be \[\.\.\., K, N\]"):
    jsparse24.compress(np.ones((8,), np.float32), np.ones((8,), bool))
  with pytest.raises(TypeError, match=r"decompress: expected a jsparse24\.Sparse24, got ndarray"):
    jsparse24.decompress(np.ones((8, 4), np.float32))
  with pytest.raises(ValueError, match=r"Sparse24\.transpose: .*compressed without its transpose"):
    _round_trip(w, _good_mask())["sp"].transpose()


def test_compress_transposed_needs_transposable_mask():
  w = np.ones((8, 8), np.float32)
  assert (NON_TRANSPOSABLE.reshape(2, 4, 8).sum(1) == 2).all()
  with pytest.raises(ValueError, match=r"compress: `mask` is not 2:4 along axis 1"):
    jsparse24.compress(w, NON_TRANSPOSABLE, transposed=True)
  with pytest.raises(ValueError, match=r"compress: .*(transposable Mask24|not 2:4 along axis 1)"):
    jsparse24.compress(w, _pack(NON_TRANSPOSABLE), transposed=True)
  with pytest.raises(ValueError, match=r"compress: `w\.shape\[1\]` = 6 \(N, for the transposed copy\)"):
    jsparse24.compress(np.ones((8, 6), np.float32), _good_mask((8, 6)), transposed=True)


# ---------------------------------------------------------------------------
# Mask24.
# ---------------------------------------------------------------------------


# (8, 1): a layer of one output (a regression head), its mask as packable.
@pytest.mark.parametrize("shape", [(8, 1), (12, 5), (16, 7), (2, 20, 3)])
def test_mask24_pack_unpack(shape):
  rng = np.random.default_rng(_seed("pack", shape))
  m = random_24_mask(rng, shape)
  mk = _pack(m)
  assert mk.shape == shape and mk.transposable is False
  assert mk.packed.dtype == np.uint8
  np.testing.assert_array_equal(np.asarray(_unpack(mk)), m)
  np.testing.assert_array_equal(np.asarray(mk.meta()), ref_meta(m))
  if (shape[-2] // 4) % 2 == 0:  # K/8 whole: the packed mask is the metadata itself
    np.testing.assert_array_equal(np.asarray(mk.packed), ref_meta(m))
  assert mk.nbytes == np.prod(mk.packed.shape)
  w = rng.standard_normal(shape).astype(np.float32)
  out = _round_trip(w, mk)  # compress takes a Mask24 like the dense mask
  _check_sparse(w, m, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("transposable", [False, True])
def test_mask24_from_weights(dtype, transposable):
  rng = np.random.default_rng(_seed("fromw", str(dtype), transposable))
  w = rng.standard_normal((16, 12)).astype(dtype)
  w[rng.random(w.shape) < 0.1] = NAN
  f = jax.jit(functools.partial(jsparse24.Mask24.from_weights, transposable=transposable))
  mk = f(w)
  dense = np.asarray(_prune(w, transposable=transposable))
  want = _pack(dense, transposable=transposable)
  assert mk.transposable is transposable and mk.shape == (16, 12)
  np.testing.assert_array_equal(np.asarray(mk.packed), np.asarray(want.packed))
  np.testing.assert_array_equal(np.asarray(_unpack(mk)), dense)
  if transposable:
    check_transposable(w, dense, exact=None)
  else:
    _check_plain(w, -2, dense)


@pytest.mark.parametrize("shape", [(8, 4), (16, 5), (4096, 64), (2, 24, 3)])
def test_mask24_at_most_one_bit_per_element(shape):
  mk = jax.eval_shape(jsparse24.Mask24.pack, jax.ShapeDtypeStruct(shape, jnp.bool_))
  assert mk.shape == shape
  assert np.prod(mk.packed.shape) * 8 <= np.prod(shape)


@pytest.mark.parametrize("shape", [(4, 8), (12, 16), (4, 3), (12, 5)])
def test_mask24_at_most_one_bit_per_element_odd_groups(shape):
  mk = jax.eval_shape(jsparse24.Mask24.pack, jax.ShapeDtypeStruct(shape, jnp.bool_))
  assert mk.shape == shape
  # Flat packing: at most one padding nibble in the whole slice.
  assert np.prod(mk.packed.shape) * 8 <= np.prod(shape) + 4, (np.prod(mk.packed.shape) * 8, np.prod(shape))


def test_mask24_transposable_pack():
  rng = np.random.default_rng(_seed("tpack"))
  m = random_transposable_mask(rng, (12, 8))
  mk = _pack(m, transposable=True)
  assert mk.transposable is True
  np.testing.assert_array_equal(np.asarray(_unpack(mk)), m)
  w = rng.standard_normal((12, 8)).astype(np.float32)
  _check_sparse(w, m, _round_trip(w, mk, transposed=True), transposed=True)


def test_mask24_pytree():
  rng = np.random.default_rng(_seed("mpytree"))
  m = random_transposable_mask(rng, (8, 12))
  mk = _pack(m, transposable=True)
  leaves, treedef = jax.tree.flatten(mk)
  assert len(leaves) == 1 and leaves[0].dtype == np.uint8
  mk2 = jax.jit(lambda a: a)(mk)
  assert isinstance(mk2, jsparse24.Mask24)
  assert mk2.shape == mk.shape and mk2.transposable is True
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a.unpack())(mk2)), m)
  mk3 = jax.tree.map(lambda a: np.asarray(a).copy(), mk)
  assert jax.tree.structure(mk3) == treedef
  np.testing.assert_array_equal(np.asarray(mk3.packed), np.asarray(mk.packed))
  # vmap of pack over a stack: the packed leaf stacked, and the stack's
  # shape says so (static metadata holds only the trailing (K, N)).
  stack = np.stack([random_24_mask(rng, (8, 12)) for _ in range(3)])
  mks = jax.jit(jax.vmap(jsparse24.Mask24.pack))(stack)
  assert mks.packed.shape == (3, 12, 1) and mks.shape == (3, 8, 12)
  assert jax.tree.structure(mks) == jax.tree.structure(jax.eval_shape(jsparse24.Mask24.pack, stack))
  one = jax.tree.map(lambda a: a[1], mks)
  assert one.shape == (8, 12)
  np.testing.assert_array_equal(np.asarray(_unpack(one)), stack[1])
  np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(lambda a: a.unpack()))(mks)), stack)


def test_mask24_errors():
  m = _good_mask((8, 4))
  with pytest.raises(TypeError, match=r"Mask24\.pack: `mask` must be a bool"):
    jsparse24.Mask24.pack(m.astype(np.float32))
  bad = m.copy()
  bad[0:4, 0] = [1, 1, 1, 0]
  with pytest.raises(ValueError, match=r"Mask24\.pack: `mask` is not 2:4.*keeping 3"):
    jsparse24.Mask24.pack(bad)
  with pytest.raises(ValueError, match=r"Mask24\.pack: `mask\.shape\[0\]` = 6"):
    jsparse24.Mask24.pack(np.ones((6, 4), bool))
  with pytest.raises(ValueError, match=r"Mask24\.pack: `mask` must be \[\.\.\., K, N\]"):
    jsparse24.Mask24.pack(np.array([1, 1, 0, 0], bool))
  with pytest.raises(ValueError, match=r"Mask24\.pack: `mask` is not 2:4 along axis 1"):
    jsparse24.Mask24.pack(NON_TRANSPOSABLE, transposable=True)
  with pytest.raises(ValueError, match=r"Mask24\.pack: `mask\.shape\[1\]` = 6"):
    jsparse24.Mask24.pack(_good_mask((8, 6)), transposable=True)
  with pytest.raises(ValueError, match=r"compress: `mask` has shape \(8, 4\), expected \(8, 8\)"):
    jsparse24.compress(np.ones((8, 8), np.float32), _pack(m))
