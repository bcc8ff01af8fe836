package bpf

import "github.com/ip-masq-agent/ip-masq-agent/pkg/policy"

// RuleStats are the hit counters of one rule: the packets the rule decided, and of a
// masqueraded flow every later packet leaving through the uplink too (iptables counts only a
// connection's first packet in the nat table). Bytes are IP packet lengths.
type RuleStats struct {
	Rule policy.Rule
	// Number is the rule's 1-based position in its family's list.
	Number  int
	Slot    uint32
	Packets uint64
	Bytes   uint64
}

// RuleStats returns, for the tests, the counters of every rule of the last synced policy, IPv4 rules first,
// each family in chain order. A rule that a previous rule shadows has its own, idle counters.
func (d *Datapath) RuleStats() ([]RuleStats, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.synced == nil {
		return nil, nil
	}
	slots := d.slotsByRule()
	var out []RuleStats
	for _, fam := range policy.Families() {
		rules := d.synced.Rules(fam)
		if !d.synced.Enabled(fam) {
			continue
		}
		for i := range rules {
			s, ok := slots[&rules[i]]
			if !ok {
				continue
			}
			packets, bytes, err := d.slotStats(s)
			if err != nil {
				return nil, err
			}
			out = append(out, RuleStats{Rule: rules[i], Number: i + 1, Slot: s, Packets: packets, Bytes: bytes})
		}
	}
	return out, nil
}

// slotsByRule is each rule of the last synced policy with its counter slot.
func (d *Datapath) slotsByRule() map[*policy.Rule]uint32 {
	m := map[*policy.Rule]uint32{}
	if d.syncedPlan != nil {
		for i, r := range d.syncedPlan.rules {
			m[r] = d.syncedSlots[i]
		}
	}
	return m
}
