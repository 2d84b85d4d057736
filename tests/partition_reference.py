"""The partition pass's merge step as it was before the dynamic topological order: the slow reference.

``merge_groups_reference`` keeps the transitive closure of the group DAG as
integer bitsets and updates it after each merge (quadratic in the number of
groups). tests/test_property_partition.py checks that ``passes.partition``
gives exactly the groups this gives, on random graphs.
"""

from __future__ import annotations

import torch.fx as fx

from qcompiler.passes.partition import _UnionFind, initial_groups


def group_nodes_reference(nodes: list[fx.Node]) -> list[list[int]]:
    return merge_groups_reference(*initial_groups(nodes))


def merge_groups_reference(uf: _UnionFind, preds, side, level) -> list[list[int]]:
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

