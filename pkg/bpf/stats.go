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
	// Set is the name of the source rule whose list holds the rule ("": the global lists).
	Set    string
	Family policy.Family
	Prefix netip.Prefix
	Action policy.Action
	Origin policy.Origin
	// Dup > 0 marks the n-th repetition of an identical rule, which never matches.
	Dup int
	// Address is the masquerade address of a MASQUERADE rule as the maps hold it: a
	// masqueradeCIDRs rule's own, read from its prefix's entry when the rule is that entry's first
	// match, else (that rule, or the outbound rule) the family's masqueradeAddress in nat_config;
	// invalid for the uplink's address and for a shadowed rule.
	Address netip.Addr
	Slot    uint32
	Packets uint64
	Bytes   uint64
}

var originOrder = map[policy.Origin]int{
	policy.OriginMasqueradeCIDRs: 0, policy.OriginLinkLocal: 1, policy.OriginNonMasqueradeCIDRs: 2,
	policy.OriginOutbound: 3,
}

// InstalledRules lists every rule that holds a counter slot, by list (the global one first,
// then the source rules' by name), family and in chain order as far as the maps tell it
// (origin, then the order the rules were first installed in).
func (d *Datapath) InstalledRules() ([]InstalledRule, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var cfg masqNatConfig
	if err := d.objs.NatConfig.Lookup(uint32(0), &cfg); err != nil {
		return nil, fmt.Errorf("read nat_config: %w", err)
	}
	sets := map[uint16]*masqNatConfig{} // the source rules' settings, read once each
	out := make([]InstalledRule, 0, len(d.slots.bySlt))
	for s, k := range d.slots.bySlt {
		packets, bytes, err := d.slotStats(s)
		if err != nil {
			return nil, err
		}
		ir := InstalledRule{Set: d.sourceRuleName(uint32(k.set)), Family: k.family, Prefix: k.prefix(), Action: k.action, Origin: k.policyOrigin(),
			Dup: int(k.dup), Slot: s, Packets: packets, Bytes: bytes}
		if k.action == policy.Masquerade {
			set := &cfg
			if k.set != 0 {
				if set = sets[k.set]; set == nil {
					sc, err := d.sourceSettings(uint32(k.set))
					if err != nil {
						return nil, err
					}
					set, sets[k.set] = &sc, &sc
				}
			}
			ir.Address = d.addressOf(k, s, set)
		}
		out = append(out, ir)
	}
	slices.SortFunc(out, func(a, b InstalledRule) int {
		return cmp.Or(cmp.Compare(a.Set, b.Set), cmp.Compare(a.Family, b.Family), cmp.Compare(originOrder[a.Origin], originOrder[b.Origin]),
			cmp.Compare(a.Slot, b.Slot))
	})
	return out, nil
}

// addressOf is the masquerade address of the MASQUERADE rule k in slot s, as the maps hold it
// (InstalledRule.Address).
func (d *Datapath) addressOf(k slotKey, s uint32, cfg *masqNatConfig) netip.Addr {
	if k.origin == masqRuleOriginORIGIN_OUTBOUND {
		return cfg.masqueradeAddress(k.family)
	}
	tries := d.tries
	if k.set != 0 {
		tries = d.ruleTries[uint32(k.set)]
	}
	for _, t := range tries {
		if v, ok := t.held[k.prefix()]; ok && t.trieKind == (trieKind{k.family, k.action, uint32(k.set)}) && v.slot == s {
			return cmp.Or(v.snat, cfg.masqueradeAddress(k.family))
		}
	}
	return netip.Addr{} // shadowed
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
