package bpf

import (
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// noSlot is the slot of a verdict no rule gave (C: NO_SLOT).
const noSlot = ^uint32(0)

// slotKey is what makes a rule "the same rule" across syncs, so its counters survive a config
// change that keeps it: not its position (rules before it may come and go) but what it matches,
// what it does and where it came from. dup tells apart identical rules of one list. It is plain
// bytes, the fields of rule_slots' value, so that the slot table's map of 100k keys hashes them
// as memory.
type slotKey struct {
	addr   [16]byte // the prefix's address, as addrBytes lays it out
	bits   uint8
	family policy.Family
	action policy.Action
	origin masqRuleOrigin
	dup    uint16
	// set is the id of the source rule whose list holds the rule (0: the global lists), which
	// slot_source records beside rule_slots.
	set uint16
}

// newSlotKey is the key of a rule with dup 0.
func newSlotKey(fam policy.Family, prefix netip.Prefix, action policy.Action, origin policy.Origin) slotKey {
	return slotKey{addr: addrBytes(prefix.Addr()), bits: uint8(prefix.Bits()), family: fam, action: action,
		origin: originCode(origin)}
}

// originCodes are the origins as rule_slots holds them.
var originCodes = map[policy.Origin]masqRuleOrigin{
	policy.OriginMasqueradeCIDRs:    masqRuleOriginORIGIN_MASQUERADE_CIDRS,
	policy.OriginLinkLocal:          masqRuleOriginORIGIN_LINK_LOCAL,
	policy.OriginNonMasqueradeCIDRs: masqRuleOriginORIGIN_NON_MASQUERADE_CIDRS,
	policy.OriginOutbound:           masqRuleOriginORIGIN_OUTBOUND,
}

// originCode is originCodes[o] without a lookup by string for every rule of a plan.
func originCode(o policy.Origin) masqRuleOrigin {
	switch o {
	case policy.OriginNonMasqueradeCIDRs:
		return masqRuleOriginORIGIN_NON_MASQUERADE_CIDRS
	case policy.OriginMasqueradeCIDRs:
		return masqRuleOriginORIGIN_MASQUERADE_CIDRS
	}
	return originCodes[o]
}

func (k slotKey) prefix() netip.Prefix {
	return netip.PrefixFrom(bytesAddr(k.family == policy.IPv6, k.addr), int(k.bits))
}

// policyOrigin is the origin of the rule, as policy.Rule says it.
func (k slotKey) policyOrigin() policy.Origin {
	for o, c := range originCodes {
		if c == k.origin {
			return o
		}
	}
	return ""
}

func (k slotKey) value() masqRuleSlot {
	return masqRuleSlot{
		Addr: k.addr, Prefixlen: k.bits, Family: uint8(k.family),
		Action: masqAction(k.action), Origin: k.origin, Dup: k.dup,
	}
}

func slotKeyOf(v masqRuleSlot) (slotKey, bool) {
	fam := policy.Family(v.Family)
	if fam != policy.IPv4 && fam != policy.IPv6 {
		return slotKey{}, false
	}
	addr := bytesAddr(fam == policy.IPv6, v.Addr)
	prefix, err := addr.Prefix(int(v.Prefixlen))
	if err != nil {
		return slotKey{}, false
	}
	for o, c := range originCodes {
		if c == v.Origin {
			k := newSlotKey(fam, prefix, policy.Action(v.Action), o)
			k.dup = v.Dup
			return k, true
		}
	}
	return slotKey{}, false
}

// slotTable assigns counter slots. A freed slot is reused as late as possible (never-used slots
// first, then the longest-freed), because established flows of a removed rule may still count
// into it for a while; it is zeroed before reuse.
type slotTable struct {
	max   uint32
	bySlt map[uint32]slotKey
	byKey map[slotKey]uint32
	next  uint32   // slots from here on were never used
	free  []uint32 // freed slots, oldest first
	gen   uint64   // changes with every alloc and release (see heldSlots)
}

func newSlotTable(max uint32) *slotTable {
	return &slotTable{max: max, bySlt: map[uint32]slotKey{}, byKey: map[slotKey]uint32{}}
}

// pick takes a slot for a rule, which assign records once the sync no longer waits for it: its
// 100k map writes for a whole new set would delay the new verdict by tens of milliseconds.
func (t *slotTable) pick() (uint32, error) {
	var s uint32
	switch {
	case t.next < t.max:
		s = t.next
		t.next++
	case len(t.free) > 0:
		s = t.free[0]
		t.free = t.free[1:]
	default:
		return 0, fmt.Errorf("all %d rule counter slots are in use (LoadOptions.MaxRules): a sync needs slots for the rules it adds while the rules it removes still hold theirs", t.max)
	}
	t.gen++
	return s, nil
}

// assign records that slot s, which pick gave, holds k.
func (t *slotTable) assign(s uint32, k slotKey) {
	t.bySlt[s], t.byKey[k] = k, s
	t.gen++
}

// unpick returns slots that pick gave and nothing holds.
func (t *slotTable) unpick(slots []uint32) {
	t.free = append(t.free, slots...)
	t.gen++
}

func (t *slotTable) release(s uint32) {
	// Pins read back may hold a key at two slots (byKey has the last): freeing the other one
	// leaves the key where it is.
	if k := t.bySlt[s]; t.byKey[k] == s {
		delete(t.byKey, k)
	}
	delete(t.bySlt, s)
	t.free = append(t.free, s)
	t.gen++
}

// claimSlots returns the counter slot of each rule of pl (in the order of pl.keys): the one the
// rule holds already, or a new one with zeroed counters, and which rules (indexes into pl.keys)
// got a new one, for the caller to assign once it wrote the tries. It claims nothing when it
// fails.
func (d *Datapath) claimSlots(pl *plan) (slots []uint32, fresh []int, err error) {
	slots = make([]uint32, len(pl.keys))
	var picked []uint32
	held := d.heldSlots(pl)
	for i, s := range held {
		if s == noSlot {
			if s, err = d.slots.pick(); err != nil {
				d.slots.unpick(picked)
				return nil, nil, err
			}
			picked, fresh = append(picked, s), append(fresh, i)
		}
		slots[i] = s
	}
	if err := d.resetSlots(picked, func(n int) slotKey { return pl.keys[fresh[n]] }); err != nil {
		d.slots.unpick(picked)
		return nil, nil, err
	}
	return slots, fresh, nil
}

// freeSlots releases the slots that no rule of the sync holds, and clears what rule_slots says
// of them.
func (d *Datapath) freeSlots(slots []uint32) error {
	used := make([]bool, d.slots.max)
	for _, s := range slots {
		used[s] = true
	}
	var gone []uint32
	for s := range d.slots.bySlt {
		if !used[s] {
			gone = append(gone, s)
		}
	}
	if err := putAll(d.objs.RuleSlots, gone, make([]masqRuleSlot, len(gone))); err != nil {
		return fmt.Errorf("free slots: %w", err)
	}
	if err := putAll(d.objs.SlotSource, gone, make([]uint32, len(gone))); err != nil {
		return fmt.Errorf("free slots: %w", err)
	}
	for _, s := range gone {
		d.slots.release(s)
	}
	return nil
}

// SlotsNeeded returns how many counter slots a SyncPolicy of p holds at its peak: the rules that
// stay and the rules it adds, while the rules it removes still hold theirs.
func (d *Datapath) SlotsNeeded(p *policy.Policy) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	pl, err := d.planFor(p)
	if err != nil {
		return 0, err
	}
	n := len(d.slots.byKey)
	for _, s := range d.heldSlots(pl) {
		if s == noSlot {
			n++
		}
	}
	return n, nil
}

// heldSlots returns the slot each key of pl holds (noSlot: none yet), looked up once for a state
// of the table: SlotsNeeded and the SyncPolicy after it ask the same of 100k keys.
func (d *Datapath) heldSlots(pl *plan) []uint32 {
	if pl.held != nil && pl.heldIn == d.slots && pl.heldGen == d.slots.gen {
		return pl.held
	}
	held := make([]uint32, len(pl.keys))
	// While the table holds what the last sync left, its keys and slots say the same as the
	// table, and a policy that changes a few rules has most of its keys in the same order: the
	// walk takes a key's slot from the last sync's key it is at, and looks up only the keys
	// that differ (where a found key continues the walk from). A map lookup per key of 100k
	// costs more than the rest of a small change.
	var last []slotKey
	var lastSlots []uint32
	if d.syncedPlan != nil && d.syncedGen == d.slots.gen {
		last, lastSlots = d.syncedPlan.keys, d.syncedSlots
	}
	var at []uint32 // slot -> 1 + its index in last, made when first needed
	j := 0          // the key of last the walk is at
	for i, k := range pl.keys {
		if j < len(last) && last[j] == k {
			held[i] = lastSlots[j]
			j++
			continue
		}
		s, ok := d.slots.byKey[k]
		if !ok {
			held[i] = noSlot
			continue
		}
		held[i] = s
		if last != nil {
			if at == nil {
				at = make([]uint32, d.slots.max)
				for n, ls := range lastSlots {
					at[ls] = uint32(n) + 1
				}
			}
			if n := at[s]; n > 0 {
				j = int(n)
			}
		}
	}
	pl.held, pl.heldIn, pl.heldGen = held, d.slots, d.slots.gen
	return held
}

// resetSlots zeroes the slots' counters on every CPU and records the rule that owns each, slot
// i's owner(i).
func (d *Datapath) resetSlots(slots []uint32, owner func(i int) slotKey) error {
	if d.claim != nil {
		if err := d.claim.claim(slots, owner); err != nil {
			return err
		}
	} else {
		owners := make([]masqRuleSlot, len(slots))
		for i := range slots {
			owners[i] = owner(i).value()
		}
		if err := putAll(d.objs.RuleStats, slots, zeroPerCPU(len(slots), int(d.objs.RuleStats.ValueSize()))); err != nil {
			return fmt.Errorf("zero rule_stats: %w", err)
		}
		if err := putAll(d.objs.RuleSlots, slots, owners); err != nil {
			return fmt.Errorf("write rule_slots: %w", err)
		}
	}
	sets := make([]uint32, len(slots))
	for i := range slots {
		sets[i] = uint32(owner(i).set)
	}
	if err := putAll(d.objs.SlotSource, slots, sets); err != nil {
		return fmt.Errorf("write %s: %w", masqMapSlotSource, err)
	}
	return nil
}

// zeroPerCPU is the values of n keys of a per-CPU map whose values are size bytes, all zero,
// as cilium/ebpf's batch update takes them cheapest: one []byte it copies as it is, where a
// struct costs a conversion by reflection per CPU and key (85 ms for 100k slots on 2 CPUs, most
// of a whole 100k-rule sync's slot claims).
func zeroPerCPU(n, size int) [][]byte {
	zero := make([]byte, size)
	values := make([][]byte, n*ebpf.MustPossibleCPU())
	for i := range values {
		values[i] = zero
	}
	return values
}
