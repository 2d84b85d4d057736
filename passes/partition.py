"""Group placed nodes into maximal connected partitions with no cycle between them.

1. Levels: ``d(n) = max over inputs p of d(p) + [placement changes]``. Every
   edge then goes from a level to the same or a higher one and a placement
   change strictly raises it, so connected components of same-placement,
   same-level nodes never form a cycle between groups.
2. Lift: a node with no same-placement input on its own level is raised to
   the lowest level its users allow, joining the group it feeds (inputs or
   constants that feed a later group no longer start groups of their own).
3. Merge: two groups of one placement joined by an edge are merged when no
   other path connects them (which would become a cycle); reachability is
   kept as bitsets over the group DAG.

Partitions are ordered topologically (ties by first node in graph order) and
named per placement in that order: ``bpu0, cpu0, bpu1, ...``. The result is
data on ``gm.meta`` (list of ``Partition``) plus ``META_PARTITION`` per node.
"""

from __future__ import annotations

import networkx as nx
import torch.fx as fx

from qcompiler.ir.meta import META_PARTITION, placement
from qcompiler.ir.partitions import GM_PARTITIONS, Partition
from qcompiler.passes.base import CompileContext, Pass, PassResult


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
    return _merge_groups(uf, preds, side, level)


def _merge_groups(uf: _UnionFind, preds, side, level) -> list[list[int]]:
    """Merge adjacent same-placement groups wherever that creates no cycle."""
    n = len(side)
    roots = sorted({uf.find(i) for i in range(n)}, key=lambda r: (level[r], r))
    gid = {r: k for k, r in enumerate(roots)}  # groups numbered in a topological order (by level)
    g_side = [side[r] for r in roots]
    g_succ: list[set[int]] = [set() for _ in roots]
    for i, ps in enumerate(preds):
        gi = gid[uf.find(i)]
        for p in ps:
            gp = gid[uf.find(p)]
            if gp != gi:
                g_succ[gp].add(gi)
    # reach[g]: bitset of groups reachable from g by a path of length >= 1
    reach = [0] * len(roots)
    for g in range(len(roots) - 1, -1, -1):
        bits = 0
        for s in g_succ[g]:
            bits |= (1 << s) | reach[s]
        reach[g] = bits
    gbits = [1 << g for g in range(len(roots))]  # per representative: bitset of its original groups
    rsucc = [set(x) for x in g_succ]  # per representative: successors (original ids) of its members
    alias = list(range(len(roots)))

    def find(g: int) -> int:
        while alias[g] != g:
            alias[g] = alias[alias[g]]
            g = alias[g]
        return g

    for a in range(len(roots)):
        for b in sorted(g_succ[a]):
            ra, rb = find(a), find(b)
            if ra == rb or g_side[ra] != g_side[rb]:
                continue
            a_bits, b_bits = gbits[ra], gbits[rb]
            both = a_bits | b_bits
            # another path ra -> ... -> rb leaves ra through a successor outside both groups
            other = 0
            for s in rsucc[ra]:
                if not (both >> s) & 1:
                    other |= (1 << s) | reach[s]
            if other & b_bits:
                continue
            alias[rb] = ra
            gbits[ra] = both
            rsucc[ra] = {x for x in rsucc[ra] | rsucc[rb] if not (both >> x) & 1}
            merged_reach = (reach[ra] | reach[rb]) & ~both
            # ancestors of ra already reach rb and all it reaches (ra -> rb); only groups that
            # reach rb but not ra gain something: ra and what ra reaches
            gained = (a_bits | reach[ra]) & ~(b_bits | reach[rb])
            m = both
            while m:
                low = m & -m
                reach[low.bit_length() - 1] = merged_reach
                m ^= low
            if gained:
                for g in range(len(roots)):
                    r = reach[g]
                    if r & b_bits and not r & a_bits and not (both >> g) & 1:
                        reach[g] = r | gained | a_bits
    out: dict[int, list[int]] = {}
    for i in range(n):
        out.setdefault(find(gid[uf.find(i)]), []).append(i)
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
    by_name = {p.name: p for p in result}

    changed = False
    for node in nodes:
        name = name_of[owner[node]]
        changed |= node.meta.get(META_PARTITION) != name
        node.meta[META_PARTITION] = name
    for node in gm.graph.nodes:
        mine = node.meta.get(META_PARTITION) if node in owner else None
        for src in node.all_input_nodes:
            theirs = src.meta.get(META_PARTITION) if src in owner else None
            if theirs == mine:
                continue
            if theirs is not None and src.name not in by_name[theirs].outputs:
                by_name[theirs].outputs.append(src.name)
            if mine is not None and src.name not in by_name[mine].inputs:
                by_name[mine].inputs.append(src.name)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    for p in result:  # documented as graph order, not order of first use
        p.inputs.sort(key=order.__getitem__)
        p.outputs.sort(key=order.__getitem__)
    gm.meta[GM_PARTITIONS] = result
    return PassResult(gm, changed)


def verify_partitions(gm: fx.GraphModule, ctx: CompileContext) -> None:
    parts = gm.meta.get(GM_PARTITIONS, [])
    seen: dict[str, str] = {}
    for p in parts:
        for name in p.nodes:
            assert name not in seen, f"node {name} in partitions {seen[name]} and {p.name}"
            seen[name] = p.name
    for node in _placed_nodes(gm):
        assert seen.get(node.name) == node.meta.get(META_PARTITION), f"node {node.name} not in its partition"


PARTITION = Pass("partition", partition, verify_partitions)
