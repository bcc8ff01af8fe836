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
package nftables

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"

	"sigs.k8s.io/knftables"

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
	// CounterOutbound counts the outbound rule.
	CounterOutbound = "outbound"
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
	// Rule is the index, in its family's rule list, of the rule the piece belongs to.
	Rule int
}

// Set is one set of the layout: the pieces of one phase and prefix length, and in the
// masquerade phase of one masquerade address (invalid: the uplink's).
type Set struct {
	Name    string
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

// Layout is a family's policy as the table holds it.
type Layout struct {
	Family policy.Family
	// Sets in lookup order: the MASQUERADE phase's by prefix length, longest first, then the
	// RETURN phase's.
	Sets []Set
	// Elements by set, in the order of Sets, each set's in rule order.
	Elements []Element
	// Outbound is the outbound rule's index in the rule list, -1 without one; outboundChain
	// the chain it goes to.
	Outbound      int
	outboundChain string
	// Pieces counts, per rule, its elements: 0 for a rule that earlier rules of its phase cover
	// entirely (it can never match, as on iptables).
	Pieces []int
	// Postrouting and Masq are the chains' rules, as nft statements.
	Postrouting, Masq []string
	// SNAT are the chains of the masquerade addresses, in the order of their names.
	SNAT []SNATChain
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

// Comment is the comment of a rule's elements: its origin and prefix.
func Comment(r policy.Rule) string { return string(r.Origin) + " " + r.Prefix.String() }

// ParseComment reads Comment back; ok is false for a comment the agent did not write.
func ParseComment(s string) (origin policy.Origin, prefix netip.Prefix, ok bool) {
	o, p, found := strings.Cut(s, " ")
	if !found {
		return "", netip.Prefix{}, false
	}
	prefix, err := netip.ParsePrefix(p)
	if err != nil {
		return "", netip.Prefix{}, false
	}
	return policy.Origin(o), prefix, true
}

// NewLayout lays out a family's rules (the family must be enabled in p).
func NewLayout(p *policy.Policy, fam policy.Family) *Layout {
	rules := p.Rules(fam)
	l := &Layout{Family: fam, Outbound: -1, Pieces: make([]int, len(rules))}
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
				l.Outbound, l.outboundChain = i, chain
				continue
			}
			for _, piece := range covered.claim(r.Prefix.Masked()) {
				id := setID{piece.Bits(), r.Address}
				name, ok := names[id]
				if !ok {
					name = SetName(action, id.bits, id.addr)
					names[id] = name
					lengths[id.bits] = append(lengths[id.bits], id.addr)
				}
				bySet[name] = append(bySet[name], Element{Set: name, Key: piece.Addr(), Rule: i})
				l.Pieces[i]++
			}
		}
		for _, bits := range slices.Backward(slices.Sorted(maps.Keys(lengths))) {
			for _, addr := range lengths[bits] {
				s := Set{Name: SetName(action, bits, addr), Action: action, Bits: bits, Address: addr}
				l.Sets = append(l.Sets, s)
				l.Elements = append(l.Elements, bySet[s.Name]...)
			}
		}
	}
	l.Postrouting = l.postroutingRules()
	l.Masq = masqRules(p, netip.Addr{})
	for i := range l.SNAT {
		l.SNAT[i].Rules = masqRules(p, l.SNAT[i].Address)
	}
	return l
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
// (iptables' `addrtype ! --dst-type LOCAL` on the jump), then the lookups, then the outbound rule.
func (l *Layout) postroutingRules() []string {
	out := []string{"fib daddr type local return"}
	for _, s := range l.Sets {
		out = append(out, l.lookup(s))
	}
	if l.Outbound >= 0 {
		out = append(out, l.outbound(""))
	}
	return out
}

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

// outbound is the outbound rule, behind the gate set when one is named (see transition).
func (l *Layout) outbound(gate string) string {
	rule := fmt.Sprintf("counter name %q goto %s", CounterOutbound, l.outboundChain)
	if gate != "" {
		rule = fmt.Sprintf("%s @%s %s", l.match(0), gate, rule)
	}
	return rule
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
	for _, action := range []policy.Action{policy.Masquerade, policy.Return} {
		for _, s := range l.Sets {
			if s.Action == action {
				out = append(out, l.lookup(s))
			}
		}
		for _, s := range old.Sets {
			if s.Action == action && !slices.ContainsFunc(l.Sets, func(n Set) bool { return n.Name == s.Name }) {
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
