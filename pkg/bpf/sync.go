package bpf

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// SyncPolicy writes a policy into the maps as a difference from what they hold: new trie
// entries and the new settings first, stale entries after (or, in a trie that passing allows,
// as soon as the writes passed them), so that no packet ever sees an empty or partial rule set
// (at worst, briefly, a mix of the old and the new). Rules that stay keep
// their counter slot, and so their counters; new rules get zeroed slots. p must not be modified
// afterwards (its plan is kept, see planFor); compile a new policy instead.
//
// It fails without writing anything when the policy cannot be represented (a MASQUERADE rule
// after a RETURN rule, more than 16 port ranges, more rules than slots); a failure midway (a map
// write) leaves the maps between the two policies, and the next sync completes the change.
func (d *Datapath) SyncPolicy(p *policy.Policy) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.syncPolicy(p); err != nil {
		return fmt.Errorf("sync policy: %w", err)
	}
	return nil
}

func (d *Datapath) syncPolicy(p *policy.Policy) error {
	pl, err := d.planFor(p)
	if err != nil {
		return err
	}
	slots, fresh, err := d.claimSlots(pl)
	if err != nil {
		return err
	}
	tries := d.policyTries(pl)
	te := pl.trieEntries(tries, slots)
	diffs, err := d.putTries(tries, te, d.passing(tries, pl.natConfig(slots, d.portSeed)))
	for _, i := range fresh { // written or not, the tries may hold them now
		d.slots.assign(slots[i], pl.keys[i])
	}
	if err != nil {
		return err
	}
	// Every list and setting of a source rule is in place before a source names it, and a
	// source leaves a rule before its lists go (sources.go).
	if err := d.writeSourceRules(pl, slots); err != nil {
		return err
	}
	cfg, err := d.writeSettings(pl, slots)
	if err != nil {
		return err
	}
	if err := d.syncSources(pl); err != nil {
		return err
	}
	if err := d.deleteStale(tries, diffs); err != nil {
		return err
	}
	if err := d.dropSourceRules(pl); err != nil {
		return err
	}
	if err := d.freeSlots(slots); err != nil {
		return err
	}
	d.synced, d.syncedPlan, d.syncedSlots, d.syncedGen = p, pl, slots, d.slots.gen
	d.check = checkState{config: cfg}
	return nil
}

// trieDiff is a sync of one trie: what it must hold, and once putTries wrote what it lacked, the
// entries to delete where known (the trie held what the last sync wrote).
type trieDiff struct {
	want  []trieEntry
	stale []trieKey
	known bool
}

// putTries writes the entries the tries lack or hold with another value than want (per trie).
// Where a trie holds what the last sync wrote, the two sorted lists are walked side by side (a
// 100k-entry policy that changes a few is compared without a map lookup per entry), which also
// gives the entries to delete; else each entry is looked up in the mirror. A trie that passing
// marks deletes its stale entries as the writes pass them (replacePassing), the others leave
// them to deleteStale.
func (d *Datapath) putTries(tries []*trie, want [][]trieEntry, passing []bool) ([]trieDiff, error) {
	diffs := make([]trieDiff, len(tries))
	for i, t := range tries {
		diff := trieDiff{want: want[i], known: t.synced != nil}
		var put []trieEntry
		if diff.known {
			put, diff.stale = diffSorted(t.synced, want[i])
		} else {
			for _, e := range want[i] {
				if cur, ok := t.held[e.prefix]; !ok || cur != e.trieValue {
					put = append(put, e)
				}
			}
		}
		t.synced = nil // until the sync completes, held is neither the old nor the new set
		var err error
		if diff.known && passing[i] {
			err = t.replacePassing(put, diff.stale)
			diff.stale = nil
		} else {
			err = t.put(put)
		}
		if err != nil {
			return nil, err
		}
		diffs[i] = diff
	}
	return diffs, nil
}

// passing tells which tries may delete their stale entries while the sync writes them, before
// it writes cfg: a family's non-masquerade trie, which its lookup consults after the masquerade
// trie (written whole by then) and before the outbound verdict, where that verdict stays: an
// address whose non-masquerade entry goes, with no new entry for it, meets the outbound verdict
// it has after the sync. The masquerade tries keep theirs to the end: an address they drop
// meets the non-masquerade trie, which still holds old entries. The rule tries of the source
// rules keep theirs to the end too (their outbound verdicts are written after their entries).
func (d *Datapath) passing(tries []*trie, cfg masqNatConfig) []bool {
	out := make([]bool, len(tries))
	if d.syncedPlan == nil {
		return out // the nat_config in force is not known
	}
	was := d.check.config
	for i, t := range tries {
		out[i] = t.set == 0 && t.action == policy.Return && outboundOf(&was, t.family) == outboundOf(&cfg, t.family)
	}
	return out
}

// outboundOf is what decides the addresses of a family that no trie entry matches.
func outboundOf(c *masqNatConfig, fam policy.Family) [3]uint32 {
	if fam == policy.IPv6 {
		return [3]uint32{uint32(c.V6.Enabled), uint32(c.V6.Outbound), c.V6.OutSlot}
	}
	return [3]uint32{uint32(c.V4.Enabled), uint32(c.V4.Outbound), c.V4.OutSlot}
}

// diffSorted compares what a trie holds with what it must hold, both in prefixOrder: the entries
// of want that have lacks or holds with another value, and the prefixes of have that want lacks.
// The walk gathers indexes, and the lists are made at their size from them: growing lists of
// entries, which hold pointers, cost a whole-set swap of 100k prefixes more than the walk.
func diffSorted(have, want []trieEntry) (put []trieEntry, stale []trieKey) {
	var putAt, staleAt []int32
	i, j := 0, 0
	for i < len(have) || j < len(want) {
		c := 1 // have is done: the rest of want is new
		switch {
		case j == len(want):
			c = -1
		case i < len(have):
			c = comparePrefixes(have[i].prefix, want[j].prefix)
		}
		switch {
		case c < 0:
			staleAt = append(staleAt, int32(i))
			i++
		case c > 0:
			putAt = append(putAt, int32(j))
			j++
		default:
			if have[i].trieValue != want[j].trieValue {
				putAt = append(putAt, int32(j))
			}
			i, j = i+1, j+1
		}
	}
	if len(putAt) > 0 {
		put = make([]trieEntry, len(putAt))
		for n, j := range putAt {
			put[n] = want[j]
		}
	}
	if len(staleAt) > 0 {
		stale = make([]trieKey, len(staleAt))
		for n, i := range staleAt {
			stale[n] = have[i].prefix
		}
	}
	return put, stale
}

// comparePrefixes is prefixOrder, on IPv4 prefixes as numbers.
func comparePrefixes(a, b trieKey) int {
	if a.Addr().Is4() && b.Addr().Is4() {
		x, y := a.Addr().As4(), b.Addr().As4()
		return cmp.Or(cmp.Compare(binary.BigEndian.Uint32(x[:]), binary.BigEndian.Uint32(y[:])), a.Bits()-b.Bits())
	}
	return prefixOrder(a, b)
}

// deleteStale deletes the entries of the tries that the sync's diffs lack, and records the
// tries as the sync wrote them.
func (d *Datapath) deleteStale(tries []*trie, diffs []trieDiff) error {
	for i, t := range tries {
		diff := diffs[i]
		del := diff.stale
		if !diff.known && len(t.held) != len(diff.want) {
			// putTries wrote every prefix of want: with as many entries, the trie holds
			// nothing else.
			wanted := prefixSet(diff.want)
			for prefix := range t.held {
				if !wanted(prefix) {
					del = append(del, prefix)
				}
			}
		}
		if err := t.delete(del); err != nil {
			return err
		}
		t.synced = diff.want
	}
	return nil
}

// prefixSet tells which prefixes entries hold. An IPv4 prefix is a number, and a set of numbers
// is several times cheaper to fill and to ask than a binary search or a map of netip.Prefix.
func prefixSet(entries []trieEntry) func(trieKey) bool {
	if len(entries) == 0 || !entries[0].prefix.Addr().Is4() {
		set := make(map[trieKey]struct{}, len(entries))
		for _, e := range entries {
			set[e.prefix] = struct{}{}
		}
		return func(p trieKey) bool {
			_, ok := set[p]
			return ok
		}
	}
	v4 := func(p trieKey) uint64 {
		a := p.Addr().As4()
		return uint64(binary.BigEndian.Uint32(a[:]))<<8 | uint64(p.Bits())
	}
	set := make(map[uint64]struct{}, len(entries))
	for _, e := range entries {
		set[v4(e.prefix)] = struct{}{}
	}
	return func(p trieKey) bool {
		if !p.Addr().Is4() {
			return false
		}
		_, ok := set[v4(p)]
		return ok
	}
}

// writeSettings writes the port table, then the outbound rules and NAT settings that say how
// much of it counts, and returns the nat_config written.
func (d *Datapath) writeSettings(pl *plan, slots []uint32) (masqNatConfig, error) {
	if err := d.holdPorts(pl.ranges); err != nil {
		return masqNatConfig{}, err
	}
	if err := d.writePorts(pl.ranges); err != nil {
		return masqNatConfig{}, err
	}
	cfg := pl.natConfig(slots, d.portSeed)
	if err := d.objs.NatConfig.Put(uint32(0), &cfg); err != nil {
		return masqNatConfig{}, fmt.Errorf("write nat_config: %w", err)
	}
	return cfg, nil
}

// writePorts lays the port ranges out in nat_ports (entry i: the i-th port), unless they are
// what the table already holds.
func (d *Datapath) writePorts(ranges policy.PortRanges) error {
	if slices.Equal(ranges, d.ports) {
		return nil
	}
	var keys []uint32
	var ports []uint16
	for _, r := range ranges {
		for p := int(r.First); p <= int(r.Last); p++ {
			keys = append(keys, uint32(len(keys)))
			ports = append(ports, uint16(p))
		}
	}
	if err := putAll(d.objs.NatPorts, keys, ports); err != nil {
		return fmt.Errorf("write nat_ports: %w", err)
	}
	d.ports = slices.Clone(ranges)
	return nil
}
