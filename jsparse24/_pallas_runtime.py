"""Where the Pallas kernels run, and the one kernel the formats use.

Below the formats and the backends (it imports neither), so that both can
ask it:

* `triton_unavailable_reason`: whether the kernels can run at all (Pallas's
  Triton lowering imports, and the environment does not switch them off:
  `DISABLE_ENV`);
* `interpret_mode` / `interpreting`: the kernels interpreted (any platform;
  tests on CPU), a context that keys jit's cache;
* `runs_natively`: compiled on an NVIDIA GPU, not interpreted;
* `transposable_mask_meta`: the fused transposable mask kernel, the fast
  path of `Mask24.from_weights` (and of the mask rebuilds' first build).

`jsparse24.backends.pallas` re-exports the first three; the kernels
themselves are imported only when used (`jax.experimental.pallas.triton`
must never be imported where the XLA fallback runs).
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp

from jsparse24._sharding import columns_parallel

# The environment variable that, set to 1, makes the Pallas kernels count as
# unable to run, as they will be once JAX removes Pallas's Triton lowering.
DISABLE_ENV = "JSPARSE24_DISABLE_PALLAS_TRITON"
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)

# Interpret mode (`interpret_mode`): a `jax.make_user_context`, so that its
# value is part of jit's cache key.
_INTERPRET = jax.make_user_context(False)


@functools.cache
def triton_unavailable_reason() -> str | None:
  """None where the Pallas kernels can run (Pallas's Triton lowering and the
  kernel modules import), else why they cannot. Decided on the first call,
  once per process: a choice that changed while traced functions are cached
  would leave some of them with the other one."""
  switch = os.environ.get(DISABLE_ENV, "")
  if switch not in ("", "0"):
    return (f"the Pallas kernels need Pallas's Triton lowering, and the environment sets"
            f" {DISABLE_ENV}={switch} (unset it, or set it to 0, to use them)")
  try:
    # pylint: disable=g-import-not-at-top,unused-import
    from jax.experimental.pallas import triton  # noqa: F401
    from pallas_kernels import prune24  # noqa: F401
  except ImportError as e:
    return (f"the Pallas kernels need Pallas's Triton lowering"
            f" (jax.experimental.pallas.triton), which cannot be imported with jax"
            f" {jax.__version__} ({type(e).__name__}: {e}); use a jax release that still"
            f" ships it")
  return None


def interpreting() -> bool:
  """Whether the Pallas kernels run in interpret mode (`interpret_mode`)."""
  return bool(_INTERPRET.value)


@contextlib.contextmanager
def interpret_mode(enabled: bool = True):
  """Runs the Pallas kernels in interpret mode (any platform; slow) within
  (they still need Pallas's Triton lowering to import:
  `triton_unavailable_reason`).

  Scope: the `with` block, in the calling thread; the choice is made where
  a function is traced. The setting is part of `jax.jit`'s cache key, and
  of the cached kernel builders' keys, so a function jitted outside the
  block is traced again when called inside it (and keeps its compiled
  kernels for calls outside). What was traced inside keeps interpret mode
  wherever it is run: an exported or lowered function (`jax.export`,
  `.lower()`), a jaxpr. Enter the block before tracing what should run
  interpreted.
  """
  with _INTERPRET(bool(enabled)):
    yield


def gpu_unavailable_reason(elsewhere: str = "") -> str | None:
  """None on an NVIDIA GPU of compute capability 8.0+ (JAX's default
  backend), else why a backend's GPU code cannot run here (`elsewhere`:
  appended where JAX's backend is not a GPU, what to do instead)."""
  if jax.default_backend() != "gpu":
    return (f"it needs an NVIDIA GPU (compute capability 8.0+) and JAX's default backend"
            f" is {jax.default_backend()!r}{elsewhere}")
  cc = getattr(jax.devices()[0], "compute_capability", None)
  try:
    ok = cc is not None and float(cc) >= 8.0
  except ValueError:  # a compute capability that is not a number
    ok = False
  return None if ok else f"it needs an NVIDIA GPU of compute capability 8.0+, found {cc!r}"


def runs_natively() -> bool:
  """Whether the Pallas kernels run compiled here: they can run
  (`triton_unavailable_reason`), on a GPU, not interpreted."""
  return (not interpreting() and triton_unavailable_reason() is None
          and gpu_unavailable_reason() is None)


def mask_kernel_takes(w, transposable: bool) -> bool:
  """Whether the mask kernels take `w` (`[..., K, N]`, K a multiple of 4, N
  too for a transposable mask, a dtype of `DTYPES`)."""
  return bool(w.ndim >= 2 and w.shape[-2] and w.shape[-1] and not w.shape[-2] % 4
              and not (transposable and w.shape[-1] % 4) and w.dtype in DTYPES)


@functools.cache
def _mask_fn(interpret: bool):
  from pallas_kernels import transposable24  # pylint: disable=g-import-not-at-top
  return lambda w: (transposable24.transposable_mask(w, interpret=interpret),)


def transposable_mask_meta(w: jax.Array) -> jax.Array:
  """The packed transposable mask of `w` (`Mask24.from_weights(w,
  transposable=True)`'s metadata, the same bits) by the fused kernel: one
  read of `w` (any leading axes, float32 master weights included), no
  values written. Under `jit` with `w` sharded on N (or K, in whole bytes of
  the mask), each device searches its own block."""
  (meta,) = columns_parallel(_mask_fn(interpreting()), (0,), 8, jax.lax.stop_gradient(w),
                             lead=w.ndim - 2, k_dims=(1,))
  return meta
