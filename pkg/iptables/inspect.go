package iptables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Installed is the chain as one iptables mode holds it, read by any process (`dump`), whether
// or not an agent runs. It implements datapath.Reader.
type Installed struct {
	mode   Mode
	chain  string
	runner Runner
	policy *policy.Policy
	// tools of each family whose nat table holds the chain.
	tools map[policy.Family]*tools
	// sources are the names of the source rules whose chains either family holds, in order.
	sources []string
}

var _ datapath.Reader = (*Installed)(nil)

// Inspect finds the chain in every mode whose tools are installed, nft first, and returns one
// Installed per mode whose nat table holds it in either family: none when nothing is installed,
// two when both modes hold it (which only happens when agents of both modes ran). p is the
// policy the agent is expected to have installed (its configuration and flags); Counters maps
// the installed lines to its rules. Reading loads no kernel module (iptables-save without -t).
func Inspect(ctx context.Context, r Runner, chain string, p *policy.Policy) ([]*Installed, error) {
	if err := ValidateChain(chain); err != nil {
		return nil, err
	}
	var out []*Installed
	var errs []error
	for _, mode := range []Mode{ModeNFT, ModeLegacy} {
		in := &Installed{mode: mode, chain: chain, runner: r, policy: p, tools: map[policy.Family]*tools{}}
		for _, fam := range policy.Families() {
			t, err := resolveTools(ctx, r, mode, fam)
			if err != nil {
				var missing *MissingToolsError
				if !errors.As(err, &missing) {
					errs = append(errs, err)
				}
				continue
			}
			nat, err := readAll(ctx, r, t)
			if err != nil {
				// A kernel without this mode or family holds nothing in it.
				continue
			}
			if nat.HasChain(chain) {
				in.tools[fam] = t
				in.addSources(nat)
			}
		}
		if len(in.tools) > 0 {
			out = append(out, in)
		}
	}
	if len(out) == 0 && len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return out, nil
}

// readAll reads every table of a mode and family with counters and returns the nat table.
func readAll(ctx context.Context, r Runner, t *tools) (*Table, error) {
	out, err := r.Run(ctx, nil, t.save, "-c")
	if err != nil {
		return nil, fmt.Errorf("read nat table: %w", err)
	}
	return ParseSave(out, "nat")
}

// Mode is the iptables mode that holds the chain.
func (in *Installed) Mode() Mode { return in.mode }

// Info implements datapath.InfoReporter.
func (in *Installed) Info() datapath.Info {
	var fams []string
	for _, fam := range policy.Families() {
		if in.tools[fam] != nil {
			fams = append(fams, fam.String())
		}
	}
	details := fmt.Sprintf("iptables-%s, chain %s (%s)", in.mode, in.chain, strings.Join(fams, ", "))
	if len(in.sources) > 0 {
		details += ", source rules " + strings.Join(in.sources, ", ")
	}
	return datapath.Info{Backend: Name, AttachMode: datapath.AttachNone, Details: details}
}

// addSources notes the source rules whose chains nat holds.
func (in *Installed) addSources(nat *Table) {
	names := sourceNames(in.chain, ourRules(nat, in.chain))
	for _, c := range nat.SourceChains(in.chain) {
		if name := names[c]; name != "" && !slices.Contains(in.sources, name) {
			in.sources = append(in.sources, name)
		}
	}
}

// ourRules are the rules of the main chain and of its source chains, in dump order.
func ourRules(nat *Table, chain string) []SavedRule {
	return nat.rules(func(r SavedRule) bool { return r.Chain == chain || isSourceChain(chain, r.Chain) })
}

// sourceNames names the source chains among live by the source rules whose chains they are, as
// the comments of their jumps and ends say; by the chain's name where no comment does.
func sourceNames(chain string, live []SavedRule) map[string]string {
	names := map[string]string{}
	for _, r := range live {
		c := r.Chain
		if c == chain {
			c = r.Target
		}
		if !isSourceChain(chain, c) {
			continue
		}
		if name := sourceRuleOf(r.Comment); name != "" {
			names[c] = name
		} else if _, ok := names[c]; !ok {
			names[c] = c
		}
	}
	return names
}

// Counters implements datapath.Reader: the live counters of each family's chains, summed per
// rule of the policy as the backend's Counters does, then the lines that implement no rule of
// it, one each (Rule 0), a source chain's named by its rule (Set). The lines that lead packets
// between the chains (jumps to source chains, their ends) are no rules and not reported.
func (in *Installed) Counters(ctx context.Context) ([]datapath.RuleCounter, error) {
	var byList [][]datapath.RuleCounter
	var rest []datapath.RuleCounter
	for _, fam := range policy.Families() {
		t := in.tools[fam]
		if t == nil {
			continue
		}
		nat, err := readAll(ctx, in.runner, t)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", fam, err)
		}
		live := ourRules(nat, in.chain)
		var layout []Chain
		if p := in.policy; p != nil {
			if p.RandomFully && !usesRandomFully(live) {
				plain := *p
				plain.RandomFully = false
				p = &plain
			}
			layout = Layout(p, fam, in.chain)
		}
		counters, unexplainedLines := mapLines(layout, live)
		byList = appendByList(byList, layout, counters)
		names := sourceNames(in.chain, live)
		for _, i := range unexplainedLines {
			if sourceRuleOf(live[i].Comment) != "" {
				continue
			}
			c := unexplained(fam, live[i])
			c.Set = names[live[i].Chain]
			rest = append(rest, c)
		}
	}
	var out []datapath.RuleCounter
	for _, cs := range byList {
		out = append(out, cs...)
	}
	return append(out, rest...), nil
}

// usesRandomFully tells whether the agent that filled the chain used --random-fully: it drops
// the option from every MASQUERADE and SNAT line where the node lacks it (Backend.Apply), so the chain
// shows what it did; a line someone added by hand is outvoted.
func usesRandomFully(live []SavedRule) bool {
	with, without := 0, 0
	for _, r := range live {
		switch {
		case r.Target != TargetMasquerade && r.Target != TargetSNAT:
		case r.RandomFully:
			with++
		default:
			without++
		}
	}
	return with >= without
}

// unexplained describes a chain line that implements no rule of the policy: its destination
// (every address when it has none), whether it masquerades (MASQUERADE or SNAT) or not, and
// SNAT's address.
func unexplained(fam policy.Family, r SavedRule) datapath.RuleCounter {
	c := datapath.RuleCounter{Family: fam, Entry: -1, Action: policy.Return, Prefix: r.Dst, Address: r.ToSource,
		Packets: r.Packets, Bytes: r.Bytes}
	if !c.Prefix.IsValid() {
		c.Prefix = netip.PrefixFrom(netip.IPv4Unspecified(), 0)
		if fam == policy.IPv6 {
			c.Prefix = netip.PrefixFrom(netip.IPv6Unspecified(), 0)
		}
	}
	if r.Target == TargetMasquerade || r.Target == TargetSNAT {
		c.Action = policy.Masquerade
	}
	return c
}
