package bpf

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

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

// RuleStats returns the counters of every rule of the last synced policy, IPv4 rules first,
// each family in chain order. A rule that a previous rule shadows has its own, idle counters.
func (d *Datapath) RuleStats() ([]RuleStats, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.synced == nil {
		return nil, nil
	}
	var out []RuleStats
	for _, fam := range []policy.Family{policy.IPv4, policy.IPv6} {
		rules := d.synced.Rules(fam)
		if !d.synced.Enabled(fam) {
			continue
		}
		for i := range rules {
			s, ok := d.syncedSlot[&rules[i]]
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

// InstalledRule is a rule as the maps record it (rule_slots), with its counters: what a reader
// without the configuration (`dump` in another process) can know.
type InstalledRule struct {
	Family policy.Family
	Prefix netip.Prefix
	Action policy.Action
	Origin policy.Origin
	// Dup > 0 marks the n-th repetition of an identical rule, which never matches.
	Dup     int
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
		out = append(out, InstalledRule{Family: k.family, Prefix: k.prefix, Action: k.action, Origin: k.origin,
			Dup: int(k.dup), Slot: s, Packets: packets, Bytes: bytes})
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

// Event is a reason the datapath counts (drops among them), summed over CPUs by Events.
type Event uint32

const (
	EventNewMasq     = Event(masqEventEV_NEW_MASQ)     // masquerade mappings created
	EventPortRetry   = Event(masqEventEV_PORT_RETRY)   // port claims that found the port taken
	EventDropNoPort  = Event(masqEventEV_DROP_NO_PORT) // dropped: no free port within the retries
	EventDropNoAddr  = Event(masqEventEV_DROP_NO_ADDR) // dropped: the uplink has no SNAT address of the family
	EventDropRewrite = Event(masqEventEV_DROP_REWRITE) // dropped: a rewrite failed midway
	EventHostFlow    = Event(masqEventEV_HOST_FLOW)    // host flows recorded
	EventHostRemap   = Event(masqEventEV_HOST_REMAP)   // host flows remapped: a pod mapping held the port
	EventInboundFlow = Event(masqEventEV_INBOUND_FLOW) // flows from outside toward pods recorded
	EventNATRace     = Event(masqEventEV_NAT_RACE)     // another CPU created the same mapping first
	EventRepair      = Event(masqEventEV_REPAIR)       // an evicted ingress entry re-created
	EventRealloc     = Event(masqEventEV_REALLOC)      // a flow lost its port to eviction: new port
	EventICMPError   = Event(masqEventEV_ICMP_ERROR)   // ICMP errors translated
	EventFragMiss    = Event(masqEventEV_FRAG_MISS)    // later fragments of no known datagram (passed)
	EventReopen      = Event(masqEventEV_REOPEN)       // closed TCP mappings reused by a new SYN

	numEvents = int(masqEventEV_MAX)
)

var eventNames = [...]string{
	EventNewMasq: "new_masq", EventPortRetry: "port_retry", EventDropNoPort: "drop_no_port",
	EventDropNoAddr: "drop_no_addr", EventDropRewrite: "drop_rewrite", EventHostFlow: "host_flow",
	EventHostRemap: "host_remap", EventInboundFlow: "inbound_flow", EventNATRace: "nat_race",
	EventRepair: "repair", EventRealloc: "realloc", EventICMPError: "icmp_error",
	EventFragMiss: "frag_miss", EventReopen: "reopen",
}

// Events lists every event, in counter order.
func Events() []Event {
	evs := make([]Event, numEvents)
	for i := range evs {
		evs[i] = Event(i)
	}
	return evs
}

// String is the event's metric label.
func (e Event) String() string {
	if int(e) < len(eventNames) {
		return eventNames[e]
	}
	return fmt.Sprintf("event_%d", uint32(e))
}

// IsDrop tells whether the event counts dropped packets.
func (e Event) IsDrop() bool {
	return e == EventDropNoPort || e == EventDropNoAddr || e == EventDropRewrite
}

// EventCounts reads every event counter, summed over CPUs.
func (d *Datapath) EventCounts() (map[Event]uint64, error) {
	out := make(map[Event]uint64, numEvents)
	for _, e := range Events() {
		var per []uint64
		if err := d.objs.EventStats.Lookup(uint32(e), &per); err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				continue
			}
			return nil, fmt.Errorf("read event_stats[%s]: %w", e, err)
		}
		var n uint64
		for _, c := range per {
			n += c
		}
		out[e] = n
	}
	return out, nil
}
