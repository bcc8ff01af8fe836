// Package policy compiles a configuration into the ordered rule list that every backend renders.
//
// The list per address family is exactly the order of the IP-MASQ-AGENT chain:
//
//  1. each masqueradeCIDRs entry          -> MASQUERADE
//  2. link-local, unless masqLinkLocal     -> RETURN
//  3. each nonMasqueradeCIDRs entry        -> RETURN
//  4. everything else, if masqOutBound     -> MASQUERADE
//
// First match wins; a packet that matches nothing leaves the chain unchanged (RETURN).
// Decide is the reference semantics every backend is tested against.
package policy

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
)

// Action is what a rule does with a matching packet.
type Action uint8

const (
	// Return leaves the packet's source address alone.
	Return Action = iota
	// Masquerade rewrites the source to the node's address.
	Masquerade
)

func (a Action) String() string {
	if a == Masquerade {
		return "MASQUERADE"
	}
	return "RETURN"
}

// Family is an address family.
type Family uint8

const (
	IPv4 Family = 4
	IPv6 Family = 6
)

// Families returns the address families, in the order the agent handles them: IPv4, then IPv6.
// Each call returns a new slice.
func Families() []Family { return []Family{IPv4, IPv6} }

func (f Family) String() string {
	if f == IPv6 {
		return "ipv6"
	}
	return "ipv4"
}

// FamilyOf returns the family of an address; IPv4-mapped IPv6 addresses count as IPv4.
func FamilyOf(a netip.Addr) Family {
	if a.Unmap().Is4() {
		return IPv4
	}
	return IPv6
}

// Origin says which part of the configuration put a rule in the list.
type Origin string

const (
	OriginMasqueradeCIDRs    Origin = config.KeyMasqueradeCIDRs
	OriginLinkLocal          Origin = "link-local"
	OriginNonMasqueradeCIDRs Origin = config.KeyNonMasqueradeCIDRs
	OriginOutbound           Origin = "outbound"
)

// Comment texts of the chain, as the seeds show them.
const (
	CommentSpecificMasquerade = "ip-masq-agent: specific outbound traffic is subject to MASQUERADE"
	CommentNonMasquerade      = "ip-masq-agent: local traffic is not subject to MASQUERADE"
	CommentOutbound           = "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)"
)

// Link-local ranges (RFC 3927, RFC 4291).
var (
	LinkLocalIPv4 = netip.MustParsePrefix("169.254.0.0/16")
	LinkLocalIPv6 = netip.MustParsePrefix("fe80::/10")
)

// Rule is one entry of the chain. Its number, as `iptables -L --line-numbers` shows it, is its
// 1-based position in its family's list.
type Rule struct {
	// Set is the name of the source rule whose list holds the rule; empty in the global list.
	Set    string
	Family Family
	// Prefix is the destination; 0.0.0.0/0 or ::/0 for the outbound rule.
	Prefix netip.Prefix
	Action Action
	Origin Origin
	// Entry is the index within the config key the rule came from, or -1.
	Entry   int
	Comment string
	// Address is the source address a masquerade rule rewrites to: its masqueradeCIDRs entry's
	// address, else the family's masqueradeAddress; invalid for the uplink's primary address
	// (and for RETURN rules).
	Address netip.Addr
}

// Source describes where the rule came from, e.g. "nonMasqueradeCIDRs[2]" or "masqOutBound: true".
func (r Rule) Source() string {
	in := ""
	if r.Set != "" {
		in = fmt.Sprintf("%s[%s].", config.KeySourceRules, r.Set)
	}
	switch r.Origin {
	case OriginMasqueradeCIDRs, OriginNonMasqueradeCIDRs:
		return fmt.Sprintf("%s%s[%d]", in, r.Origin, r.Entry)
	case OriginLinkLocal:
		return fmt.Sprintf("link-local (%s%s: false)", in, linkLocalKey(r.Family))
	case OriginOutbound:
		return in + outboundKey(r.Family) + ": true"
	}
	return in + string(r.Origin)
}

// linkLocalKey and outboundKey are the config keys that decide a family's link-local and
// outbound rules.
func linkLocalKey(fam Family) string {
	if fam == IPv6 {
		return config.KeyMasqLinkLocalIPv6
	}
	return config.KeyMasqLinkLocal
}

func outboundKey(fam Family) string {
	if fam == IPv6 {
		return config.KeyMasqOutBoundIPv6
	}
	return config.KeyMasqOutBound
}

// Options are the flags that shape the policy beyond the config file.
type Options struct {
	EnableIPv6  bool
	RandomFully bool
	// ToPorts restricts masquerade source ports; empty means the backend's default.
	ToPorts PortRanges
	// Pods are, by source rule name, the addresses of this node's pods that the rule's
	// selectors choose (see SourceRule.Pods).
	Pods map[string][]netip.Addr
}

// Policy is the compiled rule list of each family plus the NAT settings.
type Policy struct {
	IPv4 []Rule
	// IPv6 is nil when IPv6 is not enabled (the agent then leaves IPv6 traffic alone), and a
	// list, maybe empty, when it is (see Enabled).
	IPv6        []Rule
	RandomFully bool
	ToPorts     PortRanges
	// MasqueradeAddress and MasqueradeAddressIPv6 are the configured masquerade addresses of
	// the families (invalid: the uplink's primary address): the source of masquerade rules that
	// name none of their own (see Rule.Address), and the node's own source where the datapath
	// needs one (BPF: host flows).
	MasqueradeAddress, MasqueradeAddressIPv6 netip.Addr
	// Sources are the source rules, in order: the first whose sources hold a packet's source
	// decides it by its own lists (see DecideFrom); a source none holds is decided by the lists
	// above.
	Sources []SourceRule
}

// Address is the family's masquerade address (MasqueradeAddress or MasqueradeAddressIPv6).
func (p *Policy) Address(fam Family) netip.Addr {
	if fam == IPv6 {
		return p.MasqueradeAddressIPv6
	}
	return p.MasqueradeAddress
}

// AddressUse is a masquerade address of a policy and the part of the configuration that names
// it ("masqueradeAddress", "masqueradeCIDRs[2]").
type AddressUse struct {
	Addr netip.Addr
	From string
	// To are the destinations whose traffic leaves from it, by which the device it must be on
	// is found: the family's default (0.0.0.0/0, ::/0) for a masqueradeAddress, which every
	// masquerade rule without an address of its own uses; an entry's CIDR for its own address.
	To []netip.Prefix
}

func (u AddressUse) String() string { return u.From + " " + u.Addr.String() }

// Addresses lists the policy's masquerade addresses, each once with the first part of the
// configuration naming it: the families' masqueradeAddress (used by a rule or not), then the
// masqueradeCIDRs entries' in rule order. None when traffic leaves from the uplinks' primary
// addresses only.
func (p *Policy) Addresses() []AddressUse {
	var out []AddressUse
	add := func(a netip.Addr, from string, to netip.Prefix) {
		if !a.IsValid() {
			return
		}
		i := slices.IndexFunc(out, func(u AddressUse) bool { return u.Addr == a })
		if i < 0 {
			out = append(out, AddressUse{Addr: a, From: from})
			i = len(out) - 1
		}
		if !slices.Contains(out[i].To, to) {
			out[i].To = append(out[i].To, to)
		}
	}
	add(p.MasqueradeAddress, config.KeyMasqueradeAddress, netip.PrefixFrom(netip.IPv4Unspecified(), 0))
	add(p.MasqueradeAddressIPv6, config.KeyMasqueradeAddressIPv6, netip.PrefixFrom(netip.IPv6Unspecified(), 0))
	for _, fam := range Families() {
		for _, r := range p.Rules(fam) {
			if r.Address != p.Address(fam) {
				add(r.Address, r.Source(), r.Prefix)
			}
		}
	}
	for _, s := range p.Sources {
		for _, u := range s.Policy.Addresses() {
			for _, to := range u.To {
				from := u.From
				if !strings.HasPrefix(from, config.KeySourceRules) {
					from = fmt.Sprintf("%s[%s].%s", config.KeySourceRules, s.Name, from)
				}
				add(u.Addr, from, to)
			}
		}
	}
	return out
}

// Enabled reports whether the policy manages a family's traffic: IPv4 always, IPv6 with
// --enable-ipv6.
func (p *Policy) Enabled(fam Family) bool { return fam == IPv4 || p.IPv6 != nil }

// Equal reports whether p and q decide and render alike: the same rules, in order, and the same
// settings. A nil policy equals only nil.
func (p *Policy) Equal(q *Policy) bool {
	if p == nil || q == nil {
		return p == q
	}
	return p == q || (p.Enabled(IPv6) == q.Enabled(IPv6) && p.RandomFully == q.RandomFully &&
		slices.Equal(p.IPv4, q.IPv4) && slices.Equal(p.IPv6, q.IPv6) && slices.Equal(p.ToPorts, q.ToPorts) &&
		p.MasqueradeAddress == q.MasqueradeAddress && p.MasqueradeAddressIPv6 == q.MasqueradeAddressIPv6 &&
		slices.EqualFunc(p.Sources, q.Sources, SourceRule.equal))
}

// Compile builds the rule lists from a validated configuration.
func Compile(cfg config.Config, opts Options) *Policy {
	p := &Policy{RandomFully: opts.RandomFully, ToPorts: opts.ToPorts, MasqueradeAddress: cfg.MasqueradeAddress}
	p.IPv4 = compileFamily(cfg, IPv4, cfg.MasqueradeAddress)
	if opts.EnableIPv6 {
		p.MasqueradeAddressIPv6 = cfg.MasqueradeAddressIPv6
		p.IPv6 = compileFamily(cfg, IPv6, cfg.MasqueradeAddressIPv6)
	}
	for i, r := range cfg.SourceRules {
		sub := Compile(r.Effective(cfg), Options{EnableIPv6: opts.EnableIPv6, RandomFully: opts.RandomFully, ToPorts: opts.ToPorts})
		for _, fam := range Families() {
			for j := range sub.Rules(fam) {
				sub.Rules(fam)[j].Set = r.Name
			}
		}
		sr := SourceRule{Name: r.Name, Index: i, CIDRs: r.CIDRs, Selects: r.Selects(), Policy: sub, Config: r}
		if sr.Selects {
			sr.Pods = slices.Clone(opts.Pods[r.Name])
			slices.SortFunc(sr.Pods, netip.Addr.Compare)
			sr.Pods = slices.Compact(sr.Pods)
		}
		p.Sources = append(p.Sources, sr)
	}
	return p
}

// compileFamily returns a list that is never nil, so that an enabled family without rules is
// told from a disabled one. snat is the family's masquerade address.
func compileFamily(cfg config.Config, fam Family, snat netip.Addr) []Rule {
	// Sized once: a 100k-rule list grown by append is copied a dozen times.
	n := 2
	for _, c := range cfg.MasqueradeCIDRs {
		if FamilyOf(c.CIDR.Addr()) == fam {
			n++
		}
	}
	for _, c := range cfg.NonMasqueradeCIDRs {
		if FamilyOf(c.Addr()) == fam {
			n++
		}
	}
	rules := make([]Rule, 0, n)
	add := func(prefix netip.Prefix, action Action, origin Origin, entry int, comment string) *Rule {
		rules = append(rules, Rule{Family: fam, Prefix: prefix, Action: action, Origin: origin, Entry: entry,
			Comment: comment})
		return &rules[len(rules)-1]
	}
	for i, c := range cfg.MasqueradeCIDRs {
		if FamilyOf(c.CIDR.Addr()) == fam {
			r := add(c.CIDR, Masquerade, OriginMasqueradeCIDRs, i, CommentSpecificMasquerade)
			if r.Address = c.Address; !r.Address.IsValid() {
				r.Address = snat
			}
		}
	}
	linkLocal, masqLinkLocal := LinkLocalIPv4, cfg.MasqLinkLocal
	if fam == IPv6 {
		linkLocal, masqLinkLocal = LinkLocalIPv6, cfg.MasqLinkLocalIPv6
	}
	if !masqLinkLocal {
		add(linkLocal, Return, OriginLinkLocal, -1, CommentNonMasquerade)
	}
	for i, c := range cfg.NonMasqueradeCIDRs {
		if FamilyOf(c.Addr()) == fam {
			add(c, Return, OriginNonMasqueradeCIDRs, i, CommentNonMasquerade)
		}
	}
	outbound := cfg.MasqOutBound
	all := netip.PrefixFrom(netip.IPv4Unspecified(), 0)
	if fam == IPv6 {
		outbound = cfg.MasqOutBoundIPv6
		all = netip.PrefixFrom(netip.IPv6Unspecified(), 0)
	}
	if outbound {
		add(all, Masquerade, OriginOutbound, -1, CommentOutbound).Address = snat
	}
	return rules
}

// Rules returns the rule list of a family (nil when the family is not enabled).
func (p *Policy) Rules(fam Family) []Rule {
	if fam == IPv6 {
		return p.IPv6
	}
	return p.IPv4
}

// Verdict is the outcome of Decide.
type Verdict struct {
	Action Action
	// Rule is the rule that decided, or nil when no rule matched (the end of the chain); Number
	// is its 1-based position in its family's list, 0 without a rule.
	Rule   *Rule
	Number int
	// Reason explains a verdict that no rule gave.
	Reason string
	// SourceRule is the source rule whose lists decided (DecideFrom), or nil: the global ones.
	SourceRule *SourceRule
}

// Decide returns what the chain does with a packet to addr from a source that no source rule
// holds: first match over the rule list.
func (p *Policy) Decide(addr netip.Addr) Verdict {
	addr = addr.Unmap()
	fam := FamilyOf(addr)
	if !p.Enabled(fam) {
		return Verdict{Action: Return, Reason: "IPv6 is not enabled (--enable-ipv6): IPv6 traffic is left alone"}
	}
	rules := p.Rules(fam)
	for i := range rules {
		if rules[i].Prefix.Contains(addr) {
			return Verdict{Action: rules[i].Action, Rule: &rules[i], Number: i + 1}
		}
	}
	return Verdict{Action: Return, Reason: fmt.Sprintf("no rule matched and %s is false: end of chain", outboundKey(fam))}
}

// MayMasquerade tells whether the policy masquerades some address of dst: false only when the
// chain keeps every one of them (a RETURN rule that no earlier MASQUERADE rule overlaps covers
// dst whole, or none matches). Conservative where RETURN rules cover dst only together: true.
// A route to dst needs the datapath on its device only when this is true.
func (p *Policy) MayMasquerade(dst netip.Prefix) bool {
	dst = dst.Masked()
	if !dst.IsValid() || !p.Enabled(FamilyOf(dst.Addr())) {
		return false
	}
	for _, s := range p.Sources {
		if s.Policy.MayMasquerade(dst) {
			return true
		}
	}
	for _, r := range p.Rules(FamilyOf(dst.Addr())) {
		switch {
		case !r.Prefix.Overlaps(dst):
		case r.Action == Masquerade:
			return true
		case r.Prefix.Bits() <= dst.Bits():
			return false // this RETURN rule holds every address of dst
		}
	}
	return false // the end of the chain keeps them
}

// OutboundAction is what happens to a packet that no CIDR rule matched.
func (p *Policy) OutboundAction(fam Family) (Action, *Rule) {
	rules := p.Rules(fam)
	if n := len(rules); n > 0 && rules[n-1].Origin == OriginOutbound {
		return Masquerade, &rules[n-1]
	}
	return Return, nil
}
