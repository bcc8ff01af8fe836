package bpf

import (
	"cmp"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// makePlan tells identical rules apart by dup, counted in policy order per key (a prefix in two
// origins is two keys), and each trie's entry carries the first rule of its prefix.
func TestPlanDupsAndFirstRules(t *testing.T) {
	pfx := netip.MustParsePrefix
	a, b, ll := pfx("10.1.0.0/16"), pfx("10.2.0.0/16"), policy.LinkLocalIPv4
	cfg := config.Config{NonMasqueradeCIDRs: []netip.Prefix{a, b, a, ll, a, b}, MasqOutBound: true}
	p := policy.Compile(cfg, policy.Options{})
	pl, err := makePlan(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	// The rules: link-local, then the list, then the outbound rule.
	wantDup := []uint16{0, 0, 0, 1, 0, 2, 1, 0}
	if len(pl.keys) != len(wantDup) {
		t.Fatalf("%d keys, want %d", len(pl.keys), len(wantDup))
	}
	seen := map[slotKey]bool{}
	for i, k := range pl.keys {
		if k.dup != wantDup[i] || k.prefix() != p.IPv4[i].Prefix || k.policyOrigin() != p.IPv4[i].Origin {
			t.Errorf("rule %d (%s %s): key %s %s dup %d, want dup %d", i+1, p.IPv4[i].Prefix, p.IPv4[i].Origin,
				k.prefix(), k.policyOrigin(), k.dup, wantDup[i])
		}
		if seen[k] {
			t.Errorf("rule %d: key %+v twice", i+1, k)
		}
		seen[k] = true
	}
	entries := pl.tries[trieKind{policy.IPv4, policy.Return, 0}]
	want := map[netip.Prefix]int{ll: 0, a: 1, b: 2}
	if len(entries) != len(want) {
		t.Fatalf("trie entries %v, want %v", entries, want)
	}
	for _, e := range entries {
		if idx, ok := want[e.prefix]; !ok || idx != e.idx {
			t.Errorf("entry %s carries rule %d, want %d", e.prefix, e.idx, idx)
		}
	}
}

// prefixSet holds exactly the prefixes of the entries, of either family.
func TestPrefixSet(t *testing.T) {
	pfx := netip.MustParsePrefix
	for _, tc := range []struct{ in, out []string }{
		{[]string{"10.1.0.0/16", "10.1.0.0/24", "0.0.0.0/0", "255.255.255.255/32"},
			[]string{"10.1.0.0/17", "10.0.0.0/16", "::/0", "::ffff:10.1.0.0/112", "::a01:0/112"}},
		{[]string{"2001:db8::/32", "::/0"}, []string{"2001:db8::/33", "0.0.0.0/0"}},
		{nil, []string{"10.0.0.0/8", "::/0"}},
	} {
		var entries []trieEntry
		for _, s := range tc.in {
			entries = append(entries, trieEntry{prefix: pfx(s)})
		}
		in := prefixSet(entries)
		for _, s := range tc.in {
			if !in(pfx(s)) {
				t.Errorf("%v: lacks %s", tc.in, s)
			}
		}
		for _, s := range tc.out {
			if in(pfx(s)) {
				t.Errorf("%v: holds %s", tc.in, s)
			}
		}
	}
}

// sortPlanned's sort of IPv4 entries as numbers is prefixOrder, then rule order.
func TestSortPlanned(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for range 50 {
		var entries []planned
		for i := range 1 + rng.IntN(2000) {
			a := netip.AddrFrom4([4]byte{byte(rng.IntN(3)), byte(rng.IntN(3)), byte(rng.IntN(256)), byte(rng.IntN(256))})
			p, _ := a.Prefix(rng.IntN(33))
			entries = append(entries, planned{p, i * (1 + rng.IntN(3))})
		}
		want := slices.Clone(entries)
		slices.SortFunc(want, func(a, b planned) int { return cmp.Or(prefixOrder(a.prefix, b.prefix), a.idx-b.idx) })
		sortPlanned(entries)
		if !slices.Equal(entries, want) {
			t.Fatalf("sorted %v\nwant %v", entries, want)
		}
	}
}

// diffSorted finds what a map-based comparison finds: the entries of want that have lacks or
// holds with another value, and the prefixes of have that want lacks, for both families.
func TestDiffSorted(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for round := range 100 {
		v6 := round%2 == 1
		random := func() []trieEntry {
			m := map[trieKey]trieValue{}
			for range rng.IntN(200) {
				var a netip.Addr
				if v6 {
					a = netip.AddrFrom16([16]byte{0x20, 1, byte(rng.IntN(4)), byte(rng.IntN(4))})
				} else {
					a = netip.AddrFrom4([4]byte{10, byte(rng.IntN(4)), byte(rng.IntN(4)), 0})
				}
				p, _ := a.Prefix(8 + rng.IntN(25))
				m[p] = trieValue{action: policy.Return, slot: uint32(rng.IntN(3))}
			}
			var out []trieEntry
			for p, v := range m {
				out = append(out, trieEntry{p, v})
			}
			slices.SortFunc(out, func(a, b trieEntry) int { return prefixOrder(a.prefix, b.prefix) })
			return out
		}
		have, want := random(), random()
		put, stale := diffSorted(have, want)
		held := map[trieKey]trieValue{}
		for _, e := range have {
			held[e.prefix] = e.trieValue
		}
		var wantPut []trieEntry
		wanted := map[trieKey]bool{}
		for _, e := range want {
			wanted[e.prefix] = true
			if v, ok := held[e.prefix]; !ok || v != e.trieValue {
				wantPut = append(wantPut, e)
			}
		}
		var wantStale []trieKey
		for _, e := range have {
			if !wanted[e.prefix] {
				wantStale = append(wantStale, e.prefix)
			}
		}
		if !slices.Equal(put, wantPut) || !slices.Equal(stale, wantStale) {
			t.Fatalf("round %d: put %v stale %v, want %v and %v", round, put, stale, wantPut, wantStale)
		}
	}
}
