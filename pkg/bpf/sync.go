package bpf

import (
	"cmp"
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

// plan is what a policy asks of the maps.
type plan struct {
	keys  []slotKey      // per rule, in policy order (v4 then v6)
	rules []*policy.Rule // same order
	// tries are each trie's entries, each prefix once, in prefixOrder: sorted slices rather than
	// maps, which for 100k rules cost more to fill and to read than the sort.
	tries  map[trieKind][]planned
	out    map[policy.Family]int // index into keys of the outbound rule, or -1
	config masqNatConfig         // without slots
	ranges policy.PortRanges
	// held is the slot each key holds in the table (noSlot: none) as heldSlots found it, while
	// the table is heldIn at generation heldGen.
	held    []uint32
	heldIn  *slotTable
	heldGen uint64
}

// planned is an entry of a trie's plan: a prefix and the rule whose slot it carries, first the
// first rule with that prefix, after firstMatch the first rule that matches its addresses.
type planned struct {
	prefix trieKey
	idx    int // into plan.keys
}

// prefixOrder sorts by address, then length: every prefix after the prefixes that contain it.
func prefixOrder(a, b trieKey) int {
	if c := a.Addr().Compare(b.Addr()); c != 0 {
		return c
	}
	return a.Bits() - b.Bits()
}

func makePlan(p *policy.Policy) (*plan, error) {
	n := len(p.IPv4) + len(p.IPv6)
	pl := &plan{keys: make([]slotKey, 0, n), rules: make([]*policy.Rule, 0, n), tries: map[trieKind][]planned{},
		out: map[policy.Family]int{policy.IPv4: -1, policy.IPv6: -1}}
	for _, fam := range []policy.Family{policy.IPv4, policy.IPv6} {
		if !p.Enabled(fam) {
			continue
		}
		if err := pl.addFamily(p, fam); err != nil {
			return nil, err
		}
	}
	for kind, entries := range pl.tries {
		pl.tries[kind] = pl.dedup(entries)
		firstMatch(pl.tries[kind])
	}
	if err := pl.settings(p); err != nil {
		return nil, err
	}
	return pl, nil
}

// addFamily plans the rules of a family: their keys (dup 0, see dedup), the outbound rule, and
// each trie's entries in policy order.
func (pl *plan) addFamily(p *policy.Policy, fam policy.Family) error {
	rules := p.Rules(fam)
	_, outbound := p.OutboundAction(fam) // always MASQUERADE when there is one
	returned := false
	// Each action's entries gather here rather than in pl.tries: a map access per rule costs
	// more than the rest of the rule's planning.
	var byAction [policy.Masquerade + 1][]planned
	for i := range rules {
		r := &rules[i]
		if policy.FamilyOf(r.Prefix.Addr()) != fam || r.Prefix != r.Prefix.Masked() {
			return fmt.Errorf("%s rule %d: prefix %s is not a %s network", fam, i+1, r.Prefix, fam)
		}
		if r.Action == policy.Masquerade && r.Address.IsValid() &&
			(policy.FamilyOf(r.Address) != fam || r.Address.IsUnspecified()) {
			return fmt.Errorf("%s rule %d: masquerade address %s is not a %s address", fam, i+1, r.Address, fam)
		}
		idx := len(pl.keys)
		pl.keys, pl.rules = append(pl.keys, newSlotKey(fam, r.Prefix, r.Action, r.Origin)), append(pl.rules, r)
		if r == outbound {
			// The fallback: rule 4 of the chain (the only rule of its origin: dup 0).
			pl.out[fam] = idx
			continue
		}
		if int(r.Action) >= len(byAction) {
			return fmt.Errorf("%s rule %d: unknown action %d", fam, i+1, r.Action)
		}
		// First match over "all MASQUERADE rules, then all RETURN rules" is what the two
		// tries compute; any other order would need a different lookup.
		if r.Action == policy.Return {
			returned = true
		} else if returned {
			return fmt.Errorf("%s rule %d: a MASQUERADE rule after a RETURN rule cannot be expressed by the tries", fam, i+1)
		}
		if byAction[r.Action] == nil {
			byAction[r.Action] = make([]planned, 0, countAction(rules, r.Action))
		}
		byAction[r.Action] = append(byAction[r.Action], planned{r.Prefix, idx})
	}
	for action, entries := range byAction {
		if entries != nil {
			pl.tries[trieKind{fam, policy.Action(action)}] = entries
		}
	}
	return nil
}

// dedup sorts a trie's entries (in policy order) into prefixOrder and keeps the first rule of
// each prefix; the rules after it with the same key (the same prefix and origin: the trie is of
// one family and action) get their dup, 1 for the second and so on.
func (pl *plan) dedup(entries []planned) []planned {
	sortPlanned(entries)
	out := entries[:0]
	for i := 0; i < len(entries); {
		run := i + 1
		for run < len(entries) && entries[run].prefix == entries[i].prefix {
			run++
		}
		for j := i + 1; j < run; j++ {
			for _, e := range entries[i:j] {
				if pl.keys[e.idx].origin == pl.keys[entries[j].idx].origin {
					pl.keys[entries[j].idx].dup++
				}
			}
		}
		out = append(out, entries[i])
		i = run
	}
	return out
}

// countAction is how many of rules have action: the size of its trie's plan, at most.
func countAction(rules []policy.Rule, action policy.Action) int {
	n := 0
	for i := range rules {
		if rules[i].Action == action {
			n++
		}
	}
	return n
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

// firstMatch turns a trie's entries, "prefix -> first rule with this prefix" in prefixOrder, into
// "prefix -> first rule that matches the addresses whose longest match is this prefix". Those
// addresses are matched by the prefix and by every shorter prefix of the trie that contains it,
// and by nothing else of the trie; the chain counts the first of these rules, so that is the
// slot the entry must carry.
//
// In prefixOrder every prefix comes after the prefixes that contain it, and those form a chain:
// a stack walk visits each prefix once (rather than a lookup per prefix length for every entry).
func firstMatch(entries []planned) {
	type enclosing struct {
		prefix trieKey
		best   int // the first rule among it and the prefixes containing it
	}
	var stack []enclosing
	for i := range entries {
		p := entries[i].prefix
		for len(stack) > 0 {
			top := stack[len(stack)-1].prefix
			if top.Bits() <= p.Bits() && top.Contains(p.Addr()) {
				break
			}
			stack = stack[:len(stack)-1]
		}
		best := entries[i].idx
		if len(stack) > 0 {
			best = min(best, stack[len(stack)-1].best)
		}
		entries[i].idx = best
		stack = append(stack, enclosing{p, best})
	}
}

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
	te := pl.trieEntries(d.tries, slots)
	diffs, err := d.putTries(te, d.passing(pl.natConfig(slots, d.portSeed)))
	for _, i := range fresh { // written or not, the tries may hold them now
		d.slots.assign(slots[i], pl.keys[i])
	}
	if err != nil {
		return err
	}
	cfg, err := d.writeSettings(pl, slots)
	if err != nil {
		return err
	}
	if err := d.deleteStale(diffs); err != nil {
		return err
	}
	if err := d.freeSlots(slots); err != nil {
		return err
	}
	d.synced, d.syncedPlan, d.syncedSlots, d.syncedGen = p, pl, slots, d.slots.gen
	d.check = checkState{config: cfg}
	return nil
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

// trieEntries is what each of tries must hold, in prefixOrder. An entry of the trie of kind,
// whose addresses rule idx matches first, holds that rule's slot, and its masquerade address
// (the one whose SNAT conntrack would apply) where it is the rule's own: the family's
// masqueradeAddress is nat_config's alone.
func (pl *plan) trieEntries(tries []*trie, slots []uint32) [][]trieEntry {
	out := make([][]trieEntry, len(tries))
	for i, t := range tries {
		planned := pl.tries[t.trieKind]
		masq := t.action == policy.Masquerade
		family := pl.config.masqueradeAddress(t.family)
		entries := make([]trieEntry, len(planned))
		for j, e := range planned {
			entries[j] = trieEntry{e.prefix, trieValue{action: t.action, slot: slots[e.idx]}}
			if a := pl.rules[e.idx].Address; masq && a != family {
				entries[j].snat = a
			}
		}
		out[i] = entries
	}
	return out
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
func (d *Datapath) putTries(want [][]trieEntry, passing []bool) ([]trieDiff, error) {
	diffs := make([]trieDiff, len(d.tries))
	for i, t := range d.tries {
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
// meets the non-masquerade trie, which still holds old entries.
func (d *Datapath) passing(cfg masqNatConfig) []bool {
	out := make([]bool, len(d.tries))
	if d.syncedPlan == nil {
		return out // the nat_config in force is not known
	}
	was := d.check.config
	for i, t := range d.tries {
		out[i] = t.action == policy.Return && outboundOf(&was, t.family) == outboundOf(&cfg, t.family)
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
func (d *Datapath) deleteStale(diffs []trieDiff) error {
	for i, t := range d.tries {
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

// sortPlanned sorts entries (in policy order) into prefixOrder, entries of one prefix by rule.
// IPv4 entries sort as numbers (address, length, rule), several times faster than by comparing
// netip.Prefix.
func sortPlanned(entries []planned) {
	const idxBits = 26 // room for the rules' indexes: MaxRules is far below 1<<26
	if len(entries) == 0 || !entries[0].prefix.Addr().Is4() || entries[len(entries)-1].idx >= 1<<idxBits {
		slices.SortFunc(entries, func(a, b planned) int { return cmp.Or(prefixOrder(a.prefix, b.prefix), a.idx-b.idx) })
		return
	}
	packed := make([]uint64, len(entries))
	inOrder := true // by rule, as a plan gathers them
	for i, e := range entries {
		a := e.prefix.Addr().As4()
		packed[i] = (uint64(binary.BigEndian.Uint32(a[:]))<<6|uint64(e.prefix.Bits()))<<idxBits | uint64(e.idx)
		inOrder = inOrder && (i == 0 || e.idx > entries[i-1].idx)
	}
	// Entries in rule order need a stable sort on the prefix bits alone, which leaves the rules
	// of one prefix in that order; else the rule bits are sorted too.
	var shift uint
	if inOrder {
		shift = idxBits
	}
	sortStableAbove(packed, shift)
	for i, k := range packed {
		var a [4]byte
		binary.BigEndian.PutUint32(a[:], uint32(k>>(6+idxBits)))
		entries[i] = planned{netip.PrefixFrom(netip.AddrFrom4(a), int(k>>idxBits&63)), int(k & (1<<idxBits - 1))}
	}
}

// sortStableAbove sorts keys by their bits from shift up, keys with the same such bits in the
// order they come: a least-significant-digit radix sort, a few passes over 100k keys where a
// comparison sort takes several times as long. A pass whose digit is the same in every key (the
// prefix lengths of a list of /24s, the first octet of one network's addresses) is skipped.
func sortStableAbove(keys []uint64, shift uint) {
	const digitBits = 11
	if len(keys) < 2 {
		return
	}
	var (
		count [1 << digitBits]int
		buf   []uint64
		orig  = keys
	)
	for ; shift < 64; shift += digitBits {
		clear(count[:])
		for _, k := range keys {
			count[k>>shift&(1<<digitBits-1)]++
		}
		if count[keys[0]>>shift&(1<<digitBits-1)] == len(keys) {
			continue
		}
		pos := 0
		for d, c := range count {
			count[d], pos = pos, pos+c
		}
		if buf == nil {
			buf = make([]uint64, len(keys))
		}
		for _, k := range keys {
			d := k >> shift & (1<<digitBits - 1)
			buf[count[d]] = k
			count[d]++
		}
		keys, buf = buf, keys
	}
	if &keys[0] != &orig[0] {
		copy(orig, keys)
	}
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

// natConfig is the nat_config of pl with the rules' slots.
func (pl *plan) natConfig(slots []uint32, portSeed uint32) masqNatConfig {
	cfg := pl.config
	cfg.PortSeed = portSeed
	cfg.V4.OutSlot, cfg.V6.OutSlot = noSlot, noSlot
	if i := pl.out[policy.IPv4]; i >= 0 {
		cfg.V4.Outbound, cfg.V4.OutSlot = masqActionACTION_MASQUERADE, slots[i]
	}
	if i := pl.out[policy.IPv6]; i >= 0 {
		cfg.V6.Outbound, cfg.V6.OutSlot = masqActionACTION_MASQUERADE, slots[i]
	}
	return cfg
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

// resetSlots zeroes the slots' counters on every CPU and records the rule that owns each, slot
// i's owner(i).
func (d *Datapath) resetSlots(slots []uint32, owner func(i int) slotKey) error {
	if d.claim != nil {
		return d.claim.claim(slots, owner)
	}
	owners := make([]masqRuleSlot, len(slots))
	for i := range slots {
		owners[i] = owner(i).value()
	}
	if err := putArray(d.objs.RuleStats, slots, zeroPerCPU(len(slots), int(d.objs.RuleStats.ValueSize()))); err != nil {
		return fmt.Errorf("zero rule_stats: %w", err)
	}
	if err := putArray(d.objs.RuleSlots, slots, owners); err != nil {
		return fmt.Errorf("write rule_slots: %w", err)
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
	d.syncedPlan, d.syncedSlots = nil, nil // of another table
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
