package bpf

import (
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
)

// firstMatch against its definition: for each prefix, the first rule among it and every shorter
// prefix of the trie containing it, over random tries with nested and disjoint prefixes of both
// families.
func TestFirstMatch(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for round := range 200 {
		trie := map[trieKey]int{}
		v6 := round%2 == 1
		for i := range 1 + rng.IntN(300) {
			var a netip.Addr
			bits := rng.IntN(33)
			if v6 {
				var b [16]byte
				b[0], b[1], b[2] = 0x20, byte(rng.IntN(4)), byte(rng.IntN(4))
				a, bits = netip.AddrFrom16(b), rng.IntN(25)
			} else {
				a = netip.AddrFrom4([4]byte{10, byte(rng.IntN(4)), byte(rng.IntN(4)), byte(rng.IntN(256))})
			}
			p, _ := a.Prefix(bits)
			if _, ok := trie[p]; !ok {
				trie[p] = rng.IntN(1000) + i
			}
		}
		want := map[trieKey]int{}
		for p, idx := range trie {
			best := idx
			for q, j := range trie {
				if q.Bits() < p.Bits() && q.Contains(p.Addr()) && j < best {
					best = j
				}
			}
			want[p] = best
		}
		var entries []planned
		for p, idx := range trie {
			entries = append(entries, planned{p, idx})
		}
		slices.SortFunc(entries, func(a, b planned) int { return prefixOrder(a.prefix, b.prefix) })
		firstMatch(entries)
		for _, e := range entries {
			if want[e.prefix] != e.idx {
				t.Fatalf("round %d: %s carries rule %d, want %d", round, e.prefix, e.idx, want[e.prefix])
			}
		}
	}
}
