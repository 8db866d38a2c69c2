"""The entry points that dispatch to a backend: `sparse_dot` (the differentiable
2:4 sparse product and its gradient modes) and `compress`. The formats
(`_format`) stand below them and import no backend."""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from jsparse24 import _checks, _phase, backends
from jsparse24._format import Mask24, Sparse24, check_mask24, check_sparse24
from jsparse24._input_sparse import ActivationConfig
from jsparse24._options import SparsityOptions, resolve_transposable
from jsparse24._sharding import is_explicit, weight_split
from jsparse24.backends.cusparselt import cusparselt_layout_unfit, to_cusparselt_layout
from jsparse24.backends.pallas import warn_if_unmeasured


def sparse_dot(
    x: Float[Array, "... K"],
    w: Float[Array, "K N"] | Sparse24,
    mask: Bool[Array, "K N"] | Mask24 | None = None,
    *,
    gradient: Literal["ste", "masked"] = "ste",
    transposable: bool | None = None,
    implementation: str | None = None,
    precision: Any = None,
    weight_grad: Literal["dense", "mvue", "2:4"] = "dense",
    key: jax.Array | None = None,
    weight_sharding: jax.sharding.NamedSharding | None = None,
    input_sparsity: Literal["off", "masked", "ste"] = "off",
    grad_output: Literal["dense", "2:4"] = "dense",
) -> Float[Array, "... N"]:
  """`x @ (w * mask)` with `w` 2:4 sparse along K, differentiable.

  Differentiable in forward and reverse mode (`jax.jvp`, `jax.linearize`,
  `jacfwd`, `grad`, `jacrev`) on every backend. The reference backend
  (`"xla"`) is plain JAX ops; the GPU backends are a `jax.custom_jvp` whose
  tangent is one linear primitive: reverse mode transposes it into their
  backward pass (the sparse `dx` product, `dw` by XLA), forward mode
  evaluates it on their kernels (`backends._autodiff`). In `w` the tangent is
  `x @ w_dot` with the straight-through gradient (the adjoint of its dense
  `dw`), `x @ (w_dot * mask)` with `"masked"`.

  Batched activations: pass them whole (`x[B, T, K]`): the leading axes fold
  into the rows, and `y`, `dx` and `dw` are one product each. Under
  `jax.vmap` over `x` with a shared `w`, the batch axis is folded into the
  rows too: `grad(vmap(f))` computes `dw` as one product, and
  `vmap(grad(f))` gives per-example gradients.

  Args:
    x: `[..., K]` activations (floating).
    w: `[K, N]` dense weights (Flax kernel layout), or a `Sparse24` for
      inference (then `mask` must be None; differentiable in `x` and in its
      kept values on every backend).
    mask: bool `[K, N]` with 2 of every 4 kept along K, a `Mask24`, or None to
      prune `w` by magnitude now (dynamic sparsity; `jsparse24.prune_24`). A
      concrete bool mask is checked; inside `jit` one that is not 2:4 is read
      as `Mask24.pack(mask)` reads it, on every backend: each group of 4 keeps
      its first and its last kept element (with one kept, that one and the
      lowest other; with none, elements 0 and 3).
    gradient: `"ste"` (default): `dw = x^T @ dy` for every weight, pruned ones
      included (straight-through dense gradient); `"masked"`: `dw * mask`.
      `dx = dy @ (w*mask)^T` is exact in both modes.
    transposable: with `mask=None`, prune with the transposable 4x4 rule. With
      a `Mask24` it is taken from the mask; with a dense bool mask it may be
      set to say the mask is transposable (checked when concrete). With
      `input_sparsity` or `grad_output`: True prunes the activation by the
      same rule on 4x4 tiles of `[rows, K]` (or `[rows, N]`), 2:4 along the
      rows too, and `dw` is taken from the pruned operands, on
      `"cusparselt"` on the sparse tensor cores.
    implementation: None (the fastest available backend for this call), or
      one of `"xla"`, `"pallas"`, `"cusparselt"`.
    precision: passed to the dense XLA products.
    weight_grad: `"dense"` (default): `dw` from the whole output gradient;
      `"mvue"`: `dw = x^T @ mvue_24(dy, key)`, the output gradient pruned 2:4
      along the rows of `x` (all leading axes flattened) by the
      minimum-variance unbiased rule (`jsparse24.mvue_24`), so that
      `E[dw]` is the dense `dw` (Hu et al., ICML 2024). Composes with both
      gradient modes; `dx` stays exact; reverse mode only (forward mode
      raises: the estimate is drawn in the backward pass). On
      `"cusparselt"` the pruned product runs on the sparse tensor cores (its
      result rounded once to x's dtype, then cast to w's); elsewhere it is
      XLA's dense product of the pruned `dy`. `"2:4"`, with `input_sparsity`
      or `grad_output`: `dw` from the pruned activation (`prune(x)`, else
      `prune(dy)`) pruned again 2:4 along the rows by magnitude, on
      `"cusparselt"` as the sparse operand (an approximation of `dw`; the
      forward unchanged).
    key: a PRNG key, required with `weight_grad="mvue"` (the same key gives
      the same `dw`, bit for bit), refused otherwise.
    weight_sharding: tensor parallelism under `jax.jit` on a mesh: a
      `NamedSharding` of the `[K, N]` weight, e.g. `P(None, "model")`
      (column-parallel: y comes out sharded on N) or `P("model", None)`
      (row-parallel: x sharded on K, the partial products summed over the
      axis). Each device prunes and compresses only its block of `w` and
      multiplies by it; x's rows are split over the mesh axes the weight
      does not use (data parallelism). None (default): a sharded weight is
      gathered for the product (correct; the speed of data parallelism and
      FSDP only). The backend is chosen for each device's block. Also for
      a `Sparse24` `w` (each device multiplies by its block of it).
    input_sparsity: `"off"` (default), or 2:4 activations: `x` is pruned 2:4
      along K by magnitude (`prune_24(x, axis=-1)`) and `w` is a dense `[K,
      N]` array multiplied as it is (`mask` must be None, the weight-only
      options at their defaults): `y = prune(x) @ w`. The input's gradient
      is `"masked"` (`(dy @ w^T) * mask`, the derivative of the pruned
      product) or `"ste"` (`dy @ w^T`); `dw = prune(x)^T @ dy` (exact).
      Reverse mode only. The `"xla"` backend multiplies masked dense
      arrays; `implementation="cusparselt"` prunes and compresses `x` in
      one Pallas pass and runs `y` on the sparse tensor cores with `x` as
      the sparse operand (K and N multiples of 64, 16-bit), and with
      `transposable=True` `dw = prune(x)^T @ dy` too (x pruned on 4x4
      tiles, 2:4 along the rows as well); `dx` is XLA's product. The
      automatic choice keeps `"xla"`.
      Sources and approximations: the `jsparse24._input_sparse` module
      docstring.
    grad_output: `"dense"` (default), or `"2:4"`: `w` is dense (as with
      `input_sparsity`, which it may join) and the input's gradient is
      `dx = prune(dy) @ w^T`, the output gradient pruned 2:4 along N by
      magnitude, on `"cusparselt"` with `dy` as the sparse operand on the
      sparse tensor cores (N and K multiples of 64, 16-bit). Exact where
      `dy` is 2:4 along N already: the up projection of a feed-forward
      whose down projection has `input_sparsity="masked"`.
      `y` and `dw` are those of the dense product (with
      `transposable=True`, `dw = x^T @ prune(dy)`, dy pruned on 4x4 tiles,
      on `"cusparselt"` on the sparse tensor cores). Reverse mode only.

  Returns:
    `[..., N]` in the promoted dtype of `x` and `w`; products accumulate in
    float32 (float64 for float64 inputs).

  Example:
    >>> import jax, jax.numpy as jnp, jsparse24
    >>> x = jnp.ones((2, 8)); w = jnp.arange(32.).reshape(8, 4)
    >>> y = jsparse24.sparse_dot(x, w)          # prunes w by magnitude
    >>> bool(jnp.allclose(y, x @ (w * jsparse24.prune_24(w))))
    True
  """
  fn = "sparse_dot"
  opts = SparsityOptions.checked(fn, gradient=gradient, transposable=transposable,
                                 implementation=implementation, weight_grad=weight_grad,
                                 kernel_sharding=weight_sharding, input_sparsity=input_sparsity,
                                 grad_output=grad_output,
                                 mask_source=("collection" if (input_sparsity, grad_output)
                                              == ("off", "dense") else "none"))
  if key is not None and weight_grad != "mvue":
    # Ignoring it would hand a user who forgot weight_grad="mvue" the dense
    # weight gradient they meant to replace.
    raise ValueError(f"{fn}: `key` is drawn from only with weight_grad='mvue', got"
                     f" weight_grad={weight_grad!r}: pass weight_grad='mvue' for the MVUE"
                     f" weight gradient, or drop `key`.")
  return _dot(fn, x, w, mask, None, opts, precision=precision, key=key)


def sparse_or_dense_dot(x, w, mask, active, opts: SparsityOptions, *, precision, dtype=None,
                        key=None, fn="SparseDense"):
  """`sparse_dot` with a layer's options `opts` (`mask_source` is the
  layer's to read: here `mask` is given, or None to prune now), or the
  plain dense `x @ w` (full `dw`) where the bool scalar `active` is False
  (None: always sparse; `STATIC_DENSE`, or a flag known while tracing:
  decided at trace time, `jsparse24._phase`): the product of a layer in a
  schedule's dense phases (internal; `SparseDense` and `nnx.SparseLinear`
  call it). `dtype`:
  the compute dtype (the layer's promoted dtype); `w` stays in its own
  dtype and is cast inside the product, so that its gradient comes out in
  that dtype straight from the product.

  The reference backend folds a traced `active` into its mask (`mask |
  ~active`), one elementwise op that XLA fuses: no branch. The others choose
  between the sparse product and XLA's dense one inside their product
  (`Backend.dot`), by a conditional where `active` is traced.
  """
  return _dot(fn, x, w, mask, active, opts, precision=precision, dtype=dtype, key=key,
              key_required=False)


def _dot(fn, x, w, mask, active, opts: SparsityOptions, *, precision, dtype=None, key=None,
         key_required=True):
  """The product with options `opts` (checked when they were made).
  `key_required=False` (the layers): without a key the product runs, and
  only taking its gradient raises (backends._products.weight_grad), so that a
  model with MVUE layers runs inference without an rng."""
  if opts.weight_grad == "mvue" and (key is not None or key_required):
    _checks.check_key(fn, "key", key, "weight_grad='mvue'")
  _checks.check_float(fn, "x", x)
  x = jnp.asarray(x)
  if x.ndim < 1:
    raise ValueError(f"{fn}: `x` must be [..., K], got a scalar.")
  if opts.activation_sparse:
    return _input_sparse_dot(fn, x, w, mask, active, opts, precision=precision, dtype=dtype)
  if isinstance(w, Sparse24):
    return _compressed_dot(fn, x, w, mask, opts, precision=precision)
  return _masked_dot(fn, x, w, mask, active, opts, precision=precision, dtype=dtype, key=key)


def _compressed_dot(fn, x, w: Sparse24, mask, opts: SparsityOptions, *, precision):
  """`x @ decompress(w)` for a compressed weight (`compress`,
  `compress_params`): inference, its gradient that of the kept values."""
  if mask is not None:
    raise ValueError(f"{fn}: `w` is a Sparse24 (already masked); pass mask=None.")
  if opts.weight_grad != "dense":
    raise ValueError(f"{fn}: weight_grad={opts.weight_grad!r} needs a dense `w` (a Sparse24 is"
                     f" for inference; its gradient is that of its kept values).")
  check_sparse24(fn, "w" if fn == "sparse_dot" else "kernel", w)
  if len(w.shape) != 2:
    raise ValueError(f"{fn}: `w` must be a [K, N] Sparse24, got dense shape {w.shape}.")
  _check_contraction(fn, x, w.shape)
  dtype = jnp.result_type(x.dtype, w.dtype)
  w = w.astype(dtype)
  backend, split = _backend_and_split(fn, opts, x.shape, w.shape, dtype, w.has_transpose,
                                      compressed="cusparselt" if w.cusparselt else True)
  if split is not None and w.cusparselt:
    raise ValueError(
        f"{fn}: a Sparse24 in cuSPARSELt's layout (cusparselt=True) cannot be split"
        f" across devices ({_sharding_arg(fn)}"
        f"): its metadata rows follow all N rows, not each device's block. Compress it"
        f" with cusparselt=False for tensor parallelism.")
  if opts.implementation is None and backend.name == "xla":
    warn_if_unmeasured(math.prod(x.shape[:-1]), *w.shape, dtype)
  # Backends take x as [M, K]: the leading axes fold into M here.
  y = backend.dot_compressed(x.astype(dtype).reshape(-1, x.shape[-1]), w, precision, split)
  return y.reshape(*x.shape[:-1], w.shape[1])


def _masked_dot(fn, x, w, mask, active, opts: SparsityOptions, *, precision, dtype, key):
  """`x @ (w * mask)` for a dense weight and its mask (None: pruned now)."""
  weight_grad, transposable = opts.weight_grad, opts.transposable
  w = _dense_w(fn, x, w)
  _checks.check_multiple_of_4(fn, "w", w.shape, 0)

  if isinstance(mask, Mask24):
    check_mask24(fn, "mask", mask)
    _checks.check_same_shape(fn, "mask", mask.shape, w.shape, "w")
    if transposable is not None and transposable != mask.transposable:
      raise ValueError(
          f"{fn}: transposable={transposable} contradicts the Mask24, which"
          f" has transposable={mask.transposable}.")
    transposable = mask.transposable
  transposable = bool(transposable)
  if transposable:
    _checks.check_multiple_of_4(fn, "w", w.shape, 1, "N, for a transposable mask")
  if mask is not None and not isinstance(mask, Mask24):
    mask = _checks.check_dense_mask(fn, mask, w.shape, transposable)
    if not _checks.is_concrete(mask):
      # Inside jit the 2:4 property cannot be checked: every backend reads
      # the mask as Mask24.pack(mask) does (the compressed paths must), so
      # one input gives one answer everywhere.
      mask = Mask24.pack(mask, transposable=transposable)

  dtype = jnp.result_type(x.dtype, w.dtype) if dtype is None else jnp.dtype(dtype)
  backend, split = _backend_and_split(fn, opts, x.shape, w.shape, dtype, transposable)
  cfg = backends.DotConfig(opts.gradient, transposable, precision, weight_grad, split)
  if split is not None and is_explicit(split.mesh):
    # Explicit mesh axes: w typed with its split (a local slice if it was
    # whole), so that its gradient's product knows its output sharding.
    w = jax.sharding.reshard(w, jax.sharding.NamedSharding(split.mesh, split.spec("kn")))
  lead = x.shape[:-1]
  x2 = x.astype(dtype).reshape(-1, x.shape[-1])
  # A flag known while tracing picks its product here: no conditional.
  active = _phase.resolve(active)
  # `w` keeps its dtype: the backend casts it to x's (Backend.dot).
  y = backend.dot(x2, w, mask, active, cfg, key if weight_grad == "mvue" else None)
  return y.reshape(*lead, w.shape[1])


def _input_sparse_dot(fn, x, w, mask, active, opts: SparsityOptions, *, precision, dtype):
  """`prune(x) @ w` with `w` dense (`opts.input_sparsity`, and/or `dx` from
  the pruned output gradient, `opts.grad_output`; checked with the other
  options when they were made)."""
  arg = opts.pruned_options()
  if isinstance(w, Sparse24):
    raise ValueError(f"{fn}: with {arg} `w` is the dense operand; got a Sparse24 (a"
                     f" compressed 2:4 weight). Pass the dense weight.")
  if mask is not None:
    raise ValueError(f"{fn}: with {arg} the input is pruned and `w` stays dense; pass"
                     f" mask=None (a weight mask would make both operands sparse).")
  if active is not None:
    raise ValueError(f"{fn}: with {arg} there is no weight mask to switch off; a dense"
                     f" phase of a schedule does not apply.")
  if opts.kernel_sharding is not None:
    raise ValueError(f"{fn}: {arg} has no tensor-parallel products; pass"
                     f" {_sharding_arg(fn)}=None (data parallelism and FSDP work as for"
                     f" nn.Dense).")
  w = _dense_w(fn, x, w)
  if opts.input_sparsity != "off" and x.shape[-1] % 4:
    raise ValueError(
        f"{fn}: with {arg} x is pruned 2:4 along K = x.shape[-1] = {x.shape[-1]}, which"
        f" must be a multiple of 4 (pad x's last axis and w's first with zeros).")
  if opts.grad_output != "dense" and w.shape[1] % 4:
    raise ValueError(
        f"{fn}: with {arg} the output gradient is pruned 2:4 along N = w.shape[1] ="
        f" {w.shape[1]}, which must be a multiple of 4 (pad w's last axis with zeros).")
  dtype = jnp.result_type(x.dtype, w.dtype) if dtype is None else jnp.dtype(dtype)
  problem = _problem(x.shape, w.shape, dtype, False, input_sparse=True)
  backend = backends.select(opts.implementation, problem, fn)
  x2 = x.astype(dtype).reshape(-1, x.shape[-1])
  cfg = ActivationConfig(opts.input_sparsity, opts.grad_output, bool(opts.transposable),
                         opts.weight_grad, precision)
  y = backend.dot_input_sparse(x2, w, cfg)
  return y.reshape(*x.shape[:-1], w.shape[1])


def _backend_and_split(fn, opts: SparsityOptions, x_shape, w_shape, dtype, transposable,
                       compressed: bool = False):
  """The backend for this call and its tensor-parallel `Split` (None without
  `opts.kernel_sharding`). Under a split each device's block of the product
  decides the backend, and the split is checked against what the backend
  needs of a block."""
  implementation, weight_sharding = opts.implementation, opts.kernel_sharding
  rows = math.prod(x_shape[:-1])
  k, n = w_shape
  if weight_sharding is None:
    problem = _problem(x_shape, w_shape, dtype, transposable, compressed)
    return backends.select(implementation, problem, fn), None
  arg = _sharding_arg(fn)
  # First only the mesh axes (no alignment): the block that picks the backend.
  split = weight_split(fn, weight_sharding, rows, k, n, (1, 1), "any", warn=False, arg=arg)
  block = (rows // split.size("m"), k // split.size("k"), n // split.size("n"))
  backend = backends.select(implementation,
                            _problem(block[:2], block[1:], dtype, transposable, compressed), fn)
  split = weight_split(fn, weight_sharding, rows, k, n, backend.split_align(transposable),
                       backend.name, arg=arg)
  return backend, split


def _dense_w(fn: str, x: jax.Array, w) -> jax.Array:
  """`w` as a float `[K, N]` array whose K is x's last axis, else a named error."""
  _checks.check_float(fn, "w", w)
  w = jnp.asarray(w)
  if w.ndim != 2:
    raise ValueError(f"{fn}: `w` must be 2-D [K, N], got shape {w.shape}; for stacked"
                     f" weights use jax.vmap.")
  _checks.check_nonempty(fn, "w", w.shape, (0, 1), "K or N")
  _check_contraction(fn, x, w.shape)
  return w


def _sharding_arg(fn: str) -> str:
  """What `fn` calls the weight's tensor-parallel sharding, for errors:
  `sparse_dot`'s `weight_sharding`, the layers' `kernel_sharding`."""
  return "weight_sharding" if fn == "sparse_dot" else "kernel_sharding"


def _check_contraction(fn: str, x: jax.Array, w_shape: tuple[int, ...]) -> None:
  if x.shape[-1] != w_shape[0]:
    raise ValueError(
        f"{fn}: `x.shape[-1]` = {x.shape[-1]} does not match K = `w.shape[0]`"
        f" = {w_shape[0]} (x: {x.shape}, w: {tuple(w_shape)}).")


def _problem(x_shape, w_shape, dtype, transposable, compressed=False,
             input_sparse=False) -> backends.Problem:
  """`compressed`: False (a dense weight), True (a `Sparse24`) or
  "cusparselt" (a `Sparse24` in cuSPARSELt's layout); `input_sparse`: an
  activation pruned 2:4 and the weight dense, so nothing is transposable."""
  return backends.Problem(m=math.prod(x_shape[:-1]), k=w_shape[0], n=w_shape[1],
                          dtype=jnp.dtype(dtype),
                          transposable=bool(transposable) and not input_sparse,
                          platform=jax.default_backend(), compressed=bool(compressed),
                          cusparselt_layout=compressed == "cusparselt",
                          input_sparse=bool(input_sparse))


def selected_implementation(x_shape, w_shape, dtype, *, transposable: bool | None = False,
                            compressed: bool | str = False,
                            pruned_activations: bool = False) -> str:
  """The backend `sparse_dot(..., implementation=None)` runs for these shapes
  (x `[..., K]`, w `[K, N]`) and dtype on this machine; `compressed=True`: for
  a `Sparse24` weight (`compress`, `compress_params`), which may take another
  backend than a dense weight with a mask (nothing to prune or compress per
  call: the Pallas decode kernel at small M); `compressed="cusparselt"`: for
  one in cuSPARSELt's layout (`compress(..., cusparselt=True)`: K and N
  multiples of 64), which cuSPARSELt multiplies in place, so from fewer
  rows (a `dtype` other than bfloat16 or float16 is answered as
  `compressed=True`: `sparse_dot` converts such a weight to the portable
  layout for it);
  `pruned_activations=True`: for a dense weight whose layer prunes an
  activation 2:4 (`input_sparsity` or `grad_output`). `transposable=None`:
  as the layers read it, transposable where N is a multiple of 4
  (`pruned_activations`: not)."""
  fn = "selected_implementation"
  x_shape, w_shape = (_checks.check_shape(fn, name, shape)
                      for name, shape in (("x_shape", x_shape), ("w_shape", w_shape)))
  if not (isinstance(compressed, (bool, np.bool_)) or compressed == "cusparselt"):
    raise ValueError(f"{fn}: compressed must be False, True or 'cusparselt', got {compressed!r}.")
  _checks.check_flag(fn, "transposable", transposable, none="as the layers read it")
  _checks.check_flag(fn, "pruned_activations", pruned_activations)
  if dtype is None:  # jnp.dtype(None) is float64, which no layer computes in
    raise TypeError(f"{fn}: dtype must be the product's compute dtype (e.g. jnp.bfloat16),"
                    f" got None; a layer's dtype=None computes in its inputs' dtype.")
  if pruned_activations and compressed:
    raise ValueError(f"{fn}: pruned_activations=True describes a dense weight (the activation"
                     f" is the pruned operand); pass compressed=False.")
  _checks.check_float_dtype(fn, "dtype", dtype)
  if len(w_shape) != 2 or not x_shape:
    raise ValueError(f"{fn}: expected x_shape [..., K] and w_shape [K, N], got {x_shape}"
                     f" and {w_shape}.")
  _checks.check_nonempty(fn, "w", w_shape, (0, 1), "K or N")
  _checks.check_multiple_of_4(fn, "w", w_shape, 0)
  if compressed == "cusparselt":
    # Such a weight has K and N that compress could lay out. A product in a
    # dtype other than its 16 bits converts it to the portable layout first
    # (`_compressed_dot`'s `w.astype`), and is answered as one.
    unfit = cusparselt_layout_unfit(w_shape, jnp.bfloat16, off="compressed=True")
    if unfit:
      raise ValueError(f"{fn}: compressed='cusparselt' describes a weight in cuSPARSELt's layout"
                       f" (compress(..., cusparselt=True)), which {unfit}")
    if cusparselt_layout_unfit(w_shape, dtype):
      compressed = True
  if x_shape[-1] != w_shape[0]:
    raise ValueError(f"{fn}: x_shape[-1] = {x_shape[-1]} does not match K ="
                     f" w_shape[0] = {w_shape[0]}.")
  transposable = resolve_transposable(transposable, w_shape[1],
                                      "none" if pruned_activations else "collection")
  return backends.select(None, _problem(x_shape, w_shape, dtype, transposable,
                                        compressed, input_sparse=pruned_activations)).name


def compress(
    w: Float[Array, "... K N"],
    mask: Bool[Array, "... K N"] | Mask24 | None = None,
    *,
    transposed: bool = False,
    implementation: str | None = None,
    cusparselt: bool = False,
) -> Sparse24:
  """Compresses `w` with a 2:4 mask (along K, axis -2) into a `Sparse24`.

  Args:
    w: floating `[..., K, N]`, K a multiple of 4.
    mask: bool `[..., K, N]` with exactly 2 of every 4 kept along K (as made
      by `prune_24`), a `Mask24`, or None to prune `w` by magnitude now (with
      the transposable rule when `transposed=True`). A concrete bool mask is
      checked; inside `jit` the 2:4 property is the caller's promise (masks
      from `prune_24` and `Mask24` always keep it).
    transposed: also store the transpose (the mask must then be 2:4 along N
      too, i.e. transposable; N a multiple of 4).
    implementation: None (the fused Pallas kernel on a GPU for 2-D weights,
      else the reference), `"xla"` or `"pallas"`. All give identical bits.
    cusparselt: store the values in cuSPARSELt's layout (`Sparse24.cusparselt`:
      the kept values followed by cuSPARSELt's metadata, N*K/8 bytes more),
      which cuSPARSELt multiplies in place: for inference at a prefill's or a
      large batch's rows. bfloat16 or float16, K and N multiples of 64; not
      for a weight split across devices.

  Returns:
    A `Sparse24` with `decompress(compress(w, m)) == w * m` exactly.
  """
  fn = "compress"
  _checks.check_flag(fn, "transposed", transposed)
  _checks.check_flag(fn, "cusparselt", cusparselt)
  _checks.check_float(fn, "w", w)
  w = jnp.asarray(w)
  _checks.check_kn(fn, "w", w.shape)
  _checks.check_nonempty(fn, "w", w.shape, (w.ndim - 2, w.ndim - 1), "K or N")
  _checks.check_multiple_of_4(fn, "w", w.shape, w.ndim - 2)
  if transposed:
    _checks.check_multiple_of_4(fn, "w", w.shape, w.ndim - 1, "N, for the transposed copy")
  if isinstance(mask, Mask24):
    check_mask24(fn, "mask", mask)
    _checks.check_same_shape(fn, "mask", mask.shape, w.shape, "w")
    if transposed and not mask.transposable:
      raise ValueError(f"{fn}: transposed=True needs a transposable Mask24.")
  elif mask is not None:
    mask = _checks.check_dense_mask(fn, mask, w.shape, transposed)
  sp = backends.select_compress(implementation, w).compress(w, mask, transposed)
  return to_cusparselt_layout(sp, fn) if cusparselt else sp
