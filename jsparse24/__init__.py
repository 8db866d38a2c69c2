"""jsparse24: 2:4 structured-sparse training for JAX/Flax.

Public API (everything else is internal):

* formats: `prune_24`, `is_24`, `compress`, `decompress`, `Sparse24`, `Mask24`
* the op: `sparse_dot` (differentiable; gradient modes "ste" and "masked";
  `weight_grad="mvue"`: an unbiased 2:4-pruned output gradient for `dw`,
  `mvue_24` and its `mvue_24_probabilities`)
* Flax Linen: `SparseDense`, `sparsify` (patch an existing model's `Dense`
  layers by module-path regex), `rebuild_masks`, `compress_params`;
  `SparseMoE`, a mixture-of-experts feed-forward layer with 2:4 experts
  (`jsparse24.moe`: its routing, capacity and auxiliary loss)
* Flax NNX: `jsparse24.nnx.SparseLinear`
* optax: `jsparse24.optim` (the mask-update transform and its schedule;
  `optim.with_masks(optimizer, sparsity, schedule)` chains it before an
  optimizer)
* backends: `available_implementations`, `selected_implementation`,
  `BackendUnavailableError`
* several devices: `masks_like_kernels` (also in `optim` and `nnx`);
  `jsparse24.layouts`, the state's shardings per layout (data parallel, FSDP,
  tensor parallel, 2-D) and the 2:4 layers' `kernel_sharding` to match; remat:
  `CHECKPOINT_NAME`, the name of the products' compressed weights, for a
  `jax.checkpoint` policy that keeps them
  (`jax.checkpoint_policies.save_only_these_names(CHECKPOINT_NAME)`);
  `jsparse24.checkpoint_policies`, JAX's dot-saving policies with the 2:4
  products saved too (JAX's see only `dot_general`)
"""

from jsparse24 import checkpoint_policies, layouts, moe, nnx, optim
from jsparse24._format import Mask24, Sparse24, decompress
from jsparse24._mvue import mvue_24, mvue_24_probabilities
from jsparse24._ops import compress, selected_implementation, sparse_dot
from jsparse24._prune import is_24, prune_24
from jsparse24.backends import BACKENDS as _BACKENDS
from jsparse24.backends import BackendUnavailableError
from jsparse24.backends._autodiff import COMPRESSED as CHECKPOINT_NAME
from jsparse24.linen import (SparseDense, compress_params, masks_like_kernels, rebuild_masks,
                             sparsify)
from jsparse24.moe import SparseMoE

__version__ = "0.1.0"


def available_implementations() -> dict[str, str | None]:
  """Each backend name -> None if it can run here, else the reason it cannot."""
  return {name: b.unavailable_reason() for name, b in _BACKENDS.items()}


__all__ = [
    "BackendUnavailableError",
    "CHECKPOINT_NAME",
    "Mask24",
    "Sparse24",
    "SparseDense",
    "SparseMoE",
    "available_implementations",
    "checkpoint_policies",
    "compress",
    "compress_params",
    "decompress",
    "is_24",
    "layouts",
    "masks_like_kernels",
    "moe",
    "mvue_24",
    "mvue_24_probabilities",
    "nnx",
    "optim",
    "prune_24",
    "rebuild_masks",
    "selected_implementation",
    "sparse_dot",
    "sparsify",
]
