// Package nftables is the nftables datapath: the policy in a table of its own per family
// (`ip ip-masq-agent`, `ip6 ip-masq-agent`), hooked at nat postrouting, the CIDRs held in sets
// whose elements count their hits. The table, chains and rules go through knftables, the
// elements in one netlink batch between them (see phased).
//
// # Layout
//
// The policy's first-match order is kept in two phases, as the BPF datapath keeps it with its
// two tries: every MASQUERADE rule of the list comes before every RETURN rule but the outbound
// one, so "is it in a masqueradeCIDRs entry? else is it in a link-local or nonMasqueradeCIDRs
// entry? else the outbound rule" decides exactly as the list does. Within a phase a rule owns
// the part of its prefix that no earlier rule of the phase covers (Decide's first match), cut
// into prefixes; each such piece is one element, in the set of its phase and prefix length
// (masq-24, return-8, ...), keyed by the piece's network address. A packet is looked up in the
// sets of each length present, `ip daddr & MASK @SET`: hash lookups, however many CIDRs the
// config has, and only for a connection's first packet (the nat hook sees nothing else).
//
// Hash sets rather than interval sets because nft 1.0.6 (Debian 12) reads back every element
// of an interval set before it adds or deletes one: adding 10 elements to a 100k-element
// interval set took 3.4 s here and deleting 1,000 over a minute, where a hash set takes
// milliseconds. The pieces are disjoint, so the order of the lookups does not matter.
//
// # Counters
//
// Per-element counters (the sets are declared with `counter`): one element's counter is one
// piece's hits, and a rule's count is the sum over its pieces. A rule that stays across a
// change keeps its elements and so its counts; named counters would keep them too, but nft
// 1.0.6 takes minutes to load 100k of them. The outbound rule, which has no element, counts in
// the named counter "outbound", which survives the rebuilds of the chain. Each element's
// comment names its rule ("nonMasqueradeCIDRs 10.0.0.0/8"), so `dump` can tell the rules apart
// without the configuration.
//
// # Masquerade addresses
//
// A masquerade rule that names its source address (policy.Rule.Address) has its pieces in sets
// of that address ("masq-24-10.0.0.11"; an IPv6 address with dots for its colons), whose lookups
// go to a chain that SNATs to it ("snat-1", "snat-2", ... in the order the addresses first come
// in the rule list) with the masquerade chain's random ports and port ranges; so does the
// outbound rule with the family's masquerade address. Sets are named by address, so that a
// rule's elements, and counts, stay where its address does.
//
// # Source rules
//
// A source rule's lists are laid out as the global ones, in sets, a chain ("src.batch") and an
// outbound counter ("src.batch.outbound") named after the rule ("src.batch.return-8"), so that
// its elements and counts stay with it when rules come, go or move. The base chain looks the
// packet's source up once, right after the node's own addresses, in an interval verdict map
// ("sources") whose elements are the rules' sources cut into the pieces no earlier rule holds
// (DecideFrom's first match; the map refuses overlapping elements); a source it holds goes to
// its rule's chain, whose end ends the base chain, so that the global lists never see it. A
// packet costs one lookup in the map, then its rule's lookups, however many rules there are.
// A change of the map or of a source rule's chain goes in one transaction (see update); with
// them unchanged, the source rules' elements change in the element batch with the others'. A
// policy without source rules has no map and is laid out as before there were any.
package nftables

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"

	"sigs.k8s.io/knftables"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Name is the backend's name on the command line.
const Name = "nftables"

// TableName is the name of the agent's table in both families.
const TableName = "ip-masq-agent"

// Chain, set and counter names inside the table.
const (
	// ChainPostrouting is the base chain: nat, postrouting, at srcnat priority.
	ChainPostrouting = "postrouting"
	// ChainMasq masquerades (`masquerade` is a keyword of nft and cannot name a chain).
	ChainMasq = "masq"
	// ChainSNATPrefix starts the names of the chains that SNAT to a masquerade address:
	// "snat-1", "snat-2", ... (see SNATChainName).
	ChainSNATPrefix = "snat-"
	// ChainSourcePrefix starts the names of the source rules' chains: "src.batch" (see
	// SourceChainName), and of their sets and counters.
	ChainSourcePrefix = "src."
	// CounterOutbound counts the outbound rule.
	CounterOutbound = "outbound"
	// SourceMapName is the interval verdict map from a packet's source to the chain of the source
	// rule that decides it.
	SourceMapName = "sources"
)

// tableComment marks the table as the agent's.
const tableComment = "ip-masq-agent: masquerade policy; changes behind the agent's back are repaired"

// toPortsProtocols are the protocols --to-ports applies to, as MASQUERADE --to-ports upstream.
const toPortsProtocols = "{ tcp, udp, sctp }"

// nftFamily is the nftables family of an address family.
func nftFamily(fam policy.Family) knftables.Family {
	if fam == policy.IPv6 {
		return knftables.IPv6Family
	}
	return knftables.IPv4Family
}

// Element is one set element: a piece of a rule's prefix.
type Element struct {
	// Set is the set's name (SetName).
	Set string
	// Key is the piece's network address, the element's key.
	Key netip.Addr
	// Rule is the index, in the layout's rules (see Rules), of the rule the piece belongs to.
	Rule int
}

// Set is one set of the layout: the pieces of one list, phase and prefix length, and in the
// masquerade phase of one masquerade address (invalid: the uplink's).
type Set struct {
	Name string
	// Source is the source rule whose list the set holds, "" for the global lists.
	Source  string
	Action  policy.Action
	Bits    int
	Address netip.Addr
}

// SNATChain is a chain that SNATs to a masquerade address.
type SNATChain struct {
	Name    string
	Address netip.Addr
	Rules   []string
}

// SourceList is a source rule's list as the table holds it: a chain of its own that the source
// map goes to, its sets, and its outbound counter.
type SourceList struct {
	// Name is the source rule's name; Index its position in the policy's Sources.
	Name  string
	Index int
	// First is the index of its first rule in the layout's rules; Outbound that of its outbound
	// rule, -1 without one, and outboundChain the chain it goes to.
	First, Outbound int
	outboundChain   string
	// Rules are its chain's rules, as nft statements.
	Rules []string
}

// SourcePiece is an element of the source map: a piece of a source rule's sources that no
// earlier source rule holds, and the source rule's chain.
type SourcePiece struct {
	Prefix netip.Prefix
	Chain  string
}

// Layout is a family's policy as the table holds it.
type Layout struct {
	Family policy.Family
	// Sets in lookup order, the global lists' first, then each source list's: the MASQUERADE
	// phase's by prefix length, longest first, then the RETURN phase's.
	Sets []Set
	// Elements by set, in the order of Sets, each set's in rule order.
	Elements []Element
	// Outbound is the global outbound rule's index in the rule list, -1 without one;
	// outboundChain the chain it goes to.
	Outbound      int
	outboundChain string
	// Pieces counts, per rule of the layout's rules, its elements: 0 for a rule that earlier
	// rules of its list and phase cover entirely (it can never match, as on iptables).
	Pieces []int
	// Postrouting and Masq are the chains' rules, as nft statements.
	Postrouting, Masq []string
	// SNAT are the chains of the masquerade addresses, in the order of their names.
	SNAT []SNATChain
	// SourceMap are the source map's elements, in address order; empty without source rules
	// that hold a source of the family, and then the table has no map.
	SourceMap []SourcePiece
	// Sources are the lists of the source rules the source map goes to, in rule order. A source
	// rule whose sources earlier ones hold whole (or that holds none of the family) never
	// decides a packet of the family, and has no list in the table.
	Sources []SourceList
}

// SetName names the set of a phase and prefix length: "masq-24", "return-8"; with a
// masquerade address (valid only for the masquerade phase), "masq-24-10.0.0.11".
func SetName(a policy.Action, bits int, addr netip.Addr) string {
	if a != policy.Masquerade {
		return fmt.Sprintf("return-%d", bits)
	}
	if addr.IsValid() {
		// nft names take letters, digits and "_-./", not an IPv6 address's colons.
		return fmt.Sprintf("masq-%d-%s", bits, strings.ReplaceAll(addr.String(), ":", "."))
	}
	return fmt.Sprintf("masq-%d", bits)
}

// SNATChainName names the chain of the i-th masquerade address (from 0): "snat-1".
func SNATChainName(i int) string { return fmt.Sprintf("%s%d", ChainSNATPrefix, i+1) }

// SourceChainName names a source rule's chain: "src.batch". Rule names have no dots, so the
// names of a source rule's sets and counter, which start with it and a dot, tell the rule.
func SourceChainName(rule string) string { return ChainSourcePrefix + rule }

// sourceName prefixes a set or counter name of a source rule's list ("" for the global lists):
// "src.batch.masq-24", "src.batch.outbound".
func sourceName(rule, name string) string {
	if rule == "" {
		return name
	}
	return SourceChainName(rule) + "." + name
}

// parseSourceName splits a set or counter name into the source rule it belongs to ("" for the
// global lists) and the name its list gives it.
func parseSourceName(name string) (rule, own string) {
	rest, ok := strings.CutPrefix(name, ChainSourcePrefix)
	if !ok {
		return "", name
	}
	rule, own, _ = strings.Cut(rest, ".")
	return rule, own
}

// Comment is the comment of a rule's elements: its origin and prefix, after its source rule
// when it has one ("sourceRules[batch] nonMasqueradeCIDRs 10.0.0.0/8").
func Comment(r policy.Rule) string {
	c := string(r.Origin) + " " + r.Prefix.String()
	if r.Set != "" {
		c = config.KeySourceRules + "[" + r.Set + "] " + c
	}
	return c
}

// ParseComment reads Comment back; ok is false for a comment the agent did not write.
func ParseComment(s string) (set string, origin policy.Origin, prefix netip.Prefix, ok bool) {
	if rest, found := strings.CutPrefix(s, config.KeySourceRules+"["); found {
		if set, s, found = strings.Cut(rest, "] "); !found || set == "" {
			return "", "", netip.Prefix{}, false
		}
	}
	o, p, found := strings.Cut(s, " ")
	if !found {
		return "", "", netip.Prefix{}, false
	}
	prefix, err := netip.ParsePrefix(p)
	if err != nil {
		return "", "", netip.Prefix{}, false
	}
	return set, policy.Origin(o), prefix, true
}

// NewLayout lays out a family's rules (the family must be enabled in p): the global lists,
// then the list of each source rule the source map goes to.
func NewLayout(p *policy.Policy, fam policy.Family) *Layout {
	l := &Layout{Family: fam}
	l.Outbound, l.outboundChain = l.addList(p.Rules(fam), "")
	var reached map[int]bool
	l.SourceMap, reached = sourceMap(p, fam)
	for i, s := range p.Sources {
		if !reached[i] {
			continue
		}
		sl := SourceList{Name: s.Name, Index: i, First: len(l.Pieces)}
		sl.Outbound, sl.outboundChain = l.addList(s.Policy.Rules(fam), s.Name)
		if sl.Outbound >= 0 {
			sl.Outbound += sl.First
		}
		l.Sources = append(l.Sources, sl)
	}
	l.Postrouting = l.postroutingRules()
	for i := range l.Sources {
		l.Sources[i].Rules = l.sourceRules(l.Sources[i])
	}
	l.Masq = masqRules(p, netip.Addr{})
	for i := range l.SNAT {
		l.SNAT[i].Rules = masqRules(p, l.SNAT[i].Address)
	}
	return l
}

// sourceMap returns the source map's elements: each source rule's prefixes, in rule order, cut
// into the pieces no earlier rule holds (DecideFrom's first match), so that they are disjoint,
// as an interval map needs them; and the source rules that have pieces.
func sourceMap(p *policy.Policy, fam policy.Family) ([]SourcePiece, map[int]bool) {
	var out []SourcePiece
	reached := map[int]bool{}
	covered := &trie{}
	for i, s := range p.Sources {
		for _, pre := range s.Prefixes(fam) {
			for _, piece := range covered.claim(pre.Masked()) {
				out = append(out, SourcePiece{Prefix: piece, Chain: SourceChainName(s.Name)})
				reached[i] = true
			}
		}
	}
	slices.SortFunc(out, func(a, b SourcePiece) int { return a.Prefix.Addr().Compare(b.Prefix.Addr()) })
	return out, reached
}

// Rules are the layout's rules, which Element.Rule and Pieces index: the global list's, then
// each source list's.
func (l *Layout) Rules(p *policy.Policy) []policy.Rule {
	rules := p.Rules(l.Family)
	if len(l.Sources) == 0 {
		return rules
	}
	rules = slices.Clone(rules)
	for _, s := range l.Sources {
		rules = append(rules, p.Sources[s.Index].Policy.Rules(l.Family)...)
	}
	return rules
}

// addList lays out the sets and elements of a list of rules (of source rule source, "" for the
// global list), after those laid out before, and returns its outbound rule's index in the list
// (-1 without one) and the chain that rule goes to.
func (l *Layout) addList(rules []policy.Rule, source string) (outbound int, outboundChain string) {
	first := len(l.Pieces)
	l.Pieces = append(l.Pieces, make([]int, len(rules))...)
	outbound = -1
	bySet := map[string][]Element{}
	for _, action := range []policy.Action{policy.Masquerade, policy.Return} {
		covered := &trie{}
		// The sets of each prefix length, by address, the addresses in rule order.
		lengths := map[int][]netip.Addr{}
		// names are the names of those sets: a SetName per piece took a third of a 100k-CIDR layout.
		type setID struct {
			bits int
			addr netip.Addr
		}
		names := map[setID]string{}
		for i, r := range rules {
			if r.Action != action {
				continue
			}
			chain := l.snatChain(r.Address)
			if r.Origin == policy.OriginOutbound {
				outbound, outboundChain = i, chain
				continue
			}
			for _, piece := range covered.claim(r.Prefix.Masked()) {
				id := setID{piece.Bits(), r.Address}
				name, ok := names[id]
				if !ok {
					name = sourceName(source, SetName(action, id.bits, id.addr))
					names[id] = name
					lengths[id.bits] = append(lengths[id.bits], id.addr)
				}
				bySet[name] = append(bySet[name], Element{Set: name, Key: piece.Addr(), Rule: first + i})
				l.Pieces[first+i]++
			}
		}
		for _, bits := range slices.Backward(slices.Sorted(maps.Keys(lengths))) {
			for _, addr := range lengths[bits] {
				s := Set{Name: sourceName(source, SetName(action, bits, addr)), Source: source, Action: action, Bits: bits, Address: addr}
				l.Sets = append(l.Sets, s)
				l.Elements = append(l.Elements, bySet[s.Name]...)
			}
		}
	}
	return outbound, outboundChain
}

// snatChain returns the name of the chain that masquerades to addr (ChainMasq for none), adding
// it to the layout when it is new.
func (l *Layout) snatChain(addr netip.Addr) string {
	if !addr.IsValid() {
		return ChainMasq
	}
	i := slices.IndexFunc(l.SNAT, func(c SNATChain) bool { return c.Address == addr })
	if i < 0 {
		i = len(l.SNAT)
		l.SNAT = append(l.SNAT, SNATChain{Name: SNATChainName(i), Address: addr})
	}
	return l.SNAT[i].Name
}

// daddr is the destination match of a family: "ip daddr" or "ip6 daddr".
func daddr(fam policy.Family) string {
	if fam == policy.IPv6 {
		return "ip6 daddr"
	}
	return "ip daddr"
}

// postroutingRules are the base chain's rules: the node's own addresses are never masqueraded
// (iptables' `addrtype ! --dst-type LOCAL` on the jump), then the source map, then the global
// lookups, then the outbound rule.
func (l *Layout) postroutingRules() []string {
	out := []string{"fib daddr type local return"}
	if len(l.SourceMap) > 0 {
		out = append(out, l.sourceLookup())
	}
	for _, s := range l.Sets {
		if s.Source == "" {
			out = append(out, l.lookup(s))
		}
	}
	if l.Outbound >= 0 {
		out = append(out, outboundRule(l.Family, CounterOutbound, l.outboundChain, ""))
	}
	return out
}

// sourceLookup is the base chain's rule that sends a packet whose source a source rule holds to
// the rule's chain. It goes there (goto) rather than jumps: what the chain does not decide leaves
// the base chain unmasqueraded, and the global lists never see the packet.
func (l *Layout) sourceLookup() string {
	saddr := "ip saddr"
	if l.Family == policy.IPv6 {
		saddr = "ip6 saddr"
	}
	return fmt.Sprintf("%s vmap @%s", saddr, SourceMapName)
}

// sourceRules are the rules of a source list's chain: its lookups, then its outbound rule.
func (l *Layout) sourceRules(s SourceList) []string {
	var out []string
	for _, set := range l.Sets {
		if set.Source == s.Name {
			out = append(out, l.lookup(set))
		}
	}
	if s.Outbound >= 0 {
		out = append(out, outboundRule(l.Family, SourceCounterName(s.Name), s.outboundChain, ""))
	}
	return out
}

// SourceCounterName names the counter of a source rule's outbound rule: "src.batch.outbound".
func SourceCounterName(rule string) string { return sourceName(rule, CounterOutbound) }

// lookup is the base chain's rule that looks a packet up in the layout's set s.
func (l *Layout) lookup(s Set) string {
	verdict := "return"
	if s.Action == policy.Masquerade {
		verdict = "goto " + l.snatChain(s.Address)
	}
	return fmt.Sprintf("%s @%s %s", l.match(s.Bits), s.Name, verdict)
}

// match is the destination match of a lookup in a set of prefixes of length bits.
func (l *Layout) match(bits int) string {
	match := daddr(l.Family)
	if bits < maxAddr(l.Family).BitLen() {
		mask := netip.PrefixFrom(maxAddr(l.Family), bits).Masked().Addr()
		match += " & " + mask.String()
	}
	return match
}

// outboundRule is an outbound rule counting in the named counter and going to chain, behind the
// gate set when one is named (see transition).
func outboundRule(fam policy.Family, counter, chain, gate string) string {
	rule := fmt.Sprintf("counter name %q goto %s", counter, chain)
	if gate != "" {
		rule = fmt.Sprintf("%s @%s %s", (&Layout{Family: fam}).match(0), gate, rule)
	}
	return rule
}

// outbound is the global outbound rule, behind the gate set when one is named.
func (l *Layout) outbound(gate string) string {
	return outboundRule(l.Family, CounterOutbound, l.outboundChain, gate)
}

// The gate sets of the outbound rule while an apply changes it: the old rule's holds the
// family's zero address (the key of every destination masked to length 0) until the element
// batch deletes it, the new rule's gets it in the batch.
const (
	gateOld = "outbound-old"
	gateNew = "outbound-new"
)

// outboundChanges says whether the outbound rule differs between the layouts (present in one
// only, or going to another chain).
func outboundChanges(old, l *Layout) bool {
	return (old.Outbound >= 0) != (l.Outbound >= 0) || old.outboundChain != l.outboundChain
}

// transition is the base chain while an apply takes the table from layout old to l (see
// phased): the lookups of the sets of both, the masquerade phase's first, and the outbound rule
// or, when it changes, the old one and the new one, each behind its gate set. Until the element
// batch, the sets only l has are empty and the new gate closed, so the chain decides as old's;
// after it, the sets only old has are empty and the old gate closed, so it decides as l's.
func transition(old, l *Layout) []string {
	out := []string{"fib daddr type local return"}
	if len(l.SourceMap) > 0 {
		out = append(out, l.sourceLookup()) // the same in old (see phased)
	}
	for _, action := range []policy.Action{policy.Masquerade, policy.Return} {
		for _, s := range l.Sets {
			if s.Action == action && s.Source == "" {
				out = append(out, l.lookup(s))
			}
		}
		for _, s := range old.Sets {
			if s.Action == action && s.Source == "" && !slices.ContainsFunc(l.Sets, func(n Set) bool { return n.Name == s.Name }) {
				out = append(out, old.lookup(s))
			}
		}
	}
	switch {
	case !outboundChanges(old, l):
		if l.Outbound >= 0 {
			out = append(out, l.outbound(""))
		}
	default:
		if old.Outbound >= 0 {
			out = append(out, old.outbound(gateOld))
		}
		if l.Outbound >= 0 {
			out = append(out, l.outbound(gateNew))
		}
	}
	return out
}

func maxAddr(fam policy.Family) netip.Addr {
	if fam == policy.IPv6 {
		return netip.AddrFrom16([16]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	}
	return netip.AddrFrom4([4]byte{0xff, 0xff, 0xff, 0xff})
}

// masqRules are the rules of the chain that masquerades to addr (invalid: the uplink's address,
// the masquerade chain; else an SNAT chain): MASQUERADE's --random-fully and --to-ports as the
// iptables backend renders them. Several --to-ports ranges are chosen at random, each with its
// share of the ports not in an earlier range, so every port is equally likely; protocols
// without ports are masqueraded without the ranges.
func masqRules(p *policy.Policy, addr netip.Addr) []string {
	flags := ""
	if p.RandomFully {
		flags = " fully-random"
	}
	// to is the statement, with the ports when given.
	to := func(ports string) string {
		switch {
		case !addr.IsValid() && ports == "":
			return "masquerade"
		case !addr.IsValid():
			return "masquerade to :" + ports
		case ports == "":
			return "snat to " + addr.String()
		case addr.Is6():
			return "snat to [" + addr.String() + "]:" + ports
		}
		return "snat to " + addr.String() + ":" + ports
	}
	var out []string
	left := p.ToPorts.Size()
	for j, ports := range p.ToPorts {
		pick := ""
		if j < len(p.ToPorts)-1 {
			pick = fmt.Sprintf(" numgen random mod %d < %d", left, ports.Size())
		}
		out = append(out, fmt.Sprintf("meta l4proto %s%s %s%s", toPortsProtocols, pick, to(ports.String()), flags))
		left -= ports.Size()
	}
	return append(out, to("")+flags)
}
