// Package policytest draws random configurations and the destinations to probe them with, for
// the differential tests that hold every renderer of a policy to policy.Decide.
package policytest

import (
	"encoding/binary"
	"math/rand/v2"
	"net/netip"
	"slices"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Config draws a configuration of both families with nonMasq nonMasqueradeCIDRs and up to ten
// masqueradeCIDRs (more where one of the cases below adds some): nested, overlapping and
// duplicate prefixes, some in both lists, some over the link-local ranges, now and then the
// whole address space. cidrLimit admits the list; resyncInterval is left zero.
func Config(rng *rand.Rand, nonMasq int) config.Config {
	cfg := config.Config{
		MasqOutBound: rng.IntN(3) != 0, MasqOutBoundIPv6: rng.IntN(3) != 0,
		MasqLinkLocal: rng.IntN(2) == 0, MasqLinkLocalIPv6: rng.IntN(2) == 0,
	}
	var pool []netip.Prefix
	pick := func() netip.Prefix {
		fam := policy.Families()[rng.IntN(2)]
		if len(pool) > 0 && rng.IntN(3) == 0 {
			if p := pool[rng.IntN(len(pool))]; policy.FamilyOf(p.Addr()) == fam {
				if rng.IntN(3) == 0 || p.Bits() == 0 {
					return p // a duplicate
				}
				// Nested inside or around an existing prefix.
				q, _ := AddrIn(rng, p).Prefix(rng.IntN(p.Addr().BitLen() + 1))
				return q
			}
		}
		p := Prefix(rng, fam)
		pool = append(pool, p)
		return p
	}
	for range rng.IntN(11) {
		cfg.MasqueradeCIDRs = append(cfg.MasqueradeCIDRs, config.MasqueradeCIDR{CIDR: pick()})
	}
	for range nonMasq {
		cfg.NonMasqueradeCIDRs = append(cfg.NonMasqueradeCIDRs, pick())
	}
	if rng.IntN(3) == 0 {
		// The same prefix in both lists: the masquerade rule comes first and wins.
		p := pick()
		cfg.MasqueradeCIDRs = append(cfg.MasqueradeCIDRs, config.MasqueradeCIDR{CIDR: p})
		cfg.NonMasqueradeCIDRs = append(cfg.NonMasqueradeCIDRs, p)
	}
	if rng.IntN(3) == 0 {
		// Over the link-local rules, which sit between the two lists.
		cfg.MasqueradeCIDRs = append(cfg.MasqueradeCIDRs, config.MasqueradeCIDR{CIDR: netip.MustParsePrefix("169.254.169.254/32")})
		cfg.NonMasqueradeCIDRs = append(cfg.NonMasqueradeCIDRs, netip.MustParsePrefix("fe80::/64"))
	}
	if rng.IntN(8) == 0 {
		cfg.NonMasqueradeCIDRs = append(cfg.NonMasqueradeCIDRs, netip.MustParsePrefix("0.0.0.0/0"))
	}
	if rng.IntN(8) == 0 {
		cfg.MasqueradeCIDRs = append(cfg.MasqueradeCIDRs, config.MasqueradeCIDR{CIDR: netip.MustParsePrefix("::/0")})
	}
	cfg.CIDRLimit = len(cfg.NonMasqueradeCIDRs)
	return cfg
}

// WithAddresses gives cfg masquerade addresses: now and then a family's masqueradeAddress, and
// to some masqueradeCIDRs entries one of their own, drawn from a few per family, so that rules
// share addresses. A CIDR listed twice keeps one address (as the configuration requires).
func WithAddresses(rng *rand.Rand, cfg config.Config) config.Config {
	pool := map[bool][]netip.Addr{
		true:  {netip.MustParseAddr("192.0.2.11"), netip.MustParseAddr("192.0.2.12"), netip.MustParseAddr("198.51.100.13")},
		false: {netip.MustParseAddr("2001:db8::11"), netip.MustParseAddr("2001:db8::12")},
	}
	draw := func(v4 bool) netip.Addr { return pool[v4][rng.IntN(len(pool[v4]))] }
	if rng.IntN(2) == 0 {
		cfg.MasqueradeAddress = draw(true)
	}
	if rng.IntN(2) == 0 {
		cfg.MasqueradeAddressIPv6 = draw(false)
	}
	cfg.MasqueradeCIDRs = slices.Clone(cfg.MasqueradeCIDRs)
	chosen := map[netip.Prefix]netip.Addr{}
	for i, m := range cfg.MasqueradeCIDRs {
		a, seen := chosen[m.CIDR]
		if !seen && rng.IntN(2) == 0 {
			a = draw(m.CIDR.Addr().Is4())
		}
		chosen[m.CIDR] = a
		cfg.MasqueradeCIDRs[i].Address = a
	}
	return cfg
}

// Prefix draws a prefix of a family, half the time in a cluster (10.0.0.0/8, 2001::/16) so that
// the prefixes drawn nest and overlap.
func Prefix(rng *rand.Rand, fam policy.Family) netip.Prefix {
	var a netip.Addr
	var bits int
	if fam == policy.IPv6 {
		var b [16]byte
		for i := range b {
			b[i] = byte(rng.UintN(256))
		}
		if rng.IntN(2) == 0 {
			b[0], b[1] = 0x20, 0x01
		}
		a, bits = netip.AddrFrom16(b), 8+rng.IntN(121)
	} else {
		var b [4]byte
		binary.BigEndian.PutUint32(b[:], rng.Uint32())
		if rng.IntN(2) == 0 {
			b[0] = 10
		}
		a, bits = netip.AddrFrom4(b), 4+rng.IntN(29)
	}
	p, _ := a.Prefix(bits)
	return p
}

// AddrIn draws an address inside p.
func AddrIn(rng *rand.Rand, p netip.Prefix) netip.Addr {
	b := p.Addr().AsSlice()
	for i := range b {
		r := byte(rng.UintN(256))
		switch keep := p.Bits() - 8*i; { // bits of this byte that belong to the prefix
		case keep >= 8:
		case keep <= 0:
			b[i] = r
		default:
			mask := byte(0xff << (8 - keep))
			b[i] = b[i]&mask | r&^mask
		}
	}
	a, _ := netip.AddrFromSlice(b)
	return a
}

// LastAddr is the highest address of a prefix.
func LastAddr(p netip.Prefix) netip.Addr {
	b := p.Addr().AsSlice()
	for i := range b {
		switch keep := p.Bits() - 8*i; {
		case keep >= 8:
		case keep <= 0:
			b[i] = 0xff
		default:
			b[i] |= 0xff >> keep
		}
	}
	a, _ := netip.AddrFromSlice(b)
	return a
}

// Destination draws an address of a family to probe p with, aimed at the rules: inside a
// random rule's prefix, at its first or last address, or anywhere. For a family p does not
// enable, it aims at the rules the defaults would have.
func Destination(rng *rand.Rand, p *policy.Policy, fam policy.Family) netip.Addr {
	rules := p.Rules(fam)
	if !p.Enabled(fam) {
		rules = policy.Compile(config.Default(config.Options{EnableIPv6: true}), policy.Options{EnableIPv6: true}).Rules(fam)
	}
	prefixes := make([]netip.Prefix, len(rules))
	for i, r := range rules {
		prefixes[i] = r.Prefix
	}
	return aimAt(rng, prefixes, fam, 7)
}

// aimAt draws an address of a family: tenths times in ten (when there are prefixes) inside a
// random one of prefixes, at its first or last address; else anywhere.
func aimAt(rng *rand.Rand, prefixes []netip.Prefix, fam policy.Family, tenths int) netip.Addr {
	if len(prefixes) > 0 && rng.IntN(10) < tenths {
		pr := prefixes[rng.IntN(len(prefixes))]
		switch rng.IntN(6) {
		case 0:
			return pr.Addr()
		case 1:
			return LastAddr(pr)
		default:
			return AddrIn(rng, pr)
		}
	}
	if fam == policy.IPv4 {
		return AddrIn(rng, netip.PrefixFrom(netip.IPv4Unspecified(), 0))
	}
	return AddrIn(rng, netip.PrefixFrom(netip.IPv6Unspecified(), 0))
}

// WithSourceRules gives cfg up to n source rules, with options for Compile that give the
// selector rules their pods. Their source CIDRs nest in and overlap each other (and some are
// repeated across rules), now and then a rule selects pods (by a selector that matches
// everything; the pods are drawn from the rules' CIDRs and beyond) and now and then holds the
// whole address space; each rule sets a random subset of the rule keys to values drawn as
// Config draws them.
func WithSourceRules(rng *rand.Rand, cfg config.Config, n int, opts policy.Options) (config.Config, policy.Options) {
	cfg.SourceRules = nil
	opts.Pods = map[string][]netip.Addr{}
	var pool []netip.Prefix
	for i := range rng.IntN(n + 1) {
		r := config.SourceRule{Name: "r" + string(rune('a'+i%26)) + string(rune('0'+i/26%10)) + string(rune('a'+i/260))}
		for range 1 + rng.IntN(3) {
			fam := policy.IPv4
			if opts.EnableIPv6 && rng.IntN(3) == 0 {
				fam = policy.IPv6
			}
			var p netip.Prefix
			switch {
			case len(pool) > 0 && rng.IntN(3) == 0:
				q := pool[rng.IntN(len(pool))]
				if rng.IntN(2) == 0 {
					p = q
				} else {
					p, _ = AddrIn(rng, q).Prefix(min(q.Addr().BitLen(), q.Bits()+rng.IntN(9)))
				}
			case rng.IntN(12) == 0:
				p = netip.PrefixFrom(netip.IPv4Unspecified(), 0)
				if fam == policy.IPv6 {
					p = netip.PrefixFrom(netip.IPv6Unspecified(), 0)
				}
			default:
				p = Prefix(rng, fam)
			}
			pool = append(pool, p)
			r.CIDRs = append(r.CIDRs, p)
		}
		if rng.IntN(4) == 0 {
			r.PodSelector = &metav1.LabelSelector{}
			for range 1 + rng.IntN(4) {
				var a netip.Addr
				if rng.IntN(2) == 0 {
					a = AddrIn(rng, pool[rng.IntN(len(pool))])
				} else {
					a = AddrIn(rng, Prefix(rng, policy.IPv4))
				}
				opts.Pods[r.Name] = append(opts.Pods[r.Name], a)
			}
			if rng.IntN(2) == 0 {
				r.CIDRs = nil
			}
		}
		own := Config(rng, rng.IntN(6))
		if !opts.EnableIPv6 {
			own = v4Only(own)
		}
		own = WithAddresses(rng, own)
		for _, key := range config.RuleKeys {
			if rng.IntN(2) == 0 {
				r.Set = append(r.Set, key)
			}
		}
		// As the configuration requires: no rule asks for the uplink's primary address over a
		// global masqueradeAddress.
		r.Set = slices.DeleteFunc(r.Set, func(k string) bool {
			return k == config.KeyMasqueradeAddress && !own.MasqueradeAddress.IsValid() && cfg.MasqueradeAddress.IsValid() ||
				k == config.KeyMasqueradeAddressIPv6 && !own.MasqueradeAddressIPv6.IsValid() && cfg.MasqueradeAddressIPv6.IsValid()
		})
		r.Own = own
		cfg.SourceRules = append(cfg.SourceRules, r)
	}
	return cfg, opts
}

// v4Only drops the IPv6 entries of a config's lists.
func v4Only(cfg config.Config) config.Config {
	cfg.NonMasqueradeCIDRs = slices.DeleteFunc(slices.Clone(cfg.NonMasqueradeCIDRs), func(p netip.Prefix) bool { return p.Addr().Is6() })
	cfg.MasqueradeCIDRs = slices.DeleteFunc(slices.Clone(cfg.MasqueradeCIDRs), func(m config.MasqueradeCIDR) bool { return m.CIDR.Addr().Is6() })
	cfg.CIDRLimit = len(cfg.NonMasqueradeCIDRs)
	return cfg
}

// Source draws a source address of a family to probe p with, aimed at the source rules: inside
// a random rule's source prefix, at its first or last address, a selected pod, or anywhere.
func Source(rng *rand.Rand, p *policy.Policy, fam policy.Family) netip.Addr {
	var prefixes []netip.Prefix
	for _, s := range p.Sources {
		prefixes = append(prefixes, s.Prefixes(fam)...)
	}
	return aimAt(rng, prefixes, fam, 8)
}
