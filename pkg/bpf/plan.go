package bpf

import (
	"fmt"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// plan is what a policy asks of the maps.
type plan struct {
	keys  []slotKey      // per rule, in policy order (v4 then v6)
	rules []*policy.Rule // same order
	// tries are each trie's entries, each prefix once, in prefixOrder: sorted slices rather than
	// maps, which for 100k rules cost more to fill and to read than the sort.
	tries map[trieKind][]planned
	// sets are the lists the policy decides by: the global ones first (set 0), then each source
	// rule's (set: its id), in rule order.
	sets   []planSet
	config masqNatConfig // without slots
	ranges policy.PortRanges
	// sources are each family's source table (policy.SourceTable), its rules as ids, in
	// prefixOrder: what src_v4 and src_v6 hold.
	sources map[policy.Family][]trieEntry
	// held is the slot each key holds in the table (noSlot: none) as heldSlots found it, while
	// the table is heldIn at generation heldGen.
	held    []uint32
	heldIn  *slotTable
	heldGen uint64
}

// planSet is the plan of one set of lists: the global ones or a source rule's.
type planSet struct {
	// set is the source rule's id (0: the global lists), name its name.
	set  uint32
	name string
	// out is the index into keys of each family's outbound rule, or -1.
	out map[policy.Family]int
	// config holds the families' settings (enabled, masquerade address), without slots: the
	// global lists' in nat_config, a source rule's in its src_cfg entry.
	config masqNatConfig
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

// makePlan plans p, whose source rules have the ids ids (in p.Sources' order).
func makePlan(p *policy.Policy, ids []uint32) (*plan, error) {
	n := PolicyRules(p)
	pl := &plan{keys: make([]slotKey, 0, n), rules: make([]*policy.Rule, 0, n), tries: map[trieKind][]planned{}}
	if err := pl.addSet(p, 0, ""); err != nil {
		return nil, err
	}
	for i := range p.Sources {
		s := &p.Sources[i]
		if err := pl.addSet(s.Policy, ids[i], s.Name); err != nil {
			return nil, fmt.Errorf("source rule %s: %w", s.Name, err)
		}
	}
	for kind, entries := range pl.tries {
		pl.tries[kind] = pl.dedup(entries)
		firstMatch(pl.tries[kind])
	}
	if err := pl.settings(p); err != nil {
		return nil, err
	}
	if err := pl.planSources(p, ids); err != nil {
		return nil, err
	}
	return pl, nil
}

// PolicyRules is the number of rules of p that hold a counter slot: the global lists' and every
// source rule's.
func PolicyRules(p *policy.Policy) int {
	n := len(p.IPv4) + len(p.IPv6)
	for _, s := range p.Sources {
		n += len(s.Policy.IPv4) + len(s.Policy.IPv6)
	}
	return n
}

// addSet plans the lists of p (the global policy, or a source rule's) as set: its rules and the
// settings of its families.
func (pl *plan) addSet(p *policy.Policy, set uint32, name string) error {
	ps := planSet{set: set, name: name, out: map[policy.Family]int{policy.IPv4: -1, policy.IPv6: -1}}
	for _, fam := range policy.Families() {
		if !p.Enabled(fam) {
			continue
		}
		if err := pl.addFamily(p, fam, &ps); err != nil {
			return err
		}
	}
	ps.config.V4.Enabled = 1
	ps.config.setMasqueradeAddress(policy.IPv4, p.MasqueradeAddress)
	if p.Enabled(policy.IPv6) {
		ps.config.V6.Enabled = 1
		ps.config.setMasqueradeAddress(policy.IPv6, p.MasqueradeAddressIPv6)
	}
	pl.sets = append(pl.sets, ps)
	return nil
}

// addFamily plans the rules of a family of set ps: their keys (dup 0, see dedup), the outbound
// rule, and each trie's entries in policy order.
func (pl *plan) addFamily(p *policy.Policy, fam policy.Family, ps *planSet) error {
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
		key := newSlotKey(fam, r.Prefix, r.Action, r.Origin)
		key.set = uint16(ps.set)
		pl.keys, pl.rules = append(pl.keys, key), append(pl.rules, r)
		if r == outbound {
			// The fallback: rule 4 of the chain (the only rule of its origin: dup 0).
			ps.out[fam] = idx
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
			pl.tries[trieKind{fam, policy.Action(action), ps.set}] = entries
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
// masquerade addresses: the global set's, the NAT settings) and the port ranges.
func (pl *plan) settings(p *policy.Policy) error {
	ranges := p.ToPorts
	if len(ranges) == 0 {
		ranges = policy.PortRanges{policy.DefaultPortRange}
	}
	if len(ranges) > len(pl.config.Ranges) {
		return fmt.Errorf("to-ports: %d ranges given, the datapath takes at most %d", len(ranges), len(pl.config.Ranges))
	}
	c := &pl.config
	c.V4, c.V6 = pl.sets[0].config.V4, pl.sets[0].config.V6
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

// trieEntries is what each of tries must hold, in prefixOrder. An entry of the trie of kind,
// whose addresses rule idx matches first, holds that rule's slot, and its masquerade address
// (the one whose SNAT conntrack would apply) where it is the rule's own: the family's
// masqueradeAddress is nat_config's alone.
func (pl *plan) trieEntries(tries []*trie, slots []uint32) [][]trieEntry {
	out := make([][]trieEntry, len(tries))
	for i, t := range tries {
		planned := pl.tries[t.trieKind]
		masq := t.action == policy.Masquerade
		family := pl.setConfig(t.set).masqueradeAddress(t.family)
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

// natConfig is the nat_config of pl with the rules' slots.
func (pl *plan) natConfig(slots []uint32, portSeed uint32) masqNatConfig {
	cfg := pl.config
	cfg.PortSeed = portSeed
	set := pl.sets[0].withSlots(slots)
	cfg.V4, cfg.V6 = set.V4, set.V6
	return cfg
}

// withSlots is the set's settings with its outbound rules' slots.
func (ps *planSet) withSlots(slots []uint32) masqNatConfig {
	cfg := ps.config
	cfg.V4.OutSlot, cfg.V6.OutSlot = noSlot, noSlot
	if i := ps.out[policy.IPv4]; i >= 0 {
		cfg.V4.Outbound, cfg.V4.OutSlot = masqActionACTION_MASQUERADE, slots[i]
	}
	if i := ps.out[policy.IPv6]; i >= 0 {
		cfg.V6.Outbound, cfg.V6.OutSlot = masqActionACTION_MASQUERADE, slots[i]
	}
	return cfg
}

// setConfig is the settings of set (planSet.config); the global ones for a set pl lacks.
func (pl *plan) setConfig(set uint32) *masqNatConfig {
	for i := range pl.sets {
		if pl.sets[i].set == set {
			return &pl.sets[i].config
		}
	}
	return &pl.sets[0].config
}

// planFor returns the plan of p, computed once for the policy last asked about: SlotsNeeded and
// the SyncPolicy after it plan the same policy, and a 100k-rule plan costs a fifth of a second.
// d.mu must be held.
func (d *Datapath) planFor(p *policy.Policy) (*plan, error) {
	if d.planned != p || d.plan == nil {
		pl, err := makePlan(p, d.sourceIDs(p))
		if err != nil {
			return nil, err
		}
		d.planned, d.plan = p, pl
	}
	return d.plan, nil
}
