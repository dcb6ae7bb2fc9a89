"""Splitting an inner optimizer state into shared leaves and per-parameter parts.

Uses the placeholder trick of `optax.tree_utils.tree_map_params`: ``inner.init(placeholder)`` shows
where the state holds parameter-shaped subtrees. Every other leaf (step count, injected
hyper-parameters, ...) is *shared*: one copy, passed to every group.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import optax

from optax_offload._src import _compat

PerLeaf = tuple[Any, ...]
"""The state parts of one parameter leaf: one entry per parameter-shaped slot of the state."""


def leaf_path(path) -> str:
  """A leaf's key path as text, for messages (``"<root>"`` for a bare array)."""
  return jax.tree_util.keystr(path) or "<root>"


def is_placeholder(x: Any) -> bool:
  return isinstance(x, _compat.ParamsPlaceholder)


def asks_for_layout(params: Any) -> bool:
  """Whether an ``init`` is given optax's params placeholder, or a tree of them
  (`state_template`), to show where its state holds param-shaped subtrees."""
  return any(map(is_placeholder, jax.tree.leaves(params, is_leaf=is_placeholder)))


def placeholder() -> Any:
  """The object `optax.tree_utils.tree_map_params` passes to ``init``."""
  return _compat.ParamsPlaceholder()


def state_template(inner: optax.GradientTransformation, params_treedef: Any) -> Any:
  """``inner.init`` of optax's params placeholder: its state with a placeholder at each
  param-shaped subtree (`optax.tree_utils.tree_map_params`' trick).

  Where that init fails, e.g. on labels or a mask given as a function that reads the params'
  containers (``lambda p: {k: ... for k in p}``, flax's ``traverse_util.path_aware_map``), the
  same from ``inner.init`` of the params' tree with a placeholder at each leaf.

  >>> from flax import traverse_util
  >>> labels = lambda p: traverse_util.path_aware_map(lambda k, _: k[0], p)
  >>> tx = optax.multi_transform({"w": optax.adam(1.0), "b": optax.sgd(1.0)}, labels)
  >>> template = state_template(tx, jax.tree.structure({"w": 0, "b": 0}))
  >>> is_placeholder(template.inner_states["w"].inner_state[0].mu)
  True
  """
  return _template(inner, params_treedef)[0]


def _template(inner: optax.GradientTransformation, params_treedef: Any) -> tuple[Any, bool]:
  """`state_template`, and whether it comes from the placeholders at the leaves."""
  try:
    return inner.init(placeholder()), False
  except Exception as e:
    failed = e
  try:
    full = inner.init(params_treedef.unflatten([placeholder()] * params_treedef.num_leaves))
  except Exception:
    raise failed from None

  def is_slot(x):
    try:
      parts = param_parts(params_treedef, x)
    except (ValueError, TypeError):
      return False
    return any(is_placeholder(p) for p in parts) and all(
      is_placeholder(p) or isinstance(p, optax.MaskedNode) for p in parts
    )

  return jax.tree.map(lambda x: placeholder() if is_slot(x) else x, full, is_leaf=is_slot), True


def _one_level(x: Any) -> tuple[list[Any], Any]:
  """`x`'s children and its node's structure (one level of its tree)."""
  return jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)


def param_parts(treedef: Any, tree: Any) -> list[Any]:
  """A param-shaped subtree of a state, one entry per leaf of the params' `treedef`.

  As ``treedef.flatten_up_to(tree)``, and also where a mask given as a prefix of the params' tree
  put one `optax.MaskedNode` over a subtree of params: each of their leaves gets that node.

  >>> params = {"enc": {"w": 1, "b": 2}, "dec": 3}
  >>> param_parts(jax.tree.structure(params), {"enc": optax.MaskedNode(), "dec": "mu"})
  ['mu', MaskedNode(), MaskedNode()]
  """
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError):
    if not any(
      isinstance(x, optax.MaskedNode)
      for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    ):
      raise
  parts = [None] * treedef.num_leaves

  def expand(index, x):
    if isinstance(index, int):
      parts[index] = x
    elif isinstance(x, optax.MaskedNode):
      for i in jax.tree.leaves(index):
        parts[i] = x
    else:
      (index_children, index_def), (children, node_def) = _one_level(index), _one_level(x)
      if index_def != node_def:
        raise ValueError(f"expected the params' node {index_def}, got {node_def}")
      for i, c in zip(index_children, children):
        expand(i, c)

  expand(treedef.unflatten(range(treedef.num_leaves)), tree)
  return parts


def param_tree(treedef: Any, parts: Sequence[Any], like: Any) -> Any:
  """Inverse of `param_parts`: `parts` in the params' tree, with one `optax.MaskedNode` over each
  subtree of params where `like` (a tree `param_parts` took apart) has one."""
  try:
    treedef.flatten_up_to(like)
    return treedef.unflatten(parts)
  except (ValueError, TypeError):
    pass

  def collapse(index, x):
    if isinstance(index, int):
      return parts[index]
    if isinstance(x, optax.MaskedNode):
      return x
    (index_children, index_def), (children, _) = _one_level(index), _one_level(x)
    return index_def.unflatten([collapse(i, c) for i, c in zip(index_children, children)])

  return collapse(treedef.unflatten(range(treedef.num_leaves)), like)


class StateLayout:
  """Where the per-parameter parts of an inner state are, for one parameter tree structure.

  Args:
    inner: the inner transformation.
    params_treedef: the tree structure of the parameters.

  Raises:
    TypeError: when the inner state cannot be split per parameter.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    >>> layout = StateLayout(optax.adam(1.0), jax.tree.structure(params))
    >>> shared, per_leaf = layout.split(optax.adam(1.0).init(params))
    >>> len(per_leaf), len(per_leaf[0])  # two leaves, each with mu and nu
    (2, 2)
  """

  def __init__(self, inner: optax.GradientTransformation, params_treedef: Any):
    try:
      template, self.template_from_leaves = _template(inner, params_treedef)
    except Exception as e:
      raise TypeError(
        "offload: the inner transformation's state cannot be split per parameter (its init failed on "
        f"optax's params placeholder: {type(e).__name__}: {e}). Transformations whose state is not "
        "a tree of per-parameter parts plus shared leaves cannot be offloaded; a mask or labels "
        "given as a function that reads the params' leaves can be given as a pytree instead, "
        "e.g. optax.multi_transform(transforms, labels_fn(params))."
      ) from e
    self._inner = inner
    self._skeletons: dict[Any, list[PerLeaf]] = {}  # by params' tree structure
    # By (params' tree structure, slot): the slot's tree without arrays, for `param_tree`.
    self._slot_likes: dict[tuple[Any, int], Any] = {}
    slots, self._treedef = jax.tree.flatten(template, is_leaf=is_placeholder)
    self._param_slots = tuple(j for j, v in enumerate(slots) if is_placeholder(v))
    self._num_slots = len(slots)
    self.params_treedef = params_treedef
    self.num_leaves = params_treedef.num_leaves

  def matching(self, state: optax.OptState) -> StateLayout:
    """This layout, for the parameter containers `state` holds.

    The same optimizer state may come with other containers than the params `init` saw: Flax NNX
    initialises with `nnx.Param` variables and updates plain arrays (``nnx.as_pure``).
    """
    try:
      self.split(state)
      return self
    except (ValueError, TypeError):
      pass
    parts = self._treedef.flatten_up_to(state)
    for j in self._param_slots:
      treedef = jax.tree.structure(parts[j])
      if treedef.num_leaves == self.num_leaves:
        other = copy.copy(self)
        other.params_treedef = treedef
        other.split(state)  # raises if it still does not fit
        return other
    raise ValueError("the optimizer state does not fit the layout of its offload transformation")

  @property
  def num_param_slots(self) -> int:
    """How many parameter-shaped subtrees the state holds (e.g. 2 for Adam's mu and nu)."""
    return len(self._param_slots)

  def split(self, state: optax.OptState) -> tuple[list[Any], list[PerLeaf]]:
    """Splits a full state into its shared leaves and one `PerLeaf` per parameter leaf."""
    parts = self._treedef.flatten_up_to(state)
    per_slot = [param_parts(self.params_treedef, parts[j]) for j in self._param_slots]
    for j in self._param_slots:
      if (self.params_treedef, j) not in self._slot_likes:
        self._slot_likes[self.params_treedef, j] = param_tree(
          self.params_treedef, [None] * self.num_leaves, parts[j]
        )
    shared = [None if j in self._param_slots else p for j, p in enumerate(parts)]
    per_leaf = [tuple(slot[i] for slot in per_slot) for i in range(self.num_leaves)]
    return shared, per_leaf

  def merge(self, shared: Sequence[Any], per_leaf: Sequence[PerLeaf]) -> optax.OptState:
    """Inverse of `split`."""
    return self.view(shared, dict(enumerate(per_leaf)), range(self.num_leaves))

  def view(
    self, shared: Sequence[Any], per_leaf: Mapping[int, PerLeaf], group: Sequence[int]
  ) -> optax.OptState:
    """The state the inner transformation sees for a group: the group's parts (`per_leaf`), and
    their `skeletons` (no arrays) at the other leaves."""
    parts, members, skeletons = list(shared), set(group), None
    likes = [self._slot_likes.get((self.params_treedef, j)) for j in self._param_slots]
    if len(members) < self.num_leaves or None in likes:
      skeletons = self.skeletons()  # (which also finds the slots' `likes`)
      likes = [self._slot_likes.get((self.params_treedef, j)) for j in self._param_slots]
    for s, j in enumerate(self._param_slots):
      slot = [per_leaf[i][s] if i in members else skeletons[i][s] for i in range(self.num_leaves)]
      like = likes[s]
      parts[j] = (
        self.params_treedef.unflatten(slot)
        if like is None
        else param_tree(self.params_treedef, slot, like)
      )
    return self._treedef.unflatten(parts)

  def unview(
    self, state: optax.OptState, group: Sequence[int]
  ) -> tuple[list[Any], dict[int, PerLeaf]]:
    """Inverse of `view`: the shared leaves and the group's `PerLeaf` parts."""
    parts = self._treedef.flatten_up_to(state)
    per_slot = [self.group_leaves(parts[j], group) for j in self._param_slots]
    shared = [None if j in self._param_slots else p for j, p in enumerate(parts)]
    return shared, {i: tuple(slot[n] for slot in per_slot) for n, i in enumerate(group)}

  def masked(self, leaves: Sequence[Any], group: Sequence[int]) -> Any:
    """A parameter-structured tree holding `leaves` at the group's positions and None elsewhere."""
    members = set(group)
    return self.params_treedef.unflatten(
      [x if i in members else None for i, x in enumerate(leaves)]
    )

  def skeletons(self) -> list[PerLeaf]:
    """Each leaf's part, without arrays, in a group's state where the leaf is not in the group:
    what ``inner.init`` puts there for a tree of `None`s. That is `None`, or the
    `optax.MaskedNode` of a leaf that a mask given as a pytree masks out, which `optax.masked`
    also puts in its updates there.

    >>> params = {"w": jax.numpy.ones(2), "b": jax.numpy.ones(2)}
    >>> tx = optax.masked(optax.adam(1.0), {"w": True, "b": False})
    >>> StateLayout(tx, jax.tree.structure(params)).skeletons()  # b, w: mu and nu
    [(MaskedNode(), MaskedNode()), (None, None)]
    """
    if self.params_treedef not in self._skeletons:
      none = [(None,) * self.num_param_slots] * self.num_leaves
      try:
        nothing = self.masked([None] * self.num_leaves, [])
        per_leaf = self.split(jax.eval_shape(self._inner.init, nothing))[1]
      except Exception:  # an init that needs arrays: no masked leaves it could mark
        per_leaf = none
      self._skeletons[self.params_treedef] = none if jax.tree.leaves(per_leaf) else per_leaf
    return self._skeletons[self.params_treedef]

  def group_leaves(self, tree: Any, group: Sequence[int]) -> list[Any]:
    """The group's leaves of a tree returned by `masked`- or `view`-structured computations, in
    group order."""
    leaves = param_parts(self.params_treedef, tree)
    return [leaves[i] for i in group]
