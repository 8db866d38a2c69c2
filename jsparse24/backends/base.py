"""The interface every `implementation=` backend of `sparse_dot` provides.

`Backend.dot` is the product with its derivatives. By default it is built
from the backend's pieces (`_autodiff.custom_dot`): `prepare` turns `(w,
mask)` into an *operand* once per forward pass (prune and/or compress),
`forward` multiplies by it, and the backward pass reuses the same operand
for `dx = dy @ (w*m)^T` (`backward_dx`): nothing is pruned or compressed
twice per step. `dw = x^T @ dy` is a dense XLA product; with
`weight_grad="mvue"` it is `Backend.mvue_weight_grad` (XLA's dense product
of the pruned `dy` unless the backend has a sparse one). The reference
backend overrides `dot` with plain JAX ops.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any

import jax

from jsparse24._format import Mask24, Sparse24
from jsparse24._sharding import Split
from jsparse24.backends import _autodiff, _products

if TYPE_CHECKING:  # _input_sparse imports the backends' modules
  from jsparse24._input_sparse import ActivationConfig


@dataclasses.dataclass(frozen=True)
class DotConfig:
  """The static settings of one `sparse_dot` call."""

  gradient: str  # "ste" or "masked"
  transposable: bool
  precision: Any
  weight_grad: str = "dense"  # "dense" or "mvue" (dw from the MVUE-pruned dy)
  # Tensor parallelism: the products run on each device's block of the
  # weight (`_sharding.Split`, from `sparse_dot`'s `weight_sharding`).
  split: Split | None = None


class BackendUnavailableError(ValueError):
  """An explicitly requested backend cannot run here (the message says why)."""


class UnmeasuredChoiceWarning(UserWarning):
  """The automatic choice took a slow path only because nothing was measured
  for this GPU, dtype or shape (the message says which table lacks it and
  how to fill it or choose by hand). Issued once per process and case."""


class XlaFallbackWarning(UserWarning):
  """XLA code with the same bits replaces kernels that cannot run here
  (slower, still correct; the message says which and why). Issued once per
  process."""


@dataclasses.dataclass(frozen=True)
class Problem:
  """The static facts a backend needs to decide whether it can run a call."""

  m: int  # rows of x after flattening leading axes
  k: int
  n: int
  dtype: Any
  transposable: bool
  platform: str  # jax.default_backend() at trace time
  # The weight arrives compressed (a `Sparse24`, e.g. from `compress_params`):
  # no pruning or compression is paid per call.
  compressed: bool = False
  # ... in cuSPARSELt's layout (`Sparse24.cusparselt`): its products read it
  # in place.
  cusparselt_layout: bool = False
  # An activation is pruned 2:4 and the weight dense (`input_sparsity`,
  # `grad_output`): `Backend.dot_input_sparse`.
  input_sparse: bool = False


class Backend(abc.ABC):
  """One implementation of the sparse product."""

  name: str
  # Why `jsparse24.compress(..., implementation=name)` cannot use this backend
  # (None: it can).
  no_sparse24_reason: str | None = None

  def unavailable_reason(self) -> str | None:
    """None when this backend can run on this machine, else why not."""
    return None

  def check_supported(self, problem: Problem) -> None:
    """Raises NotImplementedError (with the reason) for inputs it cannot run."""

  def prefers(self, problem: Problem) -> bool:
    """Whether `implementation=None` should take this backend for `problem`:
    only where it measured faster than dense XLA."""
    del problem
    return True

  def compress(self, w: jax.Array, mask: jax.Array | Mask24 | None,
               transposed: bool) -> Sparse24:
    """`jsparse24.compress` (arguments already checked)."""
    raise NotImplementedError(f"the {self.name!r} backend has no compress")

  def dot(self, x: jax.Array, w: jax.Array, mask: jax.Array | Mask24 | None,
          active: jax.Array | None, cfg: DotConfig, key: jax.Array | None = None) -> jax.Array:
    """`x[M, K] @ (w*mask)[K, N]` computed in x's dtype, differentiable in
    `x` and `w` with `cfg.gradient`'s `dw` (in w's dtype; `w` may be wider
    than x, e.g. a float32 kernel with bfloat16 compute, and is cast inside).
    `active`: None, a traced bool scalar, or `STATIC_DENSE`
    (`jsparse24._phase`); where it is False or `STATIC_DENSE` the product is
    the plain dense `x @ w` (full `dw`): a schedule's dense phase. With
    `cfg.weight_grad == "mvue"`, `dw = x^T mvue_24(dy, key)` while sparse."""
    return _autodiff.custom_dot(x, w, mask, active, key, self, cfg)

  # The pieces of the default `dot` (a backend that overrides `dot` needs none).

  def prepare(self, w: jax.Array, mask: jax.Array | Mask24 | None,
              transposable: bool) -> Any:
    """Masks/compresses `w`: returns the operand (a pytree of arrays).

    `mask=None` means prune `w` by magnitude now (`transposable` says how).
    """
    raise NotImplementedError

  def forward(self, x: jax.Array, operand: Any, precision: Any) -> jax.Array:
    """`x[M, K] @ (w*m)[K, N]`, accumulated in float32, in x's dtype."""
    raise NotImplementedError

  def backward_dx(self, dy: jax.Array, operand: Any, precision: Any) -> jax.Array:
    """`dy[M, N] @ (w*m)^T`, accumulated in float32, in dy's dtype."""
    raise NotImplementedError

  def mask_grad(self, dw: jax.Array, operand: Any) -> jax.Array:
    """`dw * mask` for the "masked" gradient mode."""
    raise NotImplementedError

  def operand_roles(self, operand: Any) -> Any:
    """`operand`'s structure with, for each array, which axis runs over K
    and which over N (a string such as "nk"; `_sharding.Split.spec`): how a
    weight block's operand sits in the whole one, for tensor parallelism."""
    raise NotImplementedError(f"the {self.name!r} backend has no tensor-parallel products")

  def split_align(self, transposable: bool) -> tuple[int, int]:
    """What each device's block of `[K, N]` must be a multiple of, along K
    and along N, for this backend's tensor-parallel products."""
    del transposable
    return 8, 8

  def mvue_weight_grad(self, x: jax.Array, dy: jax.Array, w: jax.Array, key: jax.Array,
                       precision: Any) -> jax.Array:
    """`x[M, K]^T mvue_24(dy[M, N], key)` in w's dtype: here XLA's dense
    product of the pruned `dy` (the reference; a backend with a sparse
    product for it overrides this)."""
    del self
    return _products.mvue_weight_grad_xla(x, dy, w, key, precision)

  def dot_input_sparse(self, x: jax.Array, w: jax.Array, cfg: ActivationConfig) -> jax.Array:
    """`prune_24(x, axis=-1) * x @ w` for `x[M, K]` in the compute dtype
    and a dense `w[K, N]` (cast inside; `dw` in its dtype), with the input
    gradient `cfg.input_sparsity` ("masked" or "ste"; "off": `x @ w`,
    unpruned), `dx` from the output gradient pruned 2:4 where
    `cfg.grad_output` is "2:4", with `cfg.transposable` the masks by the 4x4
    tile rule and `dw` from the pruned operands, and with
    `cfg.weight_grad="2:4"` `dw` from the pruned activation pruned again
    along M: `jsparse24._input_sparse`."""
    raise NotImplementedError(f"the {self.name!r} backend has no 2:4-activation product")

  @abc.abstractmethod
  def forward_compressed(self, x: jax.Array, sp: Sparse24, precision: Any) -> jax.Array:
    """`x @ decompress(sp)` for inference on a compressed weight."""

  def dot_compressed(self, x: jax.Array, sp: Sparse24, precision: Any,
                     split: Split | None = None) -> jax.Array:
    """`x[M, K] @ decompress(sp)`, differentiable in `x` and in `sp.values`.
    By default a custom_vjp around `forward_compressed` (the Pallas and
    cuSPARSELt calls have no transpose rule); the reference backend
    overrides it with its plain ops. `split`: tensor parallelism, each
    device multiplying by its block of `sp` (`_sharding.split_map`)."""
    return _autodiff.compressed_product(x, sp, self, precision, split)


def grid_index(size: int, grid: tuple[int, ...]) -> int | None:
  """The index of the last point of the ascending `grid` at or below `size`
  (None below the grid): the cell of a table measured on that grid."""
  below = [i for i, g in enumerate(grid) if g <= size]
  return below[-1] if below else None
