"""The Pallas kernels in interpret mode (CPU) against the plain-jnp references:
bit-identical masks/compression (on random non-zero data, so an unwritten
output element cannot pass), dtype tolerances for the matmul, and the
`"pallas"` backend of sparse_dot forward and `jax.vjp`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse24
from jsparse24 import optim
from jsparse24.backends.pallas import interpret_mode
from pallas_kernels import mask_rebuild, masked_compress, prune24, spmm24, transposable24
from pallas_kernels.prune_config import PruneConfig

# References: the kernels' contract, through jsparse24's plain-jnp format
# (kept here, not in pallas_kernels, which imports nothing from jsparse24).
# Each is one jitted program: run eagerly, their masks' packing and
# unpacking compiled every primitive again for each new shape, most of the
# compilations of this module outside the kernels.


@functools.partial(jax.jit, static_argnames="transposable")
def prune_compress_reference(w, *, transposable=False):
  """Plain-jnp definition of `prune24.prune_compress`."""
  from jsparse24 import _format, _prune
  mask = _prune.prune_24(w, axis=0, transposable=transposable)
  sp = _format.compress_reference(w, mask, transposable)
  return sp.values, sp.meta, sp.values_t, sp.meta_t


@functools.partial(jax.jit, static_argnames="transposed")
def compress_with_meta_reference(w, meta, *, transposed=False):
  """Plain-jnp definition of `masked_compress.compress_with_meta`."""
  from jsparse24 import _format
  mask = _format.Mask24.from_meta(meta, tuple(w.shape), transposed)
  sp = _format.compress_reference(w, mask, transposed)
  return sp.values, sp.values_t, sp.meta_t


def test_pallas_kernels_import_nothing_from_jsparse24():
  import ast
  import pathlib
  root = pathlib.Path(__file__).resolve().parent.parent / "pallas_kernels"
  for path in root.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      assert not any(n.split(".")[0] == "jsparse24" for n in names), (path.name, names)



@functools.partial(jax.jit, static_argnums=1)
def _mask_meta(w, transposable):
  """`Mask24.from_weights(w, transposable=...).meta()` as one program."""
  return jsparse24.Mask24.from_weights(w, transposable=transposable).meta()


@functools.partial(jax.jit, static_argnums=2)
def _flips(old, new, shape):
  """The bool [K, N] of the elements where metas `old` and `new` differ."""
  return (jsparse24.Mask24.from_meta(old, shape).unpack()
          != jsparse24.Mask24.from_meta(new, shape).unpack())


def _bits(a):
  return np.asarray(a).view(np.uint8)


def _weights(seed, shape, dtype, specials=True):
  """Normal weights, with a NaN, +-inf, a zero row and a tie where the shape
  has room. Set in NumPy: as JAX ops each `.at[].set` compiled a program per
  shape, dozens per test module."""
  w = np.array(jax.random.normal(jax.random.key(seed), shape, jnp.float32))
  if specials:
    for i, v in enumerate((np.nan, np.inf, -np.inf)):
      if i < min(shape):
        w[i, i] = v
    w[3:4] = 0.0  # a zero row
    if shape[0] > 5 and shape[1] > 1:
      w[5, 1] = w[5, 0]  # a tie
  return jnp.asarray(w.astype(dtype))


@pytest.mark.parametrize("strided", [None, True])
@pytest.mark.parametrize("shape,dtype", [
    ((16, 8), jnp.float32), ((12, 20), jnp.bfloat16), ((36, 5), jnp.float16),
    ((132, 40), jnp.bfloat16)])
def test_prune_compress_plain_is_bit_identical(shape, dtype, strided):
  """The default tile (the tile transposed in registers), and strided row
  lanes compressed along K with the slots transposed (`strided_lanes`)."""
  w = _weights(sum(shape), shape, dtype)
  cfg = None if strided is None else PruneConfig(block_k=64, block_n=32,
                                                        strided_lanes=strided)
  got = prune24.prune_compress(w, config=cfg, interpret=True)
  ref = prune_compress_reference(w)
  assert got[2] is None and got[3] is None
  for a, b in zip(got[:2], ref[:2]):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(_bits(a), _bits(b))


def _adversarial(seed, shape, dtype):
  """`_weights`' NaN, inf, zero row and tie, plus rows of equal values,
  subnormals, and rows rounded to quarters (tied pattern scores), in the
  first 8 rows of every 64, and in the next 8 small integers beside 2^24 and
  2^25 (where float32 sums drop them: patterns tie only by rounding, which
  the order of the additions decides); elsewhere plain random values (tiles
  with no NaN or inf take the kernel's cheaper search). Built in NumPy, as
  `_weights` is."""
  w = np.array(_weights(seed, shape, jnp.float32))
  k = shape[0]
  big = jnp.asarray([0.0, 1.0, 2.0, 3.0, 2.0**24, 1.5 * 2.0**24, 2.0**25])
  for start in range(0, k, 64):
    w[start + 4:start + 6] = 1.0
    if start + 6 < k:
      w[start + 6, :4] = np.float32(1e-40)
    w[start:start + 8:3] = np.round(w[start:start + 8:3] * 4) / 4
    rows = w[start + 8:start + 16].shape
    w[start + 8:start + 16] = np.asarray(jax.random.choice(jax.random.key(seed + start), big, rows))
  with np.errstate(over="ignore"):  # float16: 2^24 and up round to inf, as XLA's cast does
    return jnp.asarray(w.astype(dtype))


@pytest.mark.parametrize("shape,dtype,strided", [
    ((12, 20), jnp.float32, False), ((24, 8), jnp.bfloat16, True),
    ((72, 136), jnp.float16, False), ((136, 72), jnp.bfloat16, True),
    ((4, 4), jnp.bfloat16, False)])
def test_prune_compress_transposable_is_bit_identical(shape, dtype, strided):
  w = _adversarial(sum(shape) + 1, shape, dtype)
  cfg = PruneConfig(block_k=64, block_n=64, strided_lanes=strided)
  got = prune24.prune_compress(w, transposable=True, config=cfg, interpret=True)
  ref = prune_compress_reference(w, transposable=True)
  for a, b in zip(got, ref):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("shape,dtype,huge", [((72, 136), jnp.float32, False),
                                              ((20, 12), jnp.bfloat16, False),
                                              ((72, 136), jnp.bfloat16, True)])
def test_transposable_mask_is_bit_identical(shape, dtype, huge):
  # The mask alone (what the rebuilds use): float32 master weights included,
  # subnormal magnitudes scoring 0 like the reference's. Its kernel searches
  # again the tiles whose magnitudes do not sum to a finite float32: the
  # NaN/inf tile, and with `huge` a tile of finite magnitudes that overflow
  # the sum (and the pattern scores: ties at inf).
  w = _adversarial(3 * sum(shape), shape, dtype)
  if huge:
    t = w[64:72, 64:80].astype(jnp.float32)
    w = w.at[64:72, 64:80].set((t / (1 + jnp.abs(t)) * 3e38).astype(dtype))  # |t| < 3e38
    assert bool(jnp.all(jnp.isfinite(w[64:72, 64:80].astype(jnp.float32))))
  got = transposable24.transposable_mask(w, interpret=True)
  want = jax.jit(lambda w: jsparse24.Mask24.pack(jsparse24.prune_24(w, transposable=True),
                                                 transposable=True).meta())(w)
  assert got.shape == want.shape and got.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("transposable", [True, False])
@pytest.mark.parametrize("shape,config", [
    ((72, 136), None),                                       # padded tiles
    ((20, 12), None),                                        # K/4 odd: a padding nibble
    ((64, 256), PruneConfig(block_k=32, block_n=64)),  # several programs each way
])
def test_rebuild_mask_only_when_flagged(shape, config, transposable):
  """The flag on: the mask of `w` (bit-identical to the reference's
  `Mask24.from_weights`); off: `old` unchanged, every byte (old is a mask of
  other weights, so an idle program that wrote anything would show)."""
  k, n = shape
  w = _adversarial(7 * k + n, shape, jnp.float32)
  old = _mask_meta(_adversarial(k + 5 * n, shape, jnp.float32), transposable)
  new = _mask_meta(w, transposable)
  assert not np.array_equal(np.asarray(old), np.asarray(new))
  changed = int(np.sum(_flips(old, new, shape)))
  assert changed
  for flag, want, flips in ((1, new, changed), (0, old, 0)):
    got, counts = mask_rebuild.rebuild_mask(w, old, jnp.full((n,), flag, jnp.int32),
                                       transposable=transposable, config=config, interpret=True)
    assert got.shape == want.shape and got.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert counts.dtype == jnp.int32 and counts.shape[1] == -(-n // 8)
    assert int(np.sum(counts)) == flips  # padding (rows, columns, nibble) not counted
  groups = -(-k // 8)
  with pytest.raises(ValueError, match=rf"rebuild_mask: `old` must be uint8\[{n}, {groups}\]"):
    mask_rebuild.rebuild_mask(w, old[:, :1], jnp.ones((n,), jnp.int32), transposable=transposable,
                         interpret=True)
  with pytest.raises(ValueError, match=rf"rebuild_mask: `rebuild` must be \[{n}\]"):
    mask_rebuild.rebuild_mask(w, old, jnp.ones((), jnp.int32), transposable=transposable,
                         interpret=True)


@pytest.mark.parametrize("transposable", [True, False])
@pytest.mark.parametrize("per", [2, 8])
def test_rebuild_mask_several_tiles_per_program(per, transposable):
  """A program that loops over `per` tiles along K: the tiles of the flagged
  columns are rebuilt (every tile along K), the others keep `old`, and
  only the flagged columns' flips are counted. The same as one tile per
  program."""
  shape, config = (256, 192), PruneConfig(block_k=32, block_n=64)
  k, n = shape
  w = _adversarial(11 * k + n, shape, jnp.float32)
  old = _mask_meta(_adversarial(k + 3 * n, shape, jnp.float32), transposable)
  new = _mask_meta(w, transposable)
  cols = np.repeat(np.array([True, False, True]), 64)
  want = np.where(cols[:, None], np.asarray(new), np.asarray(old))
  changed = int(np.sum(np.asarray(_flips(old, new, shape))[:, cols]))
  assert changed
  for p in (per, 1):
    got, counts = mask_rebuild.rebuild_mask(w, old, jnp.asarray(cols, jnp.int32),
                                       transposable=transposable, config=config,
                                       tiles_per_program=p, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert counts.shape == (k // 32, n // 8)
    assert int(np.sum(counts)) == changed
  with pytest.raises(ValueError, match=r"rebuild_mask: `tiles_per_program` must be a power"
                                       r" of two dividing the 8 tiles along K, got 3"):
    mask_rebuild.rebuild_mask(w, old, jnp.asarray(cols, jnp.int32), transposable=transposable,
                         config=config, tiles_per_program=3, interpret=True)


def test_plain_rebuild_mask_takes_any_n():
  """A plain mask needs only K in groups of 4: N = 10 (padded tiles)."""
  w = _adversarial(3, (24, 10), jnp.bfloat16)
  old = jsparse24.Mask24.from_weights(-w).meta()
  got, counts = mask_rebuild.rebuild_mask(w, old, jnp.ones((10,), jnp.int32), transposable=False,
                                     interpret=True)
  want = jsparse24.Mask24.from_weights(w)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want.meta()))
  assert int(np.sum(counts)) == int(np.sum(jsparse24.Mask24.from_weights(-w).unpack()
                                           != want.unpack()))


@pytest.mark.parametrize("transposable", [True, False])
def test_backend_mask_update_on_a_stack_under_jit(transposable):
  """The library's wrapper: a stack of layers (nn.scan's `[L, K, N]`), one
  traced flag for all, under jit: the stack's masks when set, `old` when not."""
  from jsparse24.backends import pallas as backend  # pylint: disable=g-import-not-at-top
  w = jax.random.normal(jax.random.key(3), (3, 32, 48))
  old = jsparse24.Mask24.from_weights(jax.random.normal(jax.random.key(4), w.shape),
                                      transposable=transposable)
  want = jsparse24.Mask24.from_weights(w, transposable=transposable)
  with interpret_mode():
    # One kernel call for the whole stack (a larger grid), no loop over its
    # layers: a loop sliced (copied) each layer's float32 kernel every step.
    jaxpr = str(jax.make_jaxpr(backend.rebuild_mask)(w, old, jnp.asarray(True)))
    assert jaxpr.count("pallas_call") == 1 and "scan[" not in jaxpr and "while[" not in jaxpr
    update = jax.jit(backend.rebuild_mask)
    for flag, expected in ((True, want), (False, old)):
      got, flips = update(w, old, jnp.asarray(flag))
      assert got.dims == (32, 48) and got.transposable == transposable and got.shape == w.shape
      np.testing.assert_array_equal(np.asarray(got.packed), np.asarray(expected.packed))
      # The flip rate of each layer of the stack, counted by the kernel: the
      # same count of flipped weights; the quotient by K x N within a
      # rounding (jax 0.12.1's XLA may multiply by the reciprocal instead).
      want_rate = np.asarray(optim.flip_fraction(old, expected))
      np.testing.assert_array_equal(np.rint(np.asarray(flips, np.float64) * 32 * 48),
                                    np.rint(want_rate.astype(np.float64) * 32 * 48))
      np.testing.assert_allclose(np.asarray(flips), want_rate, rtol=2.0 ** -23, atol=0)


def test_mask_from_weights_takes_the_fused_kernel_where_pallas_runs_natively(monkeypatch):
  """Mask24.from_weights (so rebuild_masks and mask_update) builds
  transposable masks with the kernel where it runs natively (a GPU), with
  the reference's bits, stacked float32 master weights and K/4 odd
  included; plain masks and interpreted kernels keep the XLA reference."""
  from jsparse24 import _pallas_runtime  # pylint: disable=g-import-not-at-top
  w = jnp.stack([_adversarial(11, (20, 24), jnp.float32),
                 _adversarial(12, (20, 24), jnp.float32)])  # as nn.scan stacks kernels
  want = jsparse24.Mask24.pack(jsparse24.prune_24(w, transposable=True), transposable=True)

  def jaxpr(transposable):
    return str(jax.make_jaxpr(
        lambda w: jsparse24.Mask24.from_weights(w, transposable=transposable))(w))

  with interpret_mode():
    assert "pallas_call" not in jaxpr(True)  # interpreting: the reference
    monkeypatch.setattr(_pallas_runtime, "runs_natively", lambda: True)
    assert "pallas_call" in jaxpr(True) and "pallas_call" not in jaxpr(False)
    got = jsparse24.Mask24.from_weights(w, transposable=True)
  assert got.shape == want.shape and got.transposable
  np.testing.assert_array_equal(np.asarray(got.packed), np.asarray(want.packed))


@pytest.mark.parametrize("strided", [True, False])
@pytest.mark.parametrize("shape,transposed", [((20, 12), False), ((12, 20), True), ((40, 8), True)])
def test_compress_with_stored_mask_is_bit_identical(shape, transposed, strided):
  # strided: the transposed copy's keep decoded per row from the codes
  # (`_tiles.keep_rows`), or the keep tile transposed.
  w = _weights(7 * shape[0], shape, jnp.bfloat16)
  # A mask that is NOT the magnitude mask of w: the kernel must follow it.
  other = jax.random.normal(jax.random.key(3), shape)
  meta = _mask_meta(other, transposed)
  cfg = PruneConfig(block_k=128, block_n=64, num_warps=8, strided_lanes=strided)
  got = masked_compress.compress_with_meta(w, meta, transposed=transposed, config=cfg,
                                   interpret=True)
  ref = compress_with_meta_reference(w, meta, transposed=transposed)
  for a, b in zip(got, ref):
    if b is None:
      assert a is None
      continue
    np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("layout,shape", [("sparse24", (40, 24)), ("cusparselt", (128, 192))])
def test_unused_transposed_copy_is_not_written(layout, shape):
  """The compression with a transposable stored mask writes both copies in
  one kernel; where a program uses only `values` (the forward pass under
  remat, which throws the residuals away), JAX's dead-code elimination
  narrows it to the plain kernel, which writes the same bytes."""
  from jax.interpreters import partial_eval as pe  # pylint: disable=g-import-not-at-top
  from jsparse24.backends import pallas as pallas_backend  # pylint: disable=g-import-not-at-top

  w = _weights(11, shape, jnp.bfloat16)
  mask = jsparse24.Mask24.from_weights(jax.random.normal(jax.random.key(4), shape),
                                       transposable=True)
  both = lambda w: pallas_backend.compress_arrays(w, mask, True, layout)  # noqa: E731
  values_only = lambda w: both(w)[0]  # noqa: E731

  def compressions(fn):
    jaxpr = jax.make_jaxpr(fn)(w).jaxpr
    jaxpr, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return [(e.params["transposed"], len(e.outvars)) for e in jaxpr.eqns
            if e.primitive.name == "jsparse24_compress_with_mask"]

  with interpret_mode():
    assert compressions(both) == [(True, 3)]
    assert compressions(values_only) == [(False, 1)]
    assert compressions(lambda w: both(w)[2]) == [(True, 3)]  # the transposed copy's codes
    want = jax.jit(both)(w)
    got = jax.jit(values_only)(w)
  # (cuSPARSELt's buffer: the value rows; the metadata rows are written later.)
  rows = shape[0] // 2 if layout == "cusparselt" else got.shape[0]
  np.testing.assert_array_equal(_bits(got[:rows]), _bits(want[0][:rows]))
  # vmapped (a stack of weights, one mask): still one primitive, narrowed alike.
  ws = jnp.stack([w, -2 * w])
  with interpret_mode():
    stacked = jax.vmap(values_only)
    assert [(e.params["transposed"], e.params["lead"]) for e in pe.dce_jaxpr(
        jax.make_jaxpr(stacked)(ws).jaxpr, [True])[0].eqns
            if e.primitive.name == "jsparse24_compress_with_mask"] == [(False, 1)]
    got = jax.jit(stacked)(ws)
    for i in range(2):
      np.testing.assert_array_equal(_bits(got[i][:rows]), _bits(jax.jit(both)(ws[i])[0][:rows]))


@pytest.mark.parametrize("shape,dtype,strided", [((64, 64), jnp.bfloat16, True),
                                                 ((192, 320), jnp.float16, False)])
def test_cusparselt_layout_is_bit_identical(shape, dtype, strided):
  # layout="cusparselt": values in the dense buffer's orientation ([K/2, N]
  # and [K, N/2]) in the leading rows of buffers with room for the metadata.
  # Each way of loading the lanes once, on one of the 16-bit dtypes (their
  # bits move alike; test_prune_compress_transposable_is_bit_identical
  # crosses dtypes and lanes in the Sparse24 layout).
  k, n = shape
  w = _weights(k + n, shape, dtype, specials=False)
  cfg = PruneConfig(block_k=128, block_n=64, strided_lanes=strided)
  values, meta, none_v, none_m = prune24.prune_compress(w, layout="cusparselt", config=cfg,
                                                        interpret=True)
  ref_values, ref_meta, _, _ = prune_compress_reference(w)
  assert none_v is None and none_m is None
  assert values.shape == (k // 2 + k // 16, n) and values.dtype == dtype
  np.testing.assert_array_equal(_bits(values[:k // 2]), _bits(ref_values.T))
  np.testing.assert_array_equal(_bits(meta), _bits(ref_meta))
  # Transposable pruning writes both copies in this layout too.
  values, meta, values_t, meta_t = prune24.prune_compress(
      w, transposable=True, layout="cusparselt", config=cfg, interpret=True)
  ref = prune_compress_reference(w, transposable=True)
  assert values.shape == (k // 2 + k // 16, n) and values_t.shape == (k + k // 8, n // 2)
  for got, want in zip((values[:k // 2], meta, values_t[:k], meta_t),
                       (ref[0].T, ref[1], ref[2], ref[3])):
    np.testing.assert_array_equal(_bits(got), _bits(want))
  mask_meta = _mask_meta(jax.random.normal(jax.random.key(4), shape), True)
  for transposed in (False, True):
    values, values_t, meta_t = masked_compress.compress_with_meta(
        w, mask_meta, transposed=transposed, layout="cusparselt", config=cfg, interpret=True)
    ref = compress_with_meta_reference(w, mask_meta, transposed=transposed)
    np.testing.assert_array_equal(_bits(values[:k // 2]), _bits(ref[0].T))
    if transposed:
      assert values_t.shape == (k + k // 8, n // 2)
      np.testing.assert_array_equal(_bits(values_t[:k]), _bits(ref[1]))
      np.testing.assert_array_equal(_bits(meta_t), _bits(ref[2]))
    else:
      assert values_t is None and meta_t is None


def test_cusparselt_layout_rejects_what_it_cannot_write():
  w = jnp.ones((128, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="layout must be one of"):
    prune24.prune_compress(w, layout="csr", interpret=True)
  with pytest.raises(TypeError, match="bfloat16 or float16"):
    prune24.prune_compress(w.astype(jnp.float32), layout="cusparselt", interpret=True)
  with pytest.raises(ValueError, match="multiples of 64"):
    masked_compress.compress_with_meta(w[:96], jnp.zeros((64, 12), jnp.uint8), layout="cusparselt",
                               interpret=True)
  with pytest.raises(ValueError, match="transposable_mask: N = w.shape.1. = 66 is not a"):
    transposable24.transposable_mask(jnp.ones((8, 66)), interpret=True)


@jax.jit
def _matmul_rel_err(got, x, values, meta):
  """|got - x @ w| / |x @ w| for the compressed w, in float32: one program
  (eagerly, each primitive compiled per shape)."""
  ref = jnp.dot(x.astype(jnp.float32), jsparse24.decompress(
      jsparse24.Sparse24(values, meta)).astype(jnp.float32))
  return jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)


@pytest.mark.parametrize("m,k,n,dtype,tol", [
    (5, 12, 7, jnp.float32, 1e-5), (16, 64, 32, jnp.bfloat16, 1e-2),
    (33, 136, 40, jnp.float16, 2e-3), (70, 256, 64, jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("lane_dots", [False, True])
def test_sparse_matmul_matches_reference(m, k, n, dtype, tol, lane_dots):
  x = jax.random.normal(jax.random.key(m), (m, k), dtype)
  w = jax.random.normal(jax.random.key(k), (k, n), dtype)
  values, meta, _, _ = prune_compress_reference(w)
  cfg = spmm24.MatmulConfig(16, 16, 128 if lane_dots else 32, 4, 2, lane_dots)
  got = spmm24.sparse_matmul(x, values, meta, k=k, config=cfg, interpret=True)
  assert got.shape == (m, n) and got.dtype == dtype
  err = float(_matmul_rel_err(got, x, values, meta))
  assert err < tol, err


def test_sparse_matmul_rejects_bad_input():
  x = jnp.ones((4, 16), jnp.bfloat16)
  values, meta, _, _ = prune_compress_reference(jnp.ones((16, 8), jnp.bfloat16))
  with pytest.raises(ValueError, match="k = 12"):
    spmm24.sparse_matmul(x, values, meta, k=12, interpret=True)
  with pytest.raises(TypeError, match="share a dtype"):
    spmm24.sparse_matmul(x.astype(jnp.float32), values, meta, k=16, interpret=True)
  with pytest.raises(ValueError, match="multiple of 4"):
    prune24.prune_compress(jnp.ones((6, 8)), interpret=True)
  with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
    prune24.prune_compress(jnp.ones((8, 8), jnp.int32), interpret=True)


@pytest.mark.parametrize("gradient", ["ste", "masked"])
@pytest.mark.parametrize("mask_kind", ["dynamic", "dense", "mask24_transposable"])
def test_pallas_backend_forward_and_vjp(gradient, mask_kind):
  x = jax.random.normal(jax.random.key(0), (2, 5, 16), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (16, 12), jnp.float32)
  mask = {"dynamic": None, "dense": jsparse24.prune_24(w),
          "mask24_transposable": jsparse24.Mask24.from_weights(w, transposable=True)}[mask_kind]

  def run(impl):
    f = lambda x, w: jsparse24.sparse_dot(x, w, mask, gradient=gradient, implementation=impl)  # noqa: E731
    y, vjp = jax.vjp(f, x, w)
    dy = jax.random.normal(jax.random.key(2), y.shape)
    return (y,) + vjp(dy)

  with interpret_mode():
    got = run("pallas")
  for a, b in zip(got, run("xla")):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_public_compress_and_inference_through_pallas():
  w = _weights(5, (16, 8), jnp.bfloat16, specials=False)
  x = jax.random.normal(jax.random.key(6), (3, 16), jnp.bfloat16)
  with interpret_mode():
    sp = jsparse24.compress(w, transposed=True, implementation="pallas")
    y = jsparse24.sparse_dot(x, sp, implementation="pallas")
  ref = jsparse24.compress(w, transposed=True, implementation="xla")
  for a, b in zip(jax.tree.leaves(sp), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(_bits(a), _bits(b))
  np.testing.assert_allclose(np.asarray(y, np.float32),
                             np.asarray(x @ jsparse24.decompress(ref), np.float32), rtol=2e-2, atol=2e-2)


def test_pallas_is_never_chosen_automatically_before_it_measured_faster():
  with interpret_mode():
    assert jsparse24.selected_implementation((16, 64), (64, 32), jnp.bfloat16) == "xla"
  # The policy itself, as on a GPU (not interpreting): no shape qualifies yet
  # (AUTO_MAX_M = 0: the Pallas product never measured faster than XLA's).
  from jsparse24.backends import Problem
  from jsparse24.backends.pallas import PallasBackend
  for m in (1, 16, 128, 4096, 65536):
    for dtype in (jnp.bfloat16, jnp.float16):
      problem = Problem(m=m, k=4096, n=4096, dtype=jnp.dtype(dtype), transposable=True,
                        platform="gpu")
      assert not PallasBackend().prefers(problem), (m, dtype)


def _pallas_call_inputs(jaxpr):
  """The input avals of every pallas_call in `jaxpr`, nested jaxprs included
  (and of the stored-mask compression's primitive, which holds its kernel)."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("pallas_call", "jsparse24_compress_with_mask"):
      found.append([v.aval for v in eqn.invars])
    for inner in sub_jaxprs(eqn):
      found += _pallas_call_inputs(inner)
  return found


def sub_jaxprs(eqn):
  """The jaxprs nested in an equation's params (a cond's branches, a scan's
  body, a pjit's jaxpr, ...)."""
  for value in eqn.params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      inner = getattr(sub, "jaxpr", sub)
      if hasattr(inner, "eqns"):
        yield inner


def test_scan_compress_kernels_read_the_cast_kernel():
  """Under nn.scan a SparseDense's float32 kernel is a slice of the stacked
  params: XLA fuses the slice into a cast (4 bytes read, 2 written per
  weight), but copies it whole (4 + 4) before a kernel that reads float32.
  So the compress kernels get the kernel already cast to the compute dtype
  (docs/design_notes.md, "The weight enters the product uncast; the cast is
  its own XLA op")."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      up = jsparse24.SparseDense(64, name="up", implementation="pallas", dtype=jnp.bfloat16)
      return x + jsparse24.SparseDense(32, name="down", implementation="pallas",
                                       dtype=jnp.bfloat16)(nn.relu(up(x))), None

  model = nn.scan(Block, variable_axes={"params": 0, "sparsity": 0},
                  split_rngs={"params": True}, length=3)()
  x = jnp.ones((8, 32), jnp.bfloat16)
  with interpret_mode():
    v = model.init(jax.random.key(0), x, None)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: model.apply(
        {"params": p, "sparsity": v["sparsity"]}, x, None)[0].astype(jnp.float32).sum()))(
            v["params"])
  kernels = [a for avals in _pallas_call_inputs(jaxpr.jaxpr) for a in avals[:1]
             if a.shape in ((32, 64), (64, 32))]
  assert len(kernels) >= 2, _pallas_call_inputs(jaxpr.jaxpr)
  assert all(a.dtype == jnp.bfloat16 for a in kernels), kernels


# --- 2:4 activations: x[M, K] pruned along its contiguous axis -------------


@pytest.mark.parametrize("config", [None, PruneConfig(block_k=32, block_n=16)])
@pytest.mark.parametrize("shape,dtype", [
    ((1, 8), jnp.float32), ((3, 12), jnp.bfloat16), ((17, 36), jnp.float16),
    ((40, 132), jnp.bfloat16)])
def test_input_prune_compress_is_bit_identical(shape, dtype, config):
  """Rows of x compressed along K equal the Sparse24 of x^T read as a [K, M]
  weight (NaN, inf, a zero row and a tie among them)."""
  from pallas_kernels import input_prune24
  x = _weights(sum(shape), shape[::-1], dtype).T if min(shape) > 5 else _weights(
      sum(shape), shape, dtype, specials=False)
  values, meta = input_prune24.prune_compress_rows(x, config=config, interpret=True)
  ref_values, ref_meta, _, _ = prune_compress_reference(x.T)
  for a, b in ((values, ref_values), (meta, ref_meta)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(_bits(a), _bits(b))


def test_input_prune_compress_cusparselt_layout_holds_the_rows():
  """layout="cusparselt": the values in the buffer's leading M rows, the
  codes as the metadata pass reads them (the Sparse24 bytes, two groups per
  byte); the metadata rows are the caller's and not compared."""
  from pallas_kernels import input_prune24
  x = jax.random.normal(jax.random.key(3), (128, 192), jnp.float32).astype(jnp.bfloat16)
  buf, codes = input_prune24.prune_compress_rows(x, interpret=True, layout="cusparselt")
  ref_values, ref_meta, _, _ = prune_compress_reference(x.T)
  assert buf.shape == (128 + 16, 96) and codes.shape == (128, 24)
  np.testing.assert_array_equal(_bits(buf[:128]), _bits(ref_values))
  np.testing.assert_array_equal(_bits(codes), _bits(ref_meta))


@pytest.mark.parametrize("shape,dtype,layout,match", [
    ((4, 6), jnp.float32, "sparse24", "multiple of 4"),
    ((64, 64), jnp.float32, "cusparselt", "bfloat16 or float16"),
    ((60, 64), jnp.bfloat16, "cusparselt", "multiples of 64"),
    ((4, 8), jnp.float32, "rows", "layout must be one of"),
])
def test_input_prune_compress_checks_its_inputs(shape, dtype, layout, match):
  from pallas_kernels import input_prune24
  with pytest.raises((ValueError, TypeError), match=f"prune_compress_rows: .*{match}"):
    input_prune24.prune_compress_rows(jnp.ones(shape, dtype), interpret=True, layout=layout)


def test_prune_compress_values_rows_leaves_the_rows_after_the_buffer_to_the_caller():
  """`values_rows` (layout="cusparselt"): the values buffer is that many
  rows (its leading rows the default buffer's, byte for byte:
  test_input_sparse.py's `tiles_times_keeping` test); too few rows, or the
  sparse24 layout, are refused with the rows needed."""
  w = jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)
  shapes = lambda **kw: [o.shape for o in jax.eval_shape(functools.partial(  # noqa: E731
      prune24.prune_compress, transposable=True, interpret=True, **kw), w)]
  assert shapes(layout="cusparselt", values_rows=100) == [(100, 64), (64, 16), (144, 32),
                                                            (128, 8)]
  assert shapes(layout="cusparselt")[0] == (72, 64)
  for layout, rows in (("cusparselt", 71), ("sparse24", 100)):
    with pytest.raises(ValueError, match="at least K/2 \\+ K/16 = 72 rows"):
      shapes(layout=layout, values_rows=rows)
