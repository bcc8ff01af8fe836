package bpf

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// noSlot is the slot of a verdict no rule gave (C: NO_SLOT).
const noSlot = ^uint32(0)

// slotKey is what makes a rule "the same rule" across syncs, so its counters survive a config
// change that keeps it: not its position (rules before it may come and go) but what it matches,
// what it does and where it came from. dup tells apart identical rules of one list.
type slotKey struct {
	family policy.Family
	prefix netip.Prefix
	action policy.Action
	origin policy.Origin
	dup    uint16
}

var originCodes = map[policy.Origin]masqRuleOrigin{
	policy.OriginMasqueradeCIDRs:    masqRuleOriginORIGIN_MASQUERADE_CIDRS,
	policy.OriginLinkLocal:          masqRuleOriginORIGIN_LINK_LOCAL,
	policy.OriginNonMasqueradeCIDRs: masqRuleOriginORIGIN_NON_MASQUERADE_CIDRS,
	policy.OriginOutbound:           masqRuleOriginORIGIN_OUTBOUND,
}

func (k slotKey) value() masqRuleSlot {
	return masqRuleSlot{
		Addr: addrBytes(k.prefix.Addr()), Prefixlen: uint8(k.prefix.Bits()), Family: uint8(k.family),
		Action: masqAction(k.action), Origin: originCodes[k.origin], Dup: k.dup,
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
			return slotKey{family: fam, prefix: prefix, action: policy.Action(v.Action), origin: o, dup: v.Dup}, true
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
}

func newSlotTable(max uint32) *slotTable {
	return &slotTable{max: max, bySlt: map[uint32]slotKey{}, byKey: map[slotKey]uint32{}}
}

func (t *slotTable) alloc(k slotKey) (uint32, error) {
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
	t.bySlt[s], t.byKey[k] = k, s
	return s, nil
}

func (t *slotTable) release(s uint32) {
	delete(t.byKey, t.bySlt[s])
	delete(t.bySlt, s)
	t.free = append(t.free, s)
}

// plan is what a policy asks of the maps.
type plan struct {
	keys   []slotKey                    // per rule, in policy order (v4 then v6)
	rules  []*policy.Rule               // same order
	tries  map[trieKind]map[trieKey]int // prefix -> index into keys of the first rule with it
	out    map[policy.Family]int        // index into keys of the outbound rule, or -1
	config masqNatConfig                // without slots
	ranges policy.PortRanges
}

func makePlan(p *policy.Policy) (*plan, error) {
	pl := &plan{tries: map[trieKind]map[trieKey]int{}, out: map[policy.Family]int{policy.IPv4: -1, policy.IPv6: -1}}
	for _, fam := range []policy.Family{policy.IPv4, policy.IPv6} {
		if !p.Enabled(fam) {
			continue
		}
		rules := p.Rules(fam)
		_, outbound := p.OutboundAction(fam) // always MASQUERADE when there is one
		seen := map[slotKey]uint16{}
		returned := false
		for i := range rules {
			r := &rules[i]
			if policy.FamilyOf(r.Prefix.Addr()) != fam || r.Prefix != r.Prefix.Masked() {
				return nil, fmt.Errorf("%s rule %d: prefix %s is not a %s network", fam, i+1, r.Prefix, fam)
			}
			if r.Action == policy.Masquerade && r.Address.IsValid() &&
				(policy.FamilyOf(r.Address) != fam || r.Address.IsUnspecified()) {
				return nil, fmt.Errorf("%s rule %d: masquerade address %s is not a %s address", fam, i+1, r.Address, fam)
			}
			k := slotKey{family: fam, prefix: r.Prefix, action: r.Action, origin: r.Origin}
			k.dup = seen[k]
			seen[k]++
			idx := len(pl.keys)
			pl.keys, pl.rules = append(pl.keys, k), append(pl.rules, r)

			if r == outbound {
				// The fallback: rule 4 of the chain.
				pl.out[fam] = idx
				continue
			}
			// First match over "all MASQUERADE rules, then all RETURN rules" is what the two
			// tries compute; any other order would need a different lookup.
			if r.Action == policy.Return {
				returned = true
			} else if returned {
				return nil, fmt.Errorf("%s rule %d: a MASQUERADE rule after a RETURN rule cannot be expressed by the tries", fam, i+1)
			}
			kind := trieKind{fam, r.Action}
			if pl.tries[kind] == nil {
				pl.tries[kind] = map[trieKey]int{}
			}
			if _, ok := pl.tries[kind][r.Prefix]; !ok {
				pl.tries[kind][r.Prefix] = idx
			}
		}
	}
	for _, prefixes := range pl.tries {
		firstMatch(prefixes)
	}
	if err := pl.settings(p); err != nil {
		return nil, err
	}
	return pl, nil
}

// settings plans nat_config but for the outbound rules' slots (the families, their
// masquerade addresses, the NAT settings) and the port ranges.
func (pl *plan) settings(p *policy.Policy) error {
	ranges := p.ToPorts
	if len(ranges) == 0 {
		ranges = policy.PortRanges{policy.DefaultPortRange}
	}
	if len(ranges) > len(pl.config.Ranges) {
		return fmt.Errorf("to-ports: %d ranges given, the datapath takes at most %d", len(ranges), len(pl.config.Ranges))
	}
	c := &pl.config
	c.V4.Enabled = 1
	c.setMasqueradeAddress(policy.IPv4, p.MasqueradeAddress)
	if p.Enabled(policy.IPv6) {
		c.V6.Enabled = 1
		c.setMasqueradeAddress(policy.IPv6, p.MasqueradeAddressIPv6)
	}
	if p.RandomFully {
		c.RandomFully = 1
	}
	pl.ranges = ranges
	c.Nranges = uint8(len(ranges))
	for i, r := range ranges {
		if r.First == 0 || r.First > r.Last {
			return fmt.Errorf("to-ports: invalid range %s", r)
		}
		c.Ranges[i].First, c.Ranges[i].Last = r.First, r.Last
		c.Nports += uint32(r.Size())
	}
	return nil
}

// firstMatch turns "prefix -> first rule with this prefix" into "prefix -> first rule that
// matches the addresses whose longest match is this prefix". Those addresses are matched by the
// prefix and by every shorter prefix of the trie that contains it, and by nothing else of the
// trie; the chain counts the first of these rules, so that is the slot the entry must carry.
//
// Sorted by address, then length, every prefix comes after the prefixes that contain it, and
// those form a chain: a stack walk visits each prefix once (n log n for the sort, rather than a
// lookup per prefix length for every entry).
func firstMatch(trie map[trieKey]int) {
	prefixes := make([]trieKey, 0, len(trie))
	for p := range trie {
		prefixes = append(prefixes, p)
	}
	slices.SortFunc(prefixes, func(a, b trieKey) int {
		if c := a.Addr().Compare(b.Addr()); c != 0 {
			return c
		}
		return a.Bits() - b.Bits()
	})
	type enclosing struct {
		prefix trieKey
		best   int // the first rule among it and the prefixes containing it
	}
	var stack []enclosing
	for _, p := range prefixes {
		for len(stack) > 0 {
			top := stack[len(stack)-1].prefix
			if top.Bits() <= p.Bits() && top.Contains(p.Addr()) {
				break
			}
			stack = stack[:len(stack)-1]
		}
		best := trie[p]
		if len(stack) > 0 {
			best = min(best, stack[len(stack)-1].best)
		}
		trie[p] = best
		stack = append(stack, enclosing{p, best})
	}
}

// SyncPolicy writes a policy into the maps as a difference from what they hold: new trie
// entries and the new settings first, stale entries after, so that no packet ever sees an empty
// or partial rule set (at worst, briefly, a mix of the old and the new). Rules that stay keep
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
	slots, err := d.claimSlots(pl)
	if err != nil {
		return err
	}
	want := pl.trieValues(slots)
	if err := d.putTries(want); err != nil {
		return err
	}
	cfg, err := d.writeSettings(pl, slots)
	if err != nil {
		return err
	}
	if err := d.deleteStale(want); err != nil {
		return err
	}
	if err := d.freeSlots(slots); err != nil {
		return err
	}
	d.synced = p
	d.syncedSlot = make(map[*policy.Rule]uint32, len(pl.rules))
	for i, r := range pl.rules {
		d.syncedSlot[r] = slots[i]
	}
	d.check = checkState{config: cfg}
	return nil
}

// claimSlots returns the counter slot of each rule of pl (in the order of pl.keys): the one the
// rule holds already, or a new one with zeroed counters. It claims nothing when it fails.
func (d *Datapath) claimSlots(pl *plan) ([]uint32, error) {
	slots := make([]uint32, len(pl.keys))
	var (
		fresh     []uint32
		freshKeys []slotKey
	)
	release := func() {
		for _, f := range fresh {
			d.slots.release(f)
		}
	}
	for i, k := range pl.keys {
		s, ok := d.slots.byKey[k]
		if !ok {
			var err error
			if s, err = d.slots.alloc(k); err != nil {
				release()
				return nil, err
			}
			fresh, freshKeys = append(fresh, s), append(freshKeys, k)
		}
		slots[i] = s
	}
	if err := d.resetSlots(fresh, freshKeys); err != nil {
		release()
		return nil, err
	}
	return slots, nil
}

// trieValues is what each trie must hold once the rules have their slots: prefix -> value,
// with the slot and the masquerade address of the rule the entry's addresses match first (the
// one whose SNAT conntrack would apply) where it is the rule's own: the family's
// masqueradeAddress is nat_config's alone.
func (pl *plan) trieValues(slots []uint32) map[trieKind]map[trieKey]trieValue {
	want := make(map[trieKind]map[trieKey]trieValue, len(pl.tries))
	for kind, prefixes := range pl.tries {
		want[kind] = make(map[trieKey]trieValue, len(prefixes))
		for prefix, idx := range prefixes {
			v := trieValue{action: kind.action, slot: slots[idx]}
			if a := pl.rules[idx].Address; kind.action == policy.Masquerade && a != pl.config.masqueradeAddress(kind.family) {
				v.snat = a
			}
			want[kind][prefix] = v
		}
	}
	return want
}

// putTries writes the entries of want that the tries lack or hold with another value.
func (d *Datapath) putTries(want map[trieKind]map[trieKey]trieValue) error {
	for _, t := range d.tries {
		var put []trieKey
		for prefix, v := range want[t.trieKind] {
			if cur, ok := t.held[prefix]; !ok || cur != v {
				put = append(put, prefix)
			}
		}
		if err := t.put(put, want[t.trieKind]); err != nil {
			return err
		}
	}
	return nil
}

// deleteStale deletes the entries of the tries that want lacks.
func (d *Datapath) deleteStale(want map[trieKind]map[trieKey]trieValue) error {
	for _, t := range d.tries {
		var del []trieKey
		for prefix := range t.held {
			if _, ok := want[t.trieKind][prefix]; !ok {
				del = append(del, prefix)
			}
		}
		if err := t.delete(del); err != nil {
			return err
		}
	}
	return nil
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
	cfg := pl.config
	cfg.PortSeed = d.portSeed
	cfg.V4.OutSlot, cfg.V6.OutSlot = noSlot, noSlot
	if i := pl.out[policy.IPv4]; i >= 0 {
		cfg.V4.Outbound, cfg.V4.OutSlot = masqActionACTION_MASQUERADE, slots[i]
	}
	if i := pl.out[policy.IPv6]; i >= 0 {
		cfg.V6.Outbound, cfg.V6.OutSlot = masqActionACTION_MASQUERADE, slots[i]
	}
	if err := d.objs.NatConfig.Put(uint32(0), &cfg); err != nil {
		return masqNatConfig{}, fmt.Errorf("write nat_config: %w", err)
	}
	return cfg, nil
}

// freeSlots releases the slots that no rule of the sync holds, and clears what rule_slots says
// of them.
func (d *Datapath) freeSlots(slots []uint32) error {
	used := make(map[uint32]bool, len(slots))
	for _, s := range slots {
		used[s] = true
	}
	var gone []uint32
	for s := range d.slots.bySlt {
		if !used[s] {
			gone = append(gone, s)
		}
	}
	if err := putArray(d.objs.RuleSlots, gone, make([]masqRuleSlot, len(gone))); err != nil {
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
	for _, k := range pl.keys {
		if _, ok := d.slots.byKey[k]; !ok {
			n++
		}
	}
	return n, nil
}

// planFor returns the plan of p, computed once for the policy last asked about: SlotsNeeded and
// the SyncPolicy after it plan the same policy, and a 100k-rule plan costs a fifth of a second.
// d.mu must be held.
func (d *Datapath) planFor(p *policy.Policy) (*plan, error) {
	if d.planned != p || d.plan == nil {
		pl, err := makePlan(p)
		if err != nil {
			return nil, err
		}
		d.planned, d.plan = p, pl
	}
	return d.plan, nil
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
	if err := putArray(d.objs.NatPorts, keys, ports); err != nil {
		return fmt.Errorf("write nat_ports: %w", err)
	}
	d.ports = slices.Clone(ranges)
	return nil
}

// resetSlots zeroes the slots' counters on every CPU and records which rule owns each.
func (d *Datapath) resetSlots(slots []uint32, keys []slotKey) error {
	zero := make([]masqRuleStats, len(slots)*ebpf.MustPossibleCPU())
	if err := putArray(d.objs.RuleStats, slots, zero); err != nil {
		return fmt.Errorf("zero rule_stats: %w", err)
	}
	values := make([]masqRuleSlot, len(keys))
	for i, k := range keys {
		values[i] = k.value()
	}
	if err := putArray(d.objs.RuleSlots, slots, values); err != nil {
		return fmt.Errorf("write rule_slots: %w", err)
	}
	return nil
}

// putArray writes values (for a per-CPU map: one per CPU for each key, key after key) at keys of
// an array map in one batch, a syscall for thousands of slots, or key by key on a kernel without
// batch operations (before 5.6).
func putArray[V any](m *ebpf.Map, keys []uint32, values []V) error {
	if len(keys) == 0 {
		return nil
	}
	_, err := m.BatchUpdate(keys, values, nil)
	if !errors.Is(err, ebpf.ErrNotSupported) {
		return err
	}
	per := len(values) / len(keys)
	for i, k := range keys {
		var v any = &values[i]
		if per > 1 {
			v = values[i*per : (i+1)*per]
		}
		if err := m.Put(k, v); err != nil {
			return err
		}
	}
	return nil
}

// eachEntry calls fn with every entry of a map without per-CPU values: a batch lookup per few
// hundred entries where the kernel can (a rule map of 32768 slots is read in a few syscalls),
// else a syscall per entry.
func eachEntry[K, V any](m *ebpf.Map, fn func(K, *V)) error {
	keys, vals := make([]K, entryBatch), make([]V, entryBatch)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		if errors.Is(err, ebpf.ErrNotSupported) {
			break
		}
		done := errors.Is(err, ebpf.ErrKeyNotExist)
		if err != nil && !done {
			return err
		}
		for i := range n {
			fn(keys[i], &vals[i])
		}
		if done {
			return nil
		}
	}
	var (
		k K
		v V
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		fn(k, &v)
	}
	return it.Err()
}

// entryBatch is how many entries eachEntry reads per syscall.
const entryBatch = 1024

// Refresh re-reads what decides verdicts (the tries and the port table) instead of trusting
// what this process last wrote, so that the next SyncPolicy also repairs entries changed or
// removed behind its back (drift). The counter slots stay as this process assigned them: their
// order of reuse (see slotTable) lives only here.
func (d *Datapath) Refresh() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.recoverTries()
}

// recover reads back the slot assignment and the tries, so that a datapath loaded over pinned
// maps continues where the previous agent left off.
func (d *Datapath) recover() error {
	d.slots = newSlotTable(d.opts.MaxRules)
	last := -1
	inUse := map[uint32]bool{}
	if err := eachEntry(d.objs.RuleSlots, func(slot uint32, value *masqRuleSlot) {
		if k, ok := slotKeyOf(*value); ok {
			d.slots.bySlt[slot], d.slots.byKey[k] = k, slot
			inUse[slot] = true
			last = max(last, int(slot))
		}
	}); err != nil {
		return fmt.Errorf("read rule_slots: %w", err)
	}
	d.slots.next = uint32(last + 1)
	for s := uint32(0); s < d.slots.next; s++ {
		if !inUse[s] {
			d.slots.free = append(d.slots.free, s)
		}
	}
	return d.recoverTries()
}

// recoverTries reads back the tries, the port ranges and the held ports.
func (d *Datapath) recoverTries() error {
	// The port table matches the ranges of nat_config when a sync wrote both.
	var cfg masqNatConfig
	if err := d.objs.NatConfig.Lookup(uint32(0), &cfg); err != nil {
		return fmt.Errorf("read nat_config: %w", err)
	}
	if d.portSeed = cfg.PortSeed; d.portSeed == 0 {
		d.portSeed = newPortSeed()
	}
	d.ports = nil
	for _, r := range cfg.Ranges[:min(int(cfg.Nranges), len(cfg.Ranges))] {
		d.ports = append(d.ports, policy.PortRange{First: r.First, Last: r.Last})
	}
	d.held = portBits{}
	if err := eachEntry(d.objs.HeldPorts, func(i uint32, w *uint64) { d.held[i] = *w }); err != nil {
		return fmt.Errorf("read held_ports: %w", err)
	}

	d.tries = d.newTries()
	for _, t := range d.tries {
		if err := t.read(); err != nil {
			return err
		}
	}
	return nil
}

// newPortSeed is a secret for nat_config's port_seed: nonzero, so that a zero read back means
// "never written".
func newPortSeed() uint32 {
	var b [4]byte
	for {
		if _, err := rand.Read(b[:]); err != nil {
			panic(fmt.Sprintf("crypto/rand: %v", err)) // cannot fail on Linux
		}
		if s := binary.NativeEndian.Uint32(b[:]); s != 0 {
			return s
		}
	}
}
