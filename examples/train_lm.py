"""Train a small character-level transformer LM dense and 2:4 sparse, side by side.

The model is a decoder-only transformer (pre-LayerNorm blocks, causal
self-attention, learned position embeddings). Its MLP layers (`mlp/up` and
`mlp/down` in every block) are `jsparse24.SparseDense`; attention, embeddings
and the output head stay dense. Two runs share the seed, the data and the step
count:

* `dense`: the same model with `nn.Dense` MLP layers (identical `params` tree,
  so both runs start from the very same weights), trained with AdamW;
* `2:4`: `jsparse24.optim.mask_update` chained before AdamW (masks of the
  kind `--mask` names; by default SparseDense's: transposable). It holds the 2:4
  masks (dense warm-up, then a magnitude rebuild every `--rebuild-every` steps,
  frozen for the last 20% of training) and adds a masked decay to the pruned
  weights; the forward pass reads the masks with `jsparse24.optim.masks`.
  With `--sparsity-ramp START,END` the MLP layers go 2:4 a few at a time
  (`jsparse24.optim.SparsityRamp`: a cosine ramp of the share of 2:4 layers
  from none at step START to all at step END, the layers whose masks remove
  the least of their weights first) instead of all at the end of the
  warm-up. The step is then jitted for each set of 2:4 layers that the ramp
  passes through, with and without a mask rebuild (at most 2 x (2:4 layers
  + 1) programs; the report prints how many), so that no product switches
  between its dense and 2:4 computations at run time
  (`jsparse24.optim.masks`).
  With `--mvue` its MLP kernels learn from the output gradient pruned 2:4 by
  the minimum-variance unbiased rule (`SparseDense(weight_grad="mvue")`, one
  key per step folded from the seed, so `--resume` continues bit for bit).

`--moe E,K`: the feed-forward layer of every block is a mixture of experts,
`jsparse24.SparseMoE` (E experts of hidden width 4 x d_model, each token
routed to its top K, capacity factor 1.25, each sequence a routing group):
2:4 experts with masks per expert in the 2:4 run, the same layer with
`sparse=False` (`nn.Dense` experts, same params) in the dense run. Both add
`--moe-aux-weight` times the layers' mean load-balancing loss (Switch
Transformer's, sown by `SparseMoE`) to the training loss; the losses
reported are the cross-entropy alone.

`--ffn-activation relu2 --sparse-activations masked` (or `ste`): both runs
use a squared-ReLU MLP, and the 2:4 run prunes mlp/down's input (the
activations) 2:4 at every step, its kernel dense; mlp/up keeps 2:4 weights,
or with `--mlp-weights dense` a dense kernel, so that the runs differ only
in the pruned activations (Haziza et al. 2025, arXiv 2503.16672). With
`--activation-weight-grad 2:4`, mlp/down's weight gradient comes from its
pruned input pruned again 2:4 along the tokens (the product that can run on
the sparse tensor cores; an approximation).

The text ships with Python: a fixed list of standard-library modules
(`--corpus`: 8 files, ~0.6 MB, in the small preset; every `.py` file of the
standard library, ~30 MB, in the gpu preset; the first 90% of each file trains,
the last 10% validates), read as bytes
(vocabulary 0..255, so a model that learned nothing scores ln 256 = 5.55).

Writes into `--out` (default `runs/train_lm`):

* `loss_curves.png`: train and validation loss of both runs;
* `checkpoints/sparse/<step>` and `checkpoints/dense/<step>`: Orbax
  checkpoints (params and the whole optimizer state, so the 2:4 run's masks and
  mask statistics too, plus the loss history), saved at every evaluation;
  `--resume` continues each run from its latest one;
* `train_lm_flags.json`: the flags that describe the models (the command line
  without `--out` and `--resume`, the preset explicit). `--resume` and
  examples/generate.py put them before the flags they are given, so those
  need name only what changes.

Run:

    python examples/train_lm.py                # the preset for this machine (below)
    python examples/train_lm.py --size small   # the CPU preset, on any machine
    python examples/train_lm.py --steps 1500 --resume  # train further

Without `--size` the preset follows the platform, and the first line printed
says which and why: "gpu" where JAX finds a GPU (d_model 4096, 2 blocks, bf16,
32 x 512 tokens per step: wide enough that the automatic choice runs the MLP
layers on cuSPARSELt; both runs take minutes on one H100), "small" elsewhere
(d_model 128, 2 blocks, float32, 16 x 64 tokens per step: both runs in a few
minutes on a CPU). A `--size` given always wins; any flag given wins over the
preset's value.

On `--resume` the learning-rate and mask schedules are those of the new
`--steps` (a longer run stretches them); a checkpoint already at or past
`--steps` trains nothing, and the run says so.

On CPU the `"xla"` backend runs (a masked dense product): the 2:4 run shows
the accuracy of 2:4 training, not its speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

import jsparse24

# Standard-library modules present in Python 3.11 to 3.13 (none of them moved
# into a package or split out by distributions). "small": ~0.6 MB of text for
# the CPU preset; "large": ~5 MB.
CORPORA = {
    "small": (
        "argparse.py", "textwrap.py", "functools.py", "dataclasses.py",
        "inspect.py", "typing.py", "enum.py", "ast.py",
    ),
}
CORPORA["large"] = CORPORA["small"] + tuple("""
    calendar.py configparser.py difflib.py doctest.py ipaddress.py optparse.py pickle.py
    pickletools.py pdb.py pydoc.py shutil.py smtplib.py socket.py ssl.py statistics.py
    subprocess.py tarfile.py threading.py traceback.py imaplib.py ftplib.py random.py
    string.py tempfile.py uuid.py weakref.py selectors.py mailbox.py _pydecimal.py
    fractions.py gettext.py locale.py os.py platform.py plistlib.py pprint.py shlex.py
    signal.py codecs.py contextlib.py copy.py csv.py heapq.py bisect.py fnmatch.py glob.py
    gzip.py hashlib.py hmac.py linecache.py numbers.py operator.py queue.py quopri.py
    reprlib.py sched.py secrets.py socketserver.py stat.py tokenize.py trace.py types.py
    warnings.py wave.py zipapp.py bdb.py cmd.py code.py codeop.py colorsys.py compileall.py
    contextvars.py copyreg.py dis.py filecmp.py fileinput.py genericpath.py getopt.py
    getpass.py graphlib.py keyword.py lzma.py bz2.py mimetypes.py modulefinder.py netrc.py
    ntpath.py nturl2path.py opcode.py posixpath.py py_compile.py pyclbr.py rlcompleter.py
    runpy.py shelve.py site.py tabnanny.py timeit.py token.py tracemalloc.py tty.py
    webbrowser.py zipimport.py collections/__init__.py logging/__init__.py
    logging/handlers.py logging/config.py email/message.py email/_header_value_parser.py
    http/client.py http/server.py http/cookiejar.py json/decoder.py json/encoder.py
    urllib/request.py urllib/parse.py unittest/mock.py unittest/case.py
    concurrent/futures/_base.py concurrent/futures/process.py asyncio/base_events.py
    asyncio/tasks.py multiprocessing/connection.py xml/dom/minidom.py
    xml/etree/ElementTree.py sqlite3/__init__.py importlib/_bootstrap.py
    importlib/_bootstrap_external.py
""".split())
VOCAB = 256  # bytes
MOE_CAPACITY_FACTOR = 1.25  # --moe's experts' capacity (SparseMoE's default)
VAL_FRACTION = 0.1

# "stdlib": every .py file of the standard library (sorted paths, without
# site-packages): ~30 MB, more than the GPU preset reads in its 1000 steps
# (16 MB), so its 400M-parameter model cannot memorise what it validates on.
CORPORA["stdlib"] = None

# Defaults per `--size`; any flag given on the command line wins.
# "gpu": wide enough (d_model 4096, MLP 4096 x 16384, 16,384 tokens per step)
# that the automatic choice puts the MLP layers on cuSPARSELt, where the 2:4
# run is faster than the dense one (a narrower model falls back to the dense
# product and gains nothing; README), yet both runs take minutes on one H100.
PRESETS = {
    "small": dict(steps=1000, batch=16, seq_len=64, d_model=128, layers=2, heads=4,
                  lr=3e-3, eval_every=100, eval_batches=8, dtype="float32", corpus="small"),
    "gpu": dict(steps=1000, batch=32, seq_len=512, d_model=4096, layers=2, heads=32,
                lr=5e-4, eval_every=250, eval_batches=8, dtype="bfloat16", corpus="stdlib"),
}
# The preset of a run without --size, by JAX's backend (`jax.default_backend()`;
# any other: "small"). On a GPU the small preset shows nothing of what 2:4 is
# for: at d_model 128 and 1,024 tokens per step the automatic choice keeps
# every product dense, and the 2:4 run still pays for its masks.
DEFAULT_SIZES = {"gpu": "gpu", "cpu": "small"}


def choose_size(size: str | None) -> tuple[str, str]:
  """(preset, why in words): `size` where given (`--size` always wins), else
  the one `DEFAULT_SIZES` names for this platform. Asks JAX for its backend,
  which starts the backends: a multi-process run calls this after
  `jax.distributed.initialize` (examples/sharded_train.py)."""
  if size is not None:
    return size, f"--size {size}"
  backend = jax.default_backend()
  chosen = DEFAULT_SIZES.get(backend, "small")
  if chosen == "gpu":
    return chosen, "JAX found a GPU; --size small for the CPU preset"
  return chosen, f"JAX's backend is {backend!r}, no GPU; --size gpu for the GPU preset"


# --- data ---------------------------------------------------------------------


def corpus_files(corpus: str) -> list[str]:
  """The standard-library files (paths relative to it) of `corpus`."""
  if CORPORA[corpus] is not None:
    return list(CORPORA[corpus])
  stdlib = sysconfig.get_paths()["stdlib"]
  files = sorted(os.path.relpath(os.path.join(d, f), stdlib)
                 for d, dirs, names in os.walk(stdlib)
                 if "site-packages" not in os.path.relpath(d, stdlib).split(os.sep)
                 and "__pycache__" not in d
                 for f in names if f.endswith(".py"))
  if not files:
    raise FileNotFoundError(f"no .py files under the standard library {stdlib!r}; this"
                            f" example trains on Python's own sources.")
  return files


def load_text(files: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  """(train, val) uint8 arrays: the first 90% / last 10% of every file."""
  stdlib = sysconfig.get_paths()["stdlib"]
  missing = [f for f in files if not os.path.isfile(os.path.join(stdlib, f))]
  if missing:
    raise FileNotFoundError(
        f"standard-library source file(s) {missing} not found in {stdlib!r}."
        f" This example trains on Python's own sources; it needs a Python"
        f" installation that ships them (not a stripped, .pyc-only one).")
  train, val = [], []
  for name in files:
    with open(os.path.join(stdlib, name), "rb") as f:
      data = np.frombuffer(f.read(), dtype=np.uint8)
    cut = int(len(data) * (1 - VAL_FRACTION))
    train.append(data[:cut])
    val.append(data[cut:])
  return np.concatenate(train), np.concatenate(val)


def train_batch(data: np.ndarray, step: int, batch: int, seq_len: int, seed: int,
                rows: slice = slice(None)):
  """Random windows for `step`: a function of (seed, step) only, so a resumed
  run sees the same batches as an uninterrupted one. `rows`: only these rows
  of the batch (a process of a multi-process run makes its own rows only)."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(data) - seq_len - 1, size=batch)[rows]
  windows = np.lib.stride_tricks.sliding_window_view(data, seq_len + 1)[starts]
  return windows[:, :-1].astype(np.int32), windows[:, 1:].astype(np.int32)


def val_batches(data: np.ndarray, n: int, batch: int, seq_len: int):
  """A fixed set of `n` validation batches, windows spread over the split:
  ([n, batch, seq_len], [n, batch, seq_len])."""
  if len(data) < seq_len + 2:
    raise ValueError(f"the validation split ({len(data)} bytes) is shorter than --seq-len.")
  starts = np.linspace(0, len(data) - seq_len - 1, n * batch).astype(np.int64)
  windows = np.lib.stride_tricks.sliding_window_view(data, seq_len + 1)[starts]
  windows = windows.reshape(n, batch, seq_len + 1).astype(np.int32)
  return windows[..., :-1], windows[..., 1:]


# --- model --------------------------------------------------------------------


# The MLP's activation by --ffn-activation (the experts' too under --moe).
ACTIVATIONS = {"gelu": nn.gelu, "relu2": lambda h: jnp.square(nn.relu(h))}


class MLP(nn.Module):
  """The block's feed-forward layers: 2:4 sparse when `sparse`. `activation`:
  "gelu", or "relu2" (squared ReLU, whose outputs are mostly zero: the
  feed-forward of Haziza et al. 2025, arXiv 2503.16672). `input_sparsity`
  ("off", "masked", "ste"): in the sparse model, `down`'s input (the
  activations) pruned 2:4 at every step and its kernel dense
  (`jsparse24.SparseDense(input_sparsity=...)`), `up` keeping 2:4 weights,
  or with `weights="dense"` a dense kernel (`nn.Dense`): then the model
  differs from the dense one only in its pruned activations."""

  hidden: int
  sparse: bool
  dtype: Any = None
  transposable: bool | None = None  # None: SparseDense's default
  weight_grad: str = "dense"
  # Tensor parallelism (examples/sharded_train.py): ((layer name,
  # NamedSharding of its kernel), ...) for the 2:4 layers' `kernel_sharding`.
  shardings: tuple = ()
  activation: str = "gelu"
  input_sparsity: str = "off"
  weights: str = "2:4"  # the sparse model's `up` kernel with input_sparsity: "2:4" or "dense"
  # `down`'s weight_grad with input_sparsity: "dense" (exact), or "2:4" (from
  # its pruned input pruned again along the tokens, SparseDense(weight_grad=)).
  activation_weight_grad: str = "dense"

  @nn.compact
  def __call__(self, x):
    kw = {name: {} for name in ("up", "down")}
    linear = {name: nn.Dense for name in ("up", "down")}
    if self.sparse:
      kind = {} if self.transposable is None else {"transposable": self.transposable}
      linear = {name: functools.partial(jsparse24.SparseDense, weight_grad=self.weight_grad,
                                        **kind) for name in ("up", "down")}
      for name, sharding in self.shardings:
        kw[name] = {"kernel_sharding": sharding}
      if self.input_sparsity != "off":
        linear["down"] = functools.partial(jsparse24.SparseDense, mask_source="none",
                                           input_sparsity=self.input_sparsity,
                                           weight_grad=self.activation_weight_grad)
        if self.weights == "dense":
          linear["up"], kw["up"] = nn.Dense, {}
    h = linear["up"](self.hidden, dtype=self.dtype, name="up", **kw["up"])(x)
    h = ACTIVATIONS[self.activation](h)
    return linear["down"](x.shape[-1], dtype=self.dtype, name="down", **kw["down"])(h)


class Block(nn.Module):
  d_model: int
  heads: int
  sparse_mlp: bool
  dtype: Any = None
  transposable: bool | None = None
  weight_grad: str = "dense"
  mlp_shardings: tuple = ()
  moe: tuple[int, int] | None = None  # (experts, top k): the MLP is a SparseMoE
  activation: str = "gelu"  # of the MLP (MLP.activation)
  input_sparsity: str = "off"  # of the 2:4 MLP's down projection (MLP.input_sparsity)
  mlp_weights: str = "2:4"  # MLP.weights
  activation_weight_grad: str = "dense"  # MLP.activation_weight_grad

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm(dtype=self.dtype, name="ln_attn")(x)
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=self.heads, dtype=self.dtype, deterministic=True, name="attn")(h, mask=mask)
    h = nn.LayerNorm(dtype=self.dtype, name="ln_mlp")(x)
    if self.moe is not None:
      experts, top_k = self.moe
      kind = {} if self.transposable is None else {"transposable": self.transposable}
      # [batch, seq, d]: each sequence is one routing group.
      return x + jsparse24.SparseMoE(experts, 4 * self.d_model, top_k,
                                     capacity_factor=MOE_CAPACITY_FACTOR, dtype=self.dtype,
                                     activation=ACTIVATIONS[self.activation],
                                     sparse=self.sparse_mlp, weight_grad=self.weight_grad,
                                     name="mlp", **kind)(h)
    return x + MLP(4 * self.d_model, self.sparse_mlp, self.dtype, self.transposable,
                   self.weight_grad, self.mlp_shardings, self.activation, self.input_sparsity,
                   self.mlp_weights, self.activation_weight_grad, name="mlp")(h)


class CharLM(nn.Module):
  """Decoder-only transformer over bytes. `sparse_mlp` switches the MLP layers
  between `jsparse24.SparseDense` and `nn.Dense`; the params are the same."""

  vocab: int
  d_model: int
  layers: int
  heads: int
  max_len: int
  sparse_mlp: bool
  dtype: Any = None
  transposable: bool | None = None
  weight_grad: str = "dense"  # of the sparse MLP layers: "dense" or "mvue"
  mlp_shardings: tuple = ()  # tensor parallelism of the 2:4 MLP layers (MLP.shardings)
  moe: tuple[int, int] | None = None  # (experts, top k): every MLP a SparseMoE (Block.moe)
  activation: str = "gelu"  # MLP.activation
  input_sparsity: str = "off"  # MLP.input_sparsity
  mlp_weights: str = "2:4"  # MLP.weights
  activation_weight_grad: str = "dense"  # MLP.activation_weight_grad

  @nn.compact
  def __call__(self, tokens):
    init = nn.initializers.normal(0.02)
    x = nn.Embed(self.vocab, self.d_model, embedding_init=init, name="embed")(tokens)
    pos = self.param("pos_embed", init, (self.max_len, self.d_model))
    x = (x + pos[: tokens.shape[-1]]).astype(self.dtype or jnp.float32)
    mask = nn.make_causal_mask(tokens)
    for i in range(self.layers):
      x = Block(self.d_model, self.heads, self.sparse_mlp, self.dtype, self.transposable,
                self.weight_grad, self.mlp_shardings, self.moe, self.activation,
                self.input_sparsity, self.mlp_weights, self.activation_weight_grad,
                name=f"block_{i}")(x, mask)
    x = nn.LayerNorm(dtype=self.dtype, name="ln_final")(x)
    return nn.Dense(self.vocab, dtype=self.dtype, name="head")(x).astype(jnp.float32)


# --- training -----------------------------------------------------------------


@dataclasses.dataclass
class Run:
  """One training run: model, optimizer and what it logged."""

  name: str
  model: CharLM
  tx: optax.GradientTransformation
  sparse: bool  # the model has 2:4 weights (masks in the optimizer state)
  params: Any = None
  opt_state: Any = None
  step: int = 0
  history: dict = dataclasses.field(default_factory=lambda: {
      "eval_steps": [], "train": [], "val": [], "train_curve": []})
  seconds: float = 0.0
  # weight_grad="mvue": the key that step `s` folds `s` into (so that a
  # resumed run draws the same pruning of the output gradients).
  mvue_key: Any = None
  # The 2:4 run's MaskSchedule: each step is jitted for its phase (dense
  # warm-up, sparse, or while a ramp mixes them, the set of 2:4 layers), so
  # no product switches at run time (optim.masks).
  schedule: Any = None
  # --moe: the weight of the MoE layers' load-balancing loss in the training loss.
  aux_weight: float = 0.0
  # Training-step time only (no compilation, evaluation or checkpointing):
  # (first step, end step, seconds) of each stretch timed between two syncs.
  segments: list = dataclasses.field(default_factory=list)
  # The distinct static arguments (phase, rebuild) that `train` jitted the
  # step for: one compiled program each.
  programs: set = dataclasses.field(default_factory=set)
  # {step: how many layers were 2:4} for each step run with a ramp (the
  # static phase's count), for `ramp_prediction`.
  sparse_counts: dict = dataclasses.field(default_factory=dict)

  def tokens_per_s(self, tokens_per_step: int, from_step: int = 0) -> float:
    """Training throughput over the timed stretches that start at `from_step`
    or later (nan if none)."""
    parts = [(b - a, t) for a, b, t in self.segments if a >= from_step]
    steps, secs = sum(p[0] for p in parts), sum(p[1] for p in parts)
    return steps * tokens_per_step / secs if secs else float("nan")

  def variables(self, params, opt_state, phase: bool | frozenset | None = None) -> dict:
    if self.sparse:
      return {"params": params, "sparsity": jsparse24.optim.masks(opt_state, phase)}
    return {"params": params}

  def phase(self, step: int) -> bool | None:
    """Whether step `step` is sparse (host-side, for the jitted step); None
    while a ramp has some layers 2:4 and others dense."""
    return None if self.schedule is None else self.schedule.phase(step)

  def static_phase(self, step: int, held: frozenset | None) -> tuple[Any, frozenset | None]:
    """(the jitted step's static phase at `step`, the set of 2:4 layers
    held for the next call). While a ramp mixes dense and 2:4 layers
    (`phase` None) it is the set of 2:4 layers, read from the optimizer
    state (a transfer that waits for the queued steps) only where the
    schedule says it changes, so at most once per layer; as in
    `jsparse24.optim.masks`, no product then switches at run time. An empty
    or full set is the phase False or True, whose programs it shares."""
    phase = self.phase(step)
    if phase is not None or self.schedule is None:
      return phase, held
    names = jsparse24.optim.layer_names(self.opt_state)
    if held is None or self.schedule.changes(step, len(names)):
      held = jsparse24.optim.sparse_layers(self.opt_state)
    return (False if not held else True if len(held) == len(names) else held), held

  def static_rebuild(self, step: int) -> bool | None:
    """With a ramp, whether the update of `step` rebuilds masks (the
    host's `MaskSchedule.update_rebuilds`), for `mask_update`'s static
    `mask_rebuild`: the step then has no conditional around the rebuild
    and the ramp's scores. None (a run-time flag) without a ramp, where the
    rebuild needs no conditional on a GPU (the flagged mask kernel) and one
    program per phase is enough."""
    if self.schedule is None or self.schedule.ramp is None:
      return None
    layers = len(jsparse24.optim.layer_names(self.opt_state))
    return self.schedule.update_rebuilds(step, layers)


def loss_fn(model, variables, x, y, rngs=None, aux_weight: float = 0.0):
  """Mean next-byte cross-entropy; plus `aux_weight` times the mean of the
  load-balancing losses that the model's `SparseMoE` layers sow, if any."""
  logits, state = model.apply(variables, x, rngs=rngs, mutable=["intermediates"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  if not aux_weight:
    return loss
  aux = [v for path, v in jax.tree_util.tree_leaves_with_path(state)
         if path[-2].key == "load_balancing_loss"]
  return loss + aux_weight * jnp.mean(jnp.stack(aux))


def make_steps(run: Run):
  """(train_step, eval_loss), both jitted."""

  def rngs(step):
    if run.mvue_key is None:
      return None
    return {"mvue": run.mvue_key if step is None else jax.random.fold_in(run.mvue_key, step)}

  # The old params and optimizer state are dead once the step returns the
  # new ones: donated, XLA writes the new ones in their buffers instead of
  # holding both (the d_model 4096 MoE run, 2.3B params, ran out of memory
  # on an H200 without donation).
  @functools.partial(jax.jit, static_argnames=("phase", "rebuild"), donate_argnums=(0, 1))
  def train_step(params, opt_state, x, y, step, phase=None, rebuild=None):
    def objective(p):
      return loss_fn(run.model, run.variables(p, opt_state, phase), x, y, rngs(step),
                     run.aux_weight)

    loss, grads = jax.value_and_grad(objective)(params)
    # `rebuild` (Run.static_rebuild): mask_update's static mask_rebuild;
    # `phase`: its static `sparse` (no masked decay for the dense layers).
    extra = {} if rebuild is None else {"mask_rebuild": rebuild}
    if run.sparse and phase is not None:
      extra["sparse"] = phase
    updates, opt_state = run.tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def eval_loss(params, opt_state, xs, ys):
    variables = run.variables(params, opt_state)
    # No gradient is taken here: the key is drawn from and never used.
    losses = jax.lax.map(lambda b: loss_fn(run.model, variables, *b, rngs(None)), (xs, ys))
    return losses.mean()

  return train_step, eval_loss


# Orbax saves a replicated array "replica-parallel": each device holding a
# copy writes one slice of it, which spreads a large array's writes over the
# devices (and the processes). For a small array the slices cost more than
# they spread: each is one more sliced device-to-host copy (a compiled slice
# per shape and device the first time). Below this many bytes per slice one
# replica writes the array whole.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def checkpoint_manager(directory: str) -> ocp.CheckpointManager:
  """A manager of `state` (params and optimizer state) and `history`
  checkpoints, keeping the last two; replicated arrays under
  `MIN_REPLICA_SLICE_BYTES` a slice are written whole by one replica (set
  for jax.Array in Orbax's global type-handler registry)."""
  ocp.type_handlers.register_type_handler(
      jax.Array, ocp.type_handlers.ArrayHandler(
          min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES), override=True)
  # Handlers named up front (not just the items' names): a manager that has
  # not saved or restored yet can then read a checkpoint's metadata
  # (`restore`'s check of the params' shapes).
  return ocp.CheckpointManager(
      os.path.abspath(directory),
      options=ocp.CheckpointManagerOptions(max_to_keep=2),
      item_handlers={"state": ocp.StandardCheckpointHandler(),
                     "history": ocp.JsonCheckpointHandler()})


def save(mngr: ocp.CheckpointManager, run: Run) -> None:
  mngr.save(run.step, args=ocp.args.Composite(
      state=ocp.args.StandardSave({"params": run.params, "opt_state": run.opt_state}),
      history=ocp.args.JsonSave(run.history)))


def param_differences(saved, params) -> list[str]:
  """Where a checkpoint's params (`saved`: Orbax's metadata of them) and a
  model's differ: each param only one of them holds, or whose shapes
  differ, as `name: [checkpoint shape] in the checkpoint, [model shape] in
  the model`."""
  shapes = [{name: tuple(leaf.shape)
             for name, leaf in traverse_util.flatten_dict(tree, sep="/").items()}
            for tree in (saved, params)]
  return [f"{name}: {list(shapes[0][name]) if name in shapes[0] else 'none'} in the checkpoint,"
          f" {list(shapes[1][name]) if name in shapes[1] else 'none'} in the model"
          for name in sorted(shapes[0].keys() | shapes[1].keys())
          if shapes[0].get(name) != shapes[1].get(name)]


def restore(mngr: ocp.CheckpointManager, run: Run) -> None:
  """Restores `run` from the latest checkpoint, into the structure of its
  freshly initialised state (the masks come back as `Mask24`s).

  The params' shapes are checked against the checkpoint's metadata first: a
  checkpoint of other flags (another width, another number of layers) is
  refused with the params that differ, before Orbax starts reading it (its
  own error lists every key, and leaves its reads pending)."""
  step = mngr.latest_step()
  differ = param_differences(mngr.item_metadata(step).state["params"], run.params)
  if differ:
    more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
    raise ValueError(f"its params differ from the model's: {'; '.join(differ[:3])}{more}")
  target = {"params": run.params, "opt_state": run.opt_state}
  restored = mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, target)),
      history=ocp.args.JsonRestore()))
  run.params = restored.state["params"]
  run.opt_state = restored.state["opt_state"]
  run.history = restored.history
  run.step = step


def train(run: Run, data, val, *, args, ckpt_dir: str) -> None:
  """Trains `run` from `run.step` to `args.steps`, evaluating and
  checkpointing every `args.eval_every` steps and at the end."""
  train_step, eval_loss = make_steps(run)
  xs, ys = (jnp.asarray(a) for a in val)
  mngr = checkpoint_manager(ckpt_dir)
  window: list[jax.Array] = []
  bar = tqdm(total=args.steps, initial=run.step, desc=f"{run.name:>5}", unit="step",
             dynamic_ncols=True)
  start = time.perf_counter()
  # Throughput: stretches of steps between syncs, timed without
  # evaluations, checkpoints, and the steps that run a program for the
  # first time (its compilation; the cusparselt backend also picks its
  # algorithms on a program's first call): the first step of this run, the
  # first sparse step, and each step where a ramp's set of 2:4 layers first
  # takes a new value. Stretches end before and start after each of these,
  # and in both runs at the last dense warm-up step and the first sparse
  # one, so that both can be compared over the same sparse steps.
  seg_start, seg_t0, held, loss = None, None, None, None
  ramp = run.schedule is not None and run.schedule.ramp is not None
  layers = len(jsparse24.optim.layer_names(run.opt_state)) if ramp else 0

  def close_stretch():
    if seg_start is not None and run.step > seg_start:
      jax.block_until_ready(loss)
      run.segments.append((seg_start, run.step, time.perf_counter() - seg_t0))

  while run.step < args.steps:
    phase, held = run.static_phase(run.step, held)
    if ramp:
      run.sparse_counts[run.step] = (len(held) if isinstance(phase, frozenset)
                                     else layers * bool(phase))
    rebuild = run.static_rebuild(run.step)
    compiles = (phase, rebuild) not in run.programs
    if compiles:
      close_stretch()
      seg_start = None
    x, y = train_batch(data, run.step, args.batch, args.seq_len, args.seed)
    run.params, run.opt_state, loss = train_step(run.params, run.opt_state, x, y, run.step,
                                                 phase=phase, rebuild=rebuild)
    run.step += 1
    if compiles:
      run.programs.add((phase, rebuild))
      jax.block_until_ready(loss)
      seg_start, seg_t0 = run.step, time.perf_counter()
    window.append(loss)
    bar.update(1)
    if run.step % 10 == 0:
      bar.set_postfix(loss=f"{float(loss):.3f}")
    boundary = run.step % args.eval_every == 0 or run.step == args.steps
    cut = boundary or run.step in (args.mask_warmup, args.mask_warmup + 1)
    if cut:
      close_stretch()
    if boundary:
      train_losses = [float(v) for v in window]
      window = []
      run.history["train_curve"].extend(train_losses)
      run.history["eval_steps"].append(run.step)
      run.history["train"].append(float(np.mean(train_losses)))
      run.history["val"].append(float(eval_loss(run.params, run.opt_state, xs, ys)))
      bar.set_postfix(loss=f"{train_losses[-1]:.3f}", val=f"{run.history['val'][-1]:.3f}")
      save(mngr, run)
    if cut:
      seg_start, seg_t0 = run.step, time.perf_counter()
  bar.close()
  mngr.wait_until_finished()
  mngr.close()
  run.seconds = time.perf_counter() - start


# --- reporting ----------------------------------------------------------------


def ramp_prediction(dense: Run, sparse: Run, from_step: int) -> tuple[int, int, float, float] | None:
  """What a ramp's share of 2:4 layers predicts for its steps, against what
  they measured: each step costs the dense run's time per step where its
  layers are dense and the 2:4 run's own time per fully 2:4 step where they
  are 2:4, in proportion to the count of 2:4 layers at that step. Over the
  timed stretches from `from_step` that hold a step with some layer still
  dense; the fully 2:4 time from the stretches with none.
  Returns `(first step, end step, measured tokens/s over predicted, fully
  2:4 over dense)` or None if the run has no stretch of either kind."""
  counts = sparse.sparse_counts
  full = max(counts.values(), default=0)
  parts = [(a, b, t) for a, b, t in sparse.segments if a >= from_step]
  ramping = [(a, b, t) for a, b, t in parts if any(counts[s] < full for s in range(a, b))]
  settled = [(a, b, t) for a, b, t in parts if (a, b, t) not in ramping]
  dense_parts = [(a, b, t) for a, b, t in dense.segments if a >= from_step]
  if not (full and ramping and settled and dense_parts):
    return None
  per_step = lambda ps: sum(t for _, _, t in ps) / sum(b - a for a, b, _ in ps)
  t_dense, t_full = per_step(dense_parts), per_step(settled)
  predicted = sum(t_dense + (t_full - t_dense) * counts[s] / full
                  for a, b, _ in ramping for s in range(a, b))
  measured = sum(t for _, _, t in ramping)
  return ramping[0][0], ramping[-1][1], predicted / measured, t_dense / t_full


def implementation_summary() -> str:
  avail = jsparse24.available_implementations()
  usable = [name for name, reason in avail.items() if reason is None]
  if len(usable) == 1:
    head = f"sparse_dot implementation: {usable[0]!r} (the only one available here)"
  else:
    head = f"sparse_dot implementation: automatic, per shape, among {usable}"
  rest = [f"  {name}: unavailable ({reason})" for name, reason in avail.items() if reason]
  return "\n".join([head, *rest])


def mask_transposable(args) -> bool | None:
  """`--mask` as SparseDense's `transposable` (None: its default)."""
  return None if args.mask == "default" else args.mask == "transposable"


def why_no_kernel(args) -> str:
  """Why the automatic choice ran no 2:4 kernel (`sparse_layer_backends` all
  "xla"), and what would: said after the tokens/s, which then compare two
  dense runs."""
  if args.sparse_activations != "off":
    return ("The automatic choice took XLA's masked products for the 2:4 activations at these"
            " shapes (their cuSPARSELt step measured short of its margin: docs/performance.md,"
            " \"2:4 activations\"): --sparse-activations shows their accuracy here, not their"
            " speed.")
  if jax.default_backend() == "gpu":
    return ("At these shapes the automatic choice measured no 2:4 kernel faster than XLA on"
            " this GPU; the gpu preset (--size gpu) trains at shapes where they are.")
  return ("On an NVIDIA GPU the gpu preset (the default there) trains at shapes where the 2:4"
          " kernels run.")


def sparse_layer_backends(args) -> dict[str, str]:
  """The backend `implementation=None` picks for each 2:4 layer at this run's
  shapes (`jsparse24.selected_implementation`): where it is "xla" for every
  layer, the 2:4 model multiplies with masked dense products and its speed
  says nothing about 2:4 kernels."""
  d, rows, prefix = args.d_model, args.batch * args.seq_len, "mlp"
  if args.moe is not None:
    # Each expert multiplies its slots of every sequence (routing group).
    experts, top_k = args.moe
    rows = args.batch * jsparse24.moe.expert_capacity(args.seq_len, experts, top_k,
                                                      MOE_CAPACITY_FACTOR)
    prefix = "mlp/experts"
  dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
  out = {f"{prefix}/{name}": jsparse24.selected_implementation(
             (rows, k), (k, n), dtype, transposable=mask_transposable(args))
         for name, (k, n) in {"up": (d, 4 * d), "down": (4 * d, d)}.items()}
  if args.sparse_activations != "off":
    # mlp/down prunes its input 2:4 and keeps its weight dense.
    out["mlp/down"] = jsparse24.selected_implementation((rows, 4 * d), (4 * d, d), dtype,
                                                        pruned_activations=True)
    if args.mlp_weights == "dense":
      del out["mlp/up"]
  return out


def sparse_kernel_bytes(compressed) -> tuple[int, int]:
  """(dense, compressed) bytes of the kernels that `compressed` (params from
  `jsparse24.compress_params`) holds as `Sparse24`s: values + metadata
  against the dense kernels they stand for."""
  sparse = [a for a in jax.tree.leaves(compressed,
                                       is_leaf=lambda a: isinstance(a, jsparse24.Sparse24))
            if isinstance(a, jsparse24.Sparse24)]
  return (sum(math.prod(a.shape) * a.dtype.itemsize for a in sparse),
          sum(a.nbytes for a in sparse))


def mlp_bytes(params, sparsity) -> dict[str, int]:
  """Bytes of the sparse layers' kernels: dense, and compressed by
  `jsparse24.compress_params` (values + metadata), in float32 and bfloat16."""
  out = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    p = jax.tree.map(lambda a: a.astype(dtype), params)
    name = jnp.dtype(dtype).name
    out[f"dense_{name}"], out[f"compressed_{name}"] = sparse_kernel_bytes(
        jsparse24.compress_params(p, sparsity))
  return out


def plot(runs: Sequence[Run], path: str) -> None:
  """Left: train (smoothed) and validation loss of both runs. Right: the
  validation gap of the 2:4 run over the dense one."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, (ax, gap) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=(2, 1))
  lowest = math.log(VOCAB)
  for run, color in zip(runs, ("tab:blue", "tab:orange")):
    curve = np.asarray(run.history["train_curve"])
    width = max(1, len(curve) // 50)
    if len(curve) >= width:
      smooth = np.convolve(curve, np.ones(width) / width, mode="valid")
      ax.plot(np.arange(width, len(curve) + 1), smooth, color=color, lw=1.2,
              label=f"{run.name} train (mean of {width} steps)")
    ax.plot(run.history["eval_steps"], run.history["val"], "o--", color=color, ms=4,
            label=f"{run.name} validation")
    lowest = min(lowest, *run.history["val"], *curve)
  ax.set_ylim(lowest - 0.1, min(math.log(VOCAB), lowest + 2.0))
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats / byte)")
  ax.set_title(f"byte-level LM, dense vs 2:4 MLP (ln vocab = {math.log(VOCAB):.2f})")
  ax.legend()
  dense, sparse = runs
  val_at = dict(zip(dense.history["eval_steps"], dense.history["val"]))
  steps = [s for s in sparse.history["eval_steps"] if s in val_at]
  gap.plot(steps, [v - val_at[s] for s, v in zip(sparse.history["eval_steps"], sparse.history["val"])
                   if s in val_at], "o-", color="tab:red", ms=4)
  gap.axhline(0.0, color="gray", lw=0.8)
  gap.set_xlabel("step")
  gap.set_title("validation loss, 2:4 minus dense")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# --- main ---------------------------------------------------------------------


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows defaults, but not the None of the flags a preset or another flag
  fills in (their help says where the value comes from). generate.py's too."""

  def _get_help_string(self, action):
    if action.default is None:
      return action.help
    return super()._get_help_string(action)


def _preset_help(key: str, text: str) -> str:
  values = ", ".join(f"{name}: {preset[key]}" for name, preset in PRESETS.items())
  return f"{text} (by --size; {values})"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=HelpFormatter)
  p.add_argument("--size", choices=sorted(PRESETS), default=None,
                 help="preset for the flags left unset: 'small' (CPU, minutes) or 'gpu'"
                      " (default: 'gpu' where JAX finds a GPU, 'small' elsewhere)")
  p.add_argument("--steps", type=int, help=_preset_help("steps", "training steps of each run"))
  p.add_argument("--batch", type=int, help=_preset_help("batch", "sequences per batch"))
  p.add_argument("--seq-len", type=int, help=_preset_help("seq_len", "bytes per sequence"))
  p.add_argument("--d-model", type=int, help=_preset_help("d_model", "model width (a multiple of 4 and of --heads)"))
  p.add_argument("--layers", type=int, help=_preset_help("layers", "transformer blocks"))
  p.add_argument("--heads", type=int, help=_preset_help("heads", "attention heads"))
  p.add_argument("--lr", type=float, help=_preset_help("lr", "peak AdamW learning rate"))
  p.add_argument("--eval-every", type=int, help=_preset_help("eval_every", "steps between validations and checkpoints"))
  p.add_argument("--eval-batches", type=int, help=_preset_help("eval_batches", "validation batches per evaluation"))
  p.add_argument("--dtype", choices=("float32", "bfloat16"), help=_preset_help("dtype", "compute dtype"))
  p.add_argument("--corpus", choices=sorted(CORPORA),
                 help=_preset_help("corpus", "which fixed list of standard-library files to train on"))
  p.add_argument("--mask-warmup", type=int,
                 help="dense steps before the first 2:4 mask (default: 10%% of --steps)")
  p.add_argument("--rebuild-every", type=int,
                 help="steps between mask rebuilds (default: 10%% of --steps)")
  p.add_argument("--sparsity-ramp", metavar="START,END",
                 help="2:4 run: the MLP layers go 2:4 a few at a time along a cosine ramp from"
                      " step START (none) to END (all), least sensitive first"
                      " (jsparse24.optim.SparsityRamp); none before --mask-warmup either;"
                      " default: all at once after --mask-warmup")
  p.add_argument("--mask", choices=("default", "plain", "transposable"), default="default",
                 help="2:4 mask kind of the sparse layers ('default': SparseDense's)")
  p.add_argument("--decay", type=float, default=2e-4,
                 help="masked decay of pruned weights (SR-STE)")
  p.add_argument("--mvue", action="store_true",
                 help="2:4 run: the MLP kernels' gradients from the output gradient pruned 2:4"
                      " by the minimum-variance unbiased rule (SparseDense(weight_grad='mvue'))")
  p.add_argument("--moe", metavar="E,K",
                 help="the MLP of every block a mixture of E experts, each token routed to"
                      " its top K (jsparse24.SparseMoE; the dense run: sparse=False)")
  p.add_argument("--moe-aux-weight", type=float, default=0.01,
                 help="--moe: weight of the load-balancing loss (Switch Transformer's 0.01)")
  p.add_argument("--ffn-activation", choices=("gelu", "relu2"), default="gelu",
                 help="the MLP's activation in both runs: gelu, or relu2 (squared ReLU,"
                      " mostly zeros: the feed-forward that 2:4 activations suit)")
  p.add_argument("--sparse-activations", choices=("off", "masked", "ste"), default="off",
                 help="2:4 activations in the 2:4 run: mlp/down's input pruned 2:4 at every"
                      " step and its kernel dense (mlp/up keeps 2:4 weights unless"
                      " --mlp-weights dense); the input's"
                      " gradient masked like the forward or straight-through"
                      " (SparseDense(input_sparsity=...)); best with --ffn-activation relu2")
  p.add_argument("--activation-weight-grad", choices=("dense", "2:4"), default="dense",
                 help="with --sparse-activations: mlp/down's weight gradient exact (dense), or"
                      " from its pruned input pruned again 2:4 along the tokens, so that it"
                      " can run on the sparse tensor cores (SparseDense(weight_grad='2:4'))")
  p.add_argument("--mlp-weights", choices=("2:4", "dense"), default="2:4",
                 help="with --sparse-activations: mlp/up's kernel in the 2:4 run, 2:4 or"
                      " dense (then the runs differ only in the pruned activations)")
  p.add_argument("--seed", type=int, default=0, help="seed of the init and the batches")
  p.add_argument("--out", default=os.path.join("runs", "train_lm"), help="output folder")
  p.add_argument("--resume", action="store_true",
                 help="continue both runs from their latest checkpoints in --out")
  args = p.parse_args(argv)
  args.size, args.size_reason = choose_size(args.size)
  for key, value in PRESETS[args.size].items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  if args.mask_warmup is None:
    args.mask_warmup = args.steps // 10
  if args.rebuild_every is None:
    args.rebuild_every = max(1, args.steps // 10)
  if args.sparsity_ramp is not None:
    try:
      args.sparsity_ramp = jsparse24.optim.SparsityRamp(
          *(int(v) for v in args.sparsity_ramp.split(",", 1)))
    except (TypeError, ValueError) as e:
      p.error(f"--sparsity-ramp {args.sparsity_ramp!r}: two steps START,END with"
              f" 0 <= START < END ({e})")
  if args.moe is not None:
    try:
      experts, top_k = (int(v) for v in args.moe.split(","))
    except ValueError:
      p.error(f"--moe {args.moe!r}: two integers E,K (experts, top k), e.g. 8,2")
    if not 1 <= top_k <= experts:
      p.error(f"--moe {args.moe}: K={top_k} must lie in [1, E={experts}]")
    args.moe = (experts, top_k)
  if args.mlp_weights == "dense":
    clash = [flag for flag, on in (("--sparse-activations off", args.sparse_activations == "off"),
                                   ("--mvue", args.mvue),
                                   ("--sparsity-ramp", args.sparsity_ramp is not None)) if on]
    if clash:
      p.error(f"--mlp-weights dense leaves the 2:4 run no 2:4 weight: it needs"
              f" --sparse-activations masked or ste, and takes no flag about 2:4 weights"
              f" (got {', '.join(clash)}).")
  if args.activation_weight_grad != "dense" and args.sparse_activations == "off":
    p.error(f"--activation-weight-grad {args.activation_weight_grad} prunes mlp/down's"
            f" pruned input: it needs --sparse-activations masked or ste.")
  sizes = ("steps", "batch", "seq_len", "eval_every", "eval_batches", "layers", "heads",
           "d_model")
  small = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in sizes
           if getattr(args, name) < 1]
  if small:
    p.error(f"{', '.join(small)}: --steps, --batch, --seq-len, --eval-every, --eval-batches,"
            f" --layers, --heads and --d-model must be >= 1.")
  if args.d_model % 4 or args.d_model % args.heads:
    p.error(f"--d-model {args.d_model} must be a multiple of 4 (2:4 groups) and of --heads.")
  try:  # before any run trains: e.g. a ramp that ends within the warm-up
    mask_schedule(args)
  except (TypeError, ValueError) as e:
    p.error(f"--mask-warmup {args.mask_warmup}, --rebuild-every {args.rebuild_every},"
            f" --sparsity-ramp, --steps {args.steps}: {e}")
  return args


def mask_schedule(args) -> jsparse24.optim.MaskSchedule:
  """The 2:4 run's schedule: dense for --mask-warmup steps, masks rebuilt
  every --rebuild-every and frozen for the last 20% of the steps; with
  --sparsity-ramp the layers go 2:4 along the ramp."""
  return jsparse24.optim.MaskSchedule(
      warmup_steps=args.mask_warmup, rebuild_every=args.rebuild_every,
      freeze_after=max(args.mask_warmup, int(0.8 * args.steps)), ramp=args.sparsity_ramp)


def make_run(name: str, sparse: bool, args, sample, mlp_shardings: tuple = (),
             state_sharding: Callable | None = None) -> Run:
  """`mlp_shardings`: tensor parallelism of the 2:4 MLP layers (`MLP.shardings`).
  `state_sharding(path, array)`: the sharding that each array of the initial
  params and optimizer state is made in (`jax.jit`'s `out_shardings`: no
  device holds more than its share, and every process of a multi-process run
  makes its share of the same arrays); None: the default device."""
  dtype = jnp.bfloat16 if args.dtype == "bfloat16" else None
  transposable = mask_transposable(args)
  weight_grad = "mvue" if sparse and args.mvue else "dense"
  if args.moe is not None and args.sparse_activations != "off":
    raise ValueError(f"make_run: --sparse-activations {args.sparse_activations} applies to the"
                     f" dense MLP's down projection; SparseMoE's experts have no 2:4"
                     f" activations yet: drop --moe or --sparse-activations.")
  if args.moe is not None and mlp_shardings:
    raise ValueError("make_run: --moe has no tensor-parallel MLP layers (`mlp_shardings`):"
                     " shard an MoE over its experts, or drop --moe.")
  model = CharLM(VOCAB, args.d_model, args.layers, args.heads, args.seq_len, sparse, dtype,
                 transposable, weight_grad, mlp_shardings, args.moe, args.ffn_activation,
                 args.sparse_activations, args.mlp_weights, args.activation_weight_grad)
  # --mlp-weights dense: the 2:4 run's only 2:4 operands are activations, so
  # it has no masks to schedule and trains with the dense run's optimizer.
  sparse = sparse and args.mlp_weights == "2:4"
  key = jax.random.key(args.seed)
  variables = jax.jit(model.init, out_shardings=_placed(state_sharding, model.init, key,
                                                        sample))(key, sample)
  lr = optax.warmup_cosine_decay_schedule(
      0.0, args.lr, warmup_steps=max(1, args.steps // 20), decay_steps=args.steps,
      end_value=args.lr / 10)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(lr, b2=0.99, weight_decay=0.01))
  schedule = None
  if sparse:
    schedule = mask_schedule(args)
    tx = optax.chain(
        jsparse24.optim.mask_update(variables["sparsity"], schedule, decay=args.decay),
        optimizer)
  else:
    tx = optimizer
  params = variables["params"]
  mvue_key = jax.random.fold_in(jax.random.key(args.seed), 1) if weight_grad == "mvue" else None
  opt_state = jax.jit(tx.init, out_shardings=_placed(state_sharding, tx.init, params))(params)
  return Run(name, model, tx, sparse, params, opt_state, mvue_key=mvue_key, schedule=schedule,
             aux_weight=args.moe_aux_weight if args.moe is not None else 0.0)


def checkpoint_dir(out: str, run_name: str) -> str:
  """Where a run's Orbax checkpoints go under `--out`: `checkpoints/dense`
  for the dense run, `checkpoints/sparse` for the 2:4 one (by run, not by
  whether the run has masks: a 2:4 run with dense weights, `--mlp-weights
  dense`, keeps its own folder). examples/sharded_train.py and generate.py
  read and write the same folders."""
  return os.path.join(out, "checkpoints", "dense" if run_name == "dense" else "sparse")


FLAGS_FILE = "train_lm_flags.json"


def save_flags(args, argv: Sequence[str]) -> None:
  """Writes the flags that describe this run's models to `--out/FLAGS_FILE`:
  the command line without `--out` and `--resume` (where the folder is, and
  how to start, say nothing of the models), the preset made explicit
  (without `--size` the preset follows the platform). `--resume` and
  examples/generate.py read them (`with_saved_flags`), so that loading the
  checkpoints does not need the training flags typed again."""
  kept, skip = ["--size", args.size], False
  for token in argv:
    if skip:
      skip = False
    elif token == "--out":
      skip = True
    elif not (token.startswith("--out=") or token == "--resume"):
      kept.append(token)
  with open(os.path.join(args.out, FLAGS_FILE), "w", encoding="utf-8") as f:
    json.dump({"argv": kept}, f, indent=1)


def with_saved_flags(out: str, argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
  """(`argv` after the flags `save_flags` wrote under `out` and `--out out`,
  so that the flags in `argv` override the saved ones and the folder is
  `out` whatever the saved flags say; the saved flags), or `(argv, None)`
  where `out` holds none."""
  path = os.path.join(out, FLAGS_FILE)
  if not os.path.isfile(path):
    return list(argv), None
  with open(path, encoding="utf-8") as f:
    saved = list(json.load(f)["argv"])
  return [*saved, "--out", out, *argv], saved


def short_reason(e: Exception) -> str:
  """`TypeName: first line` of an exception's message, cut at 300 characters:
  Orbax's restore errors go on to list every key of the checkpoint."""
  first = str(e).splitlines()[0] if str(e) else ""
  return f"{type(e).__name__}: {first if len(first) <= 300 else first[:300] + ' ...'}"


def _placed(state_sharding: Callable | None, fn: Callable, *args) -> Any:
  """`out_shardings` for `jax.jit(fn)(*args)`: `state_sharding(path, array)`
  of each array of its result (None: left to jit)."""
  if state_sharding is None:
    return None
  return jax.tree_util.tree_map_with_path(state_sharding, jax.eval_shape(fn, *args))


def describe(args, files, data, val_data) -> None:
  """Prints the run's data and model, as `main` is about to train them."""
  print(f"data: {len(data):,} train / {len(val_data):,} validation bytes from"
        f" {len(files)} stdlib files; vocabulary {VOCAB} (ln = {math.log(VOCAB):.3f})")
  print(f"model: d_model {args.d_model}, {args.layers} layers, {args.heads} heads,"
        f" seq {args.seq_len}, batch {args.batch}, {args.steps} steps, lr {args.lr},"
        f" {args.dtype}; "
        + ("no 2:4 weights (--mlp-weights dense)" if args.mlp_weights == "dense" else
           f"2:4 MLP ({args.mask} masks): dense warm-up {args.mask_warmup} steps, rebuild"
           f" every {args.rebuild_every}, decay {args.decay}")
        + (", MVUE weight gradients" if args.mvue else "")
        + (f"; every MLP a SparseMoE of {args.moe[0]} experts, top-{args.moe[1]} (load-balancing"
           f" loss weight {args.moe_aux_weight})" if args.moe else "")
        + f"; MLP activation {args.ffn_activation}"
        + (f"; 2:4 activations into mlp/down ({args.sparse_activations} gradient, dense"
           f" kernel" + (", weight gradient from them pruned along the tokens"
                         if args.activation_weight_grad == "2:4" else "") + ")"
           if args.sparse_activations != "off" else ""))


def open_checkpoints(run: Run, args) -> str:
  """`run`'s checkpoint directory, `run` restored from its latest checkpoint
  under `--resume`, else the old checkpoints removed (a fresh run replaces
  them)."""
  ckpt_dir = checkpoint_dir(args.out, run.name)
  if args.resume:
    if os.path.isdir(ckpt_dir):
      with checkpoint_manager(ckpt_dir) as mngr:
        if mngr.latest_step() is not None:
          try:
            restore(mngr, run)
          except Exception as e:  # pylint: disable=broad-except
            raise ValueError(
                f"train_lm --resume: the checkpoint in {ckpt_dir!r} does not load into the"
                f" model these flags describe ({short_reason(e)}). Resume with the flags it"
                f" was trained with, or start afresh without --resume.") from e
    print(f"{run.name}: resuming from step {run.step}" if run.step else
          f"{run.name}: no checkpoint in {ckpt_dir}, starting from step 0")
    if run.step >= args.steps:
      print(f"{run.name}: NOTHING TO TRAIN: the checkpoint is at step {run.step} and"
            f" --steps is {args.steps}; pass --steps above {run.step} to train further.")
  elif os.path.isdir(ckpt_dir):
    shutil.rmtree(ckpt_dir)  # a fresh run replaces the old checkpoints
  return ckpt_dir


def report(runs: list[Run], start_steps: dict[str, int], val, args) -> dict[str, Any]:
  """Plots the loss curves, prints the tables (losses, tokens/s, programs,
  the backends, the ramp's prediction, the shipped 2:4 model) and returns
  `main`'s result."""
  dense, sparse = runs
  if not dense.history["eval_steps"]:
    raise ValueError(f"nothing trained or restored: --steps {args.steps} and no checkpoint.")
  png = os.path.join(args.out, "loss_curves.png")
  plot(runs, png)

  print()
  # Each row: the evaluation after step `at step`; train = the mean training
  # loss of the steps since the previous evaluation.
  print(f"{'at step':>7} | {'train dense':>11} {'train 2:4':>10} | {'val dense':>10}"
        f" {'val 2:4':>9}")
  print("-" * 56)
  sparse_at = dict(zip(sparse.history["eval_steps"], zip(sparse.history["train"], sparse.history["val"])))
  for step, tr, va in zip(dense.history["eval_steps"], dense.history["train"], dense.history["val"]):
    s_tr, s_va = sparse_at.get(step, (float("nan"), float("nan")))
    print(f"{step:>7} | {tr:>11.4f} {s_tr:>10.4f} | {va:>10.4f} {s_va:>9.4f}")
  print()
  tokens = args.batch * args.seq_len
  sparse_from = args.mask_warmup + 1  # after the first sparse step (see train)
  speed = {run.name: (run.tokens_per_s(tokens), run.tokens_per_s(tokens, sparse_from))
           for run in runs}
  print(f"{'run':>5} | {'train loss':>10} {'val loss':>9} | {'tokens/s':>10}"
        f" {'tokens/s, steps ' + str(sparse_from) + '+':>22} |"
        f" steps run, wall time")
  print("-" * 88)
  for run in runs:
    start = start_steps[run.name]
    resumed = f", resumed at step {start}" if start else ""
    print(f"{run.name:>5} | {run.history['train'][-1]:>10.4f} {run.history['val'][-1]:>9.4f} |"
          f" {speed[run.name][0]:>10,.0f} {speed[run.name][1]:>22,.0f} |"
          f" {run.step - start} steps run (of {args.steps}{resumed}), {run.seconds:.1f} s")
  # One program per static phase (optim.masks): dense warm-up, 2:4, and
  # with --sparsity-ramp each set of 2:4 layers it passes through, each with
  # and without a mask rebuild (Run.static_rebuild).
  print(f"train-step programs compiled: "
        + ", ".join(f"{run.name} {len(run.programs)}" for run in runs)
        + (f" (with the ramp: at most 2 x (2:4 layers + 1) ="
           f" {2 * (len(jsparse24.optim.layer_names(sparse.opt_state)) + 1)} for the 2:4 run)"
           if args.sparsity_ramp is not None else ""))
  backends = sparse_layer_backends(args)
  if set(backends.values()) == {"xla"}:
    print(f"2:4 / dense tokens/s: no speed-up to report. No 2:4 kernel ran: the automatic"
          f" choice took the masked dense reference for every 2:4 layer ({backends}), so both"
          f" runs did dense products and their tokens/s differ by timing noise only."
          f" {why_no_kernel(args)}")
  else:
    ratio = speed["2:4"][1] / speed["dense"][1]
    print(f"2:4 / dense tokens/s over the sparse steps ({sparse_from}+): {ratio:.3f}x"
          f" (training steps only: no compilation, evaluation or checkpointing; 2:4 layers"
          f" on {backends})")
  ramp = ramp_prediction(dense, sparse, sparse_from) if args.sparsity_ramp is not None else None
  if ramp is not None:
    first, end, share, full = ramp
    print(f"the ramp's steps {first}-{end - 1} ran at {share:.1%} of the tokens/s that their"
          f" share of 2:4 layers predicts (each layer at the dense run's speed while dense and"
          f" at the fully 2:4 steps' {full:.3f}x while 2:4)")
  losses = _losses(runs, start_steps, speed)
  final = losses["final_val_loss_dense"], losses["final_val_loss_sparse"]
  print(f"final validation loss: dense {final[0]:.3f}  2:4 {final[1]:.3f}"
        f"  (gap {final[1] - final[0]:+.3f}; ln(vocab) = {math.log(VOCAB):.3f})")

  if sparse.sparse:
    shipped = ship_report(sparse, val, args)
  else:
    print("2:4 weights: none (--mlp-weights dense): the 2:4 run's only 2:4 operands are"
          " mlp/down's activations, so its weights ship dense")
    shipped = {"sparse_layers": []}
  print(implementation_summary().splitlines()[0])
  print(f"wrote {png} and checkpoints in {os.path.join(args.out, 'checkpoints')}")

  return {
      **losses,
      **shipped,
      "ramp_tokens_per_s_over_predicted": None if ramp is None else ramp[2],
      "sparse_layer_backends": backends,
      "loss_curves_png": png,
      "checkpoint_dir": checkpoint_dir(args.out, sparse.name),
      "params": sparse.params,
  }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  argv = sys.argv[1:] if argv is None else list(argv)
  args, saved = parse_args(argv), None
  if args.resume:
    # --resume continues the models in --out: the flags their run saved come
    # first, and those given now override them (e.g. a larger --steps).
    resumed, saved = with_saved_flags(args.out, argv)
    args = parse_args(resumed)
  if saved is not None:
    print(f"flags from {os.path.join(args.out, FLAGS_FILE)} (flags given here override them):"
          f" {' '.join(saved)}")
  print(f"preset {args.size} ({args.size_reason})")
  print(f"JAX {jax.__version__}, backend {jax.default_backend()!r}, devices {jax.devices()}")
  print(implementation_summary())

  files = corpus_files(args.corpus)
  data, val_data = load_text(files)
  val = val_batches(val_data, args.eval_batches, args.batch, args.seq_len)
  describe(args, files, data, val_data)

  os.makedirs(args.out, exist_ok=True)
  if not args.resume:  # a resumed run continues the models its first run described
    save_flags(args, argv)
  sample = jnp.zeros((1, args.seq_len), jnp.int32)
  runs = [make_run("dense", False, args, sample), make_run("2:4", True, args, sample)]
  if jax.tree.structure(runs[0].params) != jax.tree.structure(runs[1].params):
    raise AssertionError("the dense and 2:4 models should have the same params tree")
  n_params = sum(a.size for a in jax.tree.leaves(runs[0].params))
  print(f"parameters: {n_params:,} in both runs; layers with 2:4 weights:"
        f" {sorted(jsparse24.optim.stats(runs[1].opt_state)) if runs[1].sparse else 'none'}")

  start_steps = {}
  for run in runs:
    ckpt_dir = open_checkpoints(run, args)
    start_steps[run.name] = run.step
    train(run, data, val, args=args, ckpt_dir=ckpt_dir)

  return report(runs, start_steps, val, args)


def ship_report(sparse: Run, val, args) -> dict[str, Any]:
  """Prints the 2:4 run's masks, the bytes of its MLP kernels dense and
  compressed, and the validation loss of its compressed weights; returns
  them for `main`'s result."""
  stats = jsparse24.optim.stats(sparse.opt_state)
  last_rebuild = int(optax.tree_utils.tree_get(sparse.opt_state, "last_rebuild"))
  # Stacked layers (--moe's experts) have one value per expert.
  flip = float(np.mean([np.mean(s["flip_rate"]) for s in stats.values()]))
  density = float(np.mean([np.mean(s["sparsity"]) for s in stats.values()]))
  print(f"2:4 masks: {len(stats)} layers, sparsity {density:.2f}, mean flip rate"
        f" {flip:.4f} at the last rebuild (step {last_rebuild})")
  masks = jsparse24.optim.masks(sparse.opt_state)
  masks_are_24 = all(
      bool(jsparse24.is_24(m.unpack(), axis=-2))
      for m in jax.tree.leaves(masks, is_leaf=lambda a: isinstance(a, jsparse24.Mask24))
      if isinstance(m, jsparse24.Mask24))

  sizes = mlp_bytes(sparse.params, masks)
  for name in ("float32", "bfloat16"):
    d, c = sizes[f"dense_{name}"], sizes[f"compressed_{name}"]
    if not d:
      print(f"MLP kernels: none is 2:4 at step {sparse.step} (the sparsity ramp had not made"
            f" a layer 2:4 yet), so none ships compressed")
      break
    print(f"MLP kernels ({name}): dense {d:,} bytes, 2:4 compressed {c:,} bytes"
          f" ({c / d:.1%})")

  # Ship the weights compressed, in the compute dtype: the model applied to
  # them needs no "sparsity" collection and scores what the masked model does.
  # (Full-precision matmuls, so that only the weights' dtype differs.) A run
  # stopped mid-ramp ships its still-dense layers as dense kernels, which
  # read their (inactive) masks from the collection.
  ship = jax.tree.map(lambda a: a.astype(sparse.model.dtype or jnp.float32), sparse.params)
  compressed = jsparse24.compress_params(ship, masks)
  count = lambda tree, kind: sum(isinstance(a, kind) for a in jax.tree.leaves(
      tree, is_leaf=lambda a: isinstance(a, kind)))
  shipped = ({"params": compressed}
             if count(compressed, jsparse24.Sparse24) == count(masks, jsparse24.Mask24)
             else {"params": compressed, "sparsity": masks})
  xs, ys = (jnp.asarray(a) for a in val)
  val_loss = jax.jit(lambda variables: jax.lax.map(
      lambda b: loss_fn(sparse.model, variables, *b), (xs, ys)).mean())
  with jax.default_matmul_precision("highest"):
    masked_val = float(val_loss(sparse.variables(sparse.params, sparse.opt_state)))
    compressed_val = float(val_loss(shipped))
  print(f"validation loss of the 2:4 model with compressed {args.dtype} weights:"
        f" {compressed_val:.4f} (masked float32 weights: {masked_val:.4f})")
  return {
      "mean_flip_rate": flip,
      "sparsity": density,
      "masks_are_24": masks_are_24,
      "sparse_layers": sorted(stats),
      "mlp_kernel_bytes": sizes,
      "val_loss_compressed": compressed_val,
      "val_loss_masked": masked_val,
      "sparsity_collection": masks,
  }


def _losses(runs: Sequence[Run], start_steps: dict, speed: dict) -> dict[str, Any]:
  """`main`'s result: the losses, steps and speed of both runs."""
  dense, sparse = runs
  return {
      "final_val_loss_dense": dense.history["val"][-1],
      "final_val_loss_sparse": sparse.history["val"][-1],
      "final_train_loss_dense": dense.history["train"][-1],
      "final_train_loss_sparse": sparse.history["train"][-1],
      "eval_steps": list(sparse.history["eval_steps"]),
      "val_losses_dense": list(dense.history["val"]),
      "val_losses_sparse": list(sparse.history["val"]),
      "start_step_sparse": start_steps["2:4"],
      "start_step_dense": start_steps["dense"],
      "final_step": sparse.step,
      "tokens_per_s": {name: v[0] for name, v in speed.items()},
      "tokens_per_s_sparse_steps": {name: v[1] for name, v in speed.items()},
      "train_step_programs": {run.name: len(run.programs) for run in runs},
  }


if __name__ == "__main__":
  main()
