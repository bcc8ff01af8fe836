package nftables

import (
	"maps"
	"net/netip"
	"strings"

	"sigs.k8s.io/knftables"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// installed is what a family's table holds as far as the backend knows: whether it exists,
// its sets' elements (key and comment) and whether the outbound counter exists.
type installed struct {
	table    bool
	sets     map[string]map[netip.Addr]string
	outbound bool
}

// empty is a table that does not exist yet.
func empty() *installed { return &installed{sets: map[string]map[netip.Addr]string{}} }

// existing is a table that exists and holds nothing.
func existing() *installed {
	in := empty()
	in.table = true
	return in
}

// installedOf is what a layout installs.
func installedOf(p *policy.Policy, l *Layout) *installed {
	in := existing()
	for _, s := range l.Sets {
		in.sets[s.Name] = map[netip.Addr]string{}
	}
	rules := p.Rules(l.Family)
	for _, e := range l.Elements {
		in.sets[e.Set][e.Key] = Comment(rules[e.Rule])
	}
	in.outbound = l.Outbound >= 0
	return in
}

// installedFrom is what a table read from the kernel holds; its sets' elements must have been
// read.
func installedFrom(st *TableState) *installed {
	in := existing()
	for name, s := range st.Sets {
		m := make(map[netip.Addr]string, len(s.Elements))
		for k, e := range s.Elements {
			m[k] = e.Comment
		}
		in.sets[name] = m
	}
	in.outbound = st.Outbound != nil
	return in
}

// setType declares a set of the family's addresses whose elements count their hits.
// knftables (v0.0.22) has no field for a set's stateful statements, so `counter` follows the
// type; nft reads "type ipv4_addr ; counter ;" as the two statements they are.
func setType(fam policy.Family) string {
	if fam == policy.IPv6 {
		return "ipv6_addr ; counter"
	}
	return "ipv4_addr ; counter"
}

// update adds to tx what turns the table from cur into want (the layout l of policy p): the
// table, chains, counter and sets declared (declaring what exists changes nothing), the chains
// refilled when rebuild is set (flushed first when the table exists), the elements that changed deleted or added, and the
// sets and counter no rule uses any more deleted. A rule's elements that stay keep their
// counters. It returns how many elements it adds and deletes.
func update(tx *knftables.Transaction, p *policy.Policy, l *Layout, cur *installed, rebuild bool) (added, deleted int) {
	want := installedOf(p, l)
	tx.Add(&knftables.Table{Comment: knftables.PtrTo(tableComment)})
	tx.Add(&knftables.Chain{Name: ChainPostrouting, Type: knftables.PtrTo(knftables.NATType),
		Hook: knftables.PtrTo(knftables.PostroutingHook), Priority: knftables.PtrTo(knftables.SNATPriority)})
	tx.Add(&knftables.Chain{Name: ChainMasq})
	if want.outbound {
		tx.Add(&knftables.Counter{Name: CounterOutbound})
	}
	for _, s := range l.Sets {
		tx.Add(&knftables.Set{Name: s.Name, Type: setType(l.Family)})
	}
	if rebuild {
		if cur.table {
			tx.Flush(&knftables.Chain{Name: ChainPostrouting})
			tx.Flush(&knftables.Chain{Name: ChainMasq})
		}
		for _, r := range l.Postrouting {
			tx.Add(&knftables.Rule{Chain: ChainPostrouting, Rule: r})
		}
		for _, r := range l.Masq {
			tx.Add(&knftables.Rule{Chain: ChainMasq, Rule: r})
		}
	}
	// A rule whose pieces all stay keeps its elements, and so its counts; a rule with any
	// piece changed gets all of its elements anew, so that its count starts over rather than
	// dropping to what the pieces that stayed hold. Elements go first, then whole sets: a set no
	// rule uses any more is deleted with its elements.
	changed := changedRules(cur, want)
	for name, elems := range cur.sets {
		keep, ok := want.sets[name]
		if !ok {
			continue
		}
		for key, comment := range elems {
			if c, ok := keep[key]; !ok || c != comment || changed[comment] {
				tx.Delete(&knftables.Element{Set: name, Key: []string{key.String()}})
				deleted++
			}
		}
	}
	rules := p.Rules(l.Family)
	for _, e := range l.Elements {
		comment := Comment(rules[e.Rule])
		if c, ok := cur.sets[e.Set][e.Key]; ok && c == comment && !changed[comment] {
			continue
		}
		tx.Add(&knftables.Element{Set: e.Set, Key: []string{e.Key.String()}, Comment: knftables.PtrTo(comment)})
		added++
	}
	for name, elems := range cur.sets {
		if _, ok := want.sets[name]; !ok {
			tx.Delete(&knftables.Set{Name: name})
			deleted += len(elems)
		}
	}
	if cur.outbound && !want.outbound {
		tx.Delete(&knftables.Counter{Name: CounterOutbound})
	}
	return added, deleted
}

// changedRules returns the comments (the rules) whose elements differ between two tables.
func changedRules(a, b *installed) map[string]bool {
	type piece struct {
		set string
		key netip.Addr
	}
	pieces := func(in *installed) map[string]map[piece]bool {
		out := map[string]map[piece]bool{}
		for name, elems := range in.sets {
			for key, comment := range elems {
				if out[comment] == nil {
					out[comment] = map[piece]bool{}
				}
				out[comment][piece{name, key}] = true
			}
		}
		return out
	}
	pa, pb := pieces(a), pieces(b)
	changed := map[string]bool{}
	for comment, x := range pa {
		if !maps.Equal(x, pb[comment]) {
			changed[comment] = true
		}
	}
	for comment := range pb {
		if _, ok := pa[comment]; !ok {
			changed[comment] = true
		}
	}
	return changed
}

// replace adds to tx what removes the table, whatever it holds, and installs it anew.
func replace(tx *knftables.Transaction, p *policy.Policy, l *Layout) {
	tx.Add(&knftables.Table{})
	tx.Delete(&knftables.Table{})
	update(tx, p, l, empty(), true)
}

// Render returns the transaction that installs a family's table from nothing, as `nft -f`
// takes it.
func Render(p *policy.Policy, fam policy.Family) string {
	tx := knftables.NewFake(nftFamily(fam), TableName).NewTransaction()
	update(tx, p, NewLayout(p, fam), empty(), true)
	return tx.String()
}

// RenderAll returns what `render --backend nftables` prints: the IPv4 transaction and, when
// IPv6 is enabled, the IPv6 one, after a comment line naming the command that takes them.
func RenderAll(p *policy.Policy) string {
	var b strings.Builder
	b.WriteString("# nft -f -\n")
	for _, fam := range families {
		if p.Enabled(fam) {
			b.WriteString(Render(p, fam))
		}
	}
	return b.String()
}
