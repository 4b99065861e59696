"""Placements: which ranks hold a global tensor, as a cached ``DeviceMesh``.

The process group is set up lazily (``tpflow.world``): a placement's construction does it.

Creating a mesh of a subset of ranks calls ``new_group``, which every rank of the world must
call in the same order. A placement therefore builds its mesh when it is constructed, and SPMD
scripts construct the same placements in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tpflow.world import get_world_size, init_distributed, on_teardown

__all__ = ["Placement", "nested_index", "placement", "placement_of_mesh"]

_DEVICE_TYPES = ("cpu", "cuda")
_MESHES: dict[tuple[str, tuple], DeviceMesh] = {}


def _as_rank_tuple(ranks: object) -> tuple:
    """Nested lists (or a tensor / array) of ints -> nested tuples, rejecting anything else."""
    if hasattr(ranks, "tolist"):
        ranks = ranks.tolist()
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        return (ranks,)
    if not isinstance(ranks, Sequence) or isinstance(ranks, str) or len(ranks) == 0:
        raise TypeError(f"ranks must be a non-empty list of ints such as [0, 1] or [[0, 1], [2, 3]], got {ranks!r}")
    if all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        return tuple(ranks)
    if any(isinstance(r, int) for r in ranks):
        raise ValueError(f"ranks {ranks!r} mix ints and lists: give a flat list or a rectangular nested one")
    rows = tuple(_as_rank_tuple(r) for r in ranks)
    if len({_shape(r) for r in rows}) != 1:
        raise ValueError(f"ranks {ranks!r} must be a flat list or a rectangular nested list of ints (every row of "
                         "one length)")
    return rows


def _shape(ranks: tuple) -> tuple[int, ...]:
    return (len(ranks), *(_shape(ranks[0]) if isinstance(ranks[0], tuple) else ()))


def _flat(ranks: tuple) -> list[int]:
    return [r for row in ranks for r in _flat(row)] if isinstance(ranks[0], tuple) else list(ranks)


def _as_list(ranks: tuple) -> list:
    return [_as_list(row) for row in ranks] if isinstance(ranks[0], tuple) else list(ranks)


def _as_names(names: object, ndim: int, ranks: list) -> tuple[str, ...] | None:
    """``names`` checked: one distinct, non-empty string per axis (or None)."""
    if names is None:
        return None
    if isinstance(names, str):
        names = (names,)
    if not isinstance(names, Sequence) or not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"placement names must be non-empty strings, one per axis, such as ('dp', 'tp'); got "
                        f"{names!r}")
    names = tuple(names)
    if len(names) != ndim:
        raise ValueError(f"placement ranks {ranks} have {ndim} axis(es) but {len(names)} names {names}: give one "
                         f"name per axis")
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"placement names {names} repeat {repeated}: each axis needs its own name")
    return names


class Placement:
    """The ranks a global tensor lives on: ``placement("cuda", ranks=[[0, 1], [2, 3]], names=("dp", "tp"))``.

    ``hierarchy`` is the shape of ``ranks`` (one entry per axis); the SBP of a tensor on this
    placement has one entry per axis. Placements are hashable and compare by type, ranks and names.

    ``tpf.placement`` is this class, under OneFlow's name. Constructing one sets up the process group if needed
    (``init_distributed``) and builds its ``DeviceMesh``, cached by type, ranks and names. A mesh of a subset of
    the ranks calls ``new_group``, which every rank must call in the same order: construct the same placements in
    the same order on every rank, ranks outside them included. Such a rank holds an empty block of every tensor on
    the placement (``coordinate()`` is None there) and skips its work.

    Named axes make the mesh a named ``DeviceMesh`` (``mesh_dim_names``), as PyTorch's FSDP2 and its tensor
    parallelism take it, and let the placement be sliced by name: ``P["tp"]`` is this rank's 1-D sub-placement
    along the axis ``"tp"``, whose mesh is ``P.mesh["tp"]``, a child of ``P``'s mesh (so torch can join it with
    ``P.mesh["dp"]``). Sub-placements compare equal only to slices of the same placement.

    A bad argument is an error on every rank: a ``type`` other than ``"cpu"`` and ``"cuda"``, a rank listed twice,
    ranks that do not increase along an axis, a rank outside the world (the message says how to launch more
    processes), ``"cuda"`` with no GPU visible, or names that repeat or are not one per axis are ``ValueError``;
    ``ranks`` that are not a flat or rectangular nested list of ints are ``TypeError`` or ``ValueError``.

    Args:
        type: ``"cpu"`` (gloo; blocks on the CPU) or ``"cuda"`` (NCCL; blocks on this process's current GPU).
        ranks: a non-empty list of ints (a 1-D placement) or a rectangular nested list of them (a 2-D or 3-D
            mesh, read row-major); a single int, a tensor or an array also do. Each rank appears once, ranks
            increase along every axis, and all lie in ``0 .. get_world_size() - 1``.
        names: one name per axis, such as ``("dp", "tp")`` (default: unnamed axes, which cannot be sliced).

    Example (4 ranks)::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> P.hierarchy, P.ndim, P == tpf.placement("cpu", [0, 1])
        ((2,), 1, True)
        >>> M = tpf.placement("cpu", ranks=[[0, 1], [2, 3]], names=("dp", "tp"))   # a 2 x 2 mesh: 4 processes
        >>> M.hierarchy, M.coordinate(2), M.names
        ((2, 2), (1, 0), ('dp', 'tp'))
        >>> M["tp"].ranks, M["dp"].ranks                    # on rank 2: its row, and its column
        ([2, 3], [0, 2])
    """

    def __init__(self, type: str, ranks: object, names: Sequence[str] | None = None) -> None:
        if type not in _DEVICE_TYPES:
            raise ValueError(f"placement type must be one of {_DEVICE_TYPES}, got {type!r}")
        self._type = type
        self._ranks = _as_rank_tuple(ranks)
        self._flat = flat = _flat(self._ranks)
        shape = _shape(self._ranks)
        self._names = _as_names(names, len(shape), self.ranks)
        if len(set(flat)) != len(flat):
            raise ValueError(f"placement ranks {self.ranks} list a rank twice: each rank may appear once")
        grid = torch.tensor(flat, dtype=torch.int64).reshape(shape)
        if any(bool((grid.diff(dim=axis) <= 0).any()) for axis in range(len(shape))):
            raise ValueError(
                f"placement ranks {self.ranks} must increase along every axis (torch process groups order their "
                f"ranks, so a collective over [3, 2] would return rank 2's block first): use e.g. "
                f"{sorted(self.flat_ranks)[:2]} instead of {self.flat_ranks[:2]}"
            )
        init_distributed()
        world = dist.get_world_size()
        outside = [r for r in flat if not 0 <= r < world]
        if outside:
            raise ValueError(
                f"placement ranks {self.ranks} include {outside}, outside this world of {world} process(es) "
                f"(ranks 0..{world - 1}); launch more processes with `python -m tpflow.launch --nproc_per_node N` "
                f"or use ranks below {world}"
            )
        if type == "cuda" and not torch.cuda.is_available():
            raise ValueError("placement type 'cuda' needs a GPU, and none is visible: use placement('cpu', ...)")
        self._root: Placement | None = None  # what a slice was cut from
        key = (type, self._ranks, self._names)
        if key not in _MESHES:
            _MESHES[key] = DeviceMesh(type, grid, mesh_dim_names=self._names)
        self._mesh = _MESHES[key]
        self._index()

    def _index(self) -> None:
        """rank -> mesh coordinate, row-major, and the identity placements compare by: asked on every boxing and
        matmul, so computed once."""
        self._key = (self._type, self._ranks, self._names, None if self._root is None else self._root._key)
        self._hash = hash(self._key)
        strides = [1] * self.ndim
        for axis in range(self.ndim - 2, -1, -1):
            strides[axis] = strides[axis + 1] * self.hierarchy[axis + 1]
        self._coords = {r: tuple(i // st % n for st, n in zip(strides, self.hierarchy))
                        for i, r in enumerate(self._flat)}
        self._slices: dict[tuple[str, ...], Placement] = {}

    @classmethod
    def _slice_of(cls, root: Placement, mesh: DeviceMesh) -> Placement:
        """The sub-placement of ``root`` whose mesh is ``mesh`` (a slice of ``root``'s)."""
        sub = cls.__new__(cls)
        sub._type, sub._ranks = root.type, _as_rank_tuple(mesh.mesh.tolist())
        sub._flat, sub._names, sub._mesh = _flat(sub._ranks), tuple(mesh.mesh_dim_names), mesh
        sub._root = root
        sub._index()
        _PLACEMENTS.setdefault(mesh, sub)
        return sub

    @classmethod
    def all(cls, type: str) -> Placement:
        """Every rank of the world, 1-D (OneFlow's ``placement.all``)."""
        return cls(type, list(range(get_world_size())))

    @property
    def type(self) -> str:
        return self._type

    @property
    def ranks(self) -> list:
        """The ranks as nested lists, as they were given."""
        return _as_list(self._ranks)

    @property
    def flat_ranks(self) -> list[int]:
        """The ranks in row-major order: position ``i`` holds the mesh coordinate ``i``."""
        return list(self._flat)

    @property
    def hierarchy(self) -> tuple[int, ...]:
        """The mesh shape: ``(2,)`` for ``[0, 1]``, ``(2, 2)`` for ``[[0, 1], [2, 3]]``."""
        return tuple(self._mesh.shape)

    @property
    def ndim(self) -> int:
        return len(self.hierarchy)

    @property
    def names(self) -> tuple[str, ...] | None:
        """The axes' names (None where the placement was made without them)."""
        return self._names

    @property
    def mesh(self) -> DeviceMesh:
        return self._mesh

    @property
    def device(self) -> torch.device:
        """Where this rank's local shards live."""
        if self._type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def coordinate(self, rank: int | None = None) -> tuple[int, ...] | None:
        """Mesh coordinate of ``rank`` (default: this rank), or None when it is outside."""
        return self._coords.get(dist.get_rank() if rank is None else rank)

    def rank_at(self, coord: Sequence[int]) -> int:
        index = 0
        for c, size in zip(coord, self.hierarchy):
            index = index * size + c
        return self._flat[index]

    def axis(self, name: str | int) -> int:
        """The axis called ``name`` (an int is returned as it is, once checked).

        Args:
            name: an axis' name, or its index.

        Returns:
            The axis' index, from 0.

        Example::

            >>> tpf.placement("cpu", [0, 1], names=("tp",)).axis("tp")
            0
        """
        if isinstance(name, int) and not isinstance(name, bool):
            if not -self.ndim <= name < self.ndim:
                raise ValueError(f"{self!r} has {self.ndim} axis(es): axis {name} is out of range")
            return name % self.ndim
        if self._names is None or name not in self._names:
            have = "no names (give names= to tpf.placement)" if self._names is None else f"the axes {self._names}"
            raise ValueError(f"{self!r} has {have}: no axis called {name!r}")
        return self._names.index(name)

    def __getitem__(self, names: str | tuple[str, ...]) -> Placement:
        """This rank's sub-placement along the axes ``names`` (in that order), its mesh ``self.mesh[names]``.

        Args:
            names: an axis' name, or a tuple of them.

        Returns:
            The placement of the ranks that share this rank's coordinates on the other axes, named ``names``.

        Example (4 ranks)::

            >>> M = tpf.placement("cpu", [[0, 1], [2, 3]], names=("dp", "tp"))
            >>> M["tp"].ranks, M["tp"].names, M["dp"].ranks   # on rank 1
            ([0, 1], ('tp',), [1, 3])
            >>> M["tp"].mesh is M.mesh["tp"] or M["tp"].mesh == M.mesh["tp"]
            True
        """
        key = (names,) if isinstance(names, str) else tuple(names)
        found = self._slices.get(key)
        if found is None:
            for name in key:
                self.axis(name)
            if len(set(key)) != len(key):
                raise ValueError(f"{self!r} sliced by {key}: name each axis once")
            if self.coordinate() is None:
                raise ValueError(f"rank {dist.get_rank()} is outside {self!r}: a sub-placement is this rank's slice, "
                                 "so only the placement's ranks can take one")
            mesh = self._mesh[key]
            found = self if mesh is self._mesh else Placement._slice_of(self._root or self, mesh)
            self._slices[key] = found
        return found

    @property
    def leaves_data_axes(self) -> bool:
        """Whether a model split on this placement leaves its data axes to PyTorch's FSDP2: a named placement of
        several axes, seen from one of its ranks (``tpf.parallelize`` splits over the last axis only).

        Example (2 ranks)::

            >>> tpf.placement("cpu", [[0, 1]], names=("dp", "tp")).leaves_data_axes
            True
            >>> tpf.placement("cpu", [[0, 1]]).leaves_data_axes
            False
        """
        return self._names is not None and self.ndim > 1 and self.coordinate() is not None

    @property
    def tensor_slice(self) -> Placement:
        """Where a model's tensor-parallel layers live on this placement: the last axis' slice of one that leaves its
        data axes to FSDP2 (this rank's row), else the placement itself (also on a rank outside it, which holds
        nothing).

        Example (2 ranks)::

            >>> tpf.placement("cpu", [[0, 1]], names=("dp", "tp")).tensor_slice.names
            ('tp',)
        """
        return self[self._names[-1]] if self.leaves_data_axes else self

    def __contains__(self, rank: int) -> bool:
        return rank in self._coords

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placement) and (self is other or self._key == other._key)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        names = "" if self._names is None else f", names={self._names!r}".replace("'", '"')
        own = f'placement(type="{self._type}", ranks={self.ranks}{names})'
        return own if self._root is None else f"{own} of {self._root!r}"


placement = Placement


_PLACEMENTS: dict[DeviceMesh, Placement] = {}
on_teardown(_MESHES.clear)  # the groups are destroyed at exit: the meshes holding them go first
on_teardown(_PLACEMENTS.clear)


def nested_index(coordinate: Sequence[int], sizes: Sequence[int], axes: Sequence[int]) -> int:
    """The block a mesh coordinate holds of a tensor split over several axes, nested in DTensor's order (the first
    axis outermost): ``c * T + t`` for ``(c, t)`` on a ``(C, T)`` mesh split over both.

    Args:
        coordinate: the rank's mesh coordinate.
        sizes: the mesh's shape.
        axes: the axes the tensor is split over, outermost first.

    Returns:
        The block's index among ``prod(sizes[a] for a in axes)``.

    Example::

        >>> nested_index((1, 0), (2, 2), (0, 1)), nested_index((1, 0), (2, 2), (1,))
        (2, 0)
    """
    index = 0
    for a in axes:
        index = index * sizes[a] + coordinate[a]
    return index


def _root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself if it was not), on torch 2.13's API or an older one."""
    own = getattr(mesh, "_get_root_mesh", None)
    if own is not None:
        return own()
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_root_mesh(mesh)


def placement_of_mesh(mesh: DeviceMesh) -> Placement:
    """The placement of a DTensor's mesh (cached: this runs on every boxing and matmul),
    registering meshes that torch code built itself.

    Args:
        mesh: a 1-D or 2-D ``DeviceMesh`` whose ranks follow ``Placement``'s rules.

    Returns:
        The ``Placement`` with the mesh's device type and ranks: equal to the placement a tensor on the mesh was
        made on, though not necessarily the same object.

    Example::

        >>> import tpflow as tpf
        >>> from tpflow.placement import placement_of_mesh
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = tpf.randn(4, 5, placement=P, sbp=tpf.sbp.split(0))
        >>> placement_of_mesh(x.device_mesh) == P
        True
    """
    found = _PLACEMENTS.get(mesh)
    if found is None and mesh.mesh_dim_names and _root_mesh(mesh) is not mesh:  # a slice torch cut itself
        found = Placement._slice_of(placement_of_mesh(_root_mesh(mesh)), mesh)
    if found is None:
        key = (mesh.device_type, _as_rank_tuple(mesh.mesh.tolist()), mesh.mesh_dim_names)
        _MESHES.setdefault(key, mesh)
        found = _PLACEMENTS[mesh] = Placement(*key)
    return found
