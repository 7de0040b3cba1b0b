"""Records connected by shared identities, and the index that keeps them.
Design notes: docs/privacy.md, "privcode/privacy/components.py".

Two records sharing an identity (:mod:`privcode.privacy.identities`) are one record to the store,
closed transitively: A ~ B and B ~ C make one *component* {A, B, C}, every record of which has spent

    epsilon(component) = epsilon( compose{ events(j) : j in jobs(component) } )

over every job that trained on any of its records. Admission must check the whole component
(over-counts, never under-counts). State (numpy, no I/O)::

    keys:  sorted uint64   the first 64 bits of every identity ever trained on
    comp:  int64 per key   the component holding it (always a live component)
    cgid:  int64 per comp  the component's group: id of its set of jobs
    crec:  int64 per comp  its number of records (distinct ``exact`` identities)

:meth:`IdentityIndex.link` labels records by their component-to-be, :meth:`IdentityIndex.merge`
makes one component per label: O((n m + k) log(n m + k)), no Python loop per record.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["IdentityIndex", "Linked"]


@dataclass(frozen=True)
class Linked:
    """``n`` records resolved against an index (:meth:`IdentityIndex.link`)."""

    labels: np.ndarray  #: (n,) each record's label (its component-to-be), 0..n_labels-1
    n_labels: int
    touched: np.ndarray  #: indexed components the records touch (distinct)
    touched_label: np.ndarray  #: the label each of them joins
    new_keys: np.ndarray  #: sorted identities not indexed yet
    new_label: np.ndarray  #: the label each of them joins
    new_record: np.ndarray  #: (n,) bool: the record's ``exact`` identity is not indexed yet


class IdentityIndex:
    """Identity -> component -> group (module docstring). One writer; not thread-safe."""

    def __init__(self) -> None:
        self.keys = np.empty(0, np.uint64)
        self.comp = np.empty(0, np.int64)
        self.cgid = np.empty(0, np.int64)
        self.crec = np.empty(0, np.int64)

    @property
    def records(self) -> int:
        return int(self.crec.sum())

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The component of each key, -1 for a key not indexed."""
        if not len(self.keys):
            return np.full(keys.shape, -1, np.int64)
        pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        return np.where(self.keys[pos] == keys, self.comp[pos], -1)

    def link(self, keys: np.ndarray) -> Linked:
        """Resolve records ``keys`` ``(n, m)`` (column 0: the ``exact`` identity)."""
        from scipy.sparse import coo_matrix
        from scipy.sparse.csgraph import connected_components

        n, m = keys.shape
        uniq, first, inv, counts = np.unique(
            keys.ravel(), return_index=True, return_inverse=True, return_counts=True
        )
        comp_u = self.lookup(uniq)
        found = comp_u >= 0
        touched, comp_node = np.unique(comp_u[found], return_inverse=True)
        shared = ~found & (counts > 1)  # new identities several of the records hold
        node = np.full(len(uniq), -1, np.int64)
        node[shared] = n + np.arange(int(shared.sum()))
        node[found] = n + int(shared.sum()) + comp_node
        owner = np.repeat(np.arange(n), m)
        edge = node[inv] >= 0
        size = n + int(shared.sum()) + len(touched)
        graph = coo_matrix(
            (np.ones(int(edge.sum()), np.int8), (owner[edge], node[inv][edge])), shape=(size, size)
        )
        _, raw = connected_components(graph, directed=False)
        heads, labels = np.unique(raw[:n], return_inverse=True)
        label_of = np.full(int(raw.max()) + 1 if size else 0, -1, np.int64)
        label_of[heads] = np.arange(len(heads))
        new = ~found
        return Linked(
            labels=labels.astype(np.int64),
            n_labels=len(heads),
            touched=touched,
            touched_label=label_of[raw[n + int(shared.sum()) :]],
            new_keys=uniq[new],
            new_label=labels[owner[first[new]]].astype(np.int64),
            new_record=comp_u[inv.reshape(n, m)[:, 0]] < 0,
        )

    def merge(self, linked: Linked, gid_of_label: np.ndarray) -> None:
        """Make each label one component in group ``gid_of_label[label]``: the components
        it touched (now dead) and the records' new identities."""
        base = len(self.cgid)
        records = np.bincount(linked.labels[linked.new_record], minlength=linked.n_labels)
        records += np.bincount(
            linked.touched_label, weights=self.crec[linked.touched], minlength=linked.n_labels
        ).astype(np.int64)
        self.cgid = np.concatenate([self.cgid, gid_of_label.astype(np.int64)])
        self.crec = np.concatenate([self.crec, records])
        self.crec[linked.touched] = 0
        self.cgid[linked.touched] = -1
        if len(linked.touched):
            remap = np.arange(base, dtype=np.int64)
            remap[linked.touched] = base + linked.touched_label
            self.comp = remap[self.comp]
        pos = np.searchsorted(self.keys, linked.new_keys)
        self.keys = np.insert(self.keys, pos, linked.new_keys)
        self.comp = np.insert(self.comp, pos, base + linked.new_label)
        if len(self.cgid) > 2 * max(int((self.crec > 0).sum()), 1024):
            self.compact()

    def compact(self) -> None:
        """Drop dead components (renumber the live ones in order)."""
        live = np.flatnonzero(self.cgid >= 0)
        remap = np.full(len(self.cgid), -1, np.int64)
        remap[live] = np.arange(len(live))
        self.comp, self.cgid, self.crec = remap[self.comp], self.cgid[live], self.crec[live]

    def sizes(self, n_groups: int) -> np.ndarray:
        """Records per group id (live components summed)."""
        live = self.cgid >= 0
        return np.bincount(self.cgid[live], weights=self.crec[live], minlength=n_groups).astype(
            np.int64
        )

    # -- persistence ---------------------------------------------------------------

    _KEY, _COMP = np.dtype(">u8"), np.dtype(">u4")

    def to_bytes(self) -> tuple[bytes, int, int]:
        """(blob, keys, components): keys, their components, then (group, records) per
        component, all big-endian (the index compacted first)."""
        self.compact()
        blob = b"".join(
            (
                self.keys.astype(self._KEY).tobytes(),
                self.comp.astype(self._COMP).tobytes(),
                self.cgid.astype(self._COMP).tobytes(),
                self.crec.astype(self._COMP).tobytes(),
            )
        )
        return blob, len(self.keys), len(self.cgid)

    @classmethod
    def from_bytes(cls, blob: bytes, keys: int, comps: int, n_groups: int) -> IdentityIndex:
        """The inverse of :meth:`to_bytes`; ValueError when damaged."""
        if len(blob) != 12 * keys + 8 * comps or keys < 0 or comps < 0:
            raise ValueError("index length is not a whole number of entries")
        out = cls()
        at = 8 * keys
        out.keys = np.frombuffer(blob, cls._KEY, keys).astype(np.uint64)
        out.comp = np.frombuffer(blob, cls._COMP, keys, at).astype(np.int64)
        out.cgid = np.frombuffer(blob, cls._COMP, comps, at + 4 * keys).astype(np.int64)
        out.crec = np.frombuffer(blob, cls._COMP, comps, at + 4 * keys + 4 * comps).astype(np.int64)
        if keys and ((out.keys[1:] <= out.keys[:-1]).any() or out.comp.max() >= comps):
            raise ValueError("index keys unsorted or naming a component that does not exist")
        if comps and (out.cgid.max() >= n_groups or (out.crec < 1).any()):
            raise ValueError("index names a group that does not exist")
        return out

    @classmethod
    def from_fingerprints(cls, keys: np.ndarray, gids: np.ndarray) -> IdentityIndex:
        """An index of records with one identity each (a store from before identities);
        ``keys`` distinct (the caller joins the groups of keys equal in 64 bits)."""
        out = cls()
        order = np.argsort(keys, kind="stable")
        out.keys, out.cgid = keys[order], gids[order].astype(np.int64)
        if (out.keys[1:] == out.keys[:-1]).any():
            raise ValueError("duplicate keys")
        out.comp = np.arange(len(out.keys), dtype=np.int64)
        out.crec = np.ones(len(out.keys), np.int64)
        return out
