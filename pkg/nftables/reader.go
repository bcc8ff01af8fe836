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

// listCounters are counters by list: the global lists', and each source rule's, by its index
// in the policy's Sources.
type listCounters struct {
	global  []datapath.RuleCounter
	sources [][]datapath.RuleCounter
}

// add appends the counters of another family's lists.
func (c *listCounters) add(fam listCounters) {
	c.global = append(c.global, fam.global...)
	for i, s := range fam.sources {
		for len(c.sources) <= i {
			c.sources = append(c.sources, nil)
		}
		c.sources[i] = append(c.sources[i], s...)
	}
}

// ordered are the counters in the order Counters reports them: the global lists', then each
// source rule's, in rule order.
func (c *listCounters) ordered() []datapath.RuleCounter {
	out := c.global
	for _, s := range c.sources {
		out = append(out, s...)
	}
	return out
}

// countRules sums a table's element counters per rule of the layout l of p, and returns the
// elements no rule of it explains, grouped by their comments, as counters of rule 0. A rule
// with an element missing (or with another comment) is left out; an outbound rule counts in
// its named counter. A masquerade rule's address is what the table SNATs its sets' (or the
// outbound rule's) packets to. The rules of a source rule without a list in the table (it
// decides no source of the family) report zero.
func countRules(p *policy.Policy, l *Layout, st *TableState) (out listCounters, rest []datapath.RuleCounter) {
	if st == nil {
		return listCounters{}, nil
	}
	rules := l.Rules(p)
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
	// list counts the rules of one list, from index first of the layout's rules.
	list := func(first int, own []policy.Rule, outbound int, counter string, count *Count) []datapath.RuleCounter {
		var cs []datapath.RuleCounter
		for j, r := range own {
			i := first + j
			c := ruleCounter(l.Family, j, r)
			if i == outbound {
				if count == nil {
					continue
				}
				c.Packets, c.Bytes = count.Packets, count.Bytes
				c.Address = st.SNAT[counter]
			} else {
				if found[i] != l.Pieces[i] {
					continue
				}
				c.Packets, c.Bytes = sums[i].Packets, sums[i].Bytes
				c.Address = st.SNAT[sets[i]]
			}
			cs = append(cs, c)
		}
		return cs
	}
	counted := map[string]bool{CounterOutbound: l.Outbound >= 0}
	out.global = list(0, p.Rules(l.Family), l.Outbound, CounterOutbound, st.Outbound)
	out.sources = make([][]datapath.RuleCounter, len(p.Sources))
	for i, s := range p.Sources {
		own := s.Policy.Rules(l.Family)
		j := slices.IndexFunc(l.Sources, func(sl SourceList) bool { return sl.Index == i })
		if j < 0 {
			for n, r := range own {
				out.sources[i] = append(out.sources[i], ruleCounter(l.Family, n, r))
			}
			continue
		}
		sl := l.Sources[j]
		var count *Count
		if c, ok := st.SourceOutbound[s.Name]; ok {
			count = &c
		}
		counted[SourceCounterName(s.Name)] = sl.Outbound >= 0
		out.sources[i] = list(sl.First, own, sl.Outbound, SourceCounterName(s.Name), count)
	}
	return out, unexplained(l.Family, st, explained, counted)
}

// ruleCounter is the counter of the n-th rule r of its list (from 0), at zero.
func ruleCounter(fam policy.Family, n int, r policy.Rule) datapath.RuleCounter {
	return datapath.RuleCounter{Set: r.Set, Family: fam, Rule: n + 1, Prefix: r.Prefix, Action: r.Action, Origin: r.Origin, Entry: r.Entry}
}

func (s *SetState) elem(key netip.Addr) (ElementState, bool) {
	if s == nil {
		return ElementState{}, false
	}
	e, ok := s.Elements[key]
	return e, ok
}

// unexplained groups the elements not in explained by comment (an element whose comment the
// agent did not write is a group of its own), and adds the outbound counters that no rule
// explains (counted); each with the address its packets are SNATed to.
func unexplained(fam policy.Family, st *TableState, explained map[string]map[netip.Addr]bool, counted map[string]bool) []datapath.RuleCounter {
	var out []datapath.RuleCounter
	index := map[string]int{}
	for _, name := range slices.Sorted(maps.Keys(st.Sets)) {
		rule, own := parseSourceName(name)
		action, bits, ok := parseSetName(own)
		for _, key := range slices.SortedFunc(maps.Keys(st.Sets[name].Elements), netip.Addr.Compare) {
			if explained[name][key] {
				continue
			}
			e := st.Sets[name].Elements[key]
			c := datapath.RuleCounter{Set: rule, Family: fam, Entry: -1, Action: action, Prefix: netip.PrefixFrom(key, bits), Address: st.SNAT[name]}
			if !ok {
				c.Prefix = netip.PrefixFrom(key, key.BitLen())
			}
			group := name + " " + key.String()
			if set, origin, prefix, ok := ParseComment(e.Comment); ok {
				c.Set, c.Origin, c.Prefix, group = set, origin, prefix, name+" "+e.Comment
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
	all := netip.PrefixFrom(netip.IPv4Unspecified(), 0)
	if fam == policy.IPv6 {
		all = netip.PrefixFrom(netip.IPv6Unspecified(), 0)
	}
	outbound := func(rule, counter string, n Count) {
		out = append(out, datapath.RuleCounter{Set: rule, Family: fam, Entry: -1, Action: policy.Masquerade, Prefix: all,
			Origin: policy.OriginOutbound, Address: st.SNAT[counter], Packets: n.Packets, Bytes: n.Bytes})
	}
	if st.Outbound != nil && !counted[CounterOutbound] {
		outbound("", CounterOutbound, *st.Outbound)
	}
	for _, rule := range slices.Sorted(maps.Keys(st.SourceOutbound)) {
		if name := SourceCounterName(rule); !counted[name] {
			outbound(rule, name, st.SourceOutbound[rule])
		}
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
// them, with what no rule of a family explains (rule 0) after the family's global rules, before
// the source rules'.
func (in *Installed) Counters(ctx context.Context) ([]datapath.RuleCounter, error) {
	var out listCounters
	for _, fam := range in.fams {
		st, err := in.kernel.Table(ctx, fam, true)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", fam, err)
		}
		if st == nil {
			continue
		}
		if in.policy == nil || !in.policy.Enabled(fam) {
			out.add(listCounters{global: unexplained(fam, st, nil, nil)})
			continue
		}
		l := NewLayout(in.policy, fam)
		if err := completeWalk(ctx, in.kernel, fam, st, l.keys()); err != nil {
			return nil, fmt.Errorf("%s: %w", fam, err)
		}
		c, rest := countRules(in.policy, l, st)
		c.global = append(c.global, rest...)
		out.add(c)
	}
	return out.ordered(), nil
}
