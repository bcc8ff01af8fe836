package nftables

import (
	"maps"
	"net/netip"
	"slices"
	"strings"

	"sigs.k8s.io/knftables"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// installed is what a family's table holds as far as the backend knows: whether it exists,
// its sets, their elements (with their comments), its SNAT chains and whether the outbound
// counter exists.
type installed struct {
	table    bool
	sets     map[string]bool
	elems    map[elemKey]string
	snat     map[string]bool
	outbound bool
}

// elemKey names an element: its set and key.
type elemKey struct {
	set string
	key netip.Addr
}

// empty is a table that does not exist yet.
func empty() *installed {
	return &installed{sets: map[string]bool{}, elems: map[elemKey]string{}, snat: map[string]bool{}}
}

// installedOf is what a layout installs.
func installedOf(p *policy.Policy, l *Layout) *installed {
	in := &installed{table: true, sets: make(map[string]bool, len(l.Sets)), elems: make(map[elemKey]string, len(l.Elements)),
		snat: make(map[string]bool, len(l.SNAT)), outbound: l.Outbound >= 0}
	for _, s := range l.Sets {
		in.sets[s.Name] = true
	}
	for _, c := range l.SNAT {
		in.snat[c.Name] = true
	}
	comments := l.comments(p)
	for _, e := range l.Elements {
		in.elems[elemKey{e.Set, e.Key}] = comments[e.Rule]
	}
	return in
}

// installedFrom is what a table read from the kernel holds; its sets' elements must have been
// read.
func installedFrom(st *TableState) *installed {
	in := empty()
	in.table, in.outbound = true, st.Outbound != nil
	for name := range st.Chains {
		if strings.HasPrefix(name, ChainSNATPrefix) {
			in.snat[name] = true
		}
	}
	for name, s := range st.Sets {
		in.sets[name] = true
		for k, e := range s.Elements {
			in.elems[elemKey{name, k}] = e.Comment
		}
	}
	return in
}

// comments are the comments of the rules' elements, by rule index.
func (l *Layout) comments(p *policy.Policy) []string {
	rules := p.Rules(l.Family)
	out := make([]string, len(rules))
	for i, r := range rules {
		out[i] = Comment(r)
	}
	return out
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

// update adds to tx what turns the table from cur into the layout l of policy p, and returns
// what the table then holds and how many elements it adds and deletes:
//
//   - the table, chains, counter and sets declared (declaring what exists changes nothing);
//   - the chains refilled when rebuild is set, or the SNAT chains are others (flushed first
//     when the table exists); SNAT chains no longer used deleted;
//   - a rule whose pieces all stay keeps its elements, and so its counts; a rule with any piece
//     changed gets all of its elements anew, so that its count starts over rather than dropping
//     to what the pieces that stayed hold;
//   - a set none of whose elements stays is deleted and declared again (which the chains'
//     rebuild allows), far cheaper than deleting its elements one by one; a set no rule uses any
//     more is deleted, and so is an unused outbound counter.
func update(tx *knftables.Transaction, p *policy.Policy, l *Layout, cur *installed, rebuild bool) (want *installed, added, deleted int) {
	want = installedOf(p, l)
	comments := l.comments(p)
	changed := changedRules(cur, l, comments)
	// Per set, how many of its elements stay.
	stays := map[string]int{}
	for k, comment := range cur.elems {
		if c, ok := want.elems[k]; ok && c == comment && !changed[comment] {
			stays[k.set]++
		}
	}
	recreate := map[string]bool{}
	for name := range cur.sets {
		if want.sets[name] && stays[name] == 0 {
			recreate[name] = true
			rebuild = true
		}
	}
	rebuild = rebuild || !maps.Equal(cur.snat, want.snat)
	tx.Add(&knftables.Table{Comment: knftables.PtrTo(tableComment)})
	tx.Add(&knftables.Chain{Name: ChainPostrouting, Type: knftables.PtrTo(knftables.NATType),
		Hook: knftables.PtrTo(knftables.PostroutingHook), Priority: knftables.PtrTo(knftables.SNATPriority)})
	tx.Add(&knftables.Chain{Name: ChainMasq})
	for _, c := range l.SNAT {
		tx.Add(&knftables.Chain{Name: c.Name})
	}
	if want.outbound {
		tx.Add(&knftables.Counter{Name: CounterOutbound})
	}
	if rebuild && cur.table {
		tx.Flush(&knftables.Chain{Name: ChainPostrouting})
		tx.Flush(&knftables.Chain{Name: ChainMasq})
		for _, name := range slices.Sorted(maps.Keys(cur.snat)) {
			tx.Flush(&knftables.Chain{Name: name})
			if !want.snat[name] {
				tx.Delete(&knftables.Chain{Name: name}) // unreferenced now, and empty
			}
		}
	}
	for name := range cur.sets {
		if !want.sets[name] || recreate[name] {
			tx.Delete(&knftables.Set{Name: name})
		}
	}
	for _, s := range l.Sets {
		tx.Add(&knftables.Set{Name: s.Name, Type: setType(l.Family)})
	}
	if rebuild {
		for _, r := range l.Postrouting {
			tx.Add(&knftables.Rule{Chain: ChainPostrouting, Rule: r})
		}
		for _, r := range l.Masq {
			tx.Add(&knftables.Rule{Chain: ChainMasq, Rule: r})
		}
		for _, c := range l.SNAT {
			for _, r := range c.Rules {
				tx.Add(&knftables.Rule{Chain: c.Name, Rule: r})
			}
		}
	}
	for k, comment := range cur.elems {
		if !want.sets[k.set] || recreate[k.set] {
			deleted++ // with its set
			continue
		}
		if c, ok := want.elems[k]; !ok || c != comment || changed[comment] {
			tx.Delete(&knftables.Element{Set: k.set, Key: []string{k.key.String()}})
			deleted++
		}
	}
	for _, e := range l.Elements {
		comment := comments[e.Rule]
		if c, ok := cur.elems[elemKey{e.Set, e.Key}]; ok && c == comment && !changed[comment] && !recreate[e.Set] {
			continue
		}
		tx.Add(&knftables.Element{Set: e.Set, Key: []string{e.Key.String()}, Comment: knftables.PtrTo(comment)})
		added++
	}
	if cur.outbound && !want.outbound {
		tx.Delete(&knftables.Counter{Name: CounterOutbound})
	}
	return want, added, deleted
}

// changedRules returns the comments of the rules of the layout whose elements differ from
// those cur holds for them.
func changedRules(cur *installed, l *Layout, comments []string) map[string]bool {
	changed := map[string]bool{}
	if len(cur.elems) == 0 {
		return changed // every element is new anyway
	}
	held := map[string]int{}
	for _, c := range cur.elems {
		held[c]++
	}
	same := make([]int, len(comments))
	for _, e := range l.Elements {
		if c, ok := cur.elems[elemKey{e.Set, e.Key}]; ok && c == comments[e.Rule] {
			same[e.Rule]++
		}
	}
	for i, c := range comments {
		// A rule without pieces (a repeat of an earlier one, whose comment it shares) owns
		// nothing to compare.
		if l.Pieces[i] > 0 && (same[i] != l.Pieces[i] || held[c] != same[i]) {
			changed[c] = true
		}
	}
	return changed
}

// replace adds to tx what removes the table, whatever it holds, and installs it anew.
func replace(tx *knftables.Transaction, p *policy.Policy, l *Layout) {
	tx.Add(&knftables.Table{})
	tx.Delete(&knftables.Table{})
	_, _, _ = update(tx, p, l, empty(), true)
}

// Render returns the transaction that installs a family's table from nothing, as `nft -f`
// takes it.
func Render(p *policy.Policy, fam policy.Family) string {
	tx := knftables.NewFake(nftFamily(fam), TableName).NewTransaction()
	_, _, _ = update(tx, p, NewLayout(p, fam), empty(), true)
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
