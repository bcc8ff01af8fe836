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
// its sets, their elements (with their comments), its chains other than the base and masquerade
// chains, its counters and whether the source map exists.
type installed struct {
	table bool
	sets  map[string]bool
	// elems holds, per set, its elements' comments by key.
	elems map[string]map[netip.Addr]string
	// chains are the SNAT chains and the source rules' chains.
	chains map[string]bool
	// counters are the outbound rules' named counters.
	counters map[string]bool
	sources  bool
}

// empty is a table that does not exist yet.
func empty() *installed {
	return &installed{sets: map[string]bool{}, elems: map[string]map[netip.Addr]string{}, chains: map[string]bool{}, counters: map[string]bool{}}
}

// elements counts the elements.
func (in *installed) elements() int {
	n := 0
	for _, e := range in.elems {
		n += len(e)
	}
	return n
}

// installedOf is what a layout installs, given its rules' comments.
func installedOf(l *Layout, comments []string) *installed {
	in := &installed{table: true, sets: make(map[string]bool, len(l.Sets)), elems: make(map[string]map[netip.Addr]string, len(l.Sets)),
		chains: make(map[string]bool, len(l.SNAT)+len(l.Sources)), counters: map[string]bool{}, sources: len(l.SourceMap) > 0}
	for _, s := range l.Sets {
		in.sets[s.Name] = true
	}
	for _, c := range l.chains() {
		in.chains[c] = true
	}
	for _, c := range l.counters() {
		in.counters[c] = true
	}
	for set, elems := range l.bySet() {
		m := make(map[netip.Addr]string, len(elems))
		for _, e := range elems {
			m[e.Key] = comments[e.Rule]
		}
		in.elems[set] = m
	}
	return in
}

// chains are the names of the layout's chains other than the base and masquerade chains: the
// SNAT chains, then the source lists'.
func (l *Layout) chains() []string {
	var out []string
	for _, c := range l.SNAT {
		out = append(out, c.Name)
	}
	for _, s := range l.Sources {
		out = append(out, SourceChainName(s.Name))
	}
	return out
}

// counters are the names of the layout's outbound counters.
func (l *Layout) counters() []string {
	var out []string
	if l.Outbound >= 0 {
		out = append(out, CounterOutbound)
	}
	for _, s := range l.Sources {
		if s.Outbound >= 0 {
			out = append(out, SourceCounterName(s.Name))
		}
	}
	return out
}

// bySet yields the layout's elements set by set (they are in order of their sets).
func (l *Layout) bySet() func(yield func(string, []Element) bool) {
	return func(yield func(string, []Element) bool) {
		for i := 0; i < len(l.Elements); {
			j := i + 1
			for j < len(l.Elements) && l.Elements[j].Set == l.Elements[i].Set {
				j++
			}
			if !yield(l.Elements[i].Set, l.Elements[i:j]) {
				return
			}
			i = j
		}
	}
}

// keys are the keys of the layout's elements, by set.
func (l *Layout) keys() map[string][]netip.Addr {
	out := map[string][]netip.Addr{}
	for set, elems := range l.bySet() {
		keys := make([]netip.Addr, len(elems))
		for i, e := range elems {
			keys[i] = e.Key
		}
		out[set] = keys
	}
	return out
}

// installedFrom is what a table read from the kernel holds; its sets' elements must have been
// read.
func installedFrom(st *TableState) *installed {
	in := empty()
	in.table, in.sources = true, st.SourceMap != nil
	if st.Outbound != nil {
		in.counters[CounterOutbound] = true
	}
	for rule := range st.SourceOutbound {
		in.counters[SourceCounterName(rule)] = true
	}
	for name := range st.Chains {
		if strings.HasPrefix(name, ChainSNATPrefix) || strings.HasPrefix(name, ChainSourcePrefix) {
			in.chains[name] = true
		}
	}
	for name, s := range st.Sets {
		in.sets[name] = true
		m := make(map[netip.Addr]string, len(s.Elements))
		for k, e := range s.Elements {
			m[k] = e.Comment
		}
		in.elems[name] = m
	}
	return in
}

// comments are the comments of the layout's rules' elements, by rule index (see Rules).
func (l *Layout) comments(p *policy.Policy) []string {
	rules := l.Rules(p)
	out := make([]string, len(rules))
	for i, r := range rules {
		out[i] = Comment(r)
	}
	return out
}

// setType declares a set of the family's addresses whose elements count their hits.
// knftables (v0.0.22) has no field for a set's stateful statements, so `counter` follows the
// type; nft reads "type ipv4_addr ; counter ;" as the two statements they are.
func setType(fam policy.Family) string { return addrType(fam) + " ; counter" }

// addrType is the nft type of the family's addresses.
func addrType(fam policy.Family) string {
	if fam == policy.IPv6 {
		return "ipv6_addr"
	}
	return "ipv4_addr"
}

// elementDiff is what turns the elements of a table cur into those of the layout l of policy p:
//
//   - a rule whose pieces all stay keeps its elements, and so its counts; a rule with any piece
//     changed gets all of its elements anew, so that its count starts over rather than dropping
//     to what the pieces that stay hold;
//   - a set l keeps none of whose elements stays is emptied as a whole (flushed, or deleted and
//     declared again), far cheaper than deleting its elements one by one; the elements of a set
//     l does not have go with it.
type elementDiff struct {
	want *installed
	// empty are the sets of both cur and l none of whose elements stays.
	empty map[string]bool
	// del are the elements to delete one by one, by set; add those to add, in layout order.
	del     map[string][]netip.Addr
	add     []Element
	comment []string
	// deleted counts the elements that go, one by one or with their set.
	deleted int
}

func diffElements(p *policy.Policy, l *Layout, cur *installed) *elementDiff {
	comments := l.comments(p)
	d := &elementDiff{want: installedOf(l, comments), empty: map[string]bool{}, del: map[string][]netip.Addr{}, comment: comments}
	changed := changedRules(cur, l, comments)
	// stays says whether an element of cur, with its comment, stays.
	stays := func(set string, key netip.Addr, comment string) bool {
		c, ok := d.want.elems[set][key]
		return ok && c == comment && !changed[comment]
	}
	for set, elems := range cur.elems {
		if !d.want.sets[set] {
			d.deleted += len(elems) // with their set
			continue
		}
		var del []netip.Addr
		for key, comment := range elems {
			if !stays(set, key, comment) {
				del = append(del, key)
			}
		}
		if len(elems) > 0 && len(del) == len(elems) {
			d.empty[set] = true
		} else if len(del) > 0 {
			d.del[set] = del
		}
		d.deleted += len(del)
	}
	for set := range cur.sets {
		if d.want.sets[set] && len(cur.elems[set]) == 0 {
			d.empty[set] = true
		}
	}
	for set, elems := range l.bySet() {
		have := cur.elems[set]
		for _, e := range elems {
			if c, ok := have[e.Key]; !ok || d.empty[set] || !stays(set, e.Key, c) {
				d.add = append(d.add, e)
			}
		}
	}
	return d
}

// update adds to tx what turns the table from cur, whatever its chains hold, into the layout l
// of policy p, in one transaction, and returns what the table then holds and how many
// elements it adds and deletes (see elementDiff):
//
//   - the table, chains, counters, sets and source map declared (declaring what exists changes
//     nothing);
//   - the chains refilled (flushed first when the table exists), and the source map too; SNAT
//     and source chains no longer used deleted;
//   - a set emptied is deleted and declared again (the chains' refill allows it); a set no rule
//     uses any more is deleted, and so are unused outbound counters and an unused source map.
func update(tx *knftables.Transaction, p *policy.Policy, l *Layout, cur *installed) (want *installed, added, deleted int) {
	d := diffElements(p, l, cur)
	want = d.want
	declare(tx, l)
	if cur.table {
		tx.Flush(&knftables.Chain{Name: ChainPostrouting})
		tx.Flush(&knftables.Chain{Name: ChainMasq})
		if cur.sources {
			// Its elements go to the source chains: gone before any of them is deleted.
			tx.Flush(&knftables.Map{Name: SourceMapName})
		}
		// The chains it refills too: a source chain that the source map no longer goes to (an
		// element deleted behind the agent's back) is not in cur, yet may exist.
		for _, name := range slices.Sorted(maps.Keys(union(cur.chains, want.chains))) {
			tx.Flush(&knftables.Chain{Name: name})
			if !want.chains[name] {
				tx.Delete(&knftables.Chain{Name: name}) // unreferenced now, and empty
			}
		}
	}
	if cur.sources && !want.sources {
		tx.Delete(&knftables.Map{Name: SourceMapName})
	}
	for _, name := range slices.Sorted(maps.Keys(cur.sets)) {
		if !want.sets[name] || d.empty[name] {
			tx.Delete(&knftables.Set{Name: name})
		}
	}
	declareSets(tx, l)
	addRules(tx, ChainPostrouting, l.Postrouting)
	addRules(tx, ChainMasq, l.Masq)
	for _, c := range l.SNAT {
		addRules(tx, c.Name, c.Rules)
	}
	for _, s := range l.Sources {
		addRules(tx, SourceChainName(s.Name), s.Rules)
	}
	for _, piece := range l.SourceMap {
		tx.Add(&knftables.Element{Map: SourceMapName, Key: []string{piece.Prefix.String()}, Value: []string{"goto " + piece.Chain}})
	}
	for _, set := range slices.Sorted(maps.Keys(d.del)) {
		for _, key := range d.del[set] {
			tx.Delete(&knftables.Element{Set: set, Key: []string{key.String()}})
		}
	}
	for _, e := range d.add {
		tx.Add(&knftables.Element{Set: e.Set, Key: []string{e.Key.String()}, Comment: knftables.PtrTo(d.comment[e.Rule])})
	}
	for _, name := range slices.Sorted(maps.Keys(cur.counters)) {
		if !want.counters[name] {
			tx.Delete(&knftables.Counter{Name: name})
		}
	}
	return want, len(d.add), d.deleted
}

// declare adds to tx the table, its chains and the outbound counters, as layout l has them
// (declaring what exists changes nothing).
func declare(tx *knftables.Transaction, l *Layout) {
	tx.Add(&knftables.Table{Comment: knftables.PtrTo(tableComment)})
	tx.Add(&knftables.Chain{Name: ChainPostrouting, Type: knftables.PtrTo(knftables.NATType),
		Hook: knftables.PtrTo(knftables.PostroutingHook), Priority: knftables.PtrTo(knftables.SNATPriority)})
	tx.Add(&knftables.Chain{Name: ChainMasq})
	for _, c := range l.chains() {
		tx.Add(&knftables.Chain{Name: c})
	}
	for _, c := range l.counters() {
		tx.Add(&knftables.Counter{Name: c})
	}
}

// declareSets adds to tx the sets of layout l, and its source map: an interval map, whose
// elements are few (the source rules' CIDRs and pods), so that one lookup finds a source's rule.
func declareSets(tx *knftables.Transaction, l *Layout) {
	for _, s := range l.Sets {
		tx.Add(&knftables.Set{Name: s.Name, Type: setType(l.Family)})
	}
	if len(l.SourceMap) > 0 {
		tx.Add(&knftables.Map{Name: SourceMapName, Type: addrType(l.Family) + " : verdict", Flags: []knftables.SetFlag{knftables.IntervalFlag}})
	}
}

func addRules(tx *knftables.Transaction, chain string, rules []string) {
	for _, r := range rules {
		tx.Add(&knftables.Rule{Chain: chain, Rule: r})
	}
}

// steps are the changes of an apply in the order they run: prepare (nil for none), the element
// batch, finish (nil for none).
type steps struct {
	prepare  *knftables.Transaction
	elements []SetChange
	finish   *knftables.Transaction
	want     *installed
	// added and deleted count the elements.
	added, deleted int
}

// phased returns the steps that take the table from cur, whose chains hold layout old (an
// empty layout when there is no table), to the layout l of policy p with the elements over
// netlink, and false when it cannot: when the masquerade chain's rules differ, an SNAT chain
// that both layouts have differs, or the source rules' part differs (the source map or a source
// list's chain; then one transaction must change them, update). With the source part the same,
// the source lists' elements change in the batch with the global ones.
//
// Every state the steps leave decides every packet as old does or as l does, never partly
// one and partly the other: prepare (declareTransition) still decides as old, the element
// batch (swapElements) makes the chain decide as l, and finish (dropLeftovers) removes what
// matched nothing any more.
func phased(nft knftables.Interface, p *policy.Policy, l, old *Layout, cur *installed) (steps, bool) {
	if cur.table && !slices.Equal(old.Masq, l.Masq) || !sameSources(old, l) {
		return steps{}, false
	}
	for _, c := range l.SNAT {
		if i := slices.IndexFunc(old.SNAT, func(o SNATChain) bool { return o.Name == c.Name }); i >= 0 && !sameSNAT(old.SNAT[i:i+1], []SNATChain{c}) {
			return steps{}, false
		}
	}
	t := phase{l: l, old: old, cur: cur, d: diffElements(p, l, cur), zero: netip.PrefixFrom(maxAddr(l.Family), 0).Masked().Addr()}
	// The gates in use: the old one starts open, the new one closed.
	if outboundChanges(old, l) {
		if old.Outbound >= 0 {
			t.gates = append(t.gates, gateOld)
		}
		if l.Outbound >= 0 {
			t.gates = append(t.gates, gateNew)
		}
	}
	st := steps{want: t.d.want, added: len(t.d.add), deleted: t.d.deleted}
	st.prepare, t.chain = t.declareTransition(nft)
	st.elements = t.swapElements()
	st.finish = t.dropLeftovers(nft)
	return st, true
}

// phase is what the steps of phased are made of.
type phase struct {
	l, old *Layout
	cur    *installed
	d      *elementDiff
	// gates are the outbound gates in use (gateOld, gateNew); zero is the family's 0.0.0.0
	// or ::, the one element of an open gate.
	gates []string
	zero  netip.Addr
	// chain is the base chain's rules after prepare.
	chain []string
}

// declareTransition is prepare: it declares what l adds (sets, still empty; SNAT chains; the
// outbound counter; the gates, the old one open) and makes the base chain the transition's (see
// transition). Lookups in empty sets and a closed gate match nothing, so the chain still
// decides as old. Nil when l adds nothing, and then the base chain stays old's.
func (t phase) declareTransition(nft knftables.Interface) (*knftables.Transaction, []string) {
	cur, l, d := t.cur, t.l, t.d
	fresh := !cur.table || len(t.gates) > 0
	for _, s := range l.Sets {
		fresh = fresh || !cur.sets[s.Name]
	}
	for name := range d.want.chains {
		fresh = fresh || !cur.chains[name]
	}
	for name := range d.want.counters {
		fresh = fresh || !cur.counters[name]
	}
	if !fresh {
		return nil, t.old.Postrouting
	}
	tx := nft.NewTransaction()
	declare(tx, l)
	declareSets(tx, l)
	for _, g := range t.gates {
		tx.Add(&knftables.Set{Name: g, Type: addrType(l.Family)})
		tx.Flush(&knftables.Set{Name: g})
		if g == gateOld {
			tx.Add(&knftables.Element{Set: g, Key: []string{t.zero.String()}})
		}
	}
	if !cur.table {
		addRules(tx, ChainMasq, l.Masq)
	}
	for _, c := range l.SNAT {
		if !cur.chains[c.Name] {
			addRules(tx, c.Name, c.Rules)
		}
	}
	chain := transition(t.old, l)
	if cur.table {
		tx.Flush(&knftables.Chain{Name: ChainPostrouting})
	}
	addRules(tx, ChainPostrouting, chain)
	return tx, chain
}

// dropped tells whether a set of cur goes: l does not keep it, and it is no gate.
func (t phase) dropped(name string) bool {
	return !t.d.want.sets[name] && !slices.Contains(t.gates, name)
}

// swapElements is the element batch, one kernel transaction: it empties the sets l does not
// keep or that start over, changes the others' elements (deletions, then additions), fills the
// new ones, and swaps the gates. From then on the chain decides as l.
func (t phase) swapElements() []SetChange {
	d := t.d
	var out []SetChange
	for _, name := range slices.Sorted(maps.Keys(t.cur.sets)) {
		if t.dropped(name) || d.empty[name] {
			out = append(out, SetChange{Set: name, Flush: true})
		}
	}
	for _, name := range slices.Sorted(maps.Keys(d.del)) {
		out = append(out, SetChange{Set: name, Delete: d.del[name]})
	}
	adds := map[string][]NewElement{}
	for _, e := range d.add {
		adds[e.Set] = append(adds[e.Set], NewElement{Key: e.Key, Comment: d.comment[e.Rule]})
	}
	for _, s := range t.l.Sets {
		if len(adds[s.Name]) > 0 {
			out = append(out, SetChange{Set: s.Name, Add: adds[s.Name]})
		}
	}
	for _, g := range t.gates {
		if g == gateOld {
			out = append(out, SetChange{Set: g, Delete: []netip.Addr{t.zero}})
		} else {
			out = append(out, SetChange{Set: g, Add: []NewElement{{Key: t.zero}}})
		}
	}
	return out
}

// dropLeftovers is finish: it makes the base chain l's and deletes what l does not have (sets,
// by now empty and no longer looked up; SNAT chains; the gates; the outbound counter): the
// lookups it removes matched nothing any more. Nil when there is nothing to do.
func (t phase) dropLeftovers(nft knftables.Interface) *knftables.Transaction {
	cur, d := t.cur, t.d
	tx := nft.NewTransaction()
	if !slices.Equal(t.chain, t.l.Postrouting) {
		tx.Flush(&knftables.Chain{Name: ChainPostrouting})
		addRules(tx, ChainPostrouting, t.l.Postrouting)
	}
	for _, g := range t.gates {
		tx.Delete(&knftables.Set{Name: g})
	}
	for _, name := range slices.Sorted(maps.Keys(cur.sets)) {
		if t.dropped(name) {
			tx.Delete(&knftables.Set{Name: name})
		}
	}
	for _, name := range slices.Sorted(maps.Keys(cur.chains)) {
		if !d.want.chains[name] {
			tx.Flush(&knftables.Chain{Name: name})
			tx.Delete(&knftables.Chain{Name: name})
		}
	}
	for _, name := range slices.Sorted(maps.Keys(cur.counters)) {
		if !d.want.counters[name] {
			tx.Delete(&knftables.Counter{Name: name})
		}
	}
	if tx.NumOperations() == 0 {
		return nil
	}
	return tx
}

// union is the keys of a and b.
func union(a, b map[string]bool) map[string]bool {
	out := maps.Clone(a)
	maps.Copy(out, b)
	return out
}

// sameSources tells whether two layouts have the same source map and source lists' chains.
func sameSources(a, b *Layout) bool {
	return slices.Equal(a.SourceMap, b.SourceMap) && slices.EqualFunc(a.Sources, b.Sources, func(x, y SourceList) bool {
		return x.Name == y.Name && slices.Equal(x.Rules, y.Rules)
	})
}

// changedRules returns the comments of the rules of the layout whose elements differ from
// those cur holds for them.
func changedRules(cur *installed, l *Layout, comments []string) map[string]bool {
	changed := map[string]bool{}
	n := cur.elements()
	if n == 0 {
		return changed // every element is new anyway
	}
	held := make(map[string]int, min(n, len(comments)))
	for _, elems := range cur.elems {
		for _, c := range elems {
			held[c]++
		}
	}
	same := make([]int, len(comments))
	for set, elems := range l.bySet() {
		have := cur.elems[set]
		for _, e := range elems {
			if c, ok := have[e.Key]; ok && c == comments[e.Rule] {
				same[e.Rule]++
			}
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

// replace adds to tx what removes the table, whatever it holds, and installs it anew, and
// returns what the table then holds.
func replace(tx *knftables.Transaction, p *policy.Policy, l *Layout) *installed {
	tx.Add(&knftables.Table{})
	tx.Delete(&knftables.Table{})
	want, _, _ := update(tx, p, l, empty())
	return want
}

// Render returns the transaction that installs a family's table from nothing, as `nft -f`
// takes it.
func Render(p *policy.Policy, fam policy.Family) string {
	tx := knftables.NewFake(nftFamily(fam), TableName).NewTransaction()
	_, _, _ = update(tx, p, NewLayout(p, fam), empty())
	return tx.String()
}

// RenderAll returns what `render --backend nftables` prints: the IPv4 transaction and, when
// IPv6 is enabled, the IPv6 one, after a comment line naming the command that takes them.
func RenderAll(p *policy.Policy) string {
	var b strings.Builder
	b.WriteString("# nft -f -\n")
	for _, fam := range policy.Families() {
		if p.Enabled(fam) {
			b.WriteString(Render(p, fam))
		}
	}
	return b.String()
}
