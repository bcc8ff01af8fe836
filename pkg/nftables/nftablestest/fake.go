// Package nftablestest is a fake nftables for the backend's users' tests: knftables' Fake for
// each family's table, a Kernel that reads them as the netlink one reads the kernel's, counters
// of the elements and the outbound counter, and a tracer that runs a packet through the fake's
// rules as nft would.
package nftablestest

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"

	"sigs.k8s.io/knftables"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Fake is the node's nftables: one knftables.Fake per family.
type Fake struct {
	mu    sync.Mutex
	fakes map[policy.Family]*knftables.Fake
	gen   uint32
	// counts are the counters of elements (by family, set, key and comment: an element
	// deleted and added again starts over) and of the named counters (by family and counter).
	counts map[countKey]nftables.Count
	// Runs counts the transactions run, per family; Batches the element batches.
	Runs, Batches map[policy.Family]int
	// ElementReads counts the elements read by key; Walks the reads of every set whole.
	ElementReads, Walks int
	// WalkMisses, when set, is how many elements of each set (the lowest keys) a read of every
	// set whole leaves out, as a walk of a set the kernel is resizing does.
	WalkMisses int
	// Fail, when set, fails every transaction with it.
	Fail error
	// Others are the names of other owners' tables, per family (kube-proxy's, say).
	Others map[policy.Family][]string
	// Committed, when set, is called after each transaction or element batch commits (without
	// the fake's lock, so that it may trace), with the family it changed.
	Committed func(fam policy.Family)
}

type countKey struct {
	fam                   policy.Family
	set, comment, counter string
	key                   netip.Addr
}

// New returns an empty fake.
func New() *Fake {
	f := &Fake{fakes: map[policy.Family]*knftables.Fake{}, counts: map[countKey]nftables.Count{},
		Runs: map[policy.Family]int{}, Batches: map[policy.Family]int{}}
	for _, fam := range policy.Families() {
		kf := knftables.IPv4Family
		if fam == policy.IPv6 {
			kf = knftables.IPv6Family
		}
		f.fakes[fam] = knftables.NewFake(kf, nftables.TableName)
	}
	return f
}

// Options are backend options that use the fake.
func (f *Fake) Options() nftables.Options {
	return nftables.Options{NFT: f.NFT, Kernel: f.Kernel()}
}

// NFT returns the family's interface (nftables.Options.NFT).
func (f *Fake) NFT(fam policy.Family) (knftables.Interface, error) {
	return &iface{Fake: f.fakes[fam], f: f, fam: fam}, nil
}

// Table returns the family's fake table, nil when there is none.
func (f *Fake) Table(fam policy.Family) *knftables.FakeTable {
	kf := f.fakes[fam]
	kf.RLock()
	defer kf.RUnlock()
	return kf.Table
}

// Dump is the family's table as knftables' Fake dumps it.
func (f *Fake) Dump(fam policy.Family) string { return f.fakes[fam].Dump() }

// Run runs a transaction of someone else on the family's table, as an admin would.
func (f *Fake) Run(ctx context.Context, fam policy.Family, build func(tx *knftables.Transaction)) error {
	nft, _ := f.NFT(fam)
	tx := nft.NewTransaction()
	build(tx)
	return nft.Run(ctx, tx)
}

// iface is a family's knftables interface: every committed transaction is a new generation.
type iface struct {
	*knftables.Fake
	f   *Fake
	fam policy.Family
}

func (i *iface) Run(ctx context.Context, tx *knftables.Transaction) error {
	if err := i.f.commit(ctx, i.fam, tx); err != nil {
		return err
	}
	i.f.mu.Lock()
	i.f.Runs[i.fam]++
	i.f.mu.Unlock()
	return nil
}

// commit runs a transaction on the family's fake as the kernel commits one: all or nothing, a
// new generation.
func (f *Fake) commit(ctx context.Context, fam policy.Family, tx *knftables.Transaction) error {
	f.mu.Lock()
	if f.Fail != nil {
		f.mu.Unlock()
		return f.Fail
	}
	if err := f.fakes[fam].Run(ctx, tx); err != nil {
		f.mu.Unlock()
		return err
	}
	f.gen++
	f.forgetGone(fam)
	committed := f.Committed
	f.mu.Unlock()
	if committed != nil {
		committed(fam)
	}
	return nil
}

// forgetGone drops the counts of elements that are gone, as the kernel frees their counters.
func (f *Fake) forgetGone(fam policy.Family) {
	t := f.Table(fam)
	for k := range f.counts {
		if k.fam != fam {
			continue
		}
		if t == nil {
			delete(f.counts, k)
			continue
		}
		if k.counter != "" {
			if t.Counters[k.counter] == nil {
				delete(f.counts, k)
			}
			continue
		}
		if e := findElement(t, k.set, k.key); e == nil || comment(e) != k.comment {
			delete(f.counts, k)
		}
	}
}

func findElement(t *knftables.FakeTable, set string, key netip.Addr) *knftables.Element {
	s := t.Sets[set]
	if s == nil {
		return nil
	}
	return s.FindElement(key.String())
}

func comment(e *knftables.Element) string {
	if e.Comment == nil {
		return ""
	}
	return *e.Comment
}

// Generation implements nftables.Kernel.
func (f *Fake) Generation(context.Context) (uint32, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.gen, nil
}

// TableState reads the family's table as nftables.Kernel.Table does; a rule's fingerprint is
// its text.
func (f *Fake) TableState(fam policy.Family, elements bool) (*nftables.TableState, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	t := f.Table(fam)
	if t == nil {
		return nil, nil
	}
	st := &nftables.TableState{Sets: map[string]*nftables.SetState{}, Chains: map[string][]string{}, SNAT: map[string]netip.Addr{},
		SourceOutbound: map[string]nftables.Count{}}
	// As over netlink, the source chains are those the source map goes to.
	reached := map[string]bool{}
	if m := t.Maps[nftables.SourceMapName]; m != nil {
		for _, e := range m.Elements {
			reached[strings.TrimPrefix(strings.Join(e.Value, " "), "goto ")] = true
		}
	}
	for name, c := range t.Chains {
		if strings.HasPrefix(name, nftables.ChainSourcePrefix) && !reached[name] {
			continue
		}
		rules := []string{}
		for _, r := range c.Rules {
			rules = append(rules, r.Rule)
			if name == nftables.ChainPostrouting || strings.HasPrefix(name, nftables.ChainSourcePrefix) {
				f.noteSNAT(t, st, r.Rule)
			}
		}
		st.Chains[name] = rules
	}
	if m := t.Maps[nftables.SourceMapName]; m != nil {
		st.SourceMap = []string{}
		for _, e := range m.Elements {
			st.SourceMap = append(st.SourceMap, strings.Join(e.Key, " ")+" : "+strings.Join(e.Value, " "))
		}
		slices.Sort(st.SourceMap)
	}
	for name, s := range t.Sets {
		ss := &nftables.SetState{}
		st.Sets[name] = ss
		if !elements {
			continue
		}
		ss.Elements = map[netip.Addr]nftables.ElementState{}
		for _, e := range s.Elements {
			key, err := netip.ParseAddr(e.Key[0])
			if err != nil {
				return nil, fmt.Errorf("set %s: key %q: %w", name, e.Key[0], err)
			}
			ss.Elements[key] = nftables.ElementState{Comment: comment(e),
				Count: f.counts[countKey{fam: fam, set: name, key: key, comment: comment(e)}]}
		}
	}
	for name := range t.Counters {
		c := f.counts[countKey{fam: fam, counter: name}]
		if name == nftables.CounterOutbound {
			st.Outbound = &c
		} else if rule, ok := strings.CutPrefix(strings.TrimSuffix(name, "."+nftables.CounterOutbound), nftables.ChainSourcePrefix); ok {
			st.SourceOutbound[rule] = c
		}
	}
	return st, nil
}

// noteSNAT records in st.SNAT where a rule of the base chain or a source chain (@SET ... goto
// CHAIN, or an outbound counter's) goes, when that chain SNATs.
func (f *Fake) noteSNAT(t *knftables.FakeTable, st *nftables.TableState, rule string) {
	words := strings.Fields(rule)
	key, chain := "", ""
	for i, w := range words {
		switch {
		case strings.HasPrefix(w, "@") && key == "":
			key = w[1:]
		case i > 0 && words[i-1] == "name":
			key, _ = strconv.Unquote(w)
		case w == "goto" && i+1 < len(words):
			chain = words[i+1]
		}
	}
	v := Verdict{chain: chain}
	if key != "" && chain != "" && f.masquerade(t, &v) == nil && v.Source.IsValid() {
		st.SNAT[key] = v.Source
	}
}

// kernel adapts the fake to nftables.Kernel.
type kernel struct{ *Fake }

// Kernel returns the fake as an nftables.Kernel.
func (f *Fake) Kernel() nftables.Kernel { return kernel{f} }

func (k kernel) Table(_ context.Context, fam policy.Family, elements bool) (*nftables.TableState, error) {
	st, err := k.TableState(fam, elements)
	if !elements || st == nil || err != nil {
		return st, err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.Walks++
	for _, s := range st.Sets {
		for _, key := range slices.SortedFunc(maps.Keys(s.Elements), netip.Addr.Compare)[:min(k.WalkMisses, len(s.Elements))] {
			delete(s.Elements, key)
		}
	}
	return st, nil
}

// Elements implements nftables.Kernel. ElementReads counts the keys it read.
func (k kernel) Elements(_ context.Context, fam policy.Family, set string, keys []netip.Addr) (map[netip.Addr]nftables.ElementState, error) {
	st, err := k.TableState(fam, true)
	if err != nil || st == nil || st.Sets[set] == nil {
		return nil, err
	}
	k.mu.Lock()
	k.ElementReads += len(keys)
	k.mu.Unlock()
	out := map[netip.Addr]nftables.ElementState{}
	for _, key := range keys {
		if e, ok := st.Sets[set].Elements[key]; ok {
			out[key] = e
		}
	}
	return out, nil
}

// ChangeElements implements nftables.Kernel: the batch is one transaction of the fake, counted
// in Batches.
func (k kernel) ChangeElements(ctx context.Context, fam policy.Family, changes []nftables.SetChange) error {
	tx := k.fakes[fam].NewTransaction()
	for _, ch := range changes {
		if ch.Flush {
			tx.Flush(&knftables.Set{Name: ch.Set})
		}
		for _, key := range ch.Delete {
			tx.Delete(&knftables.Element{Set: ch.Set, Key: []string{key.String()}})
		}
		for _, e := range ch.Add {
			el := &knftables.Element{Set: ch.Set, Key: []string{e.Key.String()}}
			if e.Comment != "" {
				el.Comment = knftables.PtrTo(e.Comment)
			}
			tx.Add(el)
		}
	}
	if err := k.commit(ctx, fam, tx); err != nil {
		return err
	}
	k.mu.Lock()
	k.Batches[fam]++
	k.mu.Unlock()
	return nil
}

// TableNames implements nftables.Kernel: the agent's table when it exists, and Others.
func (k kernel) TableNames(_ context.Context, fam policy.Family) ([]string, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	out := append([]string(nil), k.Others[fam]...)
	if k.Fake.Table(fam) != nil {
		out = append(out, nftables.TableName)
	}
	return out, nil
}

// Verdict is what the rules do with a packet.
type Verdict struct {
	Action policy.Action
	// Set and Key are the element that decided, Set "" when no element did (the node's own
	// address, an outbound rule or the end of a chain).
	Set string
	Key netip.Addr
	// Outbound is set when an outbound rule decided.
	Outbound bool
	// SourceRule is the source rule whose chain the source map sent the packet to, "" for the
	// global lists.
	SourceRule string
	// Masq are the rules of the chain that masqueraded the packet (the masquerade chain or an
	// SNAT chain), and Source the address its last rule SNATs to (invalid for masquerade).
	Masq   []string
	Source netip.Addr
	chain  string
}

// Trace runs a packet to dst from a source that no source rule holds through the family's
// postrouting chain (see TraceFrom).
func (f *Fake) Trace(dst netip.Addr, local bool) (Verdict, error) {
	return f.TraceFrom(netip.Addr{}, dst, local)
}

// TraceFrom runs a packet from src to dst through the family's postrouting chain as nft would
// (local says whether dst is one of the node's addresses) and counts it where nft would: the
// source map sends it to a source rule's chain, whose end ends the base chain (goto). An invalid
// src is a source no source map element holds. It understands the statements the backend
// writes and fails on any other.
func (f *Fake) TraceFrom(src, dst netip.Addr, local bool) (Verdict, error) {
	fam := policy.FamilyOf(dst)
	f.mu.Lock()
	defer f.mu.Unlock()
	t := f.Table(fam)
	if t == nil || t.Chains[nftables.ChainPostrouting] == nil {
		return Verdict{Action: policy.Return}, nil
	}
	rules := t.Chains[nftables.ChainPostrouting].Rules
	rule := ""
	for i := 0; i < len(rules); i++ {
		to, lookup, err := f.sourceLookup(t, fam, rules[i].Rule, src)
		if err != nil {
			return Verdict{}, fmt.Errorf("rule %q: %w", rules[i].Rule, err)
		}
		if lookup && to == "" {
			continue
		}
		if lookup {
			// goto: the chain's rules instead of the rest of the base chain.
			if t.Chains[to] == nil {
				return Verdict{}, fmt.Errorf("rule %q: no chain %s", rules[i].Rule, to)
			}
			rules, i, rule = t.Chains[to].Rules, -1, strings.TrimPrefix(to, nftables.ChainSourcePrefix)
			continue
		}
		v, matched, err := f.step(t, fam, rules[i].Rule, dst, local)
		if err != nil {
			return Verdict{}, fmt.Errorf("rule %q: %w", rules[i].Rule, err)
		}
		if !matched {
			continue
		}
		v.SourceRule = rule
		if v.Action == policy.Masquerade {
			if err := f.masquerade(t, &v); err != nil {
				return Verdict{}, err
			}
		}
		return v, nil
	}
	return Verdict{Action: policy.Return, SourceRule: rule}, nil
}

// sourceLookup evaluates a rule that looks the source up in the source map (`ip saddr vmap
// @sources`): the chain its element goes to, "" for no element; lookup is false for another
// rule.
func (f *Fake) sourceLookup(t *knftables.FakeTable, fam policy.Family, rule string, src netip.Addr) (to string, lookup bool, err error) {
	words := strings.Fields(rule)
	match := "ip"
	if fam == policy.IPv6 {
		match = "ip6"
	}
	if len(words) != 4 || words[0] != match || words[1] != "saddr" || words[2] != "vmap" {
		return "", false, nil
	}
	m := t.Maps[strings.TrimPrefix(words[3], "@")]
	if m == nil {
		return "", true, fmt.Errorf("no map %s", words[3])
	}
	if !src.IsValid() {
		return "", true, nil
	}
	for _, e := range m.Elements {
		p, err := netip.ParsePrefix(e.Key[0])
		if err != nil {
			return "", true, fmt.Errorf("map %s: key %q: %w", words[3], e.Key[0], err)
		}
		if !p.Contains(src) {
			continue
		}
		if to != "" {
			// The kernel refuses overlapping intervals.
			return "", true, fmt.Errorf("map %s: %s is in more than one interval", words[3], src)
		}
		chain, ok := strings.CutPrefix(strings.Join(e.Value, " "), "goto ")
		if !ok {
			return "", true, fmt.Errorf("map %s: value %q", words[3], e.Value)
		}
		to = chain
	}
	return to, true, nil
}

func (f *Fake) masquerade(t *knftables.FakeTable, v *Verdict) error {
	c := t.Chains[v.chain]
	if c == nil || len(c.Rules) == 0 {
		return fmt.Errorf("no rules in chain %s", v.chain)
	}
	for _, m := range c.Rules {
		v.Masq = append(v.Masq, m.Rule)
	}
	last := v.Masq[len(v.Masq)-1]
	switch to, ok := strings.CutPrefix(last, "snat to "); {
	case ok:
		addr, err := netip.ParseAddr(strings.Fields(to)[0])
		if err != nil {
			return fmt.Errorf("chain %s: %q: %w", v.chain, last, err)
		}
		v.Source = addr
	case last != "masquerade" && !strings.HasPrefix(last, "masquerade "):
		return fmt.Errorf("chain %s ends in %q", v.chain, last)
	}
	return nil
}

// step evaluates one rule of the postrouting chain.
func (f *Fake) step(t *knftables.FakeTable, fam policy.Family, rule string, dst netip.Addr, local bool) (Verdict, bool, error) {
	words := strings.Fields(rule)
	chain := ""
	verdict := func(w []string) (policy.Action, error) {
		switch {
		case len(w) == 1 && w[0] == "return":
			return policy.Return, nil
		case len(w) == 2 && w[0] == "goto" && (w[1] == nftables.ChainMasq || strings.HasPrefix(w[1], nftables.ChainSNATPrefix)):
			chain = w[1]
			return policy.Masquerade, nil
		}
		return 0, fmt.Errorf("verdict %q", strings.Join(w, " "))
	}
	switch {
	case rule == "fib daddr type local return":
		return Verdict{Action: policy.Return}, local, nil
	case len(words) >= 3 && words[0] == "counter" && words[1] == "name":
		name, err := strconv.Unquote(words[2])
		if err != nil || t.Counters[name] == nil {
			return Verdict{}, false, fmt.Errorf("no counter %s", words[2])
		}
		a, err := verdict(words[3:])
		if err != nil {
			return Verdict{}, false, err
		}
		k := countKey{fam: fam, counter: name}
		c := f.counts[k]
		c.Packets++
		f.counts[k] = c
		return Verdict{Action: a, Outbound: true, chain: chain}, true, nil
	}
	// ip daddr [& MASK] @SET VERDICT
	match := "ip"
	if fam == policy.IPv6 {
		match = "ip6"
	}
	if len(words) < 4 || words[0] != match || words[1] != "daddr" {
		return Verdict{}, false, fmt.Errorf("statement not understood")
	}
	key, rest := dst, words[2:]
	if rest[0] == "&" {
		mask, err := netip.ParseAddr(rest[1])
		if err != nil {
			return Verdict{}, false, fmt.Errorf("mask: %w", err)
		}
		key = and(dst, mask)
		rest = rest[2:]
	}
	if !strings.HasPrefix(rest[0], "@") {
		return Verdict{}, false, fmt.Errorf("statement not understood")
	}
	set := rest[0][1:]
	if t.Sets[set] == nil {
		return Verdict{}, false, fmt.Errorf("no set %s", set)
	}
	e := findElement(t, set, key)
	if len(rest) > 1 && rest[1] == "counter" {
		// The outbound rule behind a gate set, while an apply changes it.
		if e == nil {
			return Verdict{}, false, nil
		}
		return f.step(t, fam, strings.Join(rest[1:], " "), dst, local)
	}
	a, err := verdict(rest[1:])
	if err != nil {
		return Verdict{}, false, err
	}
	if e == nil {
		return Verdict{}, false, nil
	}
	k := countKey{fam: fam, set: set, key: key, comment: comment(e)}
	c := f.counts[k]
	c.Packets++
	f.counts[k] = c
	return Verdict{Action: a, Set: set, Key: key, chain: chain}, true, nil
}

func and(a, mask netip.Addr) netip.Addr {
	x, m := a.AsSlice(), mask.AsSlice()
	for i := range x {
		x[i] &= m[i]
	}
	out, _ := netip.AddrFromSlice(x)
	return out
}
