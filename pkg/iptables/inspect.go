package iptables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
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
	return datapath.Info{Backend: Name, AttachMode: datapath.AttachNone,
		Details: fmt.Sprintf("iptables-%s, chain %s (%s)", in.mode, in.chain, strings.Join(fams, ", "))}
}

// Counters implements datapath.Reader: the live counters of each family's chain, summed per rule
// of the policy as the backend's Counters does, then the lines that implement no rule of it,
// one each (Rule 0).
func (in *Installed) Counters(ctx context.Context) ([]datapath.RuleCounter, error) {
	var out []datapath.RuleCounter
	for _, fam := range policy.Families() {
		t := in.tools[fam]
		if t == nil {
			continue
		}
		nat, err := readAll(ctx, in.runner, t)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", fam, err)
		}
		live := nat.ChainRules(in.chain)
		var counters []datapath.RuleCounter
		var rest []int
		if p := in.policy; p != nil {
			if p.RandomFully && !usesRandomFully(live) {
				plain := *p
				plain.RandomFully = false
				p = &plain
			}
			counters, rest = mapLines(p, fam, in.chain, live)
		} else {
			for i := range live {
				rest = append(rest, i)
			}
		}
		out = append(out, counters...)
		for _, i := range rest {
			out = append(out, unexplained(fam, live[i]))
		}
	}
	return out, nil
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
