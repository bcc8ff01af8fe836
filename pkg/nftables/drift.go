package nftables

import (
	"context"
	"maps"
	"net/netip"
	"slices"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// driftKinds are the kinds of drift CheckDrift reports.
var driftKinds = []string{datapath.DriftTable, datapath.DriftChain, datapath.DriftSet}

// DriftKinds implements datapath.DriftChecker.
func (b *Backend) DriftKinds() []string { return driftKinds }

// walkShare is the share of the time the element walks of CheckDrift may take: after a walk
// that took d, the next waits (1/walkShare - 1) d.
const walkShare = 0.05

// CheckDrift implements datapath.DriftChecker. First the ruleset's generation, one netlink
// request: unchanged since the last Apply or the last check that found everything in place,
// nothing can have changed. Otherwise each table the last Apply installed is read: that it
// exists (table), its chains' rules against those read right after the Apply (chain), its sets
// against the layout and, when the walk is due, their elements against what was installed
// (set). Walks are spaced so that they take at most walkShare of the time (a 100k-element set
// takes seconds to read back); until a walk found the elements in place, the generation is not
// taken as checked.
func (b *Backend) CheckDrift(ctx context.Context) ([]string, error) {
	fams := b.appliedFamilies()
	if len(fams) == 0 {
		return nil, nil
	}
	gen, err := b.kernel.Generation(ctx)
	if err != nil {
		return nil, err
	}
	if b.genKnown && gen == b.gen {
		return nil, nil
	}
	walk := !time.Now().Before(b.nextWalk)
	start := time.Now()
	found := map[string]bool{}
	for _, fam := range fams {
		known := b.known[fam]
		st, err := b.kernel.Table(ctx, fam, walk)
		if err != nil {
			return nil, err
		}
		switch {
		case st == nil:
			found[datapath.DriftTable] = true
			continue
		case known == nil:
			// The read back after the Apply failed: compare with nothing, repair to be sure.
			found[datapath.DriftChain] = true
			continue
		}
		found[datapath.DriftChain] = found[datapath.DriftChain] || !sameChains(st.Chains, known.links.chains)
		if !slices.Equal(st.SourceMap, known.links.sources) {
			found[datapath.DriftSet] = true
		}
		if walk {
			if err := completeWalk(ctx, b.kernel, fam, st, keysOf(known.in.elems)); err != nil {
				return nil, err
			}
		}
		if !sameSets(st, known.in, walk) {
			found[datapath.DriftSet] = true
			known.stale = true
		}
	}
	if walk {
		b.nextWalk = time.Now().Add(time.Duration(float64(time.Since(start)) * (1/walkShare - 1)))
	}
	var out []string
	for _, k := range b.DriftKinds() {
		if found[k] {
			out = append(out, k)
		}
	}
	if len(out) == 0 && walk {
		b.gen, b.genKnown = gen, true
	}
	return out, nil
}

// completeWalk adds to a table read with its elements those of want it lacks and the kernel
// holds: a walk of a set the kernel is resizing (after an apply of thousands of elements)
// misses some, 15% of 100k here, where a lookup by key does not.
func completeWalk(ctx context.Context, k Kernel, fam policy.Family, st *TableState, want map[string][]netip.Addr) error {
	for _, set := range slices.Sorted(maps.Keys(want)) {
		s := st.Sets[set]
		if s == nil || s.Elements == nil {
			continue
		}
		var missing []netip.Addr
		for _, key := range want[set] {
			if _, ok := s.Elements[key]; !ok {
				missing = append(missing, key)
			}
		}
		if len(missing) == 0 {
			continue
		}
		got, err := k.Elements(ctx, fam, set, missing)
		if err != nil {
			return err
		}
		maps.Copy(s.Elements, got)
	}
	return nil
}

// links are the fingerprints of what sends a packet where in a table: its chains' rules and
// the source map's elements.
type links struct {
	chains  map[string][]string
	sources []string
}

func linksOf(st *TableState) links { return links{chains: st.Chains, sources: st.SourceMap} }

// same tells whether two tables send packets alike; never when a table's chains are unknown.
func (a links) same(b links) bool {
	return sameChains(a.chains, b.chains) && slices.Equal(a.sources, b.sources)
}

// keysOf are the keys of elements by set.
func keysOf(elems map[string]map[netip.Addr]string) map[string][]netip.Addr {
	out := make(map[string][]netip.Addr, len(elems))
	for set, e := range elems {
		out[set] = slices.Collect(maps.Keys(e))
	}
	return out
}

// sameSets compares the sets of a table read from the kernel with what was installed: the same
// names and, when the elements were read, the same elements with the same comments.
func sameSets(st *TableState, in *installed, elements bool) bool {
	if len(st.Sets) != len(in.sets) {
		return false
	}
	n := 0
	for name, s := range st.Sets {
		if !in.sets[name] {
			return false
		}
		if !elements {
			continue
		}
		have := in.elems[name]
		for key, e := range s.Elements {
			if c, ok := have[key]; !ok || c != e.Comment {
				return false
			}
		}
		n += len(s.Elements)
	}
	return !elements || n == in.elements()
}
