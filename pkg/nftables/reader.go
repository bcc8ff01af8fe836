package nftables

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// countRules sums a table's element counters per rule of the layout l of p, and returns the
// elements no rule of it explains, grouped by their comments, as counters of rule 0. A rule
// with an element missing (or with another comment) is left out; the outbound rule counts in
// the outbound counter. A masquerade rule's address is what the table SNATs its sets' (or the
// outbound rule's) packets to.
func countRules(p *policy.Policy, l *Layout, st *TableState) (counters, rest []datapath.RuleCounter) {
	if st == nil {
		return nil, nil
	}
	rules := p.Rules(l.Family)
	sums := make([]Count, len(rules))
	found := make([]int, len(rules))
	sets := make([]string, len(rules)) // a set of each rule's elements
	explained := map[string]map[netip.Addr]bool{}
	for _, e := range l.Elements {
		live, ok := st.Sets[e.Set].elem(e.Key)
		if !ok || live.Comment != Comment(rules[e.Rule]) {
			continue
		}
		sums[e.Rule].Packets += live.Count.Packets
		sums[e.Rule].Bytes += live.Count.Bytes
		found[e.Rule]++
		sets[e.Rule] = e.Set
		if explained[e.Set] == nil {
			explained[e.Set] = map[netip.Addr]bool{}
		}
		explained[e.Set][e.Key] = true
	}
	for i, r := range rules {
		c := datapath.RuleCounter{Family: l.Family, Rule: i + 1, Prefix: r.Prefix, Action: r.Action, Origin: r.Origin, Entry: r.Entry}
		if i == l.Outbound {
			if st.Outbound == nil {
				continue
			}
			c.Packets, c.Bytes = st.Outbound.Packets, st.Outbound.Bytes
			c.Address = st.SNAT[CounterOutbound]
		} else {
			if found[i] != l.Pieces[i] {
				continue
			}
			c.Packets, c.Bytes = sums[i].Packets, sums[i].Bytes
			c.Address = st.SNAT[sets[i]]
		}
		counters = append(counters, c)
	}
	return counters, unexplained(l.Family, st, explained, l.Outbound >= 0)
}

func (s *SetState) elem(key netip.Addr) (ElementState, bool) {
	if s == nil {
		return ElementState{}, false
	}
	e, ok := s.Elements[key]
	return e, ok
}

// unexplained groups the elements not in explained by comment (an element whose comment the
// agent did not write is a group of its own), and adds the outbound counter when no rule
// explains it; each with the address its packets are SNATed to.
func unexplained(fam policy.Family, st *TableState, explained map[string]map[netip.Addr]bool, outbound bool) []datapath.RuleCounter {
	var out []datapath.RuleCounter
	index := map[string]int{}
	for _, name := range slices.Sorted(maps.Keys(st.Sets)) {
		action, bits, ok := parseSetName(name)
		for _, key := range slices.SortedFunc(maps.Keys(st.Sets[name].Elements), netip.Addr.Compare) {
			if explained[name][key] {
				continue
			}
			e := st.Sets[name].Elements[key]
			c := datapath.RuleCounter{Family: fam, Entry: -1, Action: action, Prefix: netip.PrefixFrom(key, bits), Address: st.SNAT[name]}
			if !ok {
				c.Prefix = netip.PrefixFrom(key, key.BitLen())
			}
			group := name + " " + key.String()
			if origin, prefix, ok := ParseComment(e.Comment); ok {
				c.Origin, c.Prefix, group = origin, prefix, name+" "+e.Comment
			}
			i, seen := index[group]
			if !seen {
				i = len(out)
				index[group] = i
				out = append(out, c)
			}
			out[i].Packets += e.Count.Packets
			out[i].Bytes += e.Count.Bytes
		}
	}
	if st.Outbound != nil && !outbound {
		all := netip.PrefixFrom(netip.IPv4Unspecified(), 0)
		if fam == policy.IPv6 {
			all = netip.PrefixFrom(netip.IPv6Unspecified(), 0)
		}
		out = append(out, datapath.RuleCounter{Family: fam, Entry: -1, Action: policy.Masquerade, Prefix: all,
			Origin: policy.OriginOutbound, Address: st.SNAT[CounterOutbound], Packets: st.Outbound.Packets, Bytes: st.Outbound.Bytes})
	}
	return out
}

// parseSetName reads SetName back (the address of a masquerade address's set aside).
func parseSetName(name string) (policy.Action, int, bool) {
	var bits int
	if _, err := fmt.Sscanf(name, "masq-%d", &bits); err == nil {
		return policy.Masquerade, bits, true
	}
	if _, err := fmt.Sscanf(name, "return-%d", &bits); err == nil {
		return policy.Return, bits, true
	}
	return policy.Return, 0, false
}

// Installed is the agent's tables as any process reads them (`dump`), whether or not an agent
// runs. It implements datapath.Reader.
type Installed struct {
	kernel Kernel
	policy *policy.Policy
	fams   []policy.Family
}

var _ datapath.Reader = (*Installed)(nil)

// Inspect returns the tables the agent installed, nil when there are none. p is the policy
// the agent is expected to have installed (nil: unknown); Counters maps the elements to its
// rules. kernel nil reads over netlink.
func Inspect(ctx context.Context, kernel Kernel, p *policy.Policy) (*Installed, error) {
	if kernel == nil {
		kernel = NetlinkKernel{}
	}
	in := &Installed{kernel: kernel, policy: p}
	for _, fam := range policy.Families() {
		st, err := kernel.Table(ctx, fam, false)
		if err != nil {
			return nil, err
		}
		if st != nil {
			in.fams = append(in.fams, fam)
		}
	}
	if len(in.fams) == 0 {
		return nil, nil
	}
	return in, nil
}

// Info implements datapath.InfoReporter.
func (in *Installed) Info() datapath.Info {
	return datapath.Info{Backend: Name, AttachMode: datapath.AttachNone, Details: info(in.fams)}
}

// Counters implements datapath.Reader: the rules of the policy as Backend.Counters reports
// them, then, per family, what no rule of it explains (rule 0).
func (in *Installed) Counters(ctx context.Context) ([]datapath.RuleCounter, error) {
	var out []datapath.RuleCounter
	for _, fam := range in.fams {
		st, err := in.kernel.Table(ctx, fam, true)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", fam, err)
		}
		if st == nil {
			continue
		}
		if in.policy == nil || !in.policy.Enabled(fam) {
			out = append(out, unexplained(fam, st, nil, false)...)
			continue
		}
		l := NewLayout(in.policy, fam)
		if err := completeWalk(ctx, in.kernel, fam, st, l.keys()); err != nil {
			return nil, fmt.Errorf("%s: %w", fam, err)
		}
		counters, rest := countRules(in.policy, l, st)
		out = append(append(out, counters...), rest...)
	}
	return out, nil
}
