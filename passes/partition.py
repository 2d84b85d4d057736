"""Group placed nodes into maximal connected partitions with no cycle between them.

1. Levels: ``d(n) = max over inputs p of d(p) + [placement changes]``. Every
   edge then goes from a level to the same or a higher one and a placement
   change strictly raises it, so connected components of same-placement,
   same-level nodes never form a cycle between groups.
2. Lift: a node with no same-placement input on its own level is raised to
   the lowest level its users allow, joining the group it feeds (inputs or
   constants that feed a later group no longer start groups of their own).
3. Merge: two groups of one placement joined by an edge are merged when no
   other path connects them (which would become a cycle); the group DAG keeps
   a dynamic topological numbering that bounds each path search.

Partitions are ordered topologically (ties by first node in graph order) and
named per placement in that order: ``bpu0, cpu0, bpu1, ...``. The result is
data on ``gm.meta`` (list of ``Partition``) plus ``META_PARTITION`` per node.
"""

from __future__ import annotations

from typing import Optional

import networkx as nx
import torch.fx as fx

from qcompiler.errors import PassError
from qcompiler.ir.meta import GM_PARTITIONS, META_PARTITION, placement
from qcompiler.ir.partitions import Partition
from qcompiler.passes.base import CompileContext, Fact, Pass, PassResult
from qcompiler.passes.place import PLACEMENT


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def _placed_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def group_nodes(nodes: list[fx.Node]) -> list[list[int]]:
    """Indices of ``nodes`` (topologically ordered, all placed) grouped into partitions."""
    return _merge_groups(*initial_groups(nodes))


def initial_groups(nodes: list[fx.Node]) -> tuple[_UnionFind, list[list[int]], list, list[int]]:
    """Steps 1 and 2: the same-placement, same-level groups (union-find), inputs, sides and levels."""
    index = {n: i for i, n in enumerate(nodes)}
    side = [placement(n) for n in nodes]
    preds = [[index[p] for p in n.all_input_nodes if p in index] for n in nodes]
    succs: list[list[int]] = [[] for _ in nodes]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)

    level = [0] * len(nodes)
    for i, ps in enumerate(preds):
        level[i] = max((level[p] + (side[p] != side[i]) for p in ps), default=0)
    for i in range(len(nodes) - 1, -1, -1):
        if not succs[i] or any(side[p] == side[i] and level[p] == level[i] for p in preds[i]):
            continue
        lifted = min(level[s] - (side[s] != side[i]) for s in succs[i])
        if lifted > level[i]:
            level[i] = lifted

    uf = _UnionFind(len(nodes))
    for i, ps in enumerate(preds):
        for p in ps:
            if side[p] == side[i] and level[p] == level[i]:
                uf.union(p, i)
    return uf, preds, side, level


def _merge_groups(uf: _UnionFind, preds, side, level) -> list[list[int]]:
    """Step 3: merge adjacent same-placement groups wherever that creates no cycle.

    The candidates are the group edges ``a -> b`` in a fixed order (``a`` by
    level, then ``b``); each merges the current groups of ``a`` and ``b`` unless
    another path joins them. The contracted group graph stays a DAG and keeps a
    topological numbering ``pos`` (Pearce-Kelly style): a path from ``ra`` to
    ``rb`` only visits positions between theirs, so the cycle check searches that
    window only, and a merge renumbers only the window's nodes that lie on paths
    from ``ra`` or to ``rb``. Adjacency sets are merged small into large. This is
    near-linear where the level order is close to the final order (the usual
    case); the old all-pairs bitset version (quadratic) is kept in
    tests/partition_reference.py and must give the same groups.
    """
    n = len(side)
    roots = sorted({uf.find(i) for i in range(n)}, key=lambda r: (level[r], r))
    gid = {r: k for k, r in enumerate(roots)}  # groups numbered in a topological order (by level)
    g_of = [gid[uf.find(i)] for i in range(n)]
    g_side = [side[r] for r in roots]
    g_succ: list[set[int]] = [set() for _ in roots]
    for i, ps in enumerate(preds):
        gi = g_of[i]
        for p in ps:
            gp = g_of[p]
            if gp != gi:
                g_succ[gp].add(gi)
    succ = [set(s) for s in g_succ]  # the contracted graph, over representatives
    pred: list[set[int]] = [set() for _ in roots]
    for g, ss in enumerate(g_succ):
        for s in ss:
            pred[s].add(g)
    pos = list(range(len(roots)))
    alias = list(range(len(roots)))

    def find(g: int) -> int:
        while alias[g] != g:
            alias[g] = alias[alias[g]]
            g = alias[g]
        return g

    def window(start: int, edges: list[set[int]], inside, stop: int = -1) -> Optional[list[int]]:
        """Nodes reached from ``start`` (not itself) through ``inside`` positions; None if one links to ``stop``."""
        seen, todo = set(), [x for x in edges[start] if x != stop and inside(pos[x])]
        seen.update(todo)
        while todo:
            x = todo.pop()
            if stop in edges[x]:
                return None
            for y in edges[x]:
                if y not in seen and inside(pos[y]):
                    seen.add(y)
                    todo.append(y)
        return list(seen)

    for a in range(len(roots)):
        for b in sorted(g_succ[a]):
            ra, rb = find(a), find(b)
            if ra == rb or g_side[ra] != g_side[rb]:
                continue
            lo, hi = pos[ra], pos[rb]
            after_a = window(ra, succ, lambda p: p < hi, stop=rb)
            if after_a is None:
                continue  # another path ra -> ... -> rb: merging would make a cycle
            before_b = window(rb, pred, lambda p: p > lo)
            keep, drop = (ra, rb) if len(succ[ra]) + len(pred[ra]) >= len(succ[rb]) + len(pred[rb]) else (rb, ra)
            # renumber the window: what reaches rb, then the merged group, then what ra reaches
            slots = sorted([lo, hi] + [pos[x] for x in after_a] + [pos[x] for x in before_b])
            new_order = sorted(before_b, key=pos.__getitem__) + [keep] + sorted(after_a, key=pos.__getitem__)
            for x, p in zip(new_order, slots):
                pos[x] = p
            for y in succ[drop]:
                pred[y].discard(drop)
                if y != keep:
                    pred[y].add(keep)
            for y in pred[drop]:
                succ[y].discard(drop)
                if y != keep:
                    succ[y].add(keep)
            succ[keep] |= succ[drop]
            pred[keep] |= pred[drop]
            succ[keep] -= {ra, rb}
            pred[keep] -= {ra, rb}
            succ[drop] = pred[drop] = set()
            alias[drop] = keep
    out: dict[int, list[int]] = {}
    for i in range(n):
        out.setdefault(find(g_of[i]), []).append(i)
    return list(out.values())


def partition(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    nodes = _placed_nodes(gm)
    groups = group_nodes(nodes)
    owner = {}
    for k, members in enumerate(groups):
        for i in members:
            owner[nodes[i]] = k

    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(groups)))
    for node in nodes:
        for src in node.all_input_nodes:
            if src in owner and owner[src] != owner[node]:
                dag.add_edge(owner[src], owner[node])
    if not nx.is_directed_acyclic_graph(dag):  # the grouping guarantees this; check anyway
        raise AssertionError("partitioning produced a cycle between partitions")
    first = {k: min(members) for k, members in enumerate(groups)}
    order = list(nx.lexicographical_topological_sort(dag, key=lambda k: first[k]))

    counters: dict[str, int] = {}
    result: list[Partition] = []
    name_of: dict[int, str] = {}
    for k in order:
        where = placement(nodes[groups[k][0]])
        name = f"{where}{counters.get(where, 0)}"
        counters[where] = counters.get(where, 0) + 1
        name_of[k] = name
        result.append(Partition(name, where, [nodes[i].name for i in sorted(groups[k])]))

    changed = False
    for node in nodes:
        name = name_of[owner[node]]
        changed |= node.meta.get(META_PARTITION) != name
        node.meta[META_PARTITION] = name
    # the values crossing each partition's boundary, as sets (a partition may have thousands)
    ins: dict[str, set[str]] = {p.name: set() for p in result}
    outs: dict[str, set[str]] = {p.name: set() for p in result}
    for node in gm.graph.nodes:
        mine = node.meta.get(META_PARTITION) if node in owner else None
        for src in node.all_input_nodes:
            theirs = src.meta.get(META_PARTITION) if src in owner else None
            if theirs == mine:
                continue
            if theirs is not None:
                outs[theirs].add(src.name)
            if mine is not None:
                ins[mine].add(src.name)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    for p in result:  # documented as graph order, not order of first use
        p.inputs[:] = sorted(ins[p.name], key=order.__getitem__)
        p.outputs[:] = sorted(outs[p.name], key=order.__getitem__)
    gm.meta[GM_PARTITIONS] = result
    return PassResult(gm, changed)


def verify_partitions(gm: fx.GraphModule, ctx: CompileContext) -> None:
    parts = gm.meta.get(GM_PARTITIONS, [])
    seen: dict[str, str] = {}
    for p in parts:
        for name in p.nodes:
            if name in seen:
                raise PassError(f"node {name} in partitions {seen[name]} and {p.name}")
            seen[name] = p.name
    for node in _placed_nodes(gm):
        if seen.get(node.name) != node.meta.get(META_PARTITION):
            raise PassError(f"node {node.name} not in its partition")


PARTITION = Pass("partition", partition, verify_partitions, requires=(PLACEMENT,))
# every placed node in one partition (META_PARTITION), the partitions listed in gm.meta[GM_PARTITIONS]
PARTITIONS = Fact("partitions", PARTITION, lambda gm: None if GM_PARTITIONS in gm.meta else "the graph has none")
