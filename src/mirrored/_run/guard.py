"""Skipping the per-step flatten of mirrored state while its structure is unchanged.

Flattening an NNX model and optimizer costs tens of microseconds of Python per step, as much as
a small model's whole step on a fast device. Between steps of a training loop the same objects
come back with the same structure; only their arrays change, and `run` reads those from the
Variables it already knows. A `Guard` proves "same structure" cheaply: the same root objects,
and every NNX object reachable from them still holding the same attributes (compared by
identity). Anything else — a new model, a swapped submodule, `model.eval()` setting a flag —
fails the guard and takes the full path, which re-flattens and, if needed, recompiles.

Not seen by the guard: in-place edits of plain containers *inside* an NNX object (e.g.
`module.some_list.append(...)`); assign a new container instead, as NNX recommends.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from mirrored._core.leaves import is_leaf, type_kind

_MISSING = object()


def same_static(a: Any, b: Any) -> bool:
    """Static arguments select a program by type and value: `True` is not `1`."""
    return type(a) is type(b) and bool(a == b)


def _nnx_objects(roots: Sequence[Any]) -> list[Any]:
    """Every NNX object (not Variable) reachable from `roots`, through plain containers too."""
    found, seen, stack = [], set(), list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if type_kind(type(obj)) == "g":
            found.append(obj)
            stack.extend(vars(obj).values())
        elif isinstance(obj, Mapping | nnx.State):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple):
            stack.extend(obj)
    return found


class Guard:
    """Recognises a call whose mirrored state has the structure of an earlier call."""

    def __init__(
        self,
        *,
        nargs: int,
        kw_keys: tuple[str, ...],
        roots: list[tuple[int, Any]],
        data_positions: list[int],
        objects: list[Any],
        data_treedef: Any,
        data_kinds: str,
        data_statics: list[Any],
        masked: bool,
        program: Any,
        unique: list[Any],
    ) -> None:
        self.nargs = nargs
        self.kw_keys = kw_keys
        self.roots = roots
        self.data_positions = data_positions
        # (attribute dict, its keys, ids of its values, the values — kept alive so ids stay unique)
        self.attrs = [
            (d, tuple(d), tuple(map(id, d.values())), tuple(d.values()))
            for d in (vars(obj) for obj in objects)
        ]
        self.data_treedef = data_treedef
        self.data_kinds = data_kinds
        self.data_statics = data_statics
        self.masked = masked
        self.program = program
        self.unique = unique
        # The arrays the last step wrote into `unique`: mirrored by construction.
        self.written: list[Any] = []

    @classmethod
    def unguarded(cls, program: Any, unique: list[Any]) -> Guard:
        """A guard that never matches: carries state for a call that has no fast path."""
        guard = cls(
            nargs=-1,
            kw_keys=(),
            roots=[],
            data_positions=[],
            objects=[],
            data_treedef=None,
            data_kinds="",
            data_statics=[],
            masked=False,
            program=program,
            unique=unique,
        )
        return guard

    @classmethod
    def build(
        cls,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        program: Any,
        unique: list[Any],
        sort: Callable[[list[Any], Any, Any], Any],
    ) -> Guard | None:
        """A guard for this call, or None when its arguments do not fit the fast path."""
        kw_keys = tuple(sorted(kwargs))  # the order jax flattens a dict in
        tops = (*args, *(kwargs[k] for k in kw_keys))
        roots = [(i, t) for i, t in enumerate(tops) if type_kind(type(t)) in "vg"]
        data_positions = [i for i, t in enumerate(tops) if type_kind(type(t)) not in "vg"]
        if not roots:
            return None
        for _, root in roots:  # state roots must hold Variables only
            if any(type_kind(type(x)) != "v" for x in jax.tree.leaves(root, is_leaf=is_leaf)):
                return None
        # No is_leaf here, as in `inputs`: a Variable among the data would show in the treedef.
        data_leaves, data_treedef = jax.tree.flatten([tops[i] for i in data_positions])
        if any(type_kind(type(x)) in "vg" for x in data_leaves):
            return None
        data = sort(data_leaves, args, kwargs)
        return cls(
            nargs=len(args),
            kw_keys=kw_keys,
            roots=roots,
            data_positions=data_positions,
            objects=_nnx_objects([root for _, root in roots]),
            data_treedef=data_treedef,
            data_kinds="".join(data.kinds),
            data_statics=data.statics,
            masked=data.mask is not None,
            program=program,
            unique=unique,
        )

    def data_if_unchanged(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any] | None:
        """The non-state arguments when the state is structurally unchanged, else None."""
        if len(args) != self.nargs or len(kwargs) != len(self.kw_keys):
            return None
        tops = (*args, *(kwargs.get(k, _MISSING) for k in self.kw_keys)) if kwargs else args
        for position, root in self.roots:
            if tops[position] is not root:
                return None
        for d, keys, ids, _ in self.attrs:
            if tuple(d) != keys or tuple(map(id, d.values())) != ids:
                return None
        return [tops[i] for i in self.data_positions]

    def inputs(
        self,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        check_split: Callable[[Any], None],
        is_mirrored: Callable[[Any], bool],
    ) -> tuple[list[Any], list[Any], list[Any]] | None:
        """(state, split, replicated) inputs of the cached program; None: take the full path."""
        data = self.data_if_unchanged(args, kwargs)
        if data is None:
            return None
        leaves, treedef = jax.tree.flatten(data)
        if treedef != self.data_treedef:
            return None
        split, rep = [], []
        mask = count = None
        statics = iter(self.data_statics)
        for leaf, kind in zip(leaves, self.data_kinds, strict=True):
            found = type_kind(type(leaf))
            if kind in "sk":
                if found != "p" or leaf.stacked != (kind == "k"):
                    return None
                check_split(leaf)
                if mask is None and leaf._mask is not None and not leaf.stacked:
                    mask, count = leaf._mask, leaf._count
                split.append(leaf.global_value)
            elif kind == "m":
                if found != "a" or not is_mirrored(leaf):
                    return None
                rep.append(leaf)
            elif kind == "c":
                if found != "c":
                    return None
                rep.append(leaf)
            elif found != "x" or not same_static(leaf, next(statics)):
                return None
        if (mask is not None) != self.masked:
            return None
        if mask is not None:
            split.append(mask)
            rep.append(count)
        state = [v.get_raw_value() for v in self.unique]
        ours = len(state) == len(self.written) and all(map(operator.is_, state, self.written))
        if ours:
            return self.written, split, rep  # the very arrays the last step wrote
        if not all(map(is_mirrored, state)):
            return None
        return state, split, rep
