package bpf

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Synced is the policy the last SyncPolicy wrote (nil before the first).
func (d *Datapath) Synced() *policy.Policy {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.synced
}

// InstalledRule is a rule as the maps record it (rule_slots), with its counters: what a reader
// without the configuration (`dump` in another process) can know.
type InstalledRule struct {
	Family policy.Family
	Prefix netip.Prefix
	Action policy.Action
	Origin policy.Origin
	// Dup > 0 marks the n-th repetition of an identical rule, which never matches.
	Dup int
	// Address is the masquerade address the tries hold for a MASQUERADE rule of masqueradeCIDRs
	// (its own, or the family's masqueradeAddress), read from its prefix's entry when the rule
	// is that entry's first match; invalid otherwise (the uplink's address, or a shadowed rule).
	Address netip.Addr
	Slot    uint32
	Packets uint64
	Bytes   uint64
}

var originOrder = map[policy.Origin]int{
	policy.OriginMasqueradeCIDRs: 0, policy.OriginLinkLocal: 1, policy.OriginNonMasqueradeCIDRs: 2,
	policy.OriginOutbound: 3,
}

// InstalledRules lists every rule that holds a counter slot, by family and in chain order as
// far as the maps tell it (origin, then the order the rules were first installed in).
func (d *Datapath) InstalledRules() ([]InstalledRule, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]InstalledRule, 0, len(d.slots.bySlt))
	for s, k := range d.slots.bySlt {
		packets, bytes, err := d.slotStats(s)
		if err != nil {
			return nil, err
		}
		ir := InstalledRule{Family: k.family, Prefix: k.prefix, Action: k.action, Origin: k.origin,
			Dup: int(k.dup), Slot: s, Packets: packets, Bytes: bytes}
		for _, t := range d.tries {
			if v, ok := t.held[k.prefix]; ok && t.trieKind == (trieKind{k.family, k.action}) && v.slot == s {
				ir.Address = v.snat
			}
		}
		out = append(out, ir)
	}
	slices.SortFunc(out, func(a, b InstalledRule) int {
		return cmp.Or(cmp.Compare(a.Family, b.Family), cmp.Compare(originOrder[a.Origin], originOrder[b.Origin]),
			cmp.Compare(a.Slot, b.Slot))
	})
	return out, nil
}

// slotStats sums a slot's counters over the CPUs.
func (d *Datapath) slotStats(s uint32) (packets, bytes uint64, err error) {
	var per []masqRuleStats
	if err := d.objs.RuleStats.Lookup(s, &per); err != nil {
		return 0, 0, fmt.Errorf("read rule_stats[%d]: %w", s, err)
	}
	for _, c := range per {
		packets += c.Packets
		bytes += c.Bytes
	}
	return packets, bytes, nil
}
